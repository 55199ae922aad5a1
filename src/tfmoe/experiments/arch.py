"""tfmoe arch — course §2.1 / §2.3: the three architectures' data flow, proven by visibility tests.

Questions:
1. Is attention without positions permutation-equivariant (so positions must be injected), and do
   sinusoidal positions / RoPE break that symmetry?
2. Which input tokens can each output position see? Encoder: all. Decoder: its prefix (lower triangle).
   Encoder-decoder: every source token, and only its own target prefix; cross-attention weights are
   (B, H, T_tgt, T_src).
3. What are the shapes along the way? Forward hooks on every module trace them; the data flow is drawn
   as PNG and as Mermaid text with the shapes on the edges.

Visibility matrix: perturb input token j (replace its id), record which output positions i change by more
than a dtype-relative tolerance: entry [i, j] = 1 when output i changes as token j changes.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from matplotlib.figure import Figure
from omegaconf import DictConfig

from tfmoe.components.attention import MultiHeadCrossAttention, MultiHeadSelfAttention
from tfmoe.components.encdec import DecoderOnly, EncoderDecoder, EncoderOnly
from tfmoe.components.positions import RoPESelfAttention, sinusoidal_positions
from tfmoe.errors import BadInput
from tfmoe.recorder import Recorder
from tfmoe.tables import Rows
from tfmoe.validate import require_int, require_number


@dataclass(frozen=True)
class Settings:
    """Every value an arch run reads, validated by :func:`settings`."""

    vocab_size: int
    d_model: int
    n_heads: int
    n_layers: int
    n_classes: int
    batch_size: int
    seq_len: int  # T of the encoder / decoder-only input, T_src of the encoder-decoder
    tgt_len: int  # T_tgt of the encoder-decoder
    rope: bool
    visibility_tol_eps: float  # an output "changes" when it moves by > this x dtype eps x output scale
    equivariance_tol_eps: float  # permuted outputs agree within this x dtype eps x output scale
    min_position_effect: float  # positions must move the permuted outputs by >= this (relative)


def settings(cfg: DictConfig) -> Settings:
    """The run's settings from the composed config; BadInput names the problem and the fix (no device touched)."""
    s = Settings(
        vocab_size=require_int(cfg, "vocab_size", 2), d_model=require_int(cfg, "d_model", 2), n_heads=require_int(cfg, "n_heads", 1),
        n_layers=require_int(cfg, "n_layers", 1), n_classes=require_int(cfg, "n_classes", 2),
        batch_size=require_int(cfg, "batch_size", 1), seq_len=require_int(cfg, "seq_len", 2), tgt_len=require_int(cfg, "tgt_len", 2),
        rope=bool(cfg.get("rope", True)), visibility_tol_eps=require_number(cfg, "visibility_tol_eps", positive=True),
        equivariance_tol_eps=require_number(cfg, "equivariance_tol_eps", positive=True),
        min_position_effect=require_number(cfg, "min_position_effect", positive=True),
    )
    if s.d_model % s.n_heads:
        raise BadInput(f"d_model={s.d_model} is not divisible by n_heads={s.n_heads}: pick n_heads dividing d_model")
    if s.d_model % 2:
        raise BadInput(f"d_model={s.d_model} is odd: sinusoidal positions pair sin/cos features, use an even d_model")
    if s.rope and (s.d_model // s.n_heads) % 2:
        raise BadInput(f"head size {s.d_model // s.n_heads} is odd: RoPE rotates feature pairs; "
                       "use an even d_model/n_heads or rope=false")
    if s.vocab_size < max(s.seq_len, s.tgt_len):
        raise BadInput(f"vocab_size={s.vocab_size} < sequence length {max(s.seq_len, s.tgt_len)}: the permutation "
                       "test needs distinct tokens; raise vocab_size or shorten seq_len/tgt_len")
    return s


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
    position, tol) with tol = tol_eps · eps(dtype) · max(1, max|output|)."""
    T = ids.shape[0]
    batch = ids.repeat(T + 1, 1)  # (T+1,T)
    j = torch.arange(T)
    batch[j + 1, j] = (ids + 1 + j) % vocab_size  # a different token at position j
    with torch.no_grad():
        out = forward(batch)  # (T+1,T_out,F)
    base = out[0].double()
    diffs = (out[1:].double() - base).abs().amax(dim=-1).T  # (T_out,T): [i, j] = change of output i
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


# ------------------------------------------------------------------------------------ shape tracing


@dataclass
class TraceRow:
    order: int  # call order (entry)
    module: str  # qualified name ('' = the model itself)
    kind: str  # class name
    cls: type = nn.Module
    in_shapes: list[tuple[int, ...]] = field(default_factory=list)
    out_shapes: list[tuple[int, ...]] = field(default_factory=list)


def _shapes(obj: Any) -> list[tuple[int, ...]]:
    if isinstance(obj, torch.Tensor):
        return [tuple(obj.shape)]
    if isinstance(obj, (tuple, list)):
        return [s for o in obj for s in _shapes(o)]
    if isinstance(obj, dict):
        return [s for o in obj.values() for s in _shapes(o)]
    return []


def fmt_shapes(shapes: list[tuple[int, ...]]) -> str:
    return ", ".join("(" + ", ".join(str(d) for d in s) + ")" for s in shapes)


def trace_shapes(model: nn.Module, call: Callable[[], Any]) -> list[TraceRow]:
    """Run ``call()`` with a forward pre-hook and hook on every module of ``model``; one row per module call,
    in the order the calls started, with the shapes of every tensor argument and every tensor output."""
    rows: list[TraceRow] = []
    open_rows: dict[int, list[TraceRow]] = {}
    handles = []

    def pre(name: str) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            row = TraceRow(len(rows), name, type(mod).__name__, type(mod), _shapes(args) + _shapes(kwargs))
            rows.append(row)
            open_rows.setdefault(id(mod), []).append(row)
        return hook

    def post(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        open_rows[id(mod)].pop().out_shapes = _shapes(out)

    for name, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(mod.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad():
            call()
    finally:
        for h in handles:
            h.remove()
    return rows


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


# ---------------------------------------------------------------------------------- data-flow graphs


@dataclass
class Flow:
    title: str
    nodes: list[tuple[str, str, float, float]]  # (key, label, x, y)
    edges: list[tuple[str, str, str]]  # (src, dst, label)


def _out(trace: dict[str, TraceRow], name: str, index: int = 0) -> str:
    row = trace.get(name)
    if row is None or len(row.out_shapes) <= index:
        return "?"
    return fmt_shapes([row.out_shapes[index]])


def _in(trace: dict[str, TraceRow], name: str) -> str:
    row = trace.get(name)
    return "?" if row is None or not row.in_shapes else fmt_shapes(row.in_shapes[:1])


def _chain(steps: list[tuple[str, str]], trace: dict[str, TraceRow], x: float, first_edge: str,
           y0: float = 0.0) -> tuple[list[tuple[str, str, float, float]], list[tuple[str, str, str]]]:
    """Nodes stacked top-down; the edge leaving node k carries node k's traced output shape."""
    nodes = [(key, label, x, y0 - k) for k, (key, label) in enumerate(steps)]
    edges = []
    for k in range(len(steps) - 1):
        label = first_edge if k == 0 else _out(trace, steps[k][0])
        edges.append((steps[k][0], steps[k + 1][0], label))
    return nodes, edges


