"""The module battery (``tfmoe attn-check impl=...``): the check groups in order, each behind its prerequisites.

The shapes check always runs first (it is the main forward the other groups read); then every group the config
asks for (``checks=``), skipped with a note when the adapter cannot drive it, and not judged (a note names the
check to fix first) when the main forward showed something that would fail it for another reason. A layer that
raises inside a group fails that group's remaining checks with the error, never the run. ``mode=chunked``
runs only the chunked path's probe (no layer is built).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tfmoe.adapters import AttentionAdapter, load_adapter
from tfmoe.components.chunked_attention import naive_attention_bytes
from tfmoe.components.references import reference_dtype
from tfmoe.contract.errors import BadInput
from tfmoe.contract.recorder import Recorder
from tfmoe.contract.tables import Rows
from tfmoe.experiments.attn_check.checks import (
    GROUPS,
    chunked,
    dropout,
    fully_masked,
    gradients,
    invariances,
    kv_cache,
    masks,
    sdpa,
    shapes,
)
from tfmoe.experiments.attn_check.checks.chunked import gib
from tfmoe.experiments.attn_check.heatmap import attention_heatmap
from tfmoe.experiments.attn_check.layer import LayerUnderTest
from tfmoe.rules import capabilities as caps
from tfmoe.rules.faults import raised_detail, tfmoe_fault
from tfmoe.rules.memory import available_memory_bytes
from tfmoe.rules.user_code import load_object

if TYPE_CHECKING:
    from tfmoe.experiments.attn_check.settings import ModuleSettings


def refuse_if_too_big(s: ModuleSettings, device: torch.device, dtype: torch.dtype) -> None:
    """BadInput before allocating if the naive (B,H,T,T) path cannot fit in the memory available."""
    available = available_memory_bytes(device)
    if s.mode == "full":
        need = naive_attention_bytes(s.B, s.n_heads, s.T, s.T, dtype) * 2  # module + reference side by side
        if need > available:
            raise BadInput(f"the naive attention path needs about {gib(need)} for B={s.B}, H={s.n_heads}, T={s.T} "
                           f"but {gib(available)} is available: lower T/B, or check only the chunked path "
                           "with mode=chunked (O(T·block) memory)")
    probe_need = naive_attention_bytes(1, s.probe_heads, s.probe_T, s.probe_T, torch.float32)
    if s.mode == "full" and probe_need > available:
        raise BadInput(f"chunked.probe_T={s.probe_T} needs about {gib(probe_need)} for the naive side of the memory "
                       f"probe but {gib(available)} is available: lower chunked.probe_T, or use mode=chunked")


READS_MAIN_FORWARD = ("masks", "sdpa")  # the groups that judge the shapes check's forward instead of calling the layer

# What each module-mode check needs beyond the main case (tfmoe.rules.capabilities.FEATURES): a feature the layer declares
# it lacks makes the check not applicable (listed, never failed). fully_masked_rows also needs left_padding when causal.
CHECK_NEEDS: dict[str, tuple[str, ...]] = {
    "row_sums": ("attention_weights",),
    "causal_zero": ("attention_weights",),
    "padding_zero": ("attention_weights", "padding_mask"),
    "left_padding_match": ("padding_mask", "left_padding"),
    "padded_query_rows": ("padding_mask",),
    "fully_masked_rows": ("padding_mask",),
    "gradcheck": ("backward",),
    "grad_match": ("backward",),
    "kv_cache_decode": ("kv_cache",),
    "dropout_eval_identity": ("dropout",),
    "dropout_rate": ("dropout",),
    "dropout_scale": ("dropout",),
    "dropout_seed": ("dropout",),
}
# Each check's group (checks=[...]); shapes always runs.
CHECK_GROUPS: dict[str, str] = {
    "shapes": "masks", "row_sums": "masks", "causal_zero": "masks", "padding_zero": "masks",
    "sdpa_match": "sdpa", "padded_query_rows": "sdpa", "left_padding_match": "sdpa",
    "fully_masked_rows": "fully_masked", "gradcheck": "gradients", "grad_match": "gradients",
    "kv_cache_decode": "kv_cache", "chunked_match": "chunked", "chunked_match_large": "chunked",
    "chunked_memory": "chunked", "batch_independence": "invariances", "batch_sizes": "invariances",
    "head_counts": "invariances", "dropout_eval_identity": "dropout", "dropout_rate": "dropout",
    "dropout_scale": "dropout", "dropout_seed": "dropout",
}
# The checks of tfmoe's own chunked kernel (chunked.impl): reported apart from the layer's (they do not judge it).
TFMOE_CHUNKED_CHECKS = ("chunked_match", "chunked_match_large", "chunked_memory")


def needs(check: str, s: ModuleSettings) -> tuple[str, ...]:
    """The features ``check`` needs on this run's settings."""
    extra = ("left_padding",) if check == "fully_masked_rows" and s.causal else ()
    return CHECK_NEEDS.get(check, ()) + extra


