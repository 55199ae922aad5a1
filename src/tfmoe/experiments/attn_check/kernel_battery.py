"""The kernel battery (``tfmoe attn-check kernel=SPEC``): every case of the matrix, one check per family,
each family judged only on cases whose prerequisite families passed; a conformance summary."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from tfmoe.contract.errors import AdapterError, BadInput
from tfmoe.contract.recorder import Recorder
from tfmoe.contract.tables import Rows
from tfmoe.experiments.attn_check.kernel_cases import (
    ADDITIVE,
    FAMILIES,
    PROBES,
    REVEALS,
    Case,
    case_reveals,
    make_inputs,
)
from tfmoe.experiments.attn_check.kernel_dropout import run_dropout_backward, run_dropout_case
from tfmoe.experiments.attn_check.kernel_exact import (
    EXACT_OUTPUT_MASKS,
    output_probe_inputs,
    run_exact_grad_probe,
    run_exact_output_probe,
)
from tfmoe.experiments.attn_check.kernel_judging import (
    Outcome,
    backward_differentiates_row_max,
    backward_query_chunk,
    backward_rounds_to_run_dtype,
    battery_fault,
    missing_params,
    run_case,
)
from tfmoe.experiments.attn_check.kernel_weights import run_weights_probe
from tfmoe.experiments.attn_check.kernels import Kernel, load_kernel
from tfmoe.rules import capabilities
from tfmoe.rules.memory import available_memory_bytes

if TYPE_CHECKING:
    from tfmoe.experiments.attn_check.settings import KernelSettings


PREREQ_TEXT = {"scale": "kernel_scale (plain attention)", "gqa": "kernel_gqa (Hkv < Hq)",
               "padding_bool": "kernel_padding_bool (boolean masks)",
               "padding_additive": "kernel_padding_additive (float masks)",
               "fully_masked": "kernel_fully_masked (rows that see no key)",
               "mask_bool": "kernel_mask_bool ((B,1,Tq,Tk) boolean masks)",
               "mask_additive": "kernel_mask_additive ((B,1,Tq,Tk) float masks)"}


UNMET = ("fail", "not judged")  # "vacuous" (judged only where its property cannot show) blocks nothing
DTYPE_FEATURES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def case_features(case: Case, Hq: int) -> list[str]:
    """The capabilities (tfmoe.rules.capabilities.FEATURES) a case's forward needs."""
    needs = ["gqa"] if case.Hkv != Hq else []
    if case.Tq != case.Tk:
        needs.append("unequal_lengths")
    if case.mask == "causal":
        needs.append("causal")
    elif case.mask in ADDITIVE:
        needs.append("additive_mask")
    elif case.mask != "none":
        needs.append("bool_mask")
    if case.mask.startswith("per_head"):
        needs.append("per_head_mask")
    if case.dropout_p:
        needs.append("dropout")
    return needs


def kernel_declarations(s: KernelSettings, kernel: Kernel, dtype: torch.dtype) -> capabilities.Declared:
    """What the kernel function declares it lacks (``tfmoe_lacks``), the config's ``lacks``, and
    ``kernel_checks.backward=false`` read as a declared lack of ``backward``; a declared lack of the run's
    dtype is the one main setting of kernel mode: exit 2 (tfmoe.rules.capabilities rule 1)."""
    config = [*s.lacks, *(() if s.backward else ("backward",))]
    decl = capabilities.declared(kernel.fn, config_lacks=config)
    if dtype in DTYPE_FEATURES:
        name = DTYPE_FEATURES[dtype]
        instead = "dtype=bf16 or dtype=fp16" if name == "fp32" else f"fp32 (drop dtype={name})"
        refused = capabilities.refusal(decl, {name: f"run it in {instead}, or remove {name} from its lacks"}, s.spec)
        if refused is not None:
            raise refused
    return decl  # a prerequisite family with this verdict blocks the cases resting on it


def prerequisites(case: Case, Hq: int) -> list[str]:
    """The families a case's verdict rests on: a failure there would fail this case for another reason
    (a (B,1,Tq,Tk) mask rests on the key-padding masks and on the policy for rows that see no key, which its
    random masks hold too; a per-head mask on the (B,1,Tq,Tk) masks of its kind)."""
    needs = [] if case.family == "scale" else ["scale"]
    if case.Hkv != Hq and case.family != "gqa":
        needs.append("gqa")
    additive = case.row_kind == "additive"
    if case.family in ("fully_masked", "mask_bool", "mask_additive"):
        needs.append("padding_additive" if additive else "padding_bool")
    if case.family in ("mask_bool", "mask_additive"):
        needs.append("fully_masked")
    if case.family == "per_head":
        needs.append("mask_additive" if additive else "mask_bool")
    return needs