def flow_encoder(trace: dict[str, TraceRow], s: Settings) -> Flow:
    steps = [("ids", "token ids"), ("tok_emb", f"Embedding table\n{s.vocab_size}×{s.d_model}"),
             ("pos", "+ sinusoidal positions")]
    steps += [(f"blocks.{i}", f"encoder block {i}\nbidirectional self-attn + FFN") for i in range(s.n_layers)]
    steps += [("norm_f", "LayerNorm"), ("pool", "mean pool over T"), ("cls_head", "classifier head"),
              ("out", "class logits")]
    nodes, edges = _chain(steps, trace, 0.0, _in(trace, "tok_emb"))
    return Flow("encoder-only (classification)", nodes, edges)


def flow_decoder(trace: dict[str, TraceRow], s: Settings) -> Flow:
    steps = [("ids", "token ids"), ("tok_emb", f"Embedding table\n{s.vocab_size}×{s.d_model}"),
             ("pos", "+ sinusoidal positions")]
    steps += [(f"blocks.{i}", f"decoder block {i}\ncausal self-attn + FFN") for i in range(s.n_layers)]
    steps += [("norm_f", "LayerNorm"), ("lm_head", "LM head (D→V)"), ("out", "next-token logits")]
    nodes, edges = _chain(steps, trace, 0.0, _in(trace, "tok_emb"))
    return Flow("decoder-only (generation)", nodes, edges)


