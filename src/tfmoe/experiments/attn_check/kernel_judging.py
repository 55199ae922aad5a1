"""One case of the kernel battery: run the kernel, the fp64 reference and the plain same-dtype implementation,
and judge the forward (and then dq, dk, dv) by FlashAttention's rule.

Whose fault an exception is (:func:`kernel_fault`, module mode's rule of :mod:`tfmoe.rules.faults` for kernels): a
built-in kernel (``torch:*``, ``tfmoe:chunked``) is tfmoe's own code, so anything it raises but
NotImplementedError is tfmoe's error (its wrapper, or the arguments the battery built: torch's frames are
passed over, so torch refusing them points at tfmoe's frame); a user's kernel is at fault for what it raises
itself, for what torch or native code raises under it, and for returning what SDPA's signature forbids
(ContractError); an exception whose innermost non-torch frame is inside tfmoe below the user's kernel, or
anywhere in the battery outside the kernel's call, is tfmoe's. tfmoe's error crashes the run (exit 3); the
user's fails the case with :func:`~tfmoe.rules.faults.raised_detail` leading."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from tfmoe.components.comparison import Comparison, classify_rows, judge, max_abs_err
from tfmoe.components.reference_attention import (
    causal_visibility,
    kv_head_index,
    plain_attention,
    reference_attention,
)
from tfmoe.contract.errors import AdapterError, ContractError
from tfmoe.contract.recorder import Recorder
from tfmoe.experiments.attn_check.kernel_cases import Case, CaseInputs
from tfmoe.experiments.attn_check.kernels import BUILTINS, Kernel
from tfmoe.rules.capabilities import fully_masked_accepts
from tfmoe.rules.faults import culprit_frame, is_tfmoe_frame, raised_detail

_HERE = Path(__file__).resolve()


@dataclass
class Outcome:
    """What one case (forward, or its backward) gave."""

    case: Case
    status: str  # pass | fail | n/a | skipped | blocked
    detail: str = ""
    ratio: float = 0.0  # err / limit of the worst comparison (inf for a crash or a wrong policy)
    policy: str = "none"  # the kernel's output on rows that see no key
    evidence: dict[str, torch.Tensor] = field(default_factory=dict)
    raised: str = ""  # the kernel raised: raised_detail(exc) (observed None; the diagnosis never reads it)
    not_implemented: bool = False  # n/a because the kernel raised NotImplementedError (undeclared: rule 3)
    reveals: bool = True  # the case's inputs can show its family's property (kernel_cases.case_reveals)
    substitute: bool = False  # run in place of a default case the kernel cannot take (kernel_battery.substitute)


def missing_params(kernel: Kernel, kwargs: dict[str, Any]) -> list[str]:
    return [] if kernel.params is None else [p for p in kwargs if p not in kernel.params]


def enter_kernel(kernel: Kernel, q, k, v, kwargs: dict[str, Any]) -> Any:
    """The battery's one call of the kernel's forward (an exception whose innermost non-torch frame is this one
    came from the kernel's own native or torch code: see :func:`kernel_fault`)."""
    return kernel.fn(q, k, v, **kwargs)


def enter_backward(out: torch.Tensor, inputs: list[torch.Tensor], grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The battery's one call of the kernel's backward (autograd through its graph; as :func:`enter_kernel`).

    ``inputs`` are fresh leaves; their gradients are read after ``out.backward`` rather than taken with
    ``torch.autograd.grad``, which reentrant ``torch.utils.checkpoint`` refuses (a correct chunked kernel built on
    it failed every backward case as 'raised', F-198). An input the kernel never reads gets a zero gradient."""
    for t in inputs:
        t.grad = None
    out.backward(grad_out)
    return tuple(torch.zeros_like(t) if t.grad is None else t.grad for t in inputs)


ENTRY_POINTS = ("enter_kernel", "enter_backward")


def call_kernel(kernel: Kernel, inp: CaseInputs, q, k, v) -> torch.Tensor:
    """The kernel's output, or ContractError when it is not what SDPA's signature returns."""
    out = enter_kernel(kernel, q, k, v, inp.kwargs)
    if not isinstance(out, torch.Tensor):
        raise ContractError(f"the kernel returned {type(out).__name__}, not a tensor")
    if tuple(out.shape) != tuple(q.shape):
        raise ContractError(f"the kernel returned shape {tuple(out.shape)}, expected (B, Hq, Tq, D) = "
                            f"{tuple(q.shape)}")
    if out.dtype != q.dtype:
        raise ContractError(f"the kernel returned {out.dtype} for {q.dtype} inputs (SDPA returns the inputs' dtype)")
    return out


def _raised(exc: Exception) -> str:
    message = " ".join(str(exc).split())  # the whole message, on one line
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def battery_fault(exc: BaseException, spec: str, during: str) -> AdapterError:
    """tfmoe's error for ``exc`` (the run crashes, exit 3): where it was raised, and torch's version."""
    if isinstance(exc, AdapterError):
        return exc
    frame = culprit_frame(exc)
    where = "" if frame is None else f" at {Path(frame.filename).name}:{frame.lineno} ({frame.name})"
    whose = (f"tfmoe's built-in kernel {spec} (its wrapper, or the arguments tfmoe's battery gave it)"
             if spec in BUILTINS else "tfmoe's kernel battery")
    return AdapterError(f"kernel={spec}: {raised_detail(exc)} {during}{where} on torch {torch.__version__} — an "
                        f"error in {whose}, a bug of tfmoe, not a failure of the kernel under test; please report it")


def kernel_fault(kernel: Kernel, exc: BaseException, during: str) -> AdapterError | None:
    """The error to crash with when tfmoe is at fault for ``exc`` raised by the kernel's call (module docstring);
    None when the user's kernel is (the case fails with the exception)."""
    if isinstance(exc, AdapterError) or kernel.spec in BUILTINS:
        return battery_fault(exc, kernel.spec, during)
    if isinstance(exc, ContractError):
        return None
    frame = culprit_frame(exc)
    if frame is None or not is_tfmoe_frame(frame):
        return None  # the user's file, or a library the user's kernel calls
    if Path(frame.filename).resolve() == _HERE and frame.name in ENTRY_POINTS:
        return None  # raised by native or torch code the user's kernel is (or ran) with no Python frame of its own
    return battery_fault(exc, kernel.spec, during)


def raised_outcome(kernel: Kernel, case: Case, exc: Exception, during: str, evidence: dict[str, torch.Tensor],
                   hint: str = "") -> Outcome:
    """The user's kernel raised: that case fails with the exception leading; tfmoe's error crashes the run."""
    fault = kernel_fault(kernel, exc, f"in the {during} of case {case.label()}")
    if fault is not None:
        raise fault from exc
    raised = raised_detail(exc) + hint
    return Outcome(case, "fail", f"{case.label()}: {during}: {raised}", math.inf, evidence=evidence, raised=raised)


def forward_or_outcome(kernel: Kernel, case: Case, inp: CaseInputs, label: str, during: str,
                       evidence: dict[str, torch.Tensor]) -> torch.Tensor | Outcome:
    """The kernel's output on the case's inputs (no grad), or the Outcome its raise makes: NotImplementedError is
    n/a; the user's exception fails the case; tfmoe's crashes the run (:func:`raised_outcome`)."""
    try:
        with torch.no_grad():
            return call_kernel(kernel, inp, inp.q, inp.k, inp.v)
    except NotImplementedError as exc:
        return Outcome(case, "n/a", f"{label}: {_raised(exc)}", not_implemented=True)
    except Exception as exc:  # the user's kernel raised: this case fails; tfmoe's error crashes the run
        return raised_outcome(kernel, case, exc, during, evidence)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a kernel accumulates in for inputs of ``dtype``: fp32, or fp64 for fp64 runs (eps_acc is its eps)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def accumulation_atols(inp: CaseInputs, ref_out: torch.Tensor, weights: torch.Tensor, scale: float,
                       dtype: torch.dtype, stored_out: torch.Tensor | None = None,
                       parts: dict[str, dict[str, float]] | None = None,
                       run_dtype_intermediates: bool = True, row_max: bool = False,
                       query_chunk: int = 0) -> dict[str, float]:
    """Rounding floors for the gradients, where FlashAttention's "rounding at the reference's scale" is 0 or
    far below what any fp32-accumulating kernel can reach (eps_acc = fp32's eps, fp64's for fp64 runs;
    independent roundings add in quadrature; each floor is twice the estimate):

    - dq, dk carry dS = P∘(dP - δ), δ_i = dO_i·O_i, a difference that cancels exactly when a row's softmax is
      constant (Tk = 1: dq = dk = 0 exactly, so the plain implementation's error is 0 too). A kernel forming δ
      from dO·O (FlashAttention's way) reads O as its forward stored it, in the run's dtype, and accumulates in
      fp32: e_i ≈ |Σ_d dO_id·(fl(O_id) - O_id)| + eps_acc·Σ_d|dO_id·O_id|, the first term the reference's own
      δ with its output rounded to the dtype, measured (in bf16 it is most of SDPA's dk error: 1.32x the old
      limit at seed 28, benchmarks/kernel_seed_sweep.py), or with the kernel's own forward output
      (``stored_out``, which the forward rule has passed): its accumulation error, not only its rounding (SDPA
      fp32, Tk = 2048, v offset by 4: O off by 7e-6, dq 6.5x the plain implementation's, F-173), propagated
      exactly (it is linear: dq_i += scale·e_i·Σ_j P_ij·k_j, dk_j += scale·Σ_i P_ij·e_i·q_i); the others reaching dq_i as scale·e_i·(Σ_j P_ij²)^½·max|k| and
      dk_j as scale·(Σ_i (P_ij·e_i)²)^½·max|q|.
    - dv_j = Σ_i P_ij·dO_i sums n = (Hq/Hkv)·Tq terms; a kernel that accumulates them one block after
      another (SDPA's CPU backward) rounds each partial sum: ≈ eps_acc·√n·(Σ_i P_ij²)^½·max|dO|.
    - A kernel that recomputes P in the backward from the forward's logsumexp (FlashAttention's way) with a fast
      exp carries a relative error u = 8·eps_acc per weight (PyTorch's CPU kernel: ``exp_u20``, 2^-20 = 8 eps32),
      biased, so common to a row: dq_i then errs by ε_i·dq_i (SDPA fp32 at seed 4, default matrix: ε up to 13.6
      eps32, dq 4.2x the plain implementation's error, 1.03x the limit without this term), dk_j by at most
      u·scale·Σ_i|dS_ij|·|q_i|, dv_j by at most u·Σ_i P_ij·|dO_i|.
    - The recomputed scores round again (in fp32), against a logsumexp the forward rounded otherwise: the weights
      err by P_ij·ε_ij, ε_ij = fl_acc(s_ij) - s_ij, measured on the reference (its backward with each weight so
      perturbed: dq = scale·(P∘ε∘(dP - δ))·K, dk, dv likewise). With large scores (scale=0.3, D=111) SDPA's dv
      erred 7.3x the plain implementation's, 2.1x this measured term (fp32, default matrix, seed 8: 0.92 of the
      limit without it).
    - With grouped kv heads (r = Hq/Hkv > 1) a kernel may form each query head's dk, dv and sum the group's after,
      each per-head gradient rounded to the run's dtype first (FlashAttention 2's interface for MQA/GQA sums
      ``dk_expanded``/``dv_expanded`` over the group): ≤ (eps_dtype/2)·Σ_h |g_h| per element, the group's
      per-head gradients measured on the reference (SDPA fp16, MQA, seed 10 of the reduced matrix: dv 1.18x the
      limit without this term).
    - ``run_dtype_intermediates``: the backward rounds dP and δ to the run dtype (below; detected by
      :func:`backward_rounds_to_run_dtype`, True where not measured).
    - ``row_max``: the backward differentiates through the row's max (a safe softmax's shift, or an online
      softmax's running max, left in autograd's graph; detected by :func:`backward_differentiates_row_max`). The
      max's exact gradient is 0 (softmax is shift-invariant), but autograd forms it as a sum over the row's keys of
      P_ij·(dO_i·v_j - δ_i) (and, blockwise, of each rescaling's terms), each rounded at its own magnitude, and
      hands the result to the key that attains the max: dk_j* += scale·e_i·q_i, dq_i += scale·e_i·k_j*, with
      e_i ≈ eps_acc·(Σ_j P_ij·Σ_d|dO_id·v_jd| + Σ_d|dO_id·O_id|), not weighted by P_ij*. A float64 run of such a
      kernel (blockwise online softmax, exp or exp2, blocks of 1 to 2048 keys) matches the reference to 6e-15, and
      in fp32 its errors reach 1.10x this estimate for dk and 0.86x for dq (Tq = 2, Tk = 2048, v offset by 0, 4,
      16, seeds 0-2; 0.06x and 0.59x at 97 and 257 keys): a rounding of that order of accumulation, not a wrong
      gradient (with the max detached the same kernel's dk is 58x closer). dq gets scale·max_i e_i·max|k|; dk_j
      the group's rows in quadrature, scale·(Σ_i (e_i·max|q_i|)²)^½.
    - ``query_chunk`` = C > 0: the backward adds dk, dv chunk after chunk of C queries into tensors of the run dtype
      (a kernel running its queries in chunks through autograd; detected by :func:`backward_query_chunk`): each
      chunk's contribution and each partial sum rounds, ≤ (eps/2)·Σ_h (Σ_c |chunk_c| + Σ_{c>=2} |S_c|) per element,
      the partial sums S_c over the chunks in autograd's order (last chunk first) from the reference's P and dS."""
    acc = accumulation_dtype(dtype)
    eps = torch.finfo(acc).eps
    d_o, o = inp.grad_out.double(), ref_out.detach()
    stored = (d_o * (o.to(dtype).double() - o)).sum(dim=-1, keepdim=True).abs()  # δ from O rounded to the dtype
    e = stored + eps * (d_o.abs() * o.abs()).sum(dim=-1, keepdim=True)  # (B,Hq,Tq,1)
    w = weights.detach()
    B, Hq, Tq, Tk = w.shape
    Hkv = inp.k.shape[1]
    dq = scale * float((e * w.pow(2).sum(dim=-1, keepdim=True).sqrt()).max()) * float(inp.k.double().abs().max())
    dk = scale * float((w * e).pow(2).reshape(B, Hkv, -1, Tq, Tk).sum(dim=(2, 3)).max().sqrt()) \
        * float(inp.q.double().abs().max())
    p2 = w.pow(2).reshape(B, Hkv, -1, Tq, Tk).sum(dim=(2, 3))  # (B,Hkv,Tk): Σ over the group's queries
    dv = eps * math.sqrt(Hq // Hkv * Tq) * float(p2.max().sqrt()) * float(inp.grad_out.double().abs().max())
    heads = kv_head_index(Hq, Hkv, w.device)
    k_h, v_h = inp.k.double()[:, heads], inp.v.double()[:, heads]  # (B,Hq,Tk,D)
    d_p, delta = d_o @ v_h.transpose(-2, -1), (d_o * o).sum(dim=-1, keepdim=True)  # (B,Hq,Tq,Tk), (B,Hq,Tq,1)
    d_s = w * (d_p - delta)  # dS = P∘(dP - δ), (B,Hq,Tq,Tk)
    D = inp.q.shape[-1]
    # a fast exp's relative error u per recomputed weight, common to a row, bounded a priori: the forward's weights,
    # read exactly, cannot show it (the forward normalises by its own sum, the backward recomputes P from the
    # logsumexp), and a gradient scaled by (1 + ε), ε < u, is indistinguishable from it (bench_kernel_sensitivity)
    u = 8.0 * eps
    dq_p = u * scale * float((d_s @ k_h).abs().max())
    dk_p = u * scale * float((d_s.abs().transpose(-2, -1) @ inp.q.double().abs()).reshape(B, Hkv, -1, Tk, D)
                             .sum(dim=2).max())
    dv_p = u * float((w.transpose(-2, -1) @ d_o.abs()).reshape(B, Hkv, -1, Tk, D).sum(dim=2).max())
    k_acc = inp.k.to(acc)[:, heads]
    score_err = (inp.q.to(acc) @ k_acc.transpose(-2, -1)).double() * scale \
        - (inp.q.double() @ k_h.transpose(-2, -1)) * scale  # fl_acc(s) - s, (B,Hq,Tq,Tk)
    g = d_s * score_err
    dq_s = scale * float((g @ k_h).abs().max())
    dk_s = scale * float((g.transpose(-2, -1) @ inp.q.double()).reshape(B, Hkv, -1, Tk, D).sum(dim=2).abs().max())
    dv_s = float(((w * score_err).transpose(-2, -1) @ d_o).reshape(B, Hkv, -1, Tk, D).sum(dim=2).abs().max())
    dq_o = dk_o = 0.0
    if stored_out is not None:  # δ formed from the kernel's own forward output (rows that see no key: 0)
        e_own = (d_o * (stored_out.detach().double() - o)).sum(dim=-1, keepdim=True).nan_to_num(nan=0.0)
        dq_o = scale * float((e_own * (w @ k_h)).abs().max())
        dk_o = scale * float(((w * e_own).transpose(-2, -1) @ inp.q.double()).reshape(B, Hkv, -1, Tk, D)
                             .sum(dim=2).abs().max())
    # dP and δ each rounded to the run dtype (a kernel whose backward keeps its intermediates in it: autograd through
    # exp, sum and divide in bf16, F-206): dS_ij = P_ij·(fl(dP_ij) - fl(δ_i)). The plain softmax backward forms
    # its δ from its own rounded dP (δ = Σ_k P_ik·fl(dP_ik)), so its error carries each dP_ij's rounding but not the
    # row-common difference c_i = Σ_k P_ik·(fl(dP_ik) - dP_ik) - (fl(δ_i) - δ_i), which is exactly what such a
    # kernel adds (a row that sees one key: the plain implementation's dq is exactly 0, the kernel's fl(dP) - fl(δ)
    # is an ulp). Estimated in quadrature (u = eps_dtype/2; δ summed from products each rounded to the dtype):
    # c_i ≈ u·(Σ_k (P_ik·dP_ik)² + δ_i² + Σ_d (dO_id·O_id)²)^½, propagated as a row-common error of δ.
    unit = torch.finfo(dtype).eps / 2 if run_dtype_intermediates else 0.0
    c = unit * ((w * d_p).pow(2).sum(dim=-1, keepdim=True) + delta.pow(2)
                + (d_o * o).pow(2).sum(dim=-1, keepdim=True)).sqrt()  # (B,Hq,Tq,1)
    dq_r = scale * float((c * (w @ k_h)).abs().max())
    dk_r = scale * float(((w * c).pow(2).transpose(-2, -1) @ inp.q.double().pow(2)).reshape(B, Hkv, -1, Tk, D)
                         .sum(dim=2).max().sqrt())
    dk_g = dv_g = 0.0
    if Hq > Hkv:  # each query head's dk_h, dv_h rounded to the dtype before the group's sum
        half_eps = torch.finfo(dtype).eps / 2
        dk_heads = scale * (d_s.transpose(-2, -1) @ inp.q.double())  # (B,Hq,Tk,D)
        dv_heads = w.transpose(-2, -1) @ d_o  # (B,Hq,Tk,D)
        dk_g = half_eps * float(dk_heads.abs().reshape(B, Hkv, -1, Tk, D).sum(dim=2).max())
        dv_g = half_eps * float(dv_heads.abs().reshape(B, Hkv, -1, Tk, D).sum(dim=2).max())
        # ... or adds them into one tensor of the run dtype, head after head (kv heads expanded by indexing: the
        # backward's index_put accumulates): each partial sum S_c = Σ_{h<=c} g_h rounds too, ≤ (eps/2)·Σ_{c>=2}|S_c|
        # (a correct bf16 kernel so written reached 0.98 of its dv limit without this term, seed 0)
        dk_g += half_eps * float(dk_heads.reshape(B, Hkv, -1, Tk, D).cumsum(dim=2)[:, :, 1:].abs().sum(dim=2).max())
        dv_g += half_eps * float(dv_heads.reshape(B, Hkv, -1, Tk, D).cumsum(dim=2)[:, :, 1:].abs().sum(dim=2).max())
    dq_m = dk_m = 0.0
    if row_max:  # the row max's exact-zero gradient, rounded, on the key that attains it
        heads_v = inp.v.double()[:, heads].abs()
        e_max = eps * ((w * (d_o.abs() @ heads_v.transpose(-2, -1))).sum(dim=-1, keepdim=True)
                       + (d_o * o).abs().sum(dim=-1, keepdim=True))  # (B,Hq,Tq,1)
        dq_m = scale * float(e_max.max()) * float(inp.k.double().abs().max())
        q_row = inp.q.double().abs().amax(dim=-1, keepdim=True)  # (B,Hq,Tq,1)
        dk_m = scale * float((e_max * q_row).pow(2).reshape(B, Hkv, -1).sum(dim=-1).sqrt().max())
    dk_c = dv_c = 0.0
    if query_chunk and Tq > query_chunk:  # dk, dv summed chunk after chunk of queries in the run dtype
        half_eps = torch.finfo(dtype).eps / 2
        zero = torch.zeros(B, Hq, Tk, D, dtype=torch.float64, device=w.device)
        sums, run = {"dk": zero, "dv": zero}, {"dk": zero, "dv": zero}  # Σ|rounded terms|, the partial sums
        starts = list(range(0, Tq, query_chunk))[::-1]  # autograd's order: the last chunk's gradient first
        for n, c in enumerate(starts):
            rows = slice(c, c + query_chunk)
            part = {"dk": scale * (d_s[:, :, rows].transpose(-2, -1) @ inp.q.double()[:, :, rows]),
                    "dv": w[:, :, rows].transpose(-2, -1) @ d_o[:, :, rows]}  # (B,Hq,Tk,D)
            for name in ("dk", "dv"):
                run[name] = run[name] + part[name]
                sums[name] = sums[name] + part[name].abs() + (run[name].abs() if n else 0.0)
        dk_c = half_eps * float(sums["dk"].reshape(B, Hkv, -1, Tk, D).sum(dim=2).max())
        dv_c = half_eps * float(sums["dv"].reshape(B, Hkv, -1, Tk, D).sum(dim=2).max())
    if parts is not None:  # each term, for diagnosis (benchmarks/bench_kernel_sensitivity.py --per-case)
        parts.update(dq=dict(acc=dq, fast_exp=dq_p, scores=dq_s, own_out=dq_o, run_dtype=dq_r, row_max=dq_m),
                     dk=dict(acc=dk, fast_exp=dk_p, scores=dk_s, group=dk_g, own_out=dk_o, run_dtype=dk_r,
                             row_max=dk_m, query_chunks=dk_c),
                     dv=dict(acc=dv, fast_exp=dv_p, scores=dv_s, group=dv_g, query_chunks=dv_c))
    return {"dq": 2.0 * math.hypot(dq, dq_p, dq_s, dq_o, dq_r, dq_m),
            "dk": 2.0 * math.hypot(dk, dk_p, dk_s, dk_g, dk_o, dk_r, dk_m, dk_c),
            "dv": 2.0 * math.hypot(dv, dv_p, dv_s, dv_g, dv_c)}


def backward_rounds_to_run_dtype(kernel: Kernel, dtype: torch.dtype, device: torch.device, seed: int
                                 ) -> tuple[bool, str]:
    """Whether the kernel's backward rounds dP = dO·vᵀ and δ to the run dtype (then the dq/dk floors carry that
    rounding, :func:`accumulation_atols`), measured on one causal probe (B = 2, H = 8, Tq = Tk = 16, D = 32: the
    first query of each head sees exactly one key, in either alignment), where the exact dq is 0 and a backward
    that forms dS = P∘(dP - δ) from dP and δ kept in fp32 (SDPA, FlashAttention) stays within the fp32-sized
    floors. Larger: it rounds them (a chunked kernel dividing last through autograd in the dtype, F-206; with
    Tk = 1 such a kernel's dP and δ round alike, so the probe has more keys than the row sees). A probe that
    raises counts as rounding (the looser floor: never a false alarm from not knowing). Returns the verdict and a
    note saying what was seen."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 999_983)
    B, H, T, D = 2, 8, 16, 32
    q, k, v, d_o = (torch.randn(B, H, T, D, generator=g).to(device=device, dtype=dtype) for _ in range(4))
    visible = causal_visibility(T, T, "top_left", device)[None, None]
    inp = CaseInputs(q, k, v, d_o, {"is_causal": True}, visible, None, torch.ones(B, H, T, dtype=torch.bool,
                                                                                     device=device))
    try:
        mine = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = call_kernel(kernel, inp, *mine)
        dq = enter_backward(out, mine, d_o)[0]
    except Exception as exc:  # any failure of the probe leaves the looser floor on
        return True, f"kernel_backward: the one-key probe raised {_raised(exc)}: the dq/dk floors assume the " \
                     "backward rounds dP and δ to the run dtype"
    ref, w = reference_attention(q.double(), k.double(), v.double(), visible, None, None, return_weights=True)
    first = CaseInputs(q[:, :, :1], k, v, d_o[:, :, :1], {}, None, None, inp.seen[:, :, :1])  # the one-key rows
    floor = accumulation_atols(first, ref[:, :, :1], w[:, :, :1], D ** -0.5, dtype, out.detach()[:, :, :1],
                               run_dtype_intermediates=False)["dq"]
    err = float(dq[:, :, 0].double().abs().max())  # the exact dq of a row that sees one key is 0
    rounds = not err <= floor
    return rounds, (f"kernel_backward: rows that see one key (exact dq = 0) give |dq| {err:.3g} (fp32-sized floor "
                    f"{floor:.3g}): the backward "
                    + (f"rounds dP and δ to {str(dtype).removeprefix('torch.')}; the dq/dk floors carry that"
                       if rounds else "keeps dP and δ at fp32 or better; the dq/dk floors leave that rounding out"))


def backward_differentiates_row_max(kernel: Kernel, dtype: torch.dtype, device: torch.device, seed: int,
                                    rounds: bool, factor: float) -> tuple[bool, str]:
    """Whether the kernel's backward differentiates through its row max (:func:`accumulation_atols`, ``row_max``),
    measured on one probe (B = 2, H = 2, Tq = 1, Tk = 256, D = 32, v offset by 16 so δ is large): every score is
    0 ± 0.1 but key 0's, 0.5 (q's own direction), so key 0 attains every row's max whatever the kernel's key
    blocks, its weight stays near 1/Tk (a plain softmax's rounding there is P-weighted, small), and the max's
    rounded zero gradient lands on it alone. Such a backward errs on key 0's dk beyond the limit without the term, while every
    other key stays within it; an error on every key is a wrong gradient, not this rounding (it is not excused).
    A probe that raises leaves the term out. Returns the verdict and a note saying what was seen."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 999_979)
    B, H, Tq, Tk, D = 2, 2, 1, 256, 32
    q = torch.randn(B, H, Tq, D, generator=g)
    k = 0.1 * torch.randn(B, H, Tk, D, generator=g)  # scores ≈ 0 ± 0.1: every weight near 1/Tk
    k[:, :, :1] = q * (0.5 * math.sqrt(D) / q.pow(2).sum(dim=-1, keepdim=True))  # key 0's score 0.5: the max
    v = torch.randn(B, H, Tk, D, generator=g) + 16.0
    d_o = torch.randn(B, H, Tq, D, generator=g)
    q, k, v, d_o = (t.to(device=device, dtype=dtype) for t in (q, k, v, d_o))
    inp = CaseInputs(q, k, v, d_o, {}, None, None, torch.ones(B, H, Tq, dtype=torch.bool, device=device))
    try:
        mine = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        dk = enter_backward(call_kernel(kernel, inp, *mine), mine, d_o)[1].double()
    except Exception as exc:
        return False, f"kernel_backward: the row-max probe raised {_raised(exc)}: the floors leave that rounding out"
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v)]
    ref, w = reference_attention(*leaves, None, None, None, return_weights=True)
    ref_dk = torch.autograd.grad(ref, leaves[1], d_o.double())[0]
    plain_leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    plain_dk = torch.autograd.grad(plain_attention(*plain_leaves, None, None, None), plain_leaves[1], d_o)[0]
    floor = accumulation_atols(inp, ref, w, D ** -0.5, dtype, run_dtype_intermediates=rounds)["dk"]
    j = judge(dk, ref_dk, plain_dk, dtype, factor)
    limit = replace(j, atol=max(j.atol, floor)).threshold  # the rule's limit with the floors, as run_backward's
    err = (dk - ref_dk).abs().amax(dim=-1)  # (B,H,Tk)
    on_max, elsewhere = float(err[..., 0].max()), float(err[..., 1:].max())
    found = on_max > limit and elsewhere <= limit
    return found, (f"kernel_backward: the row-max probe's dk errs by {on_max:.3g} on the key that attains the max, "
                   f"{elsewhere:.3g} elsewhere (limit without the row-max term {limit:.3g}): the backward "
                   + ("differentiates through the row max (its exact-zero gradient, rounded, lands on that key; "
                      "detaching the max removes it); the dq/dk floors carry that rounding" if found else
                      "does not route rounding through the row max; the floors leave that term out"))


def backward_query_chunk(kernel: Kernel, dtype: torch.dtype, device: torch.device, seed: int) -> tuple[int, str]:
    """The query chunk C a half-precision backward adds dv over in the run dtype (0: none seen), read on one probe
    (B = H = 1, Tq = 64, Tk = 4, D = 16, q = 0 so every weight is exactly 1/4, dO drawn in [1, 2) in the dtype): the
    exact dv is Σ_i dO_i/4, and a kernel that sums each chunk of C rows once and adds the chunks in the dtype (last
    chunk first, autograd's order) gives bit for bit what that order gives. The smallest C < 64 that reproduces the
    kernel's dv exactly, when one rounding of the whole sum does not, is the kernel's; fp32 runs are not probed."""
    if dtype not in (torch.float16, torch.bfloat16):
        return 0, ""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 999_961)
    B, H, Tq, Tk, D = 1, 1, 64, 4, 16
    k, v = torch.randn(B, H, Tk, D, generator=g), torch.randn(B, H, Tk, D, generator=g)
    d_o = (1.0 + torch.rand(B, H, Tq, D, generator=g)).to(dtype)
    q = torch.zeros(B, H, Tq, D)
    inp = CaseInputs(q.to(device=device, dtype=dtype), k.to(device=device, dtype=dtype),
                     v.to(device=device, dtype=dtype), d_o.to(device), {}, None, None,
                     torch.ones(B, H, Tq, dtype=torch.bool, device=device))
    try:
        mine = [t.detach().clone().requires_grad_(True) for t in (inp.q, inp.k, inp.v)]
        dv = enter_backward(call_kernel(kernel, inp, *mine), mine, inp.grad_out)[2].double().cpu()
    except Exception as exc:
        return 0, f"kernel_backward: the query-chunk probe raised {_raised(exc)}: no chunked sum assumed"
    contrib = d_o.double()[0, 0] / Tk  # (Tq,D): each row's dv contribution to every key, exact
    got = dv[0, 0]  # (Tk,D): every key's dv is the same sum

    def summed(chunk: int) -> torch.Tensor:
        parts = [contrib[c:c + chunk].sum(dim=0).to(dtype).double() for c in range(0, Tq, chunk)][::-1]
        acc = parts[0]
        for p in parts[1:]:
            acc = (acc + p).to(dtype).double()
        return acc

    if torch.equal(got, summed(Tq).expand_as(got)):
        return 0, "kernel_backward: the query-chunk probe's dv is the whole sum rounded once: no chunked sum"
    for chunk in (1, 2, 4, 8, 16, 32):
        if torch.equal(got, summed(chunk).expand_as(got)):
            return chunk, (f"kernel_backward: the query-chunk probe's dv is, bit for bit, {Tq // chunk} chunks of "
                           f"{chunk} queries added in {str(dtype).removeprefix('torch.')}: the dk/dv floors carry "
                           "those partial sums")
    return 0, "kernel_backward: the query-chunk probe's dv matches no chunked sum: none assumed"


