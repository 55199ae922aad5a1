"""arch's shape tracing and data-flow graphs: forward hooks on every module record each call's tensor shapes;
the three architectures' data flow is drawn (PNG) and written as Mermaid text with those shapes on the edges."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn as nn
from matplotlib.figure import Figure

from tfmoe.contract.recorder import Recorder


class ModelShape(Protocol):
    """What the graphs' labels read (arch.Settings has these)."""

    vocab_size: int
    d_model: int
    n_layers: int


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


def record_trace(rec: Recorder, arch: str, rows: list[TraceRow]) -> None:
    for r in rows:
        numel = sum(int(torch.tensor(s).prod()) if s else 1 for s in r.out_shapes)
        rec.metric("trace_out_numel", numel, step=r.order, arch=arch, module=r.module or "(model)", kind=r.kind,
                   in_shapes=fmt_shapes(r.in_shapes), out_shapes=fmt_shapes(r.out_shapes))


def trace_markdown(arch: str, rows: list[TraceRow]) -> str:
    lines = [f"<details><summary>hook trace: {arch} ({len(rows)} module calls)</summary>", "",
             "| # | module | class | input shapes | output shapes |", "|---|---|---|---|---|"]
    lines += [f"| {r.order} | `{r.module or '(model)'}` | {r.kind} | {fmt_shapes(r.in_shapes)} | "
              f"{fmt_shapes(r.out_shapes)} |" for r in rows]
    return "\n".join(lines + ["", "</details>"])


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


def _embed_steps(s: ModelShape, ids: tuple[str, str] = ("ids", "token ids"), emb: str = "tok_emb",
                 emb_label: str = "Embedding table", pos: str = "pos") -> list[tuple[str, str]]:
    """ids -> embedding table -> + positions, the first three nodes of every architecture."""
    return [ids, (emb, f"{emb_label}\n{s.vocab_size}×{s.d_model}"), (pos, "+ sinusoidal positions")]


def _block_steps(s: ModelShape, prefix: str, label: str) -> list[tuple[str, str]]:
    """One node per layer: ``prefix.i`` labelled ``label`` with ``{i}`` filled in."""
    return [(f"{prefix}.{i}", label.format(i=i)) for i in range(s.n_layers)]


def flow_encoder(trace: dict[str, TraceRow], s: ModelShape) -> Flow:
    steps = _embed_steps(s) + _block_steps(s, "blocks", "encoder block {i}\nbidirectional self-attn + FFN")
    steps += [("norm_f", "LayerNorm"), ("pool", "mean pool over T"), ("cls_head", "classifier head"),
              ("out", "class logits")]
    nodes, edges = _chain(steps, trace, 0.0, _in(trace, "tok_emb"))
    return Flow("encoder-only (classification)", nodes, edges)


def flow_decoder(trace: dict[str, TraceRow], s: ModelShape) -> Flow:
    steps = _embed_steps(s) + _block_steps(s, "blocks", "decoder block {i}\ncausal self-attn + FFN")
    steps += [("norm_f", "LayerNorm"), ("lm_head", "LM head (D→V)"), ("out", "next-token logits")]
    nodes, edges = _chain(steps, trace, 0.0, _in(trace, "tok_emb"))
    return Flow("decoder-only (generation)", nodes, edges)


def flow_encdec(trace: dict[str, TraceRow], s: ModelShape) -> Flow:
    enc = _embed_steps(s, ("src_ids", "source ids"), "src_emb", "source embedding", "src_pos")
    enc += _block_steps(s, "encoder", "encoder block {i}\nbidirectional self-attn + FFN")
    enc += [("enc_norm", "LayerNorm → memory")]
    dec = _embed_steps(s, ("tgt_ids", "target ids (shifted right)"), "tgt_emb", "target embedding", "tgt_pos")
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