def record_family(rec: Recorder, family: str, outcomes: list[Outcome], reason_blocked: str) -> str:
    """One check ``kernel_<family>`` over its cases (pass / fail), or a note when nothing was judged (n/a).
    Returns the family's verdict: pass | fail | n/a | not judged (every case blocked by a prerequisite).

    A family whose failed cases all raised (the user's kernel's exceptions) records observed None and the
    exception as the whole detail, ``raised <Type>: <message>`` (:func:`tfmoe.rules.faults.is_raised`), the cases in a
    note: the diagnosis never reads it as a measurement, and when every failed family raised the one exception the
    verdict says so once, first. A measured failure leads over raised cases."""
    name = f"kernel_{family}"
    by = {s: [o for o in outcomes if o.status == s] for s in ("pass", "fail", "n/a", "skipped", "blocked")}
    counts = ", ".join(f"{len(v)} {s}" for s, v in by.items() if v)
    extras = []
    if by["skipped"]:
        extras.append(f"skipped: {by['skipped'][0].detail}")
    if by["n/a"]:
        extras.append(f"not applicable: {by['n/a'][0].detail}")
    if by["blocked"]:
        extras.append(f"not judged: {reason_blocked}")
        if by["pass"] or by["fail"]:
            rec.note(f"{name}: {len(by['blocked'])} cases not judged: {reason_blocked}")
    if not by["pass"] and not by["fail"]:
        rec.note(f"{name} n/a ({counts or 'no cases'}): " + "; ".join(extras))
        if by["n/a"] and not by["blocked"]:  # declared lacking, or NotImplementedError: listed, never failed
            rec.not_applicable(name, f"{counts}: " + "; ".join(extras))
        return "not judged" if by["blocked"] else "n/a"  # not judged: what rests on it is not judged either
    judged_cases = by["pass"] + by["fail"]
    subs = sum(o.substitute for o in judged_cases)
    revealing = sum(o.reveals for o in judged_cases)
    coverage = (f"coverage: {len(judged_cases)} cases judged" + (f" ({subs} substituted for cases the kernel cannot "
                "take)" if subs else "") + f", {revealing} of them could reveal {REVEALS[family]}")
    if not by["fail"] and not revealing:  # judged only where the property is vacuous: never a pass
        why = f"not judged: every case it could run is vacuous for {REVEALS[family]} ({coverage}: " \
              f"{', '.join(o.case.label() for o in judged_cases[:3])})"
        rec.note(f"{name} {why}")
        rec.not_applicable(name, why + ("; " + "; ".join(extras) if extras else ""))
        return "vacuous"
    extras.insert(0, coverage)
    failed = sorted(by["fail"], key=lambda o: -o.ratio)
    measured = [o for o in failed if not o.raised]
    raised = [o for o in failed if o.raised]
    judged = len(by["pass"]) + len(failed)
    if raised:
        kinds = list(dict.fromkeys(o.raised for o in raised))
        labels = ", ".join(o.case.label() for o in raised[:3]) + (f" +{len(raised) - 3} more" if len(raised) > 3 else "")
        rec.note(f"{name}: {len(raised)} of {judged} judged cases raised ({labels}): " + "; ".join(kinds)
                 + ("" if measured or not extras else " | " + " | ".join(extras)))  # a measured detail has them
    if measured:
        worst = measured[0]
        others = [o.case.label() for o in failed if o is not worst][:3]
        more = f" +{len(failed) - 4} more" if len(failed) > 4 else ""
        detail = (f"{len(failed)} of {judged} cases failed ({counts}); worst "
                  f"{worst.detail}" + (f"; also {', '.join(others)}{more}" if others else ""))
        if raised:
            detail += f"; {len(raised)} cases raised: {'; '.join(kinds)}"
    elif raised:  # nothing measured a wrong value: the exception leads, alone when it is the one (faults.is_raised)
        worst = raised[0]
        detail = kinds[0] + (f"; other cases raised: {'; '.join(kinds[1:])}" if len(kinds) > 1 else "")
    else:
        worst = max(by["pass"], key=lambda o: o.ratio)
        detail = f"all {len(by['pass'])} judged cases within FlashAttention's rule ({counts}); closest {worst.detail}"
    if extras and (measured or not raised):
        detail += " | " + " | ".join(extras)
    observed = None if raised and not measured else float(len(failed))
    rec.check(name, not failed, observed, None if observed is None else 0.0, detail,
              evidence=worst.evidence if failed else None)
    return "fail" if failed else "pass"


