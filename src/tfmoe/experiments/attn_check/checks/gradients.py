"""gradients: fp64 gradcheck of the layer's own backward, and its gradients vs the reference's."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from tfmoe.adapters import AttentionAdapter
from tfmoe.components.comparison import Comparison, compare
from tfmoe.components.references import (
    lengths_to_key_padding,
    plain_attention,
    reference_dtype,
    rows_with_a_key,
    sdpa_attention,
    visibility,
)
from tfmoe.experiments.attn_check.checks.sdpa import declared_precision
from tfmoe.experiments.attn_check.layer import LayerUnderTest, judged_rows, precision_diagnosis

# Backward rule: a fused kernel's gradients (PyTorch's own SDPA backward, via nn.MultiheadAttention or HF's sdpa)
# reach 2.1-2.6x a plain autograd composition's error on these tiny cases (30 seeds, experiments/attn-check.md),
# so gradients get 4x where outputs get FlashAttention's 2x.
GRAD_FACTOR = 4.0


class _Bound(nn.Module):
    """The layer under test as a function of x alone (so torch.func.functional_call can swap its parameters)."""

    def __init__(self, adapter: AttentionAdapter, module: nn.Module, padding_mask: torch.Tensor | None, causal: bool):
        super().__init__()
        self.inner = module
        self._adapter, self._padding_mask, self._causal = adapter, padding_mask, causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._adapter.forward(self.inner, x, self._padding_mask, causal=self._causal)[0]


def _functional(layer: LayerUnderTest, module: nn.Module, padding_mask: torch.Tensor | None
                ) -> tuple[Callable[..., torch.Tensor], list[str]]:
    """f(x, *params) through the module's own forward, and the parameter names in that order."""
    names = list(layer.adapter.parameters(module))
    bound = _Bound(layer.adapter, module, padding_mask, layer.s.causal)

    def f(x: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(bound, {f"inner.{n}": t for n, t in zip(names, tensors, strict=True)}, (x,))
    return f, names


def _module_grads(layer: LayerUnderTest, x: torch.Tensor, padding_mask: torch.Tensor | None,
                  g: torch.Tensor) -> list[torch.Tensor | None]:
    """dx and the gradient of every tensor ``parameters()`` names, by an ordinary ``.backward()`` through the
    layer's own forward on its own parameters: a layer that keeps its weights outside its registered parameters
    (Keras variables) is differentiated as its users differentiate it (``torch.func.functional_call`` swaps only
    registered parameters: F-197). Requires-grad flags and existing ``.grad`` are restored afterwards."""
    live = list(layer.adapter.parameters(layer.module).values())
    saved = [(t.requires_grad, t.grad) for t in live]
    try:
        for t in live:
            t.grad = None
            if t.is_leaf and t.is_floating_point():
                t.requires_grad_(True)
            elif t.requires_grad:
                t.retain_grad()
        x_leaf = x.detach().clone().requires_grad_(True)
        with torch.enable_grad():
            out = layer.call(layer.module, x_leaf, padding_mask)[0]
            (out * g.to(out.dtype)).sum().backward()
        return [x_leaf.grad] + [None if t.grad is None else t.grad.detach().clone() for t in live]
    finally:
        for t, (flag, grad) in zip(live, saved, strict=True):
            t.grad = grad
            if t.is_leaf:
                t.requires_grad_(flag)


def _reference_fn(layer: LayerUnderTest, names: list[str], mask: torch.Tensor | None,
                  attention: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """f(x, *params) computed by the reference (or the plain yardstick) from the same parameter tensors."""
    s = layer.s

    def f(x: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        p = layer.adapter.projections(dict(zip(names, tensors, strict=True)), s.n_heads, s.n_kv_heads)
        return attention(x, p, mask)
    return f


def check_gradients(layer: LayerUnderTest) -> None:
    """6. torch.autograd.gradcheck in fp64 on a small case (only if the module computes in fp64: a module that
    computes in fp32 internally cannot be judged by fp64 finite differences; a note says so); module gradients vs
    the reference's at the run dtype (only when the module's forward matches the reference on that case: the
    gradients of a different function cannot judge the backward)."""
    s, rec = layer.s, layer.rec
    Tg = s.gradcheck_T
    declared = layer.declared.precisions.get("attention")
    if declared not in (None, "fp64"):  # fp64 finite differences cannot judge a layer that computes coarser
        rec.not_applicable("gradcheck", f"not applicable: the layer declares compute_dtype={declared}, and fp64 "
                           "finite differences cannot judge a layer that computes coarser (grad_match judges its "
                           "gradients at the declared precision)")
        return _grad_match(layer)
    module64 = layer.build(dtype=torch.float64, state=layer.state())
    padded = "padding_mask" not in layer.declared.lacks  # a layer without a padding mask: full rows
    pm_g = lengths_to_key_padding([Tg, max(1, Tg - 1) if padded else Tg], Tg, device=layer.device)
    pm_arg = None if bool(pm_g.all()) else pm_g
    f64, names = _functional(layer, module64, pm_arg)
    params64 = [t.detach().clone().requires_grad_(True) for t in layer.adapter.parameters(module64).values()]
    inputs = (torch.randn(2, Tg, s.d_model, dtype=torch.float64, device=layer.device, requires_grad=True), *params64)
    mask_g = visibility(Tg, Tg, s.causal, pm_arg, device=layer.device)
    valid_g = judged_rows(s.padded_query_policy, mask_g, pm_arg, 2, Tg)
    with torch.no_grad():
        x64 = inputs[0].detach()
        p64 = layer.adapter.projections(dict(zip(names, (t.detach() for t in params64), strict=True)),
                                      s.n_heads, s.n_kv_heads)
        out64, ref64 = f64(*inputs), sdpa_attention(x64, p64, mask_g)
        c64 = compare(out64, ref64, plain_attention(x64, p64, mask_g), torch.float64, valid_g)
    coarse = "" if c64.passed else precision_diagnosis(out64, ref64, x64, p64, mask_g, valid_g, torch.float64)
    rec.metric("fp64_forward_max_abs_err", c64.err)
    if coarse:
        rec.note(f"gradcheck not run: the module computes in {coarse} when given float64 input (its fp64 output is "
                 f"off the fp64 reference by {c64.err:.2g}, {coarse}-sized), so fp64 finite differences cannot "
                 "judge its gradients; grad_match judges them at the run's dtype"
                 + (" (this fp64 run's sdpa_match names the cause)" if layer.dtype == torch.float64 else ""))
    else:
        ok = torch.autograd.gradcheck(f64, inputs, eps=1e-6, atol=1e-5, rtol=1e-3, fast_mode=True,
                                      raise_exception=False)
        # A module whose forward is wrong escapes the precision probe above; if its gradients then agree with
        # finite differences at a coarse step, the fine-step failure is rounding (it computes in reduced
        # precision), not a wrong backward: not judged. A wrong backward disagrees at any step.
        coarse_ok = not ok and not c64.passed and torch.autograd.gradcheck(f64, inputs, eps=1e-3, atol=1e-3, rtol=1e-2,
                                                        fast_mode=True, raise_exception=False)
    if not coarse and coarse_ok:
        rec.note("gradcheck not judged: at fp64's finite-difference step (1e-6) the gradients disagree, at a coarse "
                 "step (1e-3) they agree: the module computes in reduced precision (its forward is also off the "
                 "reference, see sdpa_match), so fp64 gradcheck cannot judge its backward")
    elif not coarse:
        rec.check("gradcheck", ok, None, None,
                  f"torch.autograd.gradcheck (fp64, fast_mode) of output w.r.t. x and {', '.join(names)} at B=2, "
                  f"T={Tg}, D={s.d_model}, H={s.n_heads}: {'analytic = numerical' if ok else 'analytic != numerical gradient'}",
                  evidence={"x": x64, "padding_mask": pm_g,
                            **{f"param.{n}": t.detach() for n, t in zip(names, params64, strict=True)}})

    _grad_match(layer)


def _grad_match(layer: LayerUnderTest) -> None:
    """grad_match: the module's gradients (x and every parameter the adapter names) vs the reference's."""
    s, rec = layer.s, layer.rec
    rows_ok = rows_with_a_key(layer.mask, s.B, s.T).all(dim=1)  # batch rows without fully masked queries
    if not bool(rows_ok.any()):
        rec.note("grad_match skipped: every batch row has a fully masked query")
        return
    x0 = layer.x[rows_ok.to(layer.device)]
    pm0 = layer.padding_mask[rows_ok.to(layer.device)]
    pm0_arg = None if bool(pm0.all()) else pm0
    mask0 = visibility(s.T, s.T, s.causal, pm0_arg, device=layer.device)
    valid0 = judged_rows(s.padded_query_policy, mask0, pm0_arg, x0.shape[0], s.T)
    f_mod, names = _functional(layer, layer.module, pm0_arg)
    params = [t.detach() for t in layer.adapter.parameters(layer.module).values()]
    yard = declared_precision(layer) or layer.dtype  # the declared compute_dtype's yardstick (capabilities rule 4)
    with torch.no_grad():
        p0 = layer.proj()
        c0 = compare(f_mod(x0, *params), layer.reference(x0, mask0), plain_attention(x0.to(yard), p0.to(yard), mask0),
                     yard, valid0)
    if not c0.passed:
        rec.note(f"grad_match not judged: the module's forward is off the reference on its case (err {c0.err:.3g} > "
                 f"limit {c0.threshold:.3g}; sdpa_match judges that), so its gradients cannot be compared with the "
                 "reference's; fix the forward first (gradcheck judges the backward against the module's own forward)")
        return
    g = torch.randn(x0.shape, device=layer.device) * valid0[..., None].to(layer.device)  # judged rows only

    def grads(forward: Callable[..., torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor | None]:
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (x0, *params)]
        out = forward(*leaves)
        (out * g.to(dtype)).sum().backward()
        return [leaf.grad for leaf in leaves]

    rd = reference_dtype(layer.dtype)
    ref = grads(_reference_fn(layer, names, mask0, sdpa_attention), rd)
    plain = grads(_reference_fn(layer, names, mask0, plain_attention), yard)
    mod = _module_grads(layer, x0, pm0_arg, g)
    worst, parts, evidence = 0.0, [], {"x": x0, "padding_mask": pm0}
    unused = []  # parameters that neither the layer nor the reference gives a gradient: listed, not judged
    for name, gm, gr, gp, leaf in zip(("x", *names), mod, ref, plain, (x0, *params), strict=True):
        if gm is None and gr is None:
            unused.append(name)
            continue
        if gm is None:  # the reference says this parameter shapes the output, the layer left it without a gradient
            c = Comparison(math.inf, 0.0, 0.0, 1.0)
        else:  # a gradient the reference does not give (a parameter it does not read) must be zero
            gr = torch.zeros_like(leaf, dtype=rd) if gr is None else gr
            gp = torch.zeros_like(leaf, dtype=yard) if gp is None else gp
            c = compare(gm, gr, gp, yard, factor=GRAD_FACTOR)
        rec.metric("max_abs_err", c.err, comparison=f"grad_{name}_vs_sdpa", dtype=str(layer.dtype).removeprefix("torch."))
        rec.metric("plain_max_abs_err", c.plain_err, comparison=f"grad_{name}_vs_sdpa",
                   dtype=str(layer.dtype).removeprefix("torch."))
        parts.append(f"d{name}: " + ("no gradient from the layer, the reference gives one (detached?)"
                                     if gm is None else f"{c.err:.3g} (limit {c.threshold:.3g})"))
        worst = max(worst, c.ratio)
        if gm is not None:
            evidence[f"grad_{name}"] = gm
    if unused:
        parts.append(f"not judged (no gradient from the layer nor the reference: the output does not read them): "
                     f"{', '.join(unused)}")
        rec.note(f"grad_match: {len(unused)} parameter(s) get no gradient from the layer nor the reference, listed "
                 f"and not judged: {', '.join(unused)}")
    rec.check_le("grad_match", worst, 1.0, f"max over dx, {', '.join('d' + n for n in names)} of err/limit, "
                 f"limit = {GRAD_FACTOR:g}·plain + rounding: " + "; ".join(parts), evidence=evidence)

