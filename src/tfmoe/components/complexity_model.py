"""Analytic cost model of one Transformer decoder block (course §2.7): parameters, FLOPs, memory.

The block is :class:`tfmoe.components.block.TransformerBlock` (pre-norm, causal multi-head attention with
``qkv`` Linear(D, 3D) and ``out`` Linear(D, D) without bias, FFN D -> d_ff -> D with biases and GELU,
two LayerNorms). Symbols: B batch, T tokens (queries; ``T_k`` keys, = T without a cache), D = d_model,
H heads (head size D/H), d_ff FFN width (default 4D), L layers, V vocabulary, E experts, k = top-k.

FLOPs count a multiply-add as 2 (a (m x n)·(n x p) matmul costs 2mnp). Forward FLOPs of one block::

    qkv       2·B·T·D·3D        grows with T
    scores    2·B·T·T_k·D       (QKᵀ, all H heads together)  grows with T²
    softmax   3·B·H·T·T_k       (exp, sum, divide; counted separately, as Chinchilla does)  T²
    attn_v    2·B·T·T_k·D       (weights·V)  grows with T²
    out_proj  2·B·T·D²          grows with T
    ffn       2·2·B·T·D·d_ff    (two matmuls; SwiGLU: 3·2·B·T·D·hidden)  grows with T
    bias      B·T·(d_ff + D)    (the FFN's bias adds; not matmul FLOPs)  grows with T

``matmul`` = qkv + scores + attn_v + out_proj + ffn is what ``torch.utils.flop_counter.FlopCounterMode``
counts (it counts mm/bmm/addmm and ignores softmax, bias adds, LayerNorm and GELU). Backward of every
matmul is two matmuls of the same size (grad wrt input and wrt weight/other operand), so the backward
matmul FLOPs are exactly 2x forward and a training step is 3x forward.

Crossover: in the dense T² count (every query meets every key, masked or not: what the explicit block computes and
FlopCounterMode counts) the T² attention terms (scores + attn_v = 4·B·T²·D) equal the FFN (4·B·T·D·d_ff) at
T = d_ff; with d_ff = 4D that is T = 4D. A causal kernel that skips the masked upper half does ~half the T² work
(2·B·T²·D), which moves the crossover to T ≈ 2·d_ff. Against all T-linear matmuls (qkv + out_proj + ffn = 8·B·T·D² + 4·B·T·D·d_ff)
the crossover is T = 2D + d_ff.

Kaplan et al. 2020 (Table 1): C_forward ≈ 2N + 2·n_layer·n_ctx·d_attn per token with N = 2·D·L·(2·d_attn + d_ff)
non-embedding parameters. Its attention term is half this block's dense 4·n_layer·n_ctx·D;
:func:`model_forward_flops_per_token` with ``causal_visible=True`` (the (T+1)/2 keys a causal query sees on
average) comes within 2·L·D of it. Why the paper's term is half is not stated here (no source checked).

Memory: :func:`training_activation_bytes` is the exact byte count of the tensors autograd saves for the
backward pass of this block (measured with ``torch.autograd.graph.saved_tensors_hooks``; the block computes
LayerNorm, QKᵀ and softmax in at least fp32: fp16/bf16 are upcast, fp64 stays fp64). Which tensors are saved
for the attention matmuls depends on B and H (:func:`heads_fold_as_view`, a torch.matmul detail modelled
explicitly), so the formula is exact for torch 2.13 CPU in every dtype, at B = 1 and B > 1.
Compare Korthikanti et al. 2022 (a Megatron block in fp16 with dropout): 34·B·T·D + 5·H·B·T² bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp64": 8}
COMPONENTS = ("qkv", "scores", "softmax", "attn_v", "out_proj", "ffn", "bias")
MATMUL_COMPONENTS = ("qkv", "scores", "attn_v", "out_proj", "ffn")
GROWTH = {"qkv": "T", "scores": "T^2", "softmax": "T^2", "attn_v": "T^2", "out_proj": "T", "ffn": "T",
          "bias": "T"}
FP32_BYTES = 4  # LayerNorm, QKᵀ and softmax run in at least fp32 in this block (fp64 stays fp64)


@dataclass(frozen=True)
class BlockShape:
    """One block's sizes. ``d_ff=None`` means 4·D (GELU) or 2/3·4D rounded up to a multiple of 8 (SwiGLU:
    :func:`tfmoe.components.block.swiglu_hidden`; LLaMA rounds to a multiple of 256)."""

    B: int
    T: int
    D: int
    H: int
    d_ff: int | None = None
    ffn: str = "gelu"  # gelu | swiglu
    ffn_bias: bool = True  # the course's GELU FFN has biases; SwiGLU never does

    def __post_init__(self) -> None:
        for name in ("B", "T", "D", "H"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.D % self.H:
            raise ValueError(f"D={self.D} is not divisible by H={self.H}")
        if self.ffn not in ("gelu", "swiglu"):
            raise ValueError(f"unknown ffn {self.ffn!r}: choose gelu or swiglu")
        if self.d_ff is not None and self.d_ff <= 0:
            raise ValueError(f"d_ff={self.d_ff} must be positive (or None for the default)")

    @property
    def hidden(self) -> int:
        """The FFN's hidden width actually built."""
        if self.d_ff is not None:
            return self.d_ff
        if self.ffn == "gelu":
            return 4 * self.D
        return 8 * -(-int(2 * 4 * self.D / 3) // 8)  # components.block.swiglu_hidden

    @property
    def has_ffn_bias(self) -> bool:
        return self.ffn == "gelu" and self.ffn_bias


# ----------------------------------------------------------------------------------------- parameters
def ffn_params(s: BlockShape) -> int:
    """Weights (+ biases) of one FFN expert."""
    if s.ffn == "gelu":
        return 2 * s.D * s.hidden + (s.hidden + s.D if s.has_ffn_bias else 0)
    return 3 * s.D * s.hidden


def block_params(s: BlockShape) -> dict[str, int]:
    """Parameter count per part of one block; ``weights`` = Kaplan's N per layer (no biases, no norms)."""
    p = {
        "attn_qkv": 3 * s.D * s.D,
        "attn_out": s.D * s.D,
        "ffn": ffn_params(s),
        "norms": 2 * 2 * s.D,  # two LayerNorms, weight + bias each
    }
    p["total"] = sum(p.values())
    ffn_weights = (2 if s.ffn == "gelu" else 3) * s.D * s.hidden
    p["weights"] = 4 * s.D * s.D + ffn_weights
    return p


def moe_expert_shape(s: BlockShape) -> BlockShape:
    """The FFN of one expert of :class:`tfmoe.components.moe.MoELayer`: the block's GELU FFN without biases."""
    return BlockShape(s.B, s.T, s.D, s.H, s.hidden, "gelu", ffn_bias=False)


def moe_block_params(s: BlockShape, n_experts: int, top_k: int) -> dict[str, int]:
    """Params of a block whose FFN is the package's MoE layer: E bias-free GELU experts (D -> hidden -> D) and a
    linear router (D -> E, no bias) choosing top-k.

    ``total`` counts every expert; ``active`` what one token touches (attention, norms, router, k experts).
    """
    if n_experts < 1 or not 1 <= top_k <= n_experts:
        raise ValueError(f"need 1 <= top_k <= n_experts, got top_k={top_k}, n_experts={n_experts}")
    shared = block_params(s)["total"] - ffn_params(s)
    router = s.D * n_experts
    expert = ffn_params(moe_expert_shape(s))
    return {"shared": shared, "router": router, "expert": expert,
            "total": shared + router + n_experts * expert, "active": shared + router + top_k * expert}


# -------------------------------------------------------------------------------------------- FLOPs
def forward_flops(s: BlockShape, T_k: int | None = None) -> dict[str, int]:
    """Forward FLOPs per component for ``s.T`` queries attending to ``T_k`` keys (default ``s.T``).

    Decode with a KV cache is ``BlockShape(T=1, ...)`` with ``T_k`` = cached length + 1.
    Adds ``matmul`` (what FlopCounterMode counts) and ``total`` (matmul + softmax + bias).
    """
    B, T, D, H = s.B, s.T, s.D, s.H
    T_k = T if T_k is None else T_k
    n_ffn_mm = 2 if s.ffn == "gelu" else 3
    f = {
        "qkv": 2 * B * T * D * 3 * D,
        "scores": 2 * B * T * T_k * D,
        "softmax": 3 * B * H * T * T_k,
        "attn_v": 2 * B * T * T_k * D,
        "out_proj": 2 * B * T * D * D,
        "ffn": n_ffn_mm * 2 * B * T * D * s.hidden,
        "bias": B * T * (s.hidden + D) if s.has_ffn_bias else 0,
    }
    f["matmul"] = sum(f[c] for c in MATMUL_COMPONENTS)
    f["total"] = f["matmul"] + f["softmax"] + f["bias"]
    return f


def backward_matmul_flops(s: BlockShape) -> int:
    """Backward matmul FLOPs: each forward matmul needs two of the same size."""
    return 2 * forward_flops(s)["matmul"]


def moe_ffn_flops_per_token(s: BlockShape, n_experts: int, top_k: int) -> dict[str, int]:
    """Forward FLOPs of an MoE FFN for one token: router 2·D·E plus top_k bias-free experts (all E if dense)."""
    e = moe_expert_shape(s)
    one = forward_flops(BlockShape(1, 1, e.D, e.H, e.d_ff, e.ffn, e.ffn_bias))
    expert = one["ffn"] + one["bias"]
    router = 2 * s.D * n_experts
    return {"router": router, "active": router + top_k * expert, "dense_all_experts": router + n_experts * expert}


def crossover_T(s: BlockShape) -> float:
    """T where the dense T² attention matmuls (scores + attn_v, every query x every key) equal the FFN matmuls:
    d_ff for GELU. (A causal kernel skipping the masked half: ~2·d_ff.)"""
    per_token_ffn = forward_flops(BlockShape(1, 1, s.D, s.H, s.d_ff, s.ffn, s.ffn_bias))["ffn"]
    return per_token_ffn / (4 * s.D)


def crossover_T_causal(s: BlockShape) -> float:
    """T where a causal kernel's T² matmuls equal the FFN's, counting only the (T+1)/2 keys each query sees on
    average: 4·T·D·(T+1)/2 = T·per_token_ffn  =>  T = 2·d_ff − 1 for GELU (≈ twice the dense crossover)."""
    return 2 * crossover_T(s) - 1


def crossover_T_all_linear(s: BlockShape) -> float:
    """T where scores + attn_v equal all T-linear matmuls (qkv + out_proj + ffn): 2D + d_ff for GELU."""
    f = forward_flops(BlockShape(1, 1, s.D, s.H, s.d_ff, s.ffn, s.ffn_bias))
    return (f["qkv"] + f["out_proj"] + f["ffn"]) / (4 * s.D)


# ---------------------------------------------------------------------------------- whole models
def model_params(s: BlockShape, n_layers: int, vocab: int, tied: bool = True) -> dict[str, int]:
    """A decoder-only LM: embedding V·D (+ an untied head V·D), L blocks, a final norm."""
    blocks = n_layers * block_params(s)["total"]
    embedding = vocab * s.D * (1 if tied else 2)
    return {"blocks": blocks, "embedding": embedding, "final_norm": 2 * s.D,
            "non_embedding_weights": n_layers * block_params(s)["weights"],
            "total": blocks + embedding + 2 * s.D}


def model_forward_flops_per_token(s: BlockShape, n_layers: int, vocab: int, causal_visible: bool = False,
                                  include_logits: bool = False) -> float:
    """Forward matmul FLOPs per token of a T-token sequence through L blocks (+ the 2·D·V logits).

    Dense (default): every query meets all T keys, as the explicit attention computes it.
    ``causal_visible``: only the (T+1)/2 keys a causal query sees on average (what a kernel that skips the
    masked keys computes).
    """
    one = BlockShape(1, s.T, s.D, s.H, s.d_ff, s.ffn, s.ffn_bias)
    f = forward_flops(one)
    attn = f["scores"] + f["attn_v"]
    if causal_visible:
        attn = attn * (s.T + 1) / (2 * s.T)
    per_token = n_layers * (f["matmul"] - f["scores"] - f["attn_v"] + attn) / s.T
    return per_token + (2 * s.D * vocab if include_logits else 0)


def kaplan_forward_flops_per_token(n_params_non_embedding: int, n_layers: int, n_ctx: int, d_attn: int) -> int:
    """Kaplan et al. 2020: C_forward ≈ 2N + 2·n_layer·n_ctx·d_attn."""
    return 2 * n_params_non_embedding + 2 * n_layers * n_ctx * d_attn


# ---------------------------------------------------------------------------------------- memory
def score_elements(s: BlockShape, T_k: int | None = None) -> int:
    """Elements of the attention score matrix: B·H·T·T_k."""
    return s.B * s.H * s.T * (s.T if T_k is None else T_k)


def score_bytes(s: BlockShape) -> dict[str, int]:
    """Bytes of one score matrix per dtype (this block materialises it in fp32 for fp16/bf16/fp32 runs,
    in fp64 for fp64 runs: :func:`accumulate_bytes`)."""
    n = score_elements(s)
    return {name: n * size for name, size in DTYPE_BYTES.items()}


def kv_cache_bytes(s: BlockShape, n_tokens: int, dtype_bytes: int, n_layers: int = 1) -> int:
    """K and V of ``n_tokens`` tokens: 2·B·n_tokens·D·bytes per layer."""
    return 2 * s.B * n_tokens * s.D * dtype_bytes * n_layers


def kv_cache_bytes_per_token(s: BlockShape, dtype_bytes: int, n_layers: int = 1) -> int:
    return 2 * s.D * dtype_bytes * n_layers


def accumulate_bytes(dtype_bytes: int) -> int:
    """Bytes per element of what the block computes "in (at least) fp32": LayerNorm, QKᵀ and softmax.

    fp16/bf16 (2 bytes) are upcast to fp32; fp32 stays fp32 and fp64 stays fp64 (never downcast)."""
    return max(dtype_bytes, FP32_BYTES)


def heads_fold_as_view(s: BlockShape) -> bool:
    """Whether ``torch.matmul`` can fold q/kᵀ/v of shape (B, H, T, Dh) into (B·H, T, Dh) without a copy.

    q, k, v are strided views into the qkv projection's (B, T, 3D) output. Merging the B and H axes is a
    view only when one of them has size 1 (B == 1 or H == 1); otherwise ``reshape`` copies. This decides
    which tensors autograd saves for the two attention matmuls (see :func:`training_activation_bytes`)."""
    return s.B == 1 or s.H == 1


def training_activation_bytes(s: BlockShape, dtype_bytes: int) -> int:
    """Bytes autograd saves for backward in one pre-norm GELU block (causal mask, no padding mask).

    Exact for torch 2.13 on CPU in fp32, fp64, fp16 and bf16 (tested against
    ``torch.autograd.graph.saved_tensors_hooks``, counting distinct storages, parameters excluded).
    With e = ``dtype_bytes`` and a = :func:`accumulate_bytes` (fp32 for fp16/bf16, else e), it saves:

    - the two LayerNorm inputs (dtype a: upcast copies for fp16/bf16, the tensors themselves otherwise)
      and their mean/rstd (B·T each, dtype a); for fp16/bf16 also the fp32 copies of LayerNorm's weight/bias;
    - the inputs of qkv, out_proj and fc1 (e);
    - the operands of QKᵀ and weights·V. This part depends on how ``torch.matmul`` folds (B, H) into one
      batch axis (:func:`heads_fold_as_view`), an implementation detail of torch, modelled explicitly:
      * B > 1 and H > 1: the fold copies, so autograd keeps copies of q and kᵀ (a each) and of v (e);
      * B == 1 or H == 1: the fold is a view, so the saved q/kᵀ/v are views that keep the whole qkv output
        (3·B·T·D, e) alive; for fp16/bf16 q and kᵀ are upcast first, so their fp32 copies (a each) are
        saved as well: 2 extra B·T·D tensors compared with B > 1;
    - the softmax output (a) and the weights cast to the run dtype (e), B·H·T² each;
    - GELU's input and fc2's input (B·T·d_ff, e); the bool causal mask (T·T) and its row-any (T).
    """
    if s.ffn != "gelu":
        raise ValueError("training_activation_bytes models the GELU block only")
    e, a = dtype_bytes, accumulate_bytes(dtype_bytes)
    B, T, D = s.B, s.T, s.D
    btd = B * T * D
    if heads_fold_as_view(s):
        attn_operands = 3 * btd * e + (2 * btd * a if a != e else 0)  # qkv output (+ upcast q, kᵀ)
    else:
        attn_operands = 2 * btd * a + btd * e  # copies of q, kᵀ (accumulate dtype) and v (run dtype)
    total = (
        2 * btd * a  # LayerNorm inputs (x, resid1), fp32 copies for fp16/bf16
        + 2 * 2 * B * T * a  # LayerNorm mean and rstd, two norms
        + 3 * btd * e  # inputs of qkv, out_proj, fc1
        + attn_operands
        + score_elements(s) * (a + e)  # softmax output + weights in the run dtype
        + 2 * B * T * s.hidden * e  # GELU input, fc2 input
        + T * T + T  # bool causal mask and its row-any
    )
    if a != e:
        total += 2 * 2 * D * FP32_BYTES  # LayerNorm weight and bias upcast to fp32
    return total


def training_peak_estimate_bytes(s: BlockShape, dtype_bytes: int) -> int:
    """A rough upper estimate of one training step's memory: params + grads + saved activations + the
    three score-sized temporaries (fp32, fp64 in fp64 runs) alive during attention's forward (scores, masked
    scores, softmax)."""
    params = block_params(s)["total"] * dtype_bytes
    return (2 * params + training_activation_bytes(s, dtype_bytes)
            + 3 * score_elements(s) * accumulate_bytes(dtype_bytes))
