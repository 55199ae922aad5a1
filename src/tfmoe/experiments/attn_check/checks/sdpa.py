"""sdpa: the output equals SDPA on the layer's own projections, by FlashAttention's dtype rule."""

from __future__ import annotations

import math

import torch

from tfmoe.adapters import ContractError
from tfmoe.components.comparison import Comparison, compare, max_abs_err
from tfmoe.components.references import attention_weights
from tfmoe.experiments.attn_check.layer import LayerUnderTest, precision_diagnosis, record_comparison


def _precision_cause(coarse: str, c: Comparison, dtype: torch.dtype) -> str:
    run = str(dtype).removeprefix("torch.")
    return (f"; CAUSE: the module computes in {coarse}, not {run}: its error {c.err:.2g} is {coarse}-sized (within "
            f"a plain {coarse} implementation's limit, {c.err / max(c.threshold, 1e-300):.3g}x the {run} limit); "
            f"cast to the input's dtype (e.g. softmax(..., dtype=torch.promote_types(x.dtype, torch.float32))) "
            f"instead of .float() / a fixed dtype")


def check_sdpa(layer: LayerUnderTest) -> None:
    """4. output == SDPA on the module's own projections, by FlashAttention's dtype rule; outputs finite.
    A failure whose error fits a coarser dtype's rule names that dtype as the cause."""
    with torch.no_grad():
        ref = layer.reference(layer.x, layer.mask)
        plain = layer.plain(layer.x, layer.mask)
        rd = ref.dtype
        ref_w = attention_weights(layer.x.to(rd), layer.proj().to(rd), layer.mask)
    out = layer.out
    if out is None or out.shape != ref.shape:
        raise ContractError(f"output shape {None if out is None else tuple(out.shape)} != {tuple(ref.shape)}")
    c = compare(out, ref, plain, layer.dtype, layer.valid)
    cause = ""
    if not c.passed and math.isfinite(c.err):
        coarse = precision_diagnosis(out, ref, layer.x.to(rd), layer.proj(), layer.mask, layer.valid, layer.dtype)
        cause = _precision_cause(coarse, c, layer.dtype) if coarse else ""
    record_comparison(layer, "sdpa_match", "module_vs_sdpa", c,
                       f"module vs SDPA in {str(rd).removeprefix('torch.')} on the module's weights" + cause,
                       layer.evidence(out=out, ref=ref))
    if layer.s.padded_query_policy == "zeros":
        check_padded_queries_zero(layer, out, ref)
    if layer.attn is not None and layer.attn.shape == ref_w.shape:
        valid_w = layer.valid[:, None, :].expand(-1, layer.s.n_heads, -1)  # (B,H,T)
        layer.rec.metric("max_abs_err", max_abs_err(layer.attn, ref_w, valid_w), comparison="weights_vs_reference",
                       dtype=str(layer.dtype).removeprefix("torch."))



def check_padded_queries_zero(layer: LayerUnderTest, out: torch.Tensor, ref: torch.Tensor) -> None:
    """padded_query_policy=zeros: the layer's output at padded query positions (padding_mask False) is 0, within
    8 eps of the run's dtype at the reference's scale."""
    pad = ~layer.padding_mask.to(out.device)  # (B,T)
    n = int(pad.sum())
    if not n:
        layer.rec.note("padded_query_rows not run: the main case has no padded query (lengths=...)")
        return
    rows = out.detach().double()[pad]  # (n,D)
    worst = float(rows.abs().max()) if bool(torch.isfinite(rows).all()) else math.inf
    tol = 8 * torch.finfo(layer.dtype).eps * max(1.0, float(ref.detach().double().abs().max()))
    layer.rec.check_le("padded_query_rows", worst, tol,
                       f"padded_query_policy=zeros: max |out| over the {n} padded query rows {worst:.3g} "
                       f"(limit 8 eps x max|ref| = {tol:.3g})", evidence=layer.evidence(out=out))