def flow_encdec(trace: dict[str, TraceRow], s: Settings) -> Flow:
    enc = [("src_ids", "source ids"), ("src_emb", f"source embedding\n{s.vocab_size}×{s.d_model}"),
           ("src_pos", "+ sinusoidal positions")]
    enc += [(f"encoder.{i}", f"encoder block {i}\nbidirectional self-attn + FFN") for i in range(s.n_layers)]
    enc += [("enc_norm", "LayerNorm → memory")]
    dec = [("tgt_ids", "target ids (shifted right)"), ("tgt_emb", f"target embedding\n{s.vocab_size}×{s.d_model}"),
           ("tgt_pos", "+ sinusoidal positions")]
    dec += [(f"decoder.{i}", f"decoder layer {i}\ncausal self-attn → cross-attn (Q: target,\nK/V: memory) → FFN\n"
             f"cross weights {_out(trace, f'decoder.{i}.cross_attn', 1)}") for i in range(s.n_layers)]
    dec += [("dec_norm", "LayerNorm"), ("lm_head", "LM head (D→V)"), ("out", "next-token logits")]
    n1, e1 = _chain(enc, trace, 0.0, _in(trace, "src_emb"))
    n2, e2 = _chain(dec, trace, 1.6, _in(trace, "tgt_emb"))
    memory = [("enc_norm", f"decoder.{i}", "memory " + _out(trace, "enc_norm")) for i in range(s.n_layers)]
    return Flow("encoder-decoder (translation)", n1 + n2, e1 + e2 + memory)


def draw_flow(flow: Flow) -> Figure:
    """Boxes and arrows; each arrow labelled with the tensor shape it carries."""
    xs = sorted({x for _, _, x, _ in flow.nodes})
    ys = [y for _, _, _, y in flow.nodes]
    fig = Figure(figsize=(4.2 * len(xs) + 1.0, 1.05 * (max(ys) - min(ys) + 1) + 0.6))
    ax = fig.subplots()
    pos = {key: (x, y) for key, _, x, y in flow.nodes}
    boxes = {}
    for key, label, x, y in flow.nodes:
        is_io = key in ("ids", "out", "src_ids", "tgt_ids")
        boxes[key] = ax.text(x, y, label, ha="center", va="center", fontsize=8, zorder=3,
                             bbox={"boxstyle": "round,pad=0.35", "fc": "#eeeeee" if is_io else "#dbe9f6",
                                   "ec": "0.3"})
    for src, dst, label in flow.edges:
        (x1, y1), (x2, y2) = pos[src], pos[dst]
        same_column = x1 == x2
        # Anchor the arrow on the boxes themselves (coordinates relative to each text box).
        ax.annotate("", xy=(0.5, 1.0) if same_column else (0.0, 0.5), xycoords=boxes[dst],
                    xytext=(0.5, 0.0) if same_column else (1.0, 0.5), textcoords=boxes[src],
                    arrowprops={"arrowstyle": "-|>", "color": "0.35", "lw": 1.2, "shrinkA": 4, "shrinkB": 4})
        mx, my = (x1 + x2) / 2, (y1 + y2) / 2
        ax.text(mx + (0.05 if same_column else 0.0), my, label, fontsize=7, color="tab:blue", zorder=4,
                ha="left" if same_column else "center", va="center",
                bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.85})
    ax.set_xlim(min(xs) - 0.9, max(xs) + 0.9)
    ax.set_ylim(min(ys) - 0.6, max(ys) + 0.6)
    ax.set_axis_off()
    ax.set_title(flow.title)
    fig.tight_layout()
    return fig


def mermaid(flow: Flow) -> str:
    """Mermaid ``flowchart TD`` text with the shapes on the edges."""
    def node_id(key: str) -> str:
        return "n_" + re.sub(r"\W", "_", key)

    def text(label: str) -> str:
        return label.replace('"', "'").replace("\n", "<br/>")

    labels = {key: label for key, label, _, _ in flow.nodes}
    lines = ["flowchart TD"]
    lines += [f'  {node_id(k)}["{text(v)}"]' for k, v in labels.items()]
    lines += [f'  {node_id(a)} -->|"{text(lab)}"| {node_id(b)}' for a, b, lab in flow.edges]
    return "\n".join(lines)


