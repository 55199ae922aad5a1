"""sdpa: the output equals SDPA on the layer's own projections, by FlashAttention's dtype rule."""

from __future__ import annotations

import math

import torch

from tfmoe.adapters import ContractError
from tfmoe.components.comparison import Comparison, compare, max_abs_err
from tfmoe.components.references import attention_weights, plain_attention, visibility
from tfmoe.experiments.attn_check.layer import (
    LayerUnderTest,
    judged_rows,
    precision_diagnosis,
    record_comparison,
)
from tfmoe.rules import capabilities as caps

TORCH_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _precision_cause(coarse: str, c: Comparison, dtype: torch.dtype) -> str:
    run = str(dtype).removeprefix("torch.")
    return (f"; CAUSE: the module computes in {coarse}, not {run}: its error {c.err:.2g} is {coarse}-sized (within "
            f"a plain {coarse} implementation's limit, {c.err / max(c.threshold, 1e-300):.3g}x the {run} limit); "
            f"cast to the input's dtype (e.g. softmax(..., dtype=torch.promote_types(x.dtype, torch.float32))) "
            f"instead of .float() / a fixed dtype, or declare compute_dtype="
            f"{ {'float32': 'fp32', 'float16': 'fp16', 'bfloat16': 'bf16'}.get(coarse, coarse)} if that is by design")


def declared_precision(layer: LayerUnderTest) -> torch.dtype | None:
    """The precision the layer declares it computes in (compute_dtype), when coarser than the run's dtype."""
    name = layer.declared.precisions.get("attention")
    declared = TORCH_DTYPES.get(name) if name else None
    if declared is None or torch.finfo(declared).eps <= torch.finfo(layer.dtype).eps:
        return None
    return declared


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
    declared = declared_precision(layer)
    if declared is not None:  # rule 4: judged against a plain implementation in the declared precision
        plain_d = plain_attention(layer.x.to(declared), layer.proj().to(declared), layer.mask)
        c = compare(out, ref, plain_d, declared, layer.valid)
        tag = str(declared).removeprefix("torch.")
        record_comparison(layer, "sdpa_match", "module_vs_sdpa", c,
                          f"module vs SDPA in {str(rd).removeprefix('torch.')} on the module's weights, judged at the "
                          f"declared compute_dtype {tag}: "
                          + caps.precision_note("the layer", caps.precision_name(tag, "compute_dtype"), c.err,
                                                c.plain_err, detected=False),
                          layer.evidence(out=out, ref=ref), yardstick=declared)
        layer.rec.note(f"sdpa_match judged at the declared compute_dtype {tag}, not the run's "
                       f"{str(layer.dtype).removeprefix('torch.')}")
    else:
        _judge_at_run_dtype(layer, out, ref, plain, rd)
    if layer.s.padded_query_policy == "zeros":
        check_padded_queries_zero(layer, out, ref)
    if layer.attn is not None and layer.attn.shape == ref_w.shape:
        valid_w = layer.valid[:, None, :].expand(-1, layer.s.n_heads, -1)  # (B,H,T)
        layer.rec.metric("max_abs_err", max_abs_err(layer.attn, ref_w, valid_w), comparison="weights_vs_reference",
                       dtype=str(layer.dtype).removeprefix("torch."))


def _judge_at_run_dtype(layer: LayerUnderTest, out: torch.Tensor, ref: torch.Tensor, plain: torch.Tensor,
                        rd: torch.dtype) -> None:
    c = compare(out, ref, plain, layer.dtype, layer.valid)
    cause = ""
    if not c.passed and math.isfinite(c.err):
        coarse = precision_diagnosis(out, ref, layer.x.to(rd), layer.proj(), layer.mask, layer.valid, layer.dtype)
        cause = _precision_cause(coarse, c, layer.dtype) if coarse else ""
    record_comparison(layer, "sdpa_match", "module_vs_sdpa", c,
                       f"module vs SDPA in {str(rd).removeprefix('torch.')} on the module's weights" + cause,
                       layer.evidence(out=out, ref=ref))


def left_padded_probe(T: int, device: torch.device) -> torch.Tensor:
    """(2,T) padding mask: row 0 full, row 1 left-padded by max(1, T//4) positions, so that under a causal mask
    its real queries come after padded keys they must not see (with right padding no real causal query can)."""
    pm = torch.ones(2, T, dtype=torch.bool, device=device)
    pm[1, :max(1, T // 4)] = False
    return pm


def check_left_padding(layer: LayerUnderTest) -> None:
    """left_padding_match: the output on a left-padded batch equals the reference on the real queries. The main case
    pads on the right; under a causal mask its real queries never reach a padded key, so a layer that ignores its
    padding mask would pass it. Here they do: row 1's real queries follow its padded keys."""
    s = layer.s
    pm = left_padded_probe(s.T, layer.device)
    x = torch.randn(2, s.T, s.d_model, device=layer.device).to(layer.dtype)  # (2,T,D)
    mask = visibility(s.T, s.T, s.causal, pm, device=layer.device)
    valid = judged_rows(s.padded_query_policy, mask, pm, 2, s.T)
    with torch.no_grad():
        out, _ = layer.call(layer.module, x, pm)
        ref = layer.reference(x, mask)
        declared = declared_precision(layer)
        yard = declared or layer.dtype
        plain = plain_attention(x.to(yard), layer.proj().to(yard), mask)
    if out.shape != ref.shape:
        raise ContractError(f"output shape {tuple(out.shape)} != {tuple(ref.shape)} on the left-padded probe")
    c = compare(out, ref, plain, yard, valid)
    cause = ""
    if declared is None and not c.passed and math.isfinite(c.err):
        coarse = precision_diagnosis(out, ref, x.to(ref.dtype), layer.proj(), mask, valid, layer.dtype)
        cause = _precision_cause(coarse, c, layer.dtype) if coarse else ""
    record_comparison(layer, "left_padding_match", "module_vs_sdpa_left_padded", c,
                      f"left-padded probe (row 1's first {int((~pm[1]).sum())} of {s.T} positions padded, "
                      f"causal={s.causal}): module vs SDPA on the real query rows"
                      + ("" if declared is None else f", judged at the declared compute_dtype "
                         f"{str(declared).removeprefix('torch.')}") + cause,
                      {"x": x, "padding_mask": pm, "out": out, "ref": ref}, yardstick=declared)



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
