"""route-sim ``ep_size=W``: the layer battery across W processes (expert parallelism), judged from rank 0's records.

The recipe's side: it starts W workers with torch's own launcher (``python -m torch.distributed.run --standalone``,
gloo on CPU; ``route_sim/ep_worker.py`` is one rank), reads back rank 0's gathered records, and judges them
against a float64 single-process reference built here from the experts' gathered weights with
:mod:`tfmoe.components.moe_reference` (never the layer's own modules):

  ep.output          every rank's outputs = the reference on all W*T tokens
  ep.grad_input      d loss / d x for every rank's tokens (loss = sum(out * g), g drawn from the seed)
  ep.grad_router     the router's gradient summed over ranks (what data parallelism all-reduces)
  ep.grad_experts    every expert's parameter gradients, on the rank holding it
  ep.a2a_bytes       the bytes each rank wrote during each forward and backward (the process's write counter,
                     apart from the dispatcher's split sizes) = the count derived from the reference's routing
                     decisions: rows to and from other ranks * D * itemsize, the layout's metadata and the
                     per-message header measured with an empty All-to-All
  ep.loads           rows computed by each rank's experts, summed over ranks = the single-process kept loads
  ep.drops           each rank's dropped assignments per expert = the capacity rule applied per rank (the
                     layer's documented rule: C = ceil(T*k/E*capacity_factor) from each rank's T tokens)
  ep.step_time       each step's forward (slowest rank) / (slowest rank's compute + fastest rank's All-to-All
                     time, i.e. the transfer without the straggler's wait) within 1/STEP_FACTOR .. STEP_FACTOR
With the training simulation's ``noisy_topk`` strategy (the package's layer), the layer runs once more with noisy
top-k and every check is judged again as ``ep.noisy.*``: the noise is a function of the seed, the step and the
global token index (ep_worker.routing_noise), so the reference adds the very same noise.
Records per rank and step: rows and bytes to and from each peer (tags rank=, peer=), rows kept on the rank, expert
load, dropped assignments, compute / All-to-All / forward / backward times.
"""

from __future__ import annotations

import math
import time
from fractions import Fraction
from typing import Any

import torch

from tfmoe.components import moe_reference as ref
from tfmoe.contract.recorder import Recorder
from tfmoe.contract.tables import Rows
from tfmoe.experiments.route_sim import ep_slurm
from tfmoe.experiments.route_sim.ep_launch import RankFailed, launch  # noqa: F401  (RankFailed: re-exported)

PREFIX = "ep."
STEP_FACTOR = 2.0  # step time vs slowest compute + fastest All-to-All (a shared 2-core CPU's scheduling noise)


CHECKS = ("output", "grad_input", "grad_router", "grad_experts", "a2a_bytes", "loads", "drops", "step_time",
          "rows_per_token", "a2a_bytes_per_token")


# ------------------------------------------------------------------------------------------ the reference
def capacity(tokens: int, k: int, n_experts: int, factor: float | None) -> int | None:
    """The documented per-rank rule, written here: ceil(T*k/E*capacity_factor) in exact arithmetic."""
    return None if factor is None else math.ceil(Fraction(tokens * k, n_experts) * Fraction(repr(float(factor))))


EXPERT_KEYS = ("0.weight", "0.bias", "2.weight", "2.bias")  # nn.Sequential(Linear(D,H), GELU, Linear(H,D))


def expert_act(template: Any) -> str:
    """The activation of the course's expert, nn.Sequential(nn.Linear, nn.GELU, nn.Linear): 'gelu' or
    'gelu_pytorch_tanh'. ValueError naming what was found for any other layout (the reference rebuilds each expert
    from exactly those weights)."""
    import torch.nn as nn

    if not (isinstance(template, nn.Sequential) and len(template) == 3 and isinstance(template[0], nn.Linear)
            and isinstance(template[1], nn.GELU) and isinstance(template[2], nn.Linear)):
        raise ValueError(f"experts[0] is {type(template).__name__}, not the course's nn.Sequential(nn.Linear, "
                         "nn.GELU, nn.Linear): the reference rebuilds each expert from those weights")
    return "gelu" if template[1].approximate == "none" else "gelu_pytorch_tanh"


def rebuild(rank_records: list[dict[str, Any]]) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]], str]:
    """From the gathered state dicts, in float64: the router weight (E,D), every global expert's weights in id order
    (``EXPERT_KEYS``; a Linear without bias has none), and the experts' activation."""
    router = rank_records[0]["router"]["weight"].detach().double()
    act = expert_act(rank_records[0]["expert_template"])
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for r in rank_records:
        for e, state in r["experts"].items():
            experts[e] = {key: state[key].detach().double() for key in EXPERT_KEYS if key in state}
    return router, [experts[e] for e in sorted(experts)], act