def run_kernel_battery(s: KernelSettings, rec: Recorder) -> None:
    """The kernel battery: every case of the matrix, one check per family, a conformance summary.

    On CPU with ``threads`` unset it runs on one intra-op thread: its tensors are at most a few MB, and on a
    shared 2-core machine OpenMP's hand-offs cost more than the maths (the default matrix took 215 s wall /
    55 s CPU on 2 threads vs 30 s / 7 s on 1 at load 15: benchmarks/bench_attn_kernels.py)."""
    from tfmoe.contract.runtime import torch_threads

    one = rec.device.type == "cpu" and s.threads is None
    if one:
        rec.note("kernel mode on CPU: 1 intra-op thread (threads=null; pass threads=N to choose)")
    with torch_threads(1 if one else None):
        _run_battery(s, rec)


def _run_battery(s: KernelSettings, rec: Recorder) -> None:
    device, dtype = rec.device, rec.dtype
    kernel = load_kernel(s.spec, s.causal_align, device)
    if kernel.causal_align and s.causal_align and kernel.causal_align != s.causal_align:
        raise BadInput(f"causal_align={s.causal_align} contradicts {s.spec}, whose is_causal is "
                       f"{kernel.causal_align.replace('_', '-')} aligned: drop causal_align or pass "
                       f"causal_align={kernel.causal_align}")
    align = s.causal_align or kernel.causal_align or "top_left"
    decl = kernel_declarations(s, kernel, dtype)
    need = max(8 * s.B * s.Hq * c.Tq * c.Tk * 6 for c in s.cases)  # fp64 scores, weights and their grads
    if need > available_memory_bytes(device):
        raise BadInput(f"the largest case needs about {need / 2**30:.1f} GiB for the fp64 reference: "
                       "use smaller cases.shapes")
    for n in kernel.notes:
        rec.note(n)
    expect = "; ".join(f"{kind}: {'|'.join(p)}" for kind, p in s.fully_masked_expect.items())
    rec.note(f"rows that see no key, judged in every family against kernel_checks.fully_masked_expect ({expect})")
    rec.note(f"kernel mode: {s.spec}, causal_align={align}, B={s.B}, Hq={s.Hq}, {len(s.cases)} forward cases; "
             "reference = fp64 first-principles attention (tfmoe.components.reference_attention); "
             f"rule: err <= 2·plain + rounding (output), {s.grad_factor:g}·plain + rounding (dq, dk, dv)")
    if s.module_keys_set:
        rec.note("kernel mode ignores the module-mode keys (impl, B, T, d_model, ...)")

    rounds, row_max, chunk = True, False, 0
    if "backward" not in decl.lacks:
        rounds, note = backward_rounds_to_run_dtype(kernel, dtype, device, rec.seed)
        rec.note(note)
        row_max, note = backward_differentiates_row_max(kernel, dtype, device, rec.seed, rounds, s.grad_factor)
        rec.note(note)
        chunk, note = backward_query_chunk(kernel, dtype, device, rec.seed)
        if note:
            rec.note(note)
    verdict: dict[str, str] = {}
    outcomes: dict[str, list[Outcome]] = {f: [] for f in FAMILIES}
    policies: dict[str, set[str]] = {}
    t0 = time.perf_counter()
    backward_outcomes: dict[int, Outcome] = {}
    weights_outcomes: dict[int, Outcome] = {}
    n_subs = 0
    for family in FAMILIES:
        if family in PROBES:
            continue
        idx = [i for i, c in enumerate(s.cases) if c.family == family]
        if not idx:
            continue
        with rec.stage("kernel_family", family=family):
            for i in idx:
                case = s.cases[i]
                try:
                    o = _judge_case(s, rec, kernel, align, case, i, verdict, policies, backward_outcomes,
                                    weights_outcomes, decl, rounds, row_max, chunk)
                except (BadInput, AdapterError):
                    raise
                except Exception as exc:  # outside the kernel's call: the battery's own error, never the kernel's
                    raise battery_fault(exc, s.spec, f"while judging case {case.label()}") from exc
                outcomes[family].append(o)
            decl = _detect_lacks(family, outcomes[family], decl, rec)
            for case in _substitutes(family, outcomes[family], decl, kernel, s.Hq):
                i = len(s.cases) + n_subs  # its own draws, after every default case's
                n_subs += 1
                try:
                    o = _judge_case(s, rec, kernel, align, case, i, verdict, policies, backward_outcomes,
                                    weights_outcomes, decl, rounds, row_max, chunk)
                except (BadInput, AdapterError):
                    raise
                except Exception as exc:
                    raise battery_fault(exc, s.spec, f"while judging case {case.label()}") from exc
                for sub in (o, backward_outcomes.get(i), weights_outcomes.get(i)):
                    if sub is not None:
                        sub.substitute = True
                outcomes[family].append(o)
            try:
                probe = _exact_output_outcome(s, rec, kernel, align, family, outcomes[family], decl, verdict)
            except (BadInput, AdapterError):
                raise
            except Exception as exc:
                raise battery_fault(exc, s.spec, f"while running {family}'s exact-output probe") from exc
            if probe is not None:
                outcomes[family].append(probe)
        blocked_by = sorted({p for o in outcomes[family] if o.status == "blocked"
                             for p in prerequisites(o.case, s.Hq) if verdict.get(p) in UNMET})
        verdict[family] = record_family(rec, family, outcomes[family],
                                        "prerequisite " + ", ".join(f"{PREREQ_TEXT[p]} {verdict[p]}"
                                                                    for p in blocked_by) + ": fix that first")
    if n_subs:
        rec.note(f"{n_subs} cases substituted for default cases the kernel cannot take (kv heads = query heads, "
                 "Tq = Tk): each family judged where the kernel can run")
    outcomes["weights"] = [weights_outcomes[i] for i in sorted(weights_outcomes)]
    verdict["weights"] = record_family(rec, "weights", outcomes["weights"],
                                       "the weights of a case whose forward did not pass are not read")
    outcomes["backward"] = [backward_outcomes[i] for i in sorted(backward_outcomes)]
    if "backward" not in decl.lacks:  # the exact-gradient probe: plain attention, so it rests on kernel_scale
        if verdict.get("scale", "pass") == "pass":
            try:
                outcomes["backward"].append(run_exact_grad_probe(kernel, s.B, s.Hq, dtype, rec.seed, rec))
            except (BadInput, AdapterError):
                raise
            except Exception as exc:
                raise battery_fault(exc, s.spec, "while running the exact-gradient probe") from exc
        else:
            rec.note(f"kernel_backward: the exact-gradient probe not run: kernel_scale {verdict['scale']}")
    verdict["backward"] = record_family(rec, "backward", outcomes["backward"],
                                        "the backward of a case whose forward did not pass is not judged")
    if not s.backward:
        rec.note("kernel_backward not run: kernel_checks.backward=false (read as lacks=[backward])")
    wall = time.perf_counter() - t0
    rec.metric("matrix_wall_s", wall, measured=True)
    for mask, kinds in sorted(policies.items()):
        rec.note(f"rows that see no key ({mask} cases): the kernel gives {', '.join(sorted(kinds))}")
    if not any(v in ("pass", "fail") for v in verdict.values()):
        rec.check("kernel_ran", False, None, None, f"{s.spec} ran no case of the matrix (every family n/a): "
                  "see the notes for the kernel's reasons")
    _kernel_summary(rec, s, align, dtype, verdict, outcomes, policies, wall)


