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

This module is the recipe (Settings, settings(cfg), run, the summary); the parts it orchestrates:
:mod:`~tfmoe.experiments.arch.checks` (the checks) and :mod:`~tfmoe.experiments.arch.trace` (shape tracing,
data-flow graphs).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
from matplotlib.figure import Figure
from omegaconf import DictConfig

from tfmoe.components.attention import MultiHeadSelfAttention
from tfmoe.components.encdec import DecoderOnly, EncoderDecoder, EncoderOnly
from tfmoe.components.positions import RoPESelfAttention, sinusoidal_positions
from tfmoe.contract.errors import BadInput
from tfmoe.contract.recorder import Recorder
from tfmoe.contract.tables import Rows
from tfmoe.experiments import lm_battery
from tfmoe.experiments.arch.checks import (
    check_cross_weights,
    check_embedding,
    check_equivariance,
    distinct_ids,
    dtype_eps,
    nontrivial_permutation,
    relative_permutation_diff,
    run_visibility,
)
from tfmoe.experiments.arch.settings import Settings
from tfmoe.experiments.arch.trace import (
    draw_flow,
    flow_decoder,
    flow_encdec,
    flow_encoder,
    mermaid,
    record_trace,
    trace_markdown,
    trace_shapes,
)
from tfmoe.experiments.lm_battery import lm_settings
from tfmoe.rules import finite, memory
from tfmoe.rules.memory import (
    DTYPE_BYTES,
    Knob,
    available_memory_bytes,
    block_activation_elements,
    block_params,
)
from tfmoe.rules.validate import require_int, require_number


def settings(cfg: DictConfig) -> Settings:
    """The run's settings from the composed config; BadInput names the problem and the fix (no device touched)."""
    s = Settings(
        vocab_size=require_int(cfg, "vocab_size", 2), d_model=require_int(cfg, "d_model", 2), n_heads=require_int(cfg, "n_heads", 1),
        n_layers=require_int(cfg, "n_layers", 1), n_classes=require_int(cfg, "n_classes", 2),
        batch_size=require_int(cfg, "batch_size", 1), seq_len=require_int(cfg, "seq_len", 2), tgt_len=require_int(cfg, "tgt_len", 2),
        rope=bool(cfg.get("rope", True)), visibility_tol_eps=require_number(cfg, "visibility_tol_eps", positive=True),
        equivariance_tol_eps=require_number(cfg, "equivariance_tol_eps", positive=True),
        min_position_effect=require_number(cfg, "min_position_effect", positive=True),
        lm=lm_settings(cfg),
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
    if str(cfg.get("device")) == "cpu":  # the host's RAM is the device's: refused before anything is allocated
        refuse_oversized(s, str(cfg.get("dtype")), memory.host_available_bytes(), "the host's")
    return s


def estimated_bytes(z: dict[str, int], dtype: str) -> int:
    """Peak bytes of an arch run with sizes ``z``: the three models (encoder, decoder, encoder-decoder: 6 V×D
    tables and heads, 4·L blocks plus L cross-attentions) in the run's dtype and their fp32/fp64 visibility copies,
    and the largest forward: the visibility batch (T+1 sequences) or the traced batch, every layer's activations
    and the V-wide logits."""
    e = DTYPE_BYTES.get(dtype, 4)
    d, v, n_layers, t = z["d_model"], z["vocab_size"], z["n_layers"], max(z["seq_len"], z["tgt_len"])
    params = 6 * v * d + 4 * n_layers * block_params(d) + n_layers * 4 * d * d + d * z["n_classes"]
    rows = max(z["batch_size"], z["seq_len"] + 1, z["tgt_len"] + 1)
    acts = 2 * n_layers * block_activation_elements(rows * t, d, z["n_heads"], t) + 2 * rows * t * v
    return params * (e + 8) + acts * 8


def size_knobs(s: Settings) -> dict[str, Knob]:
    """arch's size keys as the guard may lower them (d_model stays a multiple of 2·n_heads, vocab_size >= T)."""
    step = s.n_heads * 2 if s.rope else math.lcm(s.n_heads, 2)
    return {"vocab_size": Knob(s.vocab_size, minimum=lambda z: max(z["seq_len"], z["tgt_len"])),
            "d_model": Knob(s.d_model, minimum=step, multiple=step), "n_layers": Knob(s.n_layers),
            "n_classes": Knob(s.n_classes, minimum=2), "batch_size": Knob(s.batch_size),
            "seq_len": Knob(s.seq_len, minimum=2), "tgt_len": Knob(s.tgt_len, minimum=2)}


def refuse_oversized(s: Settings, dtype: str, available: int, where: str) -> None:
    """BadInput (exit 2) naming the size that dominates the estimate and a value of it that fits."""
    memory.refuse_oversized(lambda z: estimated_bytes({**z, "n_heads": s.n_heads}, dtype), size_knobs(s), available,
                            where, "arch")


# ------------------------------------------------------------------------------------------- run
FINITE_QUANTITIES = ("permutation_relative_diff", "visibility_tol", "visibility_min_visible_change",
                     "visibility_max_invisible_change")


def build_models(s: Settings, device: torch.device, dtype: torch.dtype) -> tuple[nn.Module, nn.Module, nn.Module]:
    encoder = EncoderOnly(s.vocab_size, s.d_model, s.n_heads, s.n_layers, s.n_classes)
    decoder = DecoderOnly(s.vocab_size, s.d_model, s.n_heads, s.n_layers)
    encdec = EncoderDecoder(s.vocab_size, s.vocab_size, s.d_model, s.n_heads, s.n_layers)
    return tuple(m.to(device=device, dtype=dtype).eval() for m in (encoder, decoder, encdec))  # type: ignore[return-value]


def run(s: Settings, rec: Recorder) -> None:
    if s.lm is not None:  # impl=...: the user's whole causal LM, judged for causality and positions
        lm_battery.run_arch(s.lm, rec)
        return
    dev, dt = rec.device, rec.dtype
    if dev.type != "cpu":  # a CUDA run's memory is not the host's
        refuse_oversized(s, {torch.float64: "fp64", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dt, "fp32"),
                         available_memory_bytes(dev), f"{dev}'s")
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

    finite.check_finite(rec, "finite", FINITE_QUANTITIES, what="the permutation differences and the visibility "
                        "changes and tolerances: a non-finite output would read as 'no change'")

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


# ----------------------------------------------------------------------------------------- report
def matrix_markdown(name: str, m: torch.Tensor, row: str, col: str) -> str:
    """A 0/1 visibility matrix as a markdown table under its name."""
    table = Rows(name, (f"{row} \\ {col}", *(str(j) for j in range(m.shape[1]))),
                 [(i, *(int(v) for v in m[i])) for i in range(m.shape[0])])
    return f"**{name}** (rows: output position i, columns: perturbed input token j)\n\n{table.markdown()}"


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