def reference(x: torch.Tensor, g: torch.Tensor | None, router: torch.Tensor, experts: list[dict[str, torch.Tensor]],
              act: str, k: int, cap: int | None, group: int, dtype: torch.dtype, renormalize_kept: bool = False,
              noise: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, Any]:
    """moe_reference on all tokens x (N,D) in ``dtype``, every expert rebuilt from its weights
    (``moe_reference.MlpExpert``), capacity per group of ``group`` consecutive tokens (a rank's shard); with a
    cotangent g, the gradients of sum(out*g) too (keyed as the layer's parameters). ``renormalize_kept``: the
    weights are the kept assignments' scores over their sum (GShard's Top2Gate) instead of the chosen ones'
    renormalised, then dropped. ``noise`` = (eps (N,E), the noise gate's weight (E,D)): noisy top-k, the logits
    plus eps * softplus(x W_noise^T) (softplus written as logaddexp(z, 0)), entering moe_reference as a per-token
    logit offset; the noise gate's gradient is then stacked under the router's, (2E,D)."""
    grad = g is not None
    rw = router.to(dtype).clone().requires_grad_(grad)
    params = [{key: t.to(dtype).clone().requires_grad_(grad) for key, t in ex.items()} for ex in experts]
    built = [ref.MlpExpert(p["0.weight"], p["2.weight"], act, p.get("0.bias"), p.get("2.bias")) for p in params]
    xd = x.detach().to(dtype).requires_grad_(grad)
    offset, wn = None, None
    if noise is not None:
        wn = noise[1].to(dtype).clone().requires_grad_(grad)
        z = xd @ wn.T  # (N,E)
        offset = noise[0].to(dtype) * torch.logaddexp(z, torch.zeros_like(z))  # (N,E)
    w = ref.LayerWeights(router=rw, experts=built, router_bias=offset)
    sem = ref.RoutingSemantics("softmax", k, normalize=True, capacity=cap, capacity_group=group)
    routing = ref.route(xd, sem, w)
    weights = routing.weights
    if renormalize_kept:
        kept_scores = torch.where(routing.selected, routing.scores, torch.zeros_like(routing.scores))  # (N,E)
        denom = kept_scores.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(torch.float32).eps)
        weights = kept_scores / denom
    out = ref.combine(xd, weights, sem, w)
    chosen = ref.route(xd.detach(), sem.variant(capacity=None), w).selected  # (N,E) before capacity
    result = {"out": out.detach(), "kept": routing.selected, "chosen": chosen, "margin": routing.margin.detach()}
    if grad:
        (out * g.to(dtype)).sum().backward()
        result["grad_x"] = xd.grad
        result["grad_router"] = rw.grad if wn is None else torch.cat([rw.grad, wn.grad])
        result["grad_experts"] = [{key: t.grad for key, t in p.items()} for p in params]
    return result


def _err(a: torch.Tensor | None, b: torch.Tensor) -> float:
    return math.inf if a is None or a.shape != b.shape else float((a.double() - b.double()).abs().max())


def _tol(plain_err: float, scale: float, dtype: torch.dtype) -> float:
    """Twice the error of the same computation done plainly in the run's dtype, plus 16 ulps of the scale."""
    return 2.0 * plain_err + 16.0 * torch.finfo(dtype).eps * max(scale, 1.0)