def _detect_lacks(family: str, outs: list[Outcome], decl: capabilities.Declared, rec: Recorder
                  ) -> capabilities.Declared:
    """Capabilities detected from what the kernel raised (tfmoe.rules.capabilities rule 3, read once for the matrix):
    NotImplementedError on every scale case with Tq != Tk while a Tq = Tk case ran is a lack of
    ``unequal_lengths``; on every gqa case with Tq = Tk, a lack of ``gqa``. Later cases needing a detected lack are
    n/a without a call, and each family gets substitutes (:func:`_substitutes`)."""
    ran = [o for o in outs if o.status in ("pass", "fail")]
    if family == "scale" and "unequal_lengths" not in decl.lacks:
        rect = [o for o in outs if o.case.Tq != o.case.Tk]
        if rect and ran and all(o.not_implemented for o in rect) and any(o.case.Tq == o.case.Tk for o in ran):
            rec.note("detected: the kernel raised NotImplementedError on every case with Tq != Tk and ran those "
                     "with Tq = Tk: read as lacking unequal_lengths (declare it: tfmoe_lacks or lacks=[...])")
            return decl.with_lack("unequal_lengths", NotImplementedError(rect[0].detail.split(": ", 1)[-1]))
    if family == "gqa" and "gqa" not in decl.lacks:
        square = [o for o in outs if o.case.Tq == o.case.Tk]
        if square and all(o.not_implemented for o in square):
            rec.note("detected: the kernel raised NotImplementedError on every gqa case: read as lacking gqa "
                     "(declare it: tfmoe_lacks or lacks=[...])")
            return decl.with_lack("gqa", NotImplementedError(square[0].detail.split(": ", 1)[-1]))
    return decl