def measured_weights_atol(inp: CaseInputs, weights: torch.Tensor, kernel_weights: torch.Tensor,
                          ref_out: torch.Tensor, dtype: torch.dtype) -> float:
    """The output's floor measured on the kernel's own weights (read exactly through a one-hot v: kernel_weights),
    each row normalised (so a scale error of the output is not excused beyond rounding): max over the rows that
    see a key of |Σ_j (Ŵ_ij - P_ij)·v_j| + 1.5·eps_acc·|O_i|. The second term is the output's own
    normalisation, O = acc·(1/l), which the normalised weights leave out: an approximate reciprocal (PTX
    rcp.approx.f32: at most 1 ulp) and the product's rounding (half an ulp). On an H200, SDPA's efficient backend
    in fp32 erred by 4.77e-07 (an ulp of its output) at Tk = 1, where the weight is exactly 1 and the plain
    yardstick exact, against 2.38e-07 (F-211). Replaces :func:`fast_exp_atol`'s a-priori bound (which holds
    8·eps_acc·|O_i| already) where the weights were read."""
    heads = kv_head_index(inp.q.shape[1], inp.k.shape[1], inp.q.device)
    own = kernel_weights / kernel_weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    moved = ((own.nan_to_num(nan=0.0) - weights.detach()) @ inp.v.double()[:, heads]).abs()
    normalisation = 1.5 * torch.finfo(accumulation_dtype(dtype)).eps * ref_out.detach().abs()
    floor = (moved + normalisation)[inp.seen]
    return float(floor.max()) if floor.numel() else 0.0