def trace_markdown(arch: str, rows: list[TraceRow]) -> str:
    lines = [f"<details><summary>hook trace: {arch} ({len(rows)} module calls)</summary>", "",
             "| # | module | class | input shapes | output shapes |", "|---|---|---|---|---|"]
    lines += [f"| {r.order} | `{r.module or '(model)'}` | {r.kind} | {fmt_shapes(r.in_shapes)} | "
              f"{fmt_shapes(r.out_shapes)} |" for r in rows]
    return "\n".join(lines + ["", "</details>"])


def record_trace(rec: Recorder, arch: str, rows: list[TraceRow]) -> None:
    for r in rows:
        numel = sum(int(torch.tensor(s).prod()) if s else 1 for s in r.out_shapes)
        rec.metric("trace_out_numel", numel, step=r.order, arch=arch, module=r.module or "(model)", kind=r.kind,
                   in_shapes=fmt_shapes(r.in_shapes), out_shapes=fmt_shapes(r.out_shapes))


def matrix_markdown(name: str, m: torch.Tensor, row: str, col: str) -> str:
    header = "| " + row + " \\ " + col + " | " + " | ".join(str(j) for j in range(m.shape[1])) + " |"
    lines = [f"**{name}** (rows: output position i, columns: perturbed input token j)", "", header,
             "|" + "---|" * (m.shape[1] + 1)]
    lines += [f"| {i} | " + " | ".join(str(int(v)) for v in m[i]) + " |" for i in range(m.shape[0])]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- run


def build_models(s: Settings, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, nn.Module, nn.Module]:
    encoder = EncoderOnly(s.vocab_size, s.d_model, s.n_heads, s.n_layers, s.n_classes)
    decoder = DecoderOnly(s.vocab_size, s.d_model, s.n_heads, s.n_layers)
    encdec = EncoderDecoder(s.vocab_size, s.vocab_size, s.d_model, s.n_heads, s.n_layers)
    return tuple(m.to(device=device, dtype=dtype).eval() for m in (encoder, decoder, encdec))  # type: ignore[return-value]