def substitute(case: Case, Hq: int, lacks: frozenset[str] | set[str]) -> Case | None:
    """The case a kernel that lacks ``lacks`` can run in place of ``case``, judging the same family: kv heads =
    query heads (not in the gqa family, whose property that is), Tq = Tk = max(Tq, Tk) (the dropout probe: Tk,
    which keeps Tk <= D). None when nothing substitutes (the long row's square would cost Tk² per head)."""
    new = case
    if "gqa" in lacks and case.Hkv != Hq and case.family != "gqa":
        new = replace(new, Hkv=Hq)
    if "unequal_lengths" in lacks and case.Tq != case.Tk and case.family != "long_rows":
        T = case.Tk if case.family == "dropout" else max(case.Tq, case.Tk)
        new = replace(new, Tq=T, Tk=T)
    if new == case or any(f in lacks for f in case_features(new, Hq)):
        return None
    return new


def _substitutes(family: str, outs: list[Outcome], decl: capabilities.Declared, kernel: Kernel, Hq: int
                 ) -> list[Case]:
    """The family's substitutes for its cases that are n/a or skipped for lacking gqa (declared, detected, or no
    ``enable_gqa`` in the signature) or unequal lengths: distinct, and none the family already ran."""
    lacks = set(decl.lacks) | ({"gqa"} if kernel.params is not None and "enable_gqa" not in kernel.params else set())
    have = {o.case for o in outs}
    new: list[Case] = []
    for o in outs:
        if o.status not in ("n/a", "skipped") or o.substitute:
            continue
        sub = substitute(o.case, Hq, lacks)
        if sub is not None and sub not in have:
            have.add(sub)
            new.append(sub)
    return new


def _exact_output_outcome(s: KernelSettings, rec: Recorder, kernel: Kernel, align: str, family: str,
                          outs: list[Outcome], decl: capabilities.Declared, verdict: dict[str, str]
                          ) -> Outcome | None:
    """The family's exact-output probe (kernel_exact.output_probe_inputs), when the family judged a case,
    the probe's own prerequisites passed and the kernel neither lacks the probe's features nor its mask
    argument; None otherwise."""
    if family not in EXACT_OUTPUT_MASKS or not any(o.status in ("pass", "fail") for o in outs):
        return None
    Hkv = min(o.case.Hkv for o in outs)  # gqa: its fewest kv heads; the mask families: as their cases
    case, inp = output_probe_inputs(family, s.B, s.Hq, Hkv, align, rec.dtype, rec.seed, rec.device)
    if (any(f in decl.lacks for f in case_features(case, s.Hq)) or missing_params(kernel, inp.kwargs)
            or any(verdict.get(p) in UNMET for p in prerequisites(case, s.Hq))):
        return None
    return run_exact_output_probe(kernel, case, inp, rec.dtype, rec)