def fast_exp_atol(inp: CaseInputs, ref_out: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> float:
    """The output's floor for a kernel whose softmax uses a fast exp (PyTorch's CPU flash kernel: ``exp_u20``):
    weights off by a relative u = 8·eps_acc each move O_i by at most u·Σ_j P_ij·|v_j - O_i| <= u·(Σ_j P_ij·|v_j|
    + |O_i|), the bound used (not doubled). SDPA fp32 reached 2.36x the plain implementation's error at
    (257, 255, 128), MQA, seed 26 of the default matrix (1.10x the limit without it)."""
    eps = torch.finfo(accumulation_dtype(dtype)).eps
    heads = kv_head_index(inp.q.shape[1], inp.k.shape[1], inp.q.device)
    w, o = weights.detach(), ref_out.detach()
    bound = (w @ inp.v.double()[:, heads].abs() + o.abs())[inp.seen]
    return 8.0 * eps * float(bound.max()) if bound.numel() else 0.0


def reordered_yardstick(inp: CaseInputs, case: Case, plain: torch.Tensor, ref: torch.Tensor,
                        dtype: torch.dtype) -> torch.Tensor:
    """The plain same-dtype implementation whose error is larger: softmax(q kᵀ·s) v as written, or with the scale
    folded into q and k (√s each, SDPA's math backend's order). FlashAttention's tests likewise measure their
    PyTorch yardstick with the ops reordered (``reorder_ops=True``): a correct kernel may round in either order
    (SDPA's math backend reached 5.7x the first order's error in fp32 at D=13, experiments/attn-check.md)."""
    s = 1.0 / math.sqrt(case.D) if case.scale is None else case.scale
    with torch.no_grad():
        other = plain_attention(inp.q * math.sqrt(s), inp.k * math.sqrt(s), inp.v, inp.visible, inp.bias, 1.0)
    return other if max_abs_err(other, ref, inp.seen) > max_abs_err(plain, ref, inp.seen) else plain


def run_case(kernel: Kernel, case: Case, inp: CaseInputs, dtype: torch.dtype, expect: dict[str, tuple[str, ...]],
             backward: bool, grad_factor: float, rec: Recorder, kernel_weights: torch.Tensor | None = None,
             run_dtype_intermediates: bool = True, row_max: bool = False, query_chunk: int = 0
             ) -> tuple[Outcome, Outcome | None]:
    """One case: the forward (kernel vs reference on rows that see a key; on rows that see none, in every
    family, the policy declared for the case's kind of row: ``expect[case.row_kind]``), then — if the forward
    passed and backward is on — dq (rows that see a key), dk, dv."""
    tensors = {"q": inp.q, "k": inp.k, "v": inp.v, **{k: v for k, v in inp.kwargs.items()
                                                      if isinstance(v, torch.Tensor)}}
    out = forward_or_outcome(kernel, case, inp, case.label(), "forward", tensors)
    if isinstance(out, Outcome):
        return out, None
    leaves = {name: [t.detach().to(cast).requires_grad_(backward) for t in (inp.q, inp.k, inp.v)]
              for name, cast in (("ref", torch.float64), ("plain", dtype))}
    with torch.set_grad_enabled(backward):
        ref, weights = reference_attention(*leaves["ref"], inp.visible, inp.bias, case.scale, return_weights=True)
        plain = plain_attention(*leaves["plain"], inp.visible, inp.bias, case.scale)
    # The yardstick: the plain implementation as written; where the weights were not read, the worse of it and
    # the scale folded into q and k (a kernel's own order of rounding the scores shows in its weights otherwise,
    # and the measured floor carries it).
    yardstick = plain if kernel_weights is not None else reordered_yardstick(inp, case, plain, ref, dtype)
    j = judge(out, ref, yardstick, dtype, 2.0, inp.seen)
    j = replace(j, atol=max(j.atol, fast_exp_atol(inp, ref, weights, dtype) if kernel_weights is None
                            else measured_weights_atol(inp, weights, kernel_weights, ref, dtype)))
    rec.metric("err", j.err, tensor="out", plain_err=j.plain_err, limit=j.threshold, **case.tags())
    policy = "none"
    if not bool(inp.seen.all()):
        heads = kv_head_index(out.shape[1], case.Hkv, out.device)
        mean_v = inp.v.double().mean(dim=2, keepdim=True)[:, heads].expand_as(ref)  # uniform weights' output
        kind = classify_rows(out[~inp.seen], mean_v[~inp.seen], dtype)
        policy = {"mean_of_v": "uniform"}.get(kind, kind)
    ratio = j.ratio
    problems = [] if j.passed else [j.text("out")]
    allowed = expect[case.row_kind]
    if not fully_masked_accepts(allowed, policy):
        n = int((~inp.seen).sum())
        accept = {"other": "finite", "mean_of_v": "uniform"}.get(policy, policy)
        gives = ("finite values that are neither zeros nor the uniform average of v" if policy == "other"
                 else policy)
        problems.append(f"{n} rows that see no key ({case.row_kind} mask) give {gives}, expected "
                        f"{'|'.join(allowed)} (kernel_checks.fully_masked_expect; set it to {accept}, or "
                        f"{{{case.row_kind}:{accept}}} for {case.row_kind} rows only, if that is your kernel's "
                        "documented policy)")
        ratio = math.inf
    evidence = {**tensors, "out": out, "ref": ref.detach()}
    fwd = Outcome(case, "fail" if problems else "pass",
                  f"{case.label()}: " + ("; ".join(problems) if problems else j.text("out")), ratio, policy, evidence)
    if not backward or fwd.status != "pass":
        return fwd, None
    floors = accumulation_atols(inp, ref, weights, 1.0 / math.sqrt(case.D) if case.scale is None else case.scale,
                                dtype, stored_out=out.masked_fill(~inp.seen[..., None], 0.0),
                                run_dtype_intermediates=run_dtype_intermediates, row_max=row_max,
                                query_chunk=query_chunk)
    return fwd, run_backward(kernel, case, inp, dtype, grad_factor, ref, plain, leaves, tensors, floors, rec,
                             nan_rows=policy == "nan")


def kv_slices_without_nan_rows(seen: torch.Tensor, Hkv: int) -> torch.Tensor:
    """(B,Hkv) bool: the (batch row, kv head) slices none of whose query heads has a row that sees no key."""
    B, Hq, Tq = seen.shape
    return seen.reshape(B, Hkv, Hq // Hkv, Tq).all(dim=-1).all(dim=-1)


def run_backward(kernel: Kernel, case: Case, inp: CaseInputs, dtype: torch.dtype, factor: float,
                 ref: torch.Tensor, plain: torch.Tensor, leaves: dict[str, list[torch.Tensor]],
                 tensors: dict[str, torch.Tensor], floors: dict[str, float], rec: Recorder,
                 nan_rows: bool = False) -> Outcome:
    """dq (rows that see a key), dk, dv of the kernel vs the fp64 reference's, next to the plain's.

    ``nan_rows``: the kernel's forward is NaN on the rows that see no key, as its declared policy allows; the
    softmax backward then carries that NaN into dk and dv of the keys those rows share (0·NaN = NaN), as module
    mode's ``fully_masked_policy=nan`` accepts: dk, dv are judged on the (batch row, kv head) slices without
    such a row, and dq on the rows that see a key, as always."""
    evidence = {**tensors, "grad_out": inp.grad_out}
    try:
        mine = [t.detach().clone().requires_grad_(True) for t in (inp.q, inp.k, inp.v)]
        got = enter_backward(call_kernel(kernel, inp, *mine), mine, inp.grad_out)
    except NotImplementedError as exc:
        return Outcome(case, "n/a", f"{case.label()}: backward: {_raised(exc)}")
    except Exception as exc:
        hint = " (a forward-only kernel: pass kernel_checks.backward=false)" if "grad" in str(exc) else ""
        return raised_outcome(kernel, case, exc, "backward", evidence, hint)
    ref_g = torch.autograd.grad(ref, leaves["ref"], inp.grad_out.double())
    plain_g = torch.autograd.grad(plain, leaves["plain"], inp.grad_out)
    judged: dict[str, Comparison] = {}
    kv_rows = kv_slices_without_nan_rows(inp.seen, case.Hkv) if nan_rows else None
    for i, name in enumerate(("dq", "dk", "dv")):
        j = judge(got[i], ref_g[i], plain_g[i], dtype, factor, inp.seen if name == "dq" else kv_rows)
        judged[name] = replace(j, atol=max(j.atol, floors[name]))
        rec.metric("err", j.err, tensor=name, plain_err=j.plain_err, limit=judged[name].threshold, **case.tags())
    worst_name, worst = max(judged.items(), key=lambda kv: kv[1].ratio)
    bad = [j.text(n) for n, j in judged.items() if not j.passed]
    for i, n in enumerate(("dq", "dk", "dv")):
        evidence[f"{n}_kernel"], evidence[f"{n}_ref"] = got[i], ref_g[i]
    detail = f"{case.label()}: " + ("; ".join(bad) if bad else worst.text(worst_name))
    if kv_rows is not None:
        detail += (f" (NaN rows under the declared nan policy: dk, dv judged on {int(kv_rows.sum())} of "
                   f"{kv_rows.numel()} (batch row, kv head) slices)")
    return Outcome(case, "fail" if bad else "pass", detail, worst.ratio, evidence=evidence)