def declarations(s: ModuleSettings, adapter: AttentionAdapter, dtype: torch.dtype) -> caps.Declared:
    """Every declaration of the layer (its adapter, its class, the config), and rule 1: exit 2 when the run's own
    settings need a feature it declares it lacks."""
    decl = caps.declared(adapter, getattr(adapter, "cls", None), config_lacks=s.lacks,
                         config_precisions={"compute_dtype": s.compute_dtype})
    main: dict[str, str] = {}
    if s.n_kv_heads != s.n_heads:
        main["gqa"] = "set n_kv_heads=null (= n_heads)"
    main["causal" if s.causal else "non_causal"] = "set causal=false" if s.causal else "set causal=true"
    for name, tag in ((torch.float32, "fp32"), (torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        if dtype == name:
            main[tag] = "set dtype=bf16" if tag == "fp32" else "set dtype=fp32"
    if s.lengths_given and any(n < s.T for n in s.lengths):
        main["padding_mask"] = "set lengths=null (a layer without a padding mask then runs on full rows)"
    refused = caps.refusal(decl, main, s.impl)
    if refused is not None:
        raise refused
    return decl


def unmet_prerequisite(layer: LayerUnderTest, group: str) -> str:
    """Why a group cannot judge this module ('' if it can): every group reads the module's output, so a wrong
    output shape stops all but chunked (which reads only the weights); a random eval-mode forward stops all but
    the dropout and chunked groups (dropout_eval_identity names it); wrong-shaped weights stop the mask checks."""
    if group in ("shapes", "chunked"):
        return ""
    if layer.bad_output_shape:
        return f"the module's output has the wrong shape ({layer.bad_output_shape}; see shapes)"
    if layer.random_eval_forward and group != "dropout":
        return (f"the module's eval-mode forward is random (two calls on the same input differ by "
                f"{layer.random_eval_forward:.3g}; see dropout_eval_identity)")
    if group == "masks" and layer.bad_weights_shape:
        return f"the returned weights have the wrong shape ({layer.bad_weights_shape}; see shapes)"
    return ""


def guarded(rec: Recorder, names: list[str], run: Callable[[], None],
            evidence: Callable[[], dict[str, torch.Tensor]] = dict, blocked: str = "",
            adapter: AttentionAdapter | None = None) -> Exception | None:
    """Run one group of checks unless a prerequisite fails (``blocked``: then a note says which check to fix
    first). If the user's code raises, the group's not-yet-recorded checks fail with the exception (its type and
    whole message lead the detail); if tfmoe or the shipped ``adapter`` is at fault (:mod:`tfmoe.rules.faults`), the
    run crashes with an :class:`~tfmoe.contract.errors.AdapterError` instead and the layer is not blamed."""
    if blocked:
        rec.note(f"{', '.join(names)} not judged: {blocked}")
        return None
    before = {c.check for c in rec.checks_rows}
    try:
        run()
    except (BadInput, KeyboardInterrupt):
        raise
    except Exception as exc:
        who = "tfmoe" if adapter is None else f"tfmoe with impl={adapter.spec}"
        fault = tfmoe_fault(exc, who, getattr(adapter, "library", None), getattr(adapter, "supported", ""))
        if fault is not None:
            raise fault from exc
        done = {c.check for c in rec.checks_rows} - before
        fail_raised(rec, [n for n in names if n not in done], exc, evidence)
        return exc
    return None


def not_applicable(rec: Recorder, names: list[str], detail: str) -> None:
    """The checks ``names`` are not applicable to this layer (a declaration, or its NotImplementedError)."""
    for name in names:
        rec.not_applicable(name, detail)


def fail_raised(rec: Recorder, names: list[str], exc: Exception,
                evidence: Callable[[], dict[str, torch.Tensor]] = dict) -> None:
    """The checks ``names`` fail with the user's exception: observed None, the detail led by its type and message.
    An undeclared NotImplementedError makes them not applicable instead (tfmoe.rules.capabilities, rule 3)."""
    if isinstance(exc, NotImplementedError):
        detail = caps.not_implemented_detail(exc)
        not_applicable(rec, names, detail)
        rec.note(f"{', '.join(names)} {detail}")
        return
    detail = raised_detail(exc)
    for name in names:
        rec.check(name, False, None, None, detail, evidence=evidence())
    rec.note(f"{', '.join(names)}: the module {detail}")


def run_module_battery(s: ModuleSettings, rec: Recorder) -> None:
    """Load the user's code (BadInput, exit 2, when it cannot be), refuse sizes that cannot fit, run the groups."""
    device, dtype = rec.device, rec.dtype
    chunked_fn = load_object(s.chunked_impl, "chunked.impl")
    if not callable(chunked_fn):
        raise BadInput(f"chunked.impl={s.chunked_impl!r} is not callable: point it at a function "
                       "(q, k, v, *, causal, key_padding_mask, block_size) -> out")
    refuse_if_too_big(s, device, dtype)
    rec.note(f"mode={s.mode}; impl={s.impl}; reference = SDPA in {str(reference_dtype(dtype)).removeprefix('torch.')}")
    if device.type == "cpu":
        rec.note("peak memory measured with torch.profiler(profile_memory=True): CPU allocator allocations/frees")
    if s.mode == "chunked":
        guarded(rec, ["chunked_match_large", "chunked_memory"],
                lambda: chunked.chunked_probe(s, rec, chunked_fn, s.B, s.n_heads, s.T, s.d_head, dtype,
                                              s.probe_block_size, measure_naive=False))
        summarize(rec, s, dtype)
        return
    adapter = load_adapter(s.impl, s.hf_attn_implementation)
    decl = declarations(s, adapter, dtype)
    if "padding_mask" in decl.lacks and any(n < s.T for n in s.lengths):
        s = dataclasses.replace(s, lengths=(s.T,) * s.B)
        rec.note(f"{adapter.name} lacks padding_mask: the main case runs on full rows (lengths={list(s.lengths)})")
    layer = LayerUnderTest.start(s, rec, adapter, chunked_fn, decl)
    refused = refuses_padding(layer)
    if refused is not None:  # rule 3 on the main case: judge the rest on full rows, the padding checks n/a
        s = dataclasses.replace(s, lengths=(s.T,) * s.B)
        rec.note(f"{adapter.name} raised NotImplementedError for a padding mask ({refused}): the main case runs on "
                 f"full rows (lengths={list(s.lengths)}), the checks that need padding are not applicable "
                 "(declare lacks=[padding_mask] to say so up front)")
        layer = LayerUnderTest.start(s, rec, adapter, chunked_fn, decl.with_lack("padding_mask", refused))
    run_groups(layer)
    if rec.wants_plots and layer.attn is not None and layer.attn.dim() == 4:
        b = _padded_row(layer.padding_mask)
        mask = layer.mask
        vis = torch.ones(s.T, s.T, dtype=torch.bool) if mask is None else mask.expand(s.B, 1, s.T, s.T)[b, 0].cpu()
        rec.plot("attention_heatmap", attention_heatmap(
            layer.attn, vis, b, 0, f"{layer.adapter.name}: batch row {b} (length {s.lengths[b]}), head 0"))
    summarize(rec, s, dtype)


def refuses_padding(layer: LayerUnderTest) -> NotImplementedError | None:
    """The NotImplementedError the layer raises for the main case's padding mask (None if it takes it, if nothing
    is padded, or if lengths= was set: then the shapes check reports it). Any other outcome is the shapes check's
    to judge; the RNG is left as it was."""
    if layer.pm_arg is None or layer.s.lengths_given:
        return None
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            layer.call(layer.module, layer.x, layer.pm_arg)
    except NotImplementedError as exc:
        if tfmoe_fault(exc, "tfmoe", getattr(layer.adapter, "library", None), "") is None:
            return exc
    except Exception:
        return None
    return None


def run_groups(layer: LayerUnderTest) -> None:
    """Every asked-for group, in the battery's order (see the module docstring)."""
    s, rec, adapter = layer.s, layer.rec, layer.adapter

    main_error: list[Exception] = []  # what the main forward (the shapes check) raised, if it did

    def group(name: str, checks: list[str], fn: Callable[[LayerUnderTest], None]) -> None:
        for check in list(checks):
            lacking = [f for f in needs(check, s) if f in layer.declared.lacks]
            if lacking:
                rec.not_applicable(check, layer.declared.why(lacking[0]))
                checks.remove(check)
        if not checks:
            return
        if main_error and name in READS_MAIN_FORWARD:  # their input is that forward: the same exception, not a
            fail_raised(rec, checks, main_error[0], layer.evidence)  # shape complaint about its missing output
            return
        exc = guarded(rec, checks, lambda: fn(layer), layer.evidence, unmet_prerequisite(layer, name), adapter)
        if name == "shapes" and exc is not None:
            main_error.append(exc)

    group("shapes", ["shapes"], shapes.check_shapes)  # always: it runs the main forward the other checks read
    asked = set(s.groups)
    if "masks" in asked:
        group("masks", ["row_sums"] + (["causal_zero"] if s.causal else [])
              + (["padding_zero"] if not bool(layer.padding_mask.all()) else []), masks.check_rows_and_masks)
        if s.lengths_given and bool(layer.padding_mask.all()) and "padding_mask" not in layer.declared.lacks:
            rec.not_applicable("padding_zero", f"not judged: lengths={list(s.lengths)} pad no key, so a padding "
                               "mask hides nothing (vacuous); give a row a length below T to judge it")
    if "sdpa" in asked:
        group("sdpa", ["sdpa_match"] + (["padded_query_rows"] if s.padded_query_policy == "zeros" else []),
              sdpa.check_sdpa)
        if s.T >= 2:
            group("sdpa", ["left_padding_match"], sdpa.check_left_padding)
    if "fully_masked" in asked:
        group("fully_masked", ["fully_masked_rows"], fully_masked.check_fully_masked)
    if "gradients" in asked:
        group("gradients", ["gradcheck", "grad_match"], gradients.check_gradients)
    if "kv_cache" in asked:
        group("kv_cache", ["kv_cache_decode"], kv_cache.check_kv_cache)
    if "chunked" in asked:
        group("chunked", ["chunked_match", "chunked_match_large", "chunked_memory"], chunked.check_chunked)
    if "invariances" in asked:
        group("invariances", ["batch_independence", "batch_sizes", "head_counts"], invariances.check_invariances)
    if "dropout" in asked:
        why = "" if "dropout" in layer.declared.lacks else dropout.dropout_not_applicable(s, adapter)
        if why:
            rec.note(f"dropout checks not run: {why}")
        else:
            group("dropout", ["dropout_eval_identity", "dropout_rate", "dropout_scale", "dropout_seed"],
                  dropout.check_dropout)
    skipped = [g for g in GROUPS if g not in asked]
    if skipped:
        rec.note(f"check groups not run (checks=...): {', '.join(skipped)}")


def _padded_row(pm: torch.Tensor) -> int:
    rows = (~pm).any(dim=1).nonzero()
    return int(rows[0]) if len(rows) else 0


def summarize(rec: Recorder, s: ModuleSettings, dtype: torch.dtype) -> None:
    """The checks tables on the terminal: the layer's, then tfmoe's own chunked kernel's (they judge
    ``chunked.impl``, not the layer); in summary.md (which already holds passed / observed / threshold) the case
    and each check's detail, in the same two parts."""
    tag = str(dtype).removeprefix("torch.")
    own = [c for c in rec.checks_rows if c.check not in TFMOE_CHUNKED_CHECKS]
    kernel = [c for c in rec.checks_rows if c.check in TFMOE_CHUNKED_CHECKS]
    titles = [(f"attn-check: {s.impl} ({tag})", own)] if s.mode == "full" else []
    if kernel:
        titles.append((f"attn-check: tfmoe's own chunked kernel {s.chunked_impl} ({tag}), not the layer", kernel))
    markdown = []
    for title, rows in titles:
        table = Rows(title, ["check", "passed", "observed", "threshold"])
        details = Rows("", ["check", "detail"])
        for c in rows:
            shown = {"passed": "yes", "failed": "NO", "n/a": "n/a"}[c.outcome]
            table.add(c.check, shown, "" if c.observed is None else f"{c.observed:.3g}",
                      "" if c.threshold is None else f"{c.threshold:.3g}",
                      style="red" if c.outcome == "failed" else ("dim" if c.outcome == "n/a" else None))
            details.add(c.check if c.passed else f"**{c.check}**", c.detail)
        table.print_to(rec.console)
        markdown.append(f"#### {title}\n\n" + details.markdown())
    rec.summary(f"### attn-check: `{s.impl}`, mode={s.mode}, {tag}, B={s.B}, T={s.T}, D={s.d_model}, "
                f"H={s.n_heads}, causal={s.causal}, lengths={list(s.lengths)}, dropout={s.dropout}\n\n"
                + "\n\n".join(markdown))
