"""arch's checks: permutation equivariance (attention alone vs with positions), visibility matrices (which
input tokens each output position sees), the embedding's and cross-attention weights' shapes.

Each has a test in tests/test_arch.py that plants a bug and sees it fail.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from tfmoe.components.attention import MultiHeadCrossAttention
from tfmoe.contract.recorder import Recorder
from tfmoe.experiments.arch.trace import TraceRow, fmt_shapes


def dtype_eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


# ------------------------------------------------------------------------ permutation equivariance
def relative_permutation_diff(layer: Callable[[torch.Tensor], torch.Tensor], emb: torch.Tensor,
                              perm: torch.Tensor) -> float:
    """max |layer(emb[:, perm]) - layer(emb)[:, perm]| / max |layer(emb)|, emb (B,T,D) token embeddings.

    0 (up to rounding) means the layer is permutation-equivariant; position information makes it > 0."""
    with torch.no_grad():
        ref = layer(emb)[:, perm]  # (B,T,D)
        got = layer(emb[:, perm])
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1e-30))


def check_equivariance(rec: Recorder, diffs: dict[str, float], tol: float, min_effect: float) -> None:
    """diffs: 'none' (attention alone), 'sinusoidal', optionally 'rope' -> relative permutation diff."""
    rec.check_le("attention_permutation_equivariant_without_positions", diffs["none"], tol,
                 "no positions: attention(x[perm]) == attention(x)[perm] up to rounding")
    for kind in ("sinusoidal", "rope"):
        if kind in diffs:
            rec.check(f"{kind}_positions_break_equivariance", diffs[kind] >= min_effect, diffs[kind], min_effect,
                      f"with {kind} positions, permuting the tokens must change more than reordering the outputs")


def distinct_ids(B: int, T: int, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    """(B,T) ids with no repeated token inside a row (so a permutation really changes the input)."""
    return torch.stack([torch.randperm(vocab_size, generator=generator)[:T] for _ in range(B)])


def nontrivial_permutation(T: int, generator: torch.Generator) -> torch.Tensor:
    perm = torch.randperm(T, generator=generator)
    return perm.roll(1) if torch.equal(perm, torch.arange(T)) else perm


# ------------------------------------------------------------------------------ visibility matrices
def visibility_matrix(forward: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor, vocab_size: int,
                      tol_eps: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Perturb each input token j of ids (T,) and see which outputs change.

    forward: ids (N,T) -> outputs (N,T_out,F). Row 0 of the batch is the original, row j+1 has token j
    replaced by a different id. Returns (matrix (T_out,T) of 0/1, diffs (T_out,T) max |Δ| per output
    position, tol) with tol = tol_eps · eps(dtype) · max(1, max|output|); matrix and diffs on the host (the
    expected patterns, the evidence and the figure are host tensors)."""
    T = ids.shape[0]
    batch = ids.repeat(T + 1, 1)  # (T+1,T)
    j = torch.arange(T, device=ids.device)
    batch[j + 1, j] = (ids + 1 + j) % vocab_size  # a different token at position j
    with torch.no_grad():
        out = forward(batch)  # (T+1,T_out,F)
    base = out[0].double()
    diffs = (out[1:].double() - base).abs().amax(dim=-1).T.cpu()  # (T_out,T): [i, j] = change of output i
    tol = tol_eps * dtype_eps(out.dtype) * max(1.0, float(base.abs().max()))
    return (diffs > tol).to(torch.int64), diffs, tol


def check_visibility(rec: Recorder, name: str, matrix: torch.Tensor, expected: torch.Tensor, detail: str) -> bool:
    wrong = int((matrix != expected).sum())
    return rec.check(name, wrong == 0, wrong, 0, f"{detail}; observed = entries that differ from the expected "
                     "pattern", evidence={"matrix": matrix, "expected": expected})