def run(s: Settings, rec: Recorder) -> None:
    dev, dt = rec.device, rec.dtype
    g = torch.Generator().manual_seed(rec.seed)
    B, T, Tt, D, H = s.batch_size, s.seq_len, s.tgt_len, s.d_model, s.n_heads
    ids = distinct_ids(B, T, s.vocab_size, g).to(dev)  # (B,T)

    # §2.1: ids -> embeddings; attention is permutation-equivariant until positions are injected.
    emb = nn.Embedding(s.vocab_size, D).to(dev, dt)  # feeds the permutation test below
    attn = MultiHeadSelfAttention(D, H, causal=False).to(dev, dt).eval()
    perm = nontrivial_permutation(T, g).to(dev)
    with torch.no_grad():
        e = emb(ids)  # (B,T,D)
    pe = sinusoidal_positions(T, D).to(dev, dt)  # (T,D)
    diffs = {"none": relative_permutation_diff(lambda x: attn(x)[0], e, perm),
             "sinusoidal": relative_permutation_diff(lambda x: attn(x + pe)[0], e, perm)}
    if s.rope:
        rope_attn = RoPESelfAttention(D, H, causal=False).to(dev, dt).eval()
        rope_attn.load_state_dict(attn.state_dict())  # same weights: only the positions differ
        diffs["rope"] = relative_permutation_diff(lambda x: rope_attn(x)[0], e, perm)
    for kind, value in diffs.items():
        rec.metric("permutation_relative_diff", value, positions=kind)
    check_equivariance(rec, diffs, s.equivariance_tol_eps * dtype_eps(dt), s.min_position_effect)

    # §2.3: three tiny architectures, shapes traced by hooks, data flow drawn.
    encoder, decoder, encdec = build_models(s, dev, dt)
    check_embedding(rec, {"encoder.tok_emb": encoder.tok_emb, "decoder.tok_emb": decoder.tok_emb,
                          "encdec.src_emb": encdec.src_emb, "encdec.tgt_emb": encdec.tgt_emb},
                    ids, D, s.vocab_size)
    src = ids  # (B,T_src)
    tgt = distinct_ids(B, Tt, s.vocab_size, g).to(dev)  # (B,T_tgt)
    traces = {
        "encoder": trace_shapes(encoder, lambda: encoder.classify(src)),
        "decoder": trace_shapes(decoder, lambda: decoder(src)),
        "encdec": trace_shapes(encdec, lambda: encdec(src, tgt)),
    }
    check_cross_weights(rec, traces["encdec"], B, H, Tt, T)
    flows = {}
    for arch, builder in (("encoder", flow_encoder), ("decoder", flow_decoder), ("encdec", flow_encdec)):
        record_trace(rec, arch, traces[arch])
        flows[arch] = builder({r.module: r for r in traces[arch]}, s)
        rec.plot(f"dataflow_{arch}", draw_flow(flows[arch]))

    # Visibility matrices on the first sequence of the batch. Visibility is structural, so it is measured
    # on fp32 copies (fp64 when asked): in bf16 a visible change (~0.06 here) is below 16 ulps of the output
    # and rounding could hide it (seen: bf16 gave identity matrices).
    vis_dtype = torch.float64 if dt == torch.float64 else torch.float32
    vis_models = [copy.deepcopy(m).to(vis_dtype) for m in (encoder, decoder, encdec)]
    mats = run_visibility(rec, *vis_models, src[0], tgt[0], s.vocab_size, s.visibility_tol_eps)
    for name, m in mats.items():
        rec.tensor(name, m)
    rec.plot("visibility", draw_visibility(mats))

    table = Rows("visibility: wrong entries vs the expected pattern", ("check", "passed", "wrong entries"))
    for c in rec.checks_rows:
        if c.check.startswith("visibility"):
            table.add(c.check, str(c.passed), f"{c.observed:.0f}")
    table.print_to(rec.console)

    rec.note(f"visibility measured on {str(vis_dtype).removeprefix('torch.')} copies of the models")
    rec.note(f"dtype {str(dt).removeprefix('torch.')}, B={B}, T=T_src={T}, T_tgt={Tt}, D={D}, H={H}, "
             f"layers={s.n_layers}, V={s.vocab_size}; permutation {perm.tolist()}")
    permutation = Rows("", ("positions", "relative diff"), [(k, f"{v:.3g}") for k, v in diffs.items()])
    parts = ["## Permutation equivariance (relative max difference)", "", permutation.markdown()]
    parts += ["", "## Visibility matrices", "",
              matrix_markdown("visibility_encoder", mats["visibility_encoder"], "i", "j"), "",
              matrix_markdown("visibility_decoder", mats["visibility_decoder"], "i", "j"), "",
              matrix_markdown("visibility_cross", mats["visibility_cross"], "tgt i", "src j"), "",
              matrix_markdown("visibility_encdec_target", mats["visibility_encdec_target"], "tgt i", "tgt j"), "",
              "## Data flow (Mermaid; shapes from forward hooks)", ""]
    for flow in flows.values():
        parts += [f"### {flow.title}", "", "```mermaid", mermaid(flow), "```", ""]
    parts += ["## Hook traces", ""] + [trace_markdown(a, r) + "\n" for a, r in traces.items()]
    rec.summary("\n".join(parts))


def draw_visibility(mats: dict[str, torch.Tensor]) -> Figure:
    fig = Figure(figsize=(3.3 * len(mats), 3.9))
    axes = fig.subplots(1, len(mats))
    for ax, (name, m) in zip(axes, mats.items(), strict=True):
        ax.imshow(m.numpy(), cmap="Blues", vmin=0, vmax=1)
        ax.set_title(name.removeprefix("visibility_"), fontsize=9)
        ax.set_xlabel("perturbed input token j")
        ax.set_ylabel("output position i")
        for i in range(m.shape[0]):
            for j in range(m.shape[1]):
                ax.text(j, i, str(int(m[i, j])), ha="center", va="center", fontsize=6,
                        color="white" if m[i, j] else "black")
    fig.suptitle("visibility: 1 = output i changes when input token j changes")
    fig.tight_layout()
    return fig