def _judge_case(s: KernelSettings, rec: Recorder, kernel: Kernel, align: str, case: Case, i: int,
                verdict: dict[str, str], policies: dict[str, set[str]], backward_outcomes: dict[int, Outcome],
                weights_outcomes: dict[int, Outcome], decl: capabilities.Declared, rounds: bool = True,
                row_max: bool = False, chunk: int = 0) -> Outcome:
    """One case of the matrix: blocked, skipped, not applicable (declared), or run and judged; then its probes
    (the backward, and the weights read through a one-hot v) into backward_outcomes and weights_outcomes.
    ``rounds``: the backward rounds dP and δ to the run dtype (kernel_judging.backward_rounds_to_run_dtype);
    ``row_max``: it differentiates through the row max (kernel_judging.backward_differentiates_row_max);
    ``chunk``: it adds dk, dv over chunks of that many queries in the run dtype (kernel_judging.backward_query_chunk)."""
    family, device, dtype = case.family, rec.device, rec.dtype
    blocked = [p for p in prerequisites(case, s.Hq) if verdict.get(p) in UNMET]
    inp = make_inputs(case, s.B, s.Hq, align, rec.seed, i, device, dtype)
    missing = missing_params(kernel, inp.kwargs)
    lacked = [f for f in case_features(case, s.Hq) if f in decl.lacks]
    backward = "backward" not in decl.lacks
    bwd = None
    if blocked:
        o = Outcome(case, "blocked", f"{case.label()}: needs {', '.join(blocked)}")
    elif lacked:
        o = Outcome(case, "n/a", f"{case.label()}: {decl.why(lacked[0])}")
    elif missing:
        o = Outcome(case, "skipped", f"{case.label()}: the kernel's signature has no {', '.join(missing)}")
    elif family == "dropout":
        seed = rec.seed * 1_000_003 + i
        o = run_dropout_case(kernel, case, inp, dtype, seed, s.dropout_seeds, rec)
        rec.metric("case_passed", float(o.status == "pass"), status=o.status, **case.tags())
        if backward and o.status == "pass":
            bwd = run_dropout_backward(kernel, case, inp, dtype, seed, s.grad_factor, rec, rounds, row_max, chunk)
    else:  # the weights first: the output's and gradients' floors are measured on them where they passed
        probe, read = run_weights_probe(kernel, case, inp, dtype, rec)
        o, bwd = run_case(kernel, case, inp, dtype, s.fully_masked_expect, backward, s.grad_factor, rec, read,
                          rounds, row_max, chunk)
        if o.policy != "none":
            policies.setdefault(case.mask, set()).add(o.policy)
        rec.metric("case_passed", float(o.status == "pass"), status=o.status, policy=o.policy, **case.tags())
    o.reveals = case_reveals(case, inp)
    if family != "dropout" and o.status == "pass":
        probe.reveals = case_reveals(replace(case, family="weights"), inp)
    not_run = Outcome(case, o.status, o.detail) if o.status in ("n/a", "skipped") else None
    if bwd is not None:
        backward_outcomes[i] = bwd
    elif not backward:
        backward_outcomes[i] = not_run or Outcome(case, "n/a", f"{case.label()}: {decl.why('backward')}")
    else:
        backward_outcomes[i] = not_run or Outcome(case, "blocked", f"{case.label()}: its forward did not pass")
    if family != "dropout":  # dropout reads its own weights
        weights_outcomes[i] = (not_run or Outcome(case, "blocked", f"{case.label()}: its forward did not pass")
                               if o.status != "pass" else probe)
    return o


def _kernel_summary(rec: Recorder, s: KernelSettings, align: str, dtype: torch.dtype, verdict: dict[str, str],
                    outcomes: dict[str, list[Outcome]], policies: dict[str, set[str]], wall: float) -> None:
    table = Rows(f"attn-check kernel={s.spec} ({str(dtype).removeprefix('torch.')}, causal_align={align})",
                 ["family", "verdict", "pass", "fail", "n/a", "skipped", "not judged", "substituted",
                  "could reveal"])
    for family in FAMILIES:
        outs = outcomes[family]
        n = [sum(o.status == st for o in outs) for st in ("pass", "fail", "n/a", "skipped", "blocked")]
        judged = [o for o in outs if o.status in ("pass", "fail")]
        v = verdict.get(family, "n/a")
        v = "not judged (vacuous)" if v == "vacuous" else v
        table.add(f"kernel_{family}", v, *n, sum(o.substitute for o in judged),
                  f"{sum(o.reveals for o in judged)}/{len(judged)}" if judged else "-",
                  style="red" if v == "fail" else ("yellow" if v.startswith("not judged") else None))
    table.print_to(rec.console)
    pol = "; ".join(f"{m}: {', '.join(sorted(k))}" for m, k in sorted(policies.items())) or "none observed"
    rec.print(f"rows that see no key: {pol}; matrix {wall:.1f} s")
    rec.summary(f"### attn-check kernel mode: `{s.spec}`, {str(dtype).removeprefix('torch.')}, causal_align={align}, "
                f"B={s.B}, Hq={s.Hq}, {len(s.cases)} cases\n\n" + table.markdown()
                + f"\n\nRows that see no key: {pol}. Matrix wall time {wall:.1f} s.")