def visibility_margins(rec: Recorder, arch: str, diffs: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """How far the visible / invisible changes sit from the tolerance (the check's safety margin)."""
    vis, invis = diffs[expected.bool()], diffs[~expected.bool()]
    rec.metric("visibility_tol", tol, arch=arch)
    if vis.numel():
        rec.metric("visibility_min_visible_change", float(vis.min()), arch=arch)
    if invis.numel():
        rec.metric("visibility_max_invisible_change", float(invis.max()), arch=arch)


def run_visibility(rec: Recorder, encoder: nn.Module, decoder: nn.Module, encdec: nn.Module, src: torch.Tensor,
                   tgt: torch.Tensor, vocab_size: int, tol_eps: float) -> dict[str, torch.Tensor]:
    """The four visibility matrices and their checks. src (T_src,), tgt (T_tgt,) ids."""
    T, Tt = src.shape[0], tgt.shape[0]
    ones = torch.ones(T, T, dtype=torch.int64)
    tril = torch.tril(ones)
    enc_m, enc_d, enc_tol = visibility_matrix(lambda b: encoder(b), src, vocab_size, tol_eps)
    dec_m, dec_d, dec_tol = visibility_matrix(lambda b: decoder(b), src, vocab_size, tol_eps)
    cross_m, cross_d, cross_tol = visibility_matrix(lambda b: encdec(b, tgt.expand(b.shape[0], -1)), src,
                                                    vocab_size, tol_eps)
    tgt_m, tgt_d, tgt_tol = visibility_matrix(lambda b: encdec(src.expand(b.shape[0], -1), b), tgt,
                                              vocab_size, tol_eps)
    check_visibility(rec, "visibility_encoder_all_ones", enc_m, ones,
                     "encoder: every output position changes when any input token changes")
    check_visibility(rec, "visibility_decoder_lower_triangular", dec_m, tril,
                     "decoder-only: output i changes exactly for tokens j <= i")
    check_visibility(rec, "visibility_cross_all_ones", cross_m, torch.ones(Tt, T, dtype=torch.int64),
                     "encoder-decoder: every decoder position sees every source token")
    check_visibility(rec, "visibility_encdec_target_lower_triangular", tgt_m, torch.tril(torch.ones(Tt, Tt,
                     dtype=torch.int64)), "encoder-decoder: decoder position i sees target tokens j <= i only")
    visibility_margins(rec, "encoder", enc_d, ones, enc_tol)
    visibility_margins(rec, "decoder", dec_d, tril, dec_tol)
    visibility_margins(rec, "cross", cross_d, torch.ones(Tt, T), cross_tol)
    visibility_margins(rec, "encdec_target", tgt_d, torch.tril(torch.ones(Tt, Tt)), tgt_tol)
    return {"visibility_encoder": enc_m, "visibility_decoder": dec_m, "visibility_cross": cross_m,
            "visibility_encdec_target": tgt_m}


# ---------------------------------------------------------------------------------------- shapes
def check_cross_weights(rec: Recorder, rows: list[TraceRow], B: int, H: int, T_tgt: int, T_src: int) -> bool:
    """Every cross-attention call returned weights of shape (B, H, T_tgt, T_src)."""
    expected = (B, H, T_tgt, T_src)
    calls = [r for r in rows if issubclass(r.cls, MultiHeadCrossAttention)]
    wrong = [r for r in calls if len(r.out_shapes) < 2 or r.out_shapes[1] != expected]
    got = "; ".join(f"{r.module}: {fmt_shapes(r.out_shapes[1:2])}" for r in calls) or "no cross-attention ran"
    return rec.check("cross_attention_weights_shape", bool(calls) and not wrong, len(wrong) + (not calls), 0,
                     f"expected (B,H,T_tgt,T_src) = {expected}; got {got}")


def check_embedding(rec: Recorder, emb: nn.Module | dict[str, nn.Module], ids: torch.Tensor, D: int,
                    V: int) -> bool:
    """token ids (B,T) -> (B,T,D) through a V x D table, for every embedding table of the models under test
    (``emb``: one table, or {name: table}). observed/threshold = total parameters vs V·D per table."""
    tables = emb if isinstance(emb, dict) else {"embedding": emb}
    ok, params, parts = True, 0, []
    for name, table in tables.items():
        with torch.no_grad():
            out = table(ids)
        good = tuple(out.shape) == (*ids.shape, D) and tuple(table.weight.shape) == (V, D)
        ok &= good
        params += table.weight.numel()
        parts.append(f"{name}: ids {tuple(ids.shape)} -> {tuple(out.shape)}, table {tuple(table.weight.shape)}"
                     + ("" if good else " ✗"))
    return rec.check("embedding_shapes", ok, float(params), float(V * D * len(tables)),
                     f"expected ids -> {(*ids.shape, D)} through a {(V, D)} table; " + "; ".join(parts))