# ------------------------------------------------------------------------------------------ judging
def judge(result: dict[str, Any], world: int, spec: dict[str, Any], rec: Recorder,
          capacity_factor: float | None, noisy: bool = False, prefix: str = PREFIX) -> dict[str, Any]:
    """Record the per-rank metrics and the ep.* checks (named ``prefix`` + check) of one layer's gathered records
    (run with ``capacity_factor``; ``noisy``: noisy top-k, the reference drawing the same ``routing_noise``);
    returns figures for the summary."""
    from tfmoe.experiments.route_sim.ep_worker import DTYPES, batch, routing_noise

    PREFIX = prefix  # noqa: N806 (this layer's check and metric names)

    ranks = sorted(result, key=lambda r: r["rank"])
    raised = [f"rank {r['rank']} raised {r['raised']}" for r in ranks if "raised" in r]
    if raised:  # the user's layer: every check fails, its exception leading the detail
        for name in CHECKS:  # the claim checks too
            rec.check(PREFIX + name, False, None, None, "; ".join(raised)[:600])
        return {"rows": [], "capacity": None, "local_tokens": spec["tokens"] // world, "itemsize": 0, "ratio": None}
    dtype = DTYPES[spec["dtype"]]
    n, d, e, k = spec["tokens"], spec["d_model"], spec["n_experts"], spec["top_k"]
    t, local = n // world, e // world
    semantics = ranks[0].get("semantics", {})
    cap = capacity(t, k, e, capacity_factor)
    if semantics.get("capacity_float32") and capacity_factor is not None:  # deepspeed: ceil(fp32(T/E) * fp32(k*cf))
        import numpy as np

        cap = math.ceil(float(np.float32(t / e) * np.float32(float(capacity_factor) * k)))
    itemsize = torch.finfo(dtype).bits // 8
    try:
        router, experts, act = rebuild(ranks)
    except ValueError as exc:  # an expert layout the interface does not allow: every check fails, saying so
        for name in CHECKS:
            rec.check(PREFIX + name, False, None, None, str(exc))
        return {"rows": [], "capacity": None, "local_tokens": t, "itemsize": 0, "ratio": None}
    n_steps = len(ranks[0]["steps"])

    # outputs and gradients at step 0, every rank's tokens
    x0, g0 = batch(spec["seed"], 0, n, d, dtype)
    renorm = bool(semantics.get("renormalize_kept", False))
    gate = ranks[0]["noise_gate"]["weight"].detach().double() if noisy else None

    def noise_at(step: int) -> tuple[torch.Tensor, torch.Tensor] | None:  # the step's noise, the reference's draw
        return None if gate is None else (routing_noise(spec["seed"], step, n, e).to(dtype).double(), gate)

    exact = reference(x0, g0, router, experts, act, k, cap, t, torch.float64, renorm, noise_at(0))
    plain = reference(x0, g0, router, experts, act, k, cap, t, dtype, renorm, noise_at(0))
    out = torch.cat([r["steps"][0]["out"] for r in ranks])
    _compare(rec, "output", out, exact["out"], plain["out"], dtype, "every rank's output vs the float64 reference"
             + (" (noisy top-k: the same noise per global token)" if noisy else ""), PREFIX)
    gx = [r["grads"].get("x") for r in ranks]
    _compare(rec, "grad_input", None if any(v is None for v in gx) else torch.cat(gx), exact["grad_x"],
             plain["grad_x"], dtype, "d sum(out*g) / dx for every rank's tokens", PREFIX)
    gr = [r["grads"]["router"].get("weight") for r in ranks]
    if noisy:  # the noise gate's gradient stacked under the router's
        gn = [(r["grads"].get("noise_gate") or {}).get("weight") for r in ranks]
        gr = [None if a is None or b is None else torch.cat([a, b]) for a, b in zip(gr, gn, strict=True)]
    _compare(rec, "grad_router", None if any(v is None for v in gr) else torch.stack(gr).sum(0),
             exact["grad_router"], plain["grad_router"], dtype, "the router's gradient summed over ranks"
             + (" (and the noise gate's, stacked below it)" if noisy else ""), PREFIX)
    worst, missing = 0.0, []  # the largest error / tolerance over every expert's parameters
    for r in ranks:
        for ge, grads in r["grads"]["experts"].items():
            for name, want in exact["grad_experts"][ge].items():
                got = grads.get(name)
                if got is None:
                    missing.append(f"expert {ge} {name}")
                tol = _tol(_err(plain["grad_experts"][ge][name], want), float(want.abs().max()), dtype)
                worst = max(worst, _err(got, want) / tol)
    detail = ("no gradient reached " + ", ".join(missing[:3])) if missing else \
        "every expert's parameter gradients on the rank holding it (max error / its tolerance)"
    rec.check_le(PREFIX + "grad_experts", worst, 1.0, detail)
    rec.metric(PREFIX + "min_routing_margin", float(exact["margin"].min()))

    # per step: bytes, loads, drops, times
    rows_table, byte_errs, load_errs, drop_errs, ratios = [], [], [], [], []
    for step in range(n_steps):
        x, _g = batch(spec["seed"], step, n, d, dtype)
        decided = reference(x, None, router, experts, act, k, cap, t, torch.float64, renorm, noise_at(step))
        kept, chosen = decided["kept"], decided["chosen"]  # (N,E)
        rows = torch.stack([kept[p * t:(p + 1) * t].view(t, world, local).sum((0, 2)) for p in range(world)])  # (W,W)
        steps = [r["steps"][step] for r in ranks]
        for p, (r, s) in enumerate(zip(ranks, steps, strict=True)):
            st = s["stats"]
            if st is not None:
                for q in range(world):
                    rec.metric(PREFIX + "rows_sent", st.send_rows[q], step=step, rank=p, peer=q)
                    rec.metric(PREFIX + "rows_received", st.recv_rows[q], step=step, rank=p, peer=q)
                    rec.metric(PREFIX + "bytes_sent", st.send_rows[q] * d * itemsize, step=step, rank=p, peer=q)
                    rec.metric(PREFIX + "bytes_received", st.recv_rows[q] * d * itemsize, step=step, rank=p, peer=q)
                rec.metric(PREFIX + "kept_on_rank", st.send_rows[p], step=step, rank=p)
                dropped = int((~st.keep).sum())
                rec.metric(PREFIX + "dropped", dropped, step=step, rank=p)
                for j in range(len(st.received_load)):
                    rec.metric(PREFIX + "expert_load", int(st.received_load[j]), step=step, rank=p, expert=p * local + j)
                rec.metric(PREFIX + "compute_ms", st.compute_ms, step=step, measured=True, rank=p)
                rec.metric(PREFIX + "a2a_ms", st.a2a_ms, step=step, measured=True, rank=p)
            rec.metric(PREFIX + "forward_ms", s["forward_ms"], step=step, measured=True, rank=p)
            rec.metric(PREFIX + "backward_ms", s["backward_ms"], step=step, measured=True, rank=p)
            # bytes: what this rank must write, from the reference's decisions alone
            off = int(rows[p].sum() - rows[p, p] + rows[:, p].sum() - rows[p, p])  # rows to + from other ranks
            layout, header = r["layout"], r["header_bytes"] or 0.0
            if layout is not None and s["wire_forward"] is not None:
                fwd = off * d * itemsize + (world - 1) * (layout[2] + header * layout[0])
                bwd = off * d * itemsize + (world - 1) * header * layout[1]
                padded = layout[3]
                if len(layout) > 4 and layout[4]:  # padded to the largest expert load on any rank (chosen, dropless)
                    padded = local * int(max(chosen[q * t:(q + 1) * t].sum(0).max() for q in range(world)))
                if padded is not None:  # capacity-padded: the same rows to every peer in every call
                    fwd = (world - 1) * (layout[0] * (padded * d * itemsize + header) + layout[2])
                    bwd = (world - 1) * layout[1] * (padded * d * itemsize + header)
                if len(layout) > 5 and layout[5]:  # the extra scalar all_reduces, each measured in the run
                    fwd += layout[5] * (r.get("allreduce_bytes") or 0.0)
                rec.metric(PREFIX + "wire_bytes", s["wire_forward"], step=step, rank=p, phase="forward")
                rec.metric(PREFIX + "wire_bytes", s["wire_backward"], step=step, rank=p, phase="backward")
                rec.metric(PREFIX + "wire_bytes_expected", fwd, step=step, rank=p, phase="forward")
                rec.metric(PREFIX + "wire_bytes_expected", bwd, step=step, rank=p, phase="backward")
                byte_errs.append(max(abs(s["wire_forward"] - fwd), abs(s["wire_backward"] - bwd)))
            rows_table.append((step, p, s, off))
        if all(s["stats"] is not None for s in steps):
            load = torch.zeros(e, dtype=torch.long)
            for p, s in enumerate(steps):
                load[p * local:(p + 1) * local] += s["stats"].received_load.long()
            load_errs.append(int((load - kept.sum(0)).abs().max()))
            for p, s in enumerate(steps):
                st = s["stats"]
                drop = torch.zeros(e, dtype=torch.long).index_add(0, st.topk_idx[~st.keep],
                                                                   torch.ones(int((~st.keep).sum()), dtype=torch.long))
                want = (chosen[p * t:(p + 1) * t] & ~kept[p * t:(p + 1) * t]).sum(0)
                drop_errs.append(int((drop - want).abs().max()))
            step_ms = max(s["forward_ms"] for s in steps)
            predicted = max(s["stats"].compute_ms for s in steps) + min(s["stats"].a2a_ms for s in steps)
            rec.metric(PREFIX + "step_ms", step_ms, step=step, measured=True)
            rec.metric(PREFIX + "step_ms_predicted", predicted, step=step, measured=True)
            ratios.append(step_ms / max(predicted, 1e-9))

    def judged(name: str, errs: list, detail: str, why_na: str) -> None:
        if errs:
            rec.check(PREFIX + name, max(errs) == 0, max(errs), 0.0, detail)
        else:
            rec.not_applicable(PREFIX + name, why_na)

    judged("a2a_bytes", byte_errs, "bytes each rank wrote in each forward and backward (write counter) minus the "
           "count from the reference's routing decisions (rows to and from other ranks, metadata, headers)",
           "the layer declares no collective layout (`layout`), or the process has no write counter")
    judged("loads", load_errs, "rows each expert computed (on its rank), summed over ranks, minus the "
           "single-process kept loads", "the layer keeps no dispatch statistics (`last`)")
    judged("drops", drop_errs, f"each rank's dropped assignments per expert minus the per-rank capacity rule "
           f"(C = {cap} from {t} tokens)", "the layer keeps no dispatch statistics (`last`)")
    if ratios:
        ratio = sorted(ratios)[len(ratios) // 2]
        rec.check(PREFIX + "step_time", 1 / STEP_FACTOR <= ratio <= STEP_FACTOR, ratio, STEP_FACTOR,
                  "median over steps of forward time (slowest rank) / (slowest rank's compute + fastest rank's "
                  f"All-to-All), within 1/{STEP_FACTOR:g} .. {STEP_FACTOR:g}")
    else:
        rec.not_applicable(PREFIX + "step_time", "the layer reports no compute / All-to-All times (`last`)")
    claim = claim_checks(rec, ranks, world, spec, cap, itemsize, PREFIX)
    facts = {"rows": rows_table, "capacity": cap, "local_tokens": t, "itemsize": itemsize,
             "ratio": sorted(ratios)[len(ratios) // 2] if ratios else None, "claim": claim,
             "bytes_per_token": payload_per_token(ranks, world, n)}
    if all(s["stats"] is not None for r in ranks for s in r["steps"]):
        load = torch.zeros(e, dtype=torch.float64)
        compute_ms = 0.0
        for p, r in enumerate(ranks):
            for s in r["steps"]:
                load[p * local:(p + 1) * local] += s["stats"].received_load.double()
                compute_ms += s["stats"].compute_ms
        facts["popularity"] = (load / load.sum()).numpy()
        facts["ms_per_row"] = compute_ms / max(float(load.sum()), 1.0)
    return facts


def payload_per_token(ranks: list[dict[str, Any]], world: int, n: int) -> float | None:
    """All-to-All payload bytes per token in a forward, from the write counters: each rank's bytes written minus the
    headers (measured) and the metadata its layout declares, summed over ranks, per token and step."""
    if not all(r["layout"] is not None and r["steps"][0]["wire_forward"] is not None for r in ranks):
        return None
    if any(r["layout"][3] is not None or (len(r["layout"]) > 4 and r["layout"][4]) for r in ranks):
        return None  # a padded layout: its bytes follow its padding, not the routing
    payload = 0.0
    for r in ranks:
        calls, _bwd, meta = r["layout"][:3]
        overhead = (world - 1) * (meta + (r["header_bytes"] or 0.0) * calls)
        payload += sum(s["wire_forward"] - overhead for s in r["steps"])
    return payload / (n * len(ranks[0]["steps"]))


def claim_checks(rec: Recorder, ranks: list[dict[str, Any]], world: int, spec: dict[str, Any], cap: int | None,
                 itemsize: int, prefix: str = PREFIX) -> dict[str, float]:
    """The chapter's claim, measured (dropless runs only): the expert rows computed per token stay k whatever E and
    W (``ep.rows_per_token``), while the All-to-All payload per token in a forward is 2*k*(W-1)/W*D*itemsize
    (dispatch and combine; ``ep.a2a_bytes_per_token``): a token's expert sits on another rank with probability
    (W-1)/W whatever the experts' popularity, as long as routing does not depend on the token's rank. Tolerance:
    4 standard deviations of a binomial count of the N*k assignments."""
    PREFIX = prefix  # noqa: N806
    names = ("rows_per_token", "a2a_bytes_per_token")
    if cap is not None:
        for name in names:
            rec.not_applicable(PREFIX + name, "the claim is about dropless routing: run with capacity_factor=null")
        return {}
    n, d, k = spec["tokens"], spec["d_model"], spec["top_k"]
    steps = len(ranks[0]["steps"])
    stats = [[r["steps"][i]["stats"] for r in ranks] for i in range(steps)]
    out: dict[str, float] = {}
    if all(st is not None for row in stats for st in row):
        per_token = [sum(int(st.received_load.sum()) for st in row) / n for row in stats]
        worst = max(abs(v - k) for v in per_token)
        rec.check(PREFIX + "rows_per_token", worst == 0, worst, 0.0,
                  f"expert rows computed per token (all ranks) minus top_k={k}: the expert FLOPs per token")
        out["rows_per_token"] = sum(per_token) / len(per_token)
    else:
        rec.not_applicable(PREFIX + "rows_per_token", "the layer keeps no dispatch statistics (`last`)")
    measured = payload_per_token(ranks, world, n)
    if measured is not None:
        p = (world - 1) / world
        law = 2 * k * p * d * itemsize
        sigma = math.sqrt(n * steps * k * p * (1 - p)) * 2 * d * itemsize / (n * steps)
        rec.check(PREFIX + "a2a_bytes_per_token", abs(measured - law) <= 4 * sigma + 1e-9, measured, law,
                  f"All-to-All payload bytes per token in a forward (measured on the wire) vs 2*k*(W-1)/W*D*"
                  f"itemsize = {law:g}, within 4 sigma = {4 * sigma:.1f}")
        rec.metric(PREFIX + "a2a_bytes_per_token", measured, world=world)
        rec.metric(PREFIX + "a2a_bytes_per_token_law", law, world=world)
        out["bytes_per_token"] = measured
    else:
        rec.not_applicable(PREFIX + "a2a_bytes_per_token", "the layer declares no collective layout (`layout`), or "
                           "a padded one (its bytes follow its padding, judged by a2a_bytes)")
    return out


def _compare(rec: Recorder, name: str, got: torch.Tensor | None, want: torch.Tensor, plain: torch.Tensor,
             dtype: torch.dtype, detail: str, prefix: str = PREFIX) -> None:
    if got is None:
        rec.check(prefix + name, False, math.inf, None, detail + ": no gradient reached it")
        return
    err, tol = _err(got, want), _tol(_err(plain, want), float(want.abs().max()), dtype)
    rec.check_le(prefix + name, err, tol, detail + " (max abs error; tolerance 2x the plain same-dtype error + "
                 "16 ulps of the scale)", evidence={"got": got, "want": want})


def per_rank_rows(facts: dict[str, Any], world: int) -> Rows:
    """One row per rank (mean over steps): rows kept, sent, received; bytes written; times."""
    by_rank: dict[int, list] = {}
    for _step, p, s, _off in facts["rows"]:
        by_rank.setdefault(p, []).append(s)
    table = Rows("expert parallelism: per rank, mean over steps",
                 ["rank", "kept", "sent", "received", "dropped", "wire kB fwd+bwd", "compute ms", "a2a ms",
                  "forward ms", "backward ms"])
    for p in range(world):
        ss = by_rank.get(p, [])
        cols: list[list[float]] = [[] for _ in range(9)]
        for s in ss:
            st = s["stats"]
            if st is not None:
                for i, v in enumerate((st.send_rows[p], sum(st.send_rows) - st.send_rows[p],
                                       sum(st.recv_rows) - st.recv_rows[p], int((~st.keep).sum()))):
                    cols[i].append(v)
                cols[5].append(st.compute_ms)
                cols[6].append(st.a2a_ms)
            cols[4].append(((s["wire_forward"] or 0) + (s["wire_backward"] or 0)) / 1e3)
            cols[7].append(s["forward_ms"])
            cols[8].append(s["backward_ms"])
        table.add(p, *(f"{sum(c) / len(c):.2f}" if c else "-" for c in cols))
    return table


def trained_strategies(s: Any) -> list[str]:
    """The strategies the training simulation runs under expert parallelism (ep_worker.TRAINED_STRATEGIES)."""
    from tfmoe.experiments.route_sim.ep_worker import TRAINED_STRATEGIES

    return [name for name in s.strategies if name in TRAINED_STRATEGIES]


def train_spec(s: Any) -> dict[str, Any] | None:
    """The training simulation's part of the spec (None when steps=0)."""
    if s.steps == 0:
        return None
    return {"steps": s.steps, "tokens": s.train_tokens, "clusters": s.clusters, "init_skew": s.init_skew,
            "lr": s.lr, "aux_loss_coef": s.aux_loss_coef, "z_loss_coef": s.z_loss_coef,
            "bias_update_rate": s.bias_update_rate, "capacity_factor": s.capacity_factor,
            "strategies": trained_strategies(s)}


NOISY = "@noisy"  # the label suffix (and check prefix ep.noisy.) of a layer run under noisy top-k


def spec_for(s: Any, seed: int, dtype: str, impls: list[str],
             dropless: tuple[str, ...] = (), noisy: tuple[str, ...] = ()) -> dict[str, Any]:
    """What every worker reads (JSON): the sizes, the seed, the layers to run (labelled by their impl; those in
    ``dropless`` once more as "<impl>@dropless", with capacity_factor None; those in ``noisy`` once more as
    "<impl>@noisy", built with noisy=True and given ``routing_noise``)."""
    layers = [{"label": i, "impl": i, "capacity_factor": s.capacity_factor} for i in impls]
    layers += [{"label": f"{i}@dropless", "impl": i, "capacity_factor": None} for i in dropless]
    layers += [{"label": f"{i}{NOISY}", "impl": i, "capacity_factor": s.capacity_factor, "noisy": True}
               for i in noisy]
    return {"d_model": s.d_model, "d_hidden": s.d_hidden, "n_experts": s.n_experts, "top_k": s.top_k,
            "tokens": s.tokens, "seed": seed, "dtype": dtype, "steps": s.ep.steps, "timeout_s": s.ep.timeout_s,
            "layers": layers}


def run_ep(s: Any, rec: Recorder) -> None:
    """route-sim with ep_size >= 2: launch, judge, record; the summary names the layer and the rank table."""
    from tfmoe.contract.errors import BadInput

    dtype = {torch.float32: "fp32", torch.float64: "fp64"}.get(rec.dtype)
    if dtype is None:
        raise BadInput(f"dtype={rec.dtype} is not supported with ep_size={s.ep.size}: pass dtype=fp32 or dtype=fp64")
    impl = s.ep.impl or "own"
    if impl.startswith("lib:"):
        from tfmoe.adapters.moe_ep_libs import check_lib

        check_lib(impl, s.tokens // s.ep.size, s.n_experts, s.top_k, s.capacity_factor, dtype)  # exit 2 first
    elif impl != "own":
        from tfmoe.rules.user_code import load_object

        load_object(impl, "ep_impl")  # bad input (exit 2) here, before any worker starts
    noisy = impl == "own" and s.steps > 0 and "noisy_topk" in s.strategies  # its forward judged under the noise
    spec = spec_for(s, rec.seed, dtype, [impl], noisy=(impl,) if noisy else ())
    spec["train"] = train_spec(s) if impl == "own" else None
    if spec["train"] is not None:
        skipped = [name for name in s.strategies if name not in spec["train"]["strategies"]]
        if skipped:
            rec.note(f"training simulation under expert parallelism: {', '.join(skipped)} not run (not supported "
                     "under ep_size yet)")
    step = ep_slurm.slurm_step()  # under srun / submitit with W tasks: the ranks are the step's tasks
    started = "started by torch.distributed.run" if step is None else \
        f"the {step.world} tasks of SLURM job {step.job_id} step {step.step_id}"
    rec.note(f"expert parallelism: {s.ep.size} ranks, {started} (gloo, CPU), "
             f"{s.n_experts // s.ep.size} experts and {s.tokens // s.ep.size} tokens per rank; collectives time "
             f"out after {s.ep.timeout_s:g} s")
    t0 = time.perf_counter()
    result = launch(spec, s.ep.size) if step is None else ep_slurm.launch(spec, step)
    rec.timing("ep.launch", (time.perf_counter() - t0) * 1e3)
    facts = judge([r[impl] for r in result["ranks"]], result["world"], spec, rec, s.capacity_factor)
    if noisy:  # noisy top-k's forward and backward, every check again under its own names (ep.noisy.*)
        judge([r[impl + NOISY] for r in result["ranks"]], result["world"], spec, rec, s.capacity_factor,
              noisy=True, prefix=PREFIX + "noisy.")
    table = per_rank_rows(facts, result["world"])
    table.print_to(rec.console)
    cap = facts["capacity"] if facts["capacity"] is not None else "none (dropless)"
    model = scaling(s, rec, facts, result["world"])
    if spec["train"] is not None:
        model += training(spec, rec, [r["__train__"] for r in result["ranks"]], result["world"])
    if noisy:
        model += ["", "Noisy top-k (the `noisy_topk` strategy): the layer ran once more with noisy routing, the noise a "
                  "function of the seed, the step and the global token, and every check was judged again (`ep.noisy.*`) "
                  "against the reference with the same noise."]
    rec.summary("\n".join([
        f"## Expert parallelism: {s.ep.size} ranks, layer {impl}",
        "",
        f"{s.n_experts} experts ({s.n_experts // s.ep.size} per rank, blocked), top-{s.top_k}, "
        f"{facts['local_tokens']} tokens per rank, capacity per rank {cap}; {s.ep.steps} steps. Per rank, mean "
        "over steps (sent/received: rows to/from other ranks):",
        "",
        table.markdown(),
        *model,
    ]))


def scaling(s: Any, rec: Recorder, facts: dict[str, Any], world: int) -> list[str]:
    """The scaling model (route_sim/ep_scaling.py) fed with this run's measurements: metrics ep.sim.* per W, the
    plot ``ep_scaling``, and the summary's lines."""
    from tfmoe.experiments.route_sim.ep_scaling import Measured, scaling_plot, simulate

    if not s.ep.sim_ranks or "popularity" not in facts:
        return []
    m = Measured(world, facts["local_tokens"], s.n_experts // world, s.d_model, facts["itemsize"], s.top_k,
                 facts["popularity"], facts["ms_per_row"], facts["bytes_per_token"])
    points = simulate(m, tuple(sorted({world, *s.ep.sim_ranks})), s.ep.link_gbps, s.ep.latency_us, rec.seed)
    table = Rows(f"scaling model: {s.ep.link_gbps:g} Gbit/s, {s.ep.latency_us:g} us per message, "
                 f"{m.ms_per_row * 1e3:.2f} us per expert row (measured)",
                 ["W", "experts", "straggler", "compute ms", "a2a ms", "step ms", "tokens/s/rank", "bytes/token"])
    for p in points:
        for name, value in (("tokens_per_s_per_rank", p.tokens_per_s_per_rank), ("bytes_per_token", p.bytes_per_token),
                            ("straggler", p.straggler), ("step_ms", p.step_ms), ("compute_ms", p.compute_ms),
                            ("a2a_ms", p.a2a_ms)):
            rec.metric(PREFIX + "sim." + name, value, measured=name not in ("bytes_per_token", "straggler"),
                       world=p.world)
        table.add(p.world, p.experts, f"{p.straggler:.3f}", f"{p.compute_ms:.3f}", f"{p.a2a_ms:.3f}",
                  f"{p.step_ms:.3f}", f"{p.tokens_per_s_per_rank:,.0f}", f"{p.bytes_per_token:.0f}")
    rec.plot("ep_scaling", scaling_plot(m, points, s.ep.link_gbps, s.ep.latency_us))
    table.print_to(rec.console)
    measured = "" if m.bytes_per_token is None else f" (measured here at W={world}: {m.bytes_per_token:.1f})"
    return ["", "### Beyond this machine (model, route_sim/ep_scaling.py; not measured)", "",
            f"From this run: {m.tokens_per_rank} tokens per rank, {m.experts_per_rank} experts per rank (experts "
            f"added with ranks), expert popularity and {m.ms_per_row * 1e3:.2f} us per expert row as measured; "
            f"bytes per token 2k(W-1)/W x D x itemsize{measured}.", "", table.markdown()]


def training(spec: dict[str, Any], rec: Recorder, per_rank: list[dict[str, Any]], world: int) -> list[str]:
    """The training simulation's per-rank records (tags strategy=, rank=; per step), its checks and plot, and the
    summary's lines: per strategy, how unevenly the ranks' experts are loaded while it trains."""
    from matplotlib.figure import Figure

    t, k, e = spec["train"], spec["top_k"], spec["n_experts"]
    n = t["tokens"]
    fig = Figure(figsize=(9, 3.6))
    ax1, ax2 = fig.subplots(1, 2)
    table = Rows("training under expert parallelism: mean over the last 10% of steps",
                 ["strategy", "rank imbalance (max/mean rows)", "expert CV", "dropped", "task loss"])
    worst_router, worst_total = 0.0, 0
    for strategy in t["strategies"]:
        traces = [r[strategy] for r in per_rank]
        imbalance, cv = [], []
        for step in range(t["steps"]):
            rows = [tr["rank_rows"][step] for tr in traces]
            load = traces[0]["load"][step].double()
            dropped = sum(tr["dropped"][step] for tr in traces)
            worst_total = max(worst_total, abs(sum(rows) + dropped - n * k), int((load.sum() - n * k).abs()))
            for p, value in enumerate(rows):
                rec.metric(PREFIX + "train.rank_rows", value, step=step, strategy=strategy, rank=p)
            imbalance.append(max(rows) / (sum(rows) / world) if sum(rows) else math.inf)
            cv.append(float(load.std(unbiased=False) / load.mean()))
            rec.metric(PREFIX + "train.rank_imbalance", imbalance[-1], step=step, strategy=strategy)
            rec.metric(PREFIX + "train.cv", cv[-1], step=step, strategy=strategy)
            rec.metric(PREFIX + "train.dropped_fraction", dropped / (n * k), step=step, strategy=strategy)
            rec.metric(PREFIX + "train.task_loss", sum(tr["task_loss"][step] for tr in traces) / world, step=step,
                       strategy=strategy)
        worst_router = max(worst_router, *(float((tr["router"] - traces[0]["router"]).abs().max()) for tr in traces))
        tail = slice(max(0, t["steps"] - max(1, t["steps"] // 10)), t["steps"])

        def mean(v: list[float], tail: slice = tail) -> float:
            return sum(v[tail]) / len(v[tail])

        table.add(strategy, f"{mean(imbalance):.3f}", f"{mean(cv):.3f}",
                  f"{mean([sum(tr['dropped'][i] for tr in traces) / (n * k) for i in range(t['steps'])]):.3f}",
                  f"{mean([sum(tr['task_loss'][i] for tr in traces) / world for i in range(t['steps'])]):.4f}")
        ax1.plot(imbalance, label=strategy)
        ax2.plot(cv, label=strategy)
    rec.check(PREFIX + "train.router_replicated", worst_router == 0.0, worst_router, 0.0,
              "the router after training, every rank minus rank 0 (its gradient is all-reduced)")
    rec.check(PREFIX + "train.assignments_add_up", worst_total == 0, worst_total, 0.0,
              "every step: rows computed on all ranks + dropped = tokens*k, and the routed loads sum to tokens*k")
    ax1.set_xlabel("step")
    ax1.set_ylabel(f"max / mean rows over {world} ranks")
    ax1.legend(fontsize=7)
    ax2.set_xlabel("step")
    ax2.set_ylabel(f"CV of the {e} experts' loads")
    fig.tight_layout()
    rec.plot("ep_training", fig)
    table.print_to(rec.console)
    return ["", f"### Training simulation under expert parallelism: {t['steps']} steps x {n} tokens "
            f"({n // world} per rank), init_skew {t['init_skew']:g}", "", table.markdown()]


# ------------------------------------------------------------------------------------------ settings
WORKER_BYTES = 512 * 2**20  # one worker's resident memory (python + torch + gloo), rounded up


def most_ranks(available_bytes: int) -> int:
    """The most workers this machine can start: one WORKER_BYTES each in 80% of the available memory."""
    return max(1, int(0.8 * available_bytes // WORKER_BYTES))


def ep_settings(cfg: Any, n_experts: int, tokens: int) -> Any:
    """The ``ep_*`` keys, validated before anything starts (bad input: one line, exit 2)."""
    from omegaconf import ListConfig, OmegaConf

    from tfmoe.contract.errors import BadInput
    from tfmoe.experiments.route_sim.settings import EPSettings
    from tfmoe.rules.validate import require_int, require_number

    size = require_int(cfg, "ep_size", 1)
    under_slurm = ep_slurm.check_world(size, n_experts, tokens)  # the ranks are a SLURM step's tasks
    impl = OmegaConf.select(cfg, "ep_impl", default=None)
    if impl is not None and (not isinstance(impl, str) or ":" not in impl):
        raise BadInput(f"ep_impl={impl!r} is not 'python.module:Class': pass ep_impl=mymodule:MyEPLayer, "
                       "ep_impl=lib:fairscale, or ep_impl=null for the package's ExpertParallelMoE")
    steps = require_int(cfg, "ep_steps", 1)
    timeout = require_number(cfg, "ep_timeout_s", positive=True)
    ranks = OmegaConf.select(cfg, "ep_sim_ranks", default=[])
    ranks = list(ranks) if isinstance(ranks, (list, tuple, ListConfig)) else ranks
    if not isinstance(ranks, list) or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 2
                                              for w in ranks):
        raise BadInput(f"ep_sim_ranks={ranks!r} is not a list of integers >= 2: pass e.g. ep_sim_ranks=[8,64,1024] "
                       "(or [] for no scaling model)")
    link = require_number(cfg, "ep_link_gbps", positive=True)
    latency = require_number(cfg, "ep_link_latency_us", minimum=0.0)
    extra = (tuple(ranks), link, latency)
    if size == 1:
        return EPSettings(1, impl, steps, timeout, *extra)
    import psutil

    train_tokens, steps_train = cfg.get("train_tokens"), cfg.get("steps")
    training = isinstance(steps_train, int) and steps_train > 0 and isinstance(train_tokens, int)
    limit = most_ranks(int(psutil.virtual_memory().available))
    # every suggestion below is itself accepted: sizes that divide the experts and both token counts, and fit here
    fitting = [w for w in range(1, n_experts + 1) if n_experts % w == 0 and tokens % w == 0
               and (not training or train_tokens % w == 0) and (w <= limit or under_slurm)]
    sizes = f"pass ep_size as one of {', '.join(map(str, fitting))}"
    if n_experts % size:
        raise BadInput(f"ep_size={size} does not divide n_experts={n_experts}: {sizes}")
    uneven = [(key, n) for key, n in (("tokens", tokens), ("train_tokens", train_tokens if training else None))
              if n is not None and n % size]
    if uneven:
        said = " and ".join(f"{key}={n}" for key, n in uneven)
        fix = " ".join(f"{key}={n // size * size or size}" for key, n in uneven)
        raise BadInput(f"{said} {'is' if len(uneven) == 1 else 'are'} not divisible by ep_size={size}: pass {fix} "
                       f"(multiples of {size}){', or steps=0 for no training simulation' if training else ''}, "
                       f"or {sizes.removeprefix('pass ')}")
    if cfg.get("impl") is not None:
        raise BadInput(f"impl={cfg.get('impl')!r} names a single-process layer: with ep_size={size} pass the "
                       "expert-parallel layer as ep_impl=module:Class (and impl=null)")
    if str(cfg.get("device")) != "cpu":
        raise BadInput(f"ep_size={size} runs its ranks on CPU with gloo (device={cfg.get('device')} is not supported "
                       "yet): pass device=cpu")
    if str(cfg.get("dtype")) not in ("fp32", "fp64"):
        raise BadInput(f"dtype={cfg.get('dtype')} is not supported with ep_size={size}: pass dtype=fp32 or "
                       "dtype=fp64")
    if size > limit and not under_slurm:  # under SLURM each task starts one worker
        raise BadInput(f"ep_size={size} is more worker processes than this machine can start (at most {limit}: "
                       f"{WORKER_BYTES / 2**20:.0f} MiB each in 80% of the available memory): pass ep_size="
                       f"{max(fitting)} or less")
    return EPSettings(size, impl, steps, timeout, *extra)
