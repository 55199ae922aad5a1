"""The layer under test on the battery's main case: what every check group of the module battery shares.

:class:`LayerUnderTest` holds the adapter, the built layer, the main case's input and masks (the reference's own,
from :mod:`tfmoe.components.references`), the main forward's output (written by the shapes check) and what
that forward revealed that stops other groups (see ``module_battery.unmet_prerequisite``); it builds fresh
instances, calls the layer and computes the reference and the plain yardstick on its weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from tfmoe.adapters import AttentionAdapter
from tfmoe.components.comparison import COARSER, Comparison, compare
from tfmoe.components.references import (
    Projections,
    lengths_to_key_padding,
    plain_attention,
    reference_dtype,
    rows_with_a_key,
    sdpa_attention,
    visibility,
)
from tfmoe.contract.errors import BadInput, ContractError
from tfmoe.contract.recorder import Recorder
from tfmoe.rules.capabilities import Declared
from tfmoe.rules.faults import tfmoe_fault

if TYPE_CHECKING:
    from tfmoe.experiments.attn_check.settings import ModuleSettings


@dataclass
class LayerUnderTest:
    """The layer under test and the main case, shared by every check group of one run."""

    s: ModuleSettings
    rec: Recorder
    adapter: AttentionAdapter
    module: nn.Module
    x: torch.Tensor  # (B,T,D) at the run's dtype
    padding_mask: torch.Tensor  # (B,T) True = real token (all True when nothing is padded)
    mask: torch.Tensor | None  # broadcastable (B|1,1,T,T) True = visible, or None (the reference's own)
    valid: torch.Tensor  # (B,T) the query rows judged: they see a key and (padded_query_policy != attend) are real
    device: torch.device
    dtype: torch.dtype
    chunked_fn: Callable[..., torch.Tensor]
    declared: Declared  # what the layer declares it lacks and computes in (tfmoe.rules.capabilities)
    # the main forward, written by the shapes check (which always runs first); None if the layer raised there
    out: torch.Tensor | None = None
    attn: torch.Tensor | None = None  # also None when the layer returns no weights
    # what the main forward revealed (see module_battery.unmet_prerequisite); '' / 0 = nothing wrong
    bad_output_shape: str = ""
    bad_weights_shape: str = ""
    random_eval_forward: float = 0.0  # how far two eval-mode calls on the same input differ

    @classmethod
    def start(cls, s: ModuleSettings, rec: Recorder, adapter: AttentionAdapter,
              chunked_fn: Callable[..., torch.Tensor], declared: Declared | None = None) -> LayerUnderTest:
        """Build the layer (random weights from the run's seed) and draw the main case: x (B,T,D), the key
        padding of ``s.lengths`` and the reference's own visibility mask."""
        device, dtype = rec.device, rec.dtype
        try:
            module = adapter.build(s.d_model, s.n_heads, n_kv_heads=s.n_kv_heads, causal=s.causal,
                                   dropout=s.dropout, seed=None, dtype=dtype, device=device)
        except BadInput:
            raise
        except Exception as exc:  # tfmoe's or a shipped adapter's fault: say so (library, version, range)
            fault = tfmoe_fault(exc, f"impl={adapter.spec} (building the layer)", adapter.library, adapter.supported)
            if fault is not None:
                raise fault from exc
            # the user's adapter or layer could not be built for these settings: bad input, one line, as the course
            # interface says it (an adapter refuses a setting on purpose by raising tfmoe.contract.errors.BadInput; F-199)
            message = " ".join(str(exc).split())
            raise BadInput(f"impl={adapter.spec}: building the layer (d_model={s.d_model}, n_heads={s.n_heads}, "
                           f"n_kv_heads={s.n_kv_heads}, causal={s.causal}) raised {type(exc).__name__}"
                           f"{': ' + message if message else ''}: fix the adapter's build or change those settings"
                           ) from None
        for text in adapter.notes:
            rec.note(f"{adapter.name}: {text}")
        x = torch.randn(s.B, s.T, s.d_model, device=device).to(dtype)  # (B,T,D)
        padding_mask = lengths_to_key_padding(s.lengths, s.T, device=device)  # (B,T)
        pm_arg = None if bool(padding_mask.all()) else padding_mask
        mask = visibility(s.T, s.T, s.causal, pm_arg, device=device)  # the reference's own mask
        seen = rows_with_a_key(mask, s.B, s.T)
        if not bool(seen.all()):
            rec.note(f"{int((~seen).sum())} query rows of the main case see no key (length 0 rows): excluded "
                     "from comparisons (policy)")
        valid = judged_rows(s.padded_query_policy, mask, padding_mask, s.B, s.T)
        padded = int((seen & ~valid).sum())
        if padded:
            rec.note(f"{padded} padded query rows of the main case (padding_mask False) are excluded from every "
                     f"comparison (padded_query_policy={s.padded_query_policy}: their output is don't-care in a "
                     "loss, as in FlashAttention's tests; padded_query_policy=attend judges them, zeros requires 0)")
        return cls(s, rec, adapter, module, x, padding_mask, mask, valid, device, dtype, chunked_fn,
                   Declared() if declared is None else declared)

    @property
    def pm_arg(self) -> torch.Tensor | None:
        """What the module gets as padding_mask: None when nothing is padded (the common call)."""
        return None if bool(self.padding_mask.all()) else self.padding_mask

    def build(self, n_heads: int | None = None, causal: bool | None = None, dropout: float | None = None,
              dtype: torch.dtype | None = None, state: dict[str, torch.Tensor] | None = None) -> nn.Module:
        """A fresh instance of the layer under test (eval mode), optionally with another instance's weights."""
        s = self.s
        h = s.n_heads if n_heads is None else n_heads
        module = self.adapter.build(s.d_model, h, n_kv_heads=s.n_kv_heads if n_heads is None else h,
                                    causal=s.causal if causal is None else causal,
                                    dropout=s.dropout if dropout is None else dropout, seed=None,
                                    dtype=self.dtype if dtype is None else dtype, device=self.device)
        if state is not None:
            try:
                module.load_state_dict(state)
            except RuntimeError as exc:  # the layer's contract, not tfmoe's: two builds must name their weights alike
                if n_heads is not None and n_heads != self.s.n_heads:
                    raise  # another head count: head_counts says why it cannot be rebuilt (n/a, the whole error)
                own = module.state_dict()
                if len(own) == len(state) and all(a.shape == b.shape for a, b in zip(own.values(), state.values(),
                                                                                     strict=True)):
                    # the same weights under per-instance names (Keras numbers its layers): copied in order
                    module.load_state_dict(dict(zip(own, state.values(), strict=True)))
                    if not getattr(self, "_renamed_noted", False):
                        self.rec.note("the layer's builds name their weights differently (e.g. per-instance names); "
                                      "weights were copied between builds by position, every shape matching")
                        self._renamed_noted = True
                    return module
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise ContractError(
                    f"two builds of the layer have different state_dict keys ({first[:160]}): the battery copies "
                    "weights between instances (another dtype, head count or dropout), so every build must name its "
                    "parameters the same way (e.g. give a Keras layer a fixed name=)") from exc
        return module

    def call(self, module: nn.Module, x: torch.Tensor, padding_mask: torch.Tensor | None, causal: bool | None = None,
             cache: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.adapter.forward(module, x, padding_mask, causal=self.s.causal if causal is None else causal,
                                    cache=cache)

    def proj(self, module: nn.Module | None = None, n_heads: int | None = None) -> Projections:
        """The layer's projections (detached) as the reference reads them."""
        m = self.module if module is None else module
        h = self.s.n_heads if n_heads is None else n_heads
        params = {k: v.detach() for k, v in self.adapter.parameters(m).items()}
        return self.adapter.projections(params, h, self.s.n_kv_heads if n_heads is None else h)

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def reference(self, x: torch.Tensor, mask: torch.Tensor | None, p: Projections | None = None) -> torch.Tensor:
        rd = reference_dtype(self.dtype)
        return sdpa_attention(x.to(rd), (self.proj() if p is None else p).to(rd), mask)

    def plain(self, x: torch.Tensor, mask: torch.Tensor | None, p: Projections | None = None) -> torch.Tensor:
        return plain_attention(x, (self.proj() if p is None else p).to(x.dtype), mask)

    def evidence(self, **more: torch.Tensor) -> dict[str, torch.Tensor]:
        """The failing inputs (saved as failing.<check>.<name> tensors when a check fails)."""
        base: dict[str, Any] = {"x": self.x, "padding_mask": self.padding_mask, **projection_tensors(self.proj())}
        base.update(more)
        return {k: v for k, v in base.items() if isinstance(v, torch.Tensor)}


def judged_rows(policy: str, mask: torch.Tensor | None, padding_mask: torch.Tensor | None, B: int,
                T: int) -> torch.Tensor:
    """(B,T) on CPU: the query rows a comparison judges: those that see a key and, unless ``policy``
    (padded_query_policy) is attend, only real queries (padding_mask (B,T) True = real; None = all real)."""
    rows = rows_with_a_key(mask, B, T)
    if padding_mask is not None and policy != "attend":
        rows = rows & padding_mask.detach().to("cpu", torch.bool).expand(B, T)
    return rows


def projection_tensors(p: Projections) -> dict[str, torch.Tensor]:
    """w_qkv (q, k, v rows stacked), w_out and the biases, as saved in a run."""
    out = {"w_qkv": torch.cat([p.w_q, p.w_k, p.w_v]), "w_out": p.w_o}
    for name in ("b_q", "b_k", "b_v", "b_o"):
        out[name] = getattr(p, name)
    return {k: v for k, v in out.items() if v is not None}


def precision_diagnosis(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, p: Projections,
                        mask: torch.Tensor | None, valid: torch.Tensor | None, dtype: torch.dtype) -> str:
    """'' or the coarser dtype the layer evidently computes in: its error vs the reference is too large for
    ``dtype``'s rule but within the rule of a plain implementation in that coarser dtype (e.g. a ``.float()``
    softmax in an fp64 run)."""
    for coarse in COARSER.get(dtype, ()):
        plain = plain_attention(x.to(coarse), p.to(coarse), mask)
        if compare(out, ref, plain, coarse, valid).passed:
            return str(coarse).removeprefix("torch.")
    return ""


def record_comparison(layer: LayerUnderTest, name: str, comparison: str, c: Comparison, detail: str,
                       evidence: dict[str, torch.Tensor], yardstick: torch.dtype | None = None) -> None:
    """One comparison's metrics and check; ``yardstick`` is the plain implementation's dtype when it is not the
    run's (a declared compute_dtype)."""
    tag = str(layer.dtype).removeprefix("torch.")
    plain_tag = tag if yardstick is None else str(yardstick).removeprefix("torch.")
    layer.rec.metric("max_abs_err", c.err, comparison=comparison, dtype=tag)
    layer.rec.metric("max_rel_err", c.rel_err, comparison=comparison, dtype=tag)
    layer.rec.metric("plain_max_abs_err", c.plain_err, comparison=comparison, dtype=tag)
    layer.rec.metric("threshold", c.threshold, comparison=comparison, dtype=tag)
    layer.rec.check(name, c.passed, c.err, c.threshold,
                  f"{detail}; max abs err {c.err:.3g} (rel {c.rel_err:.3g}) vs plain {plain_tag} {c.plain_err:.3g}; "
                  f"threshold 2·plain + {c.atol:.2g}", evidence=evidence)

