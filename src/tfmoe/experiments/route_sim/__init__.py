"""tfmoe route-sim — course §2.6: MoE routing you can watch.

Question: how unevenly does a top-k router spread tokens over experts (loads, CV, MaxVio), what does a
capacity limit drop, and which balancing strategy (Switch aux loss, router z-loss, noisy top-k,
aux-loss-free bias) undoes a router that has collapsed onto a few experts — at what cost?

Part 1, the course's exercise: ``tokens`` random tokens routed once (default 100 tokens, 8 experts, top-2):
loads, CV, MaxVio, capacity drops, the Switch aux penalty; both dispatches (loop and sorted) run and
compared with each other and with a dense float64 reference.
Part 2, a training simulation: an MoE layer (output x + expert mixture, so a dropped token passes through
unchanged) trained with Adam on clustered inputs, the router initialised so that experts 0..k-1 win every
token; each strategy on identical data and init; per step CV, MaxVio, dropped fraction, balance loss,
router entropy, task loss.

``balance_loss`` is the Switch aux loss alpha*E*sum_i f_i*P_i (f_i = load_i/(N*k), P_i = mean router
probability) measured for every strategy as a common yardstick; it is added to the training loss only
under ``aux_loss``. ``z_loss`` likewise is measured always and applied only under ``z_loss``.

This module is the recipe: :class:`Settings`, :func:`settings`, :func:`run`. The parts it runs:
  route_course.py    part 1, the course case (route once, record, check)
  route_training.py  part 2, the training simulation and its per-step checks
  route_checks.py    the bookkeeping checks both parts (and the layer battery) apply
  route_layer.py     the layer battery (``impl=``): one MoE layer against components/moe_reference.py
  route_plots.py     the figures, and :func:`sweep_plots`
"""

from __future__ import annotations

from omegaconf import DictConfig, ListConfig, OmegaConf

from tfmoe.adapters.moe_layers import LayerSizes
from tfmoe.components import moe
from tfmoe.contract.errors import BadInput
from tfmoe.contract.recorder import Recorder
from tfmoe.experiments.route_sim import course as route_course
from tfmoe.experiments.route_sim import ep_slurm as route_ep_slurm
from tfmoe.experiments.route_sim import expert_parallel as route_ep
from tfmoe.experiments.route_sim import layer as route_layer
from tfmoe.experiments.route_sim import training as route_training
from tfmoe.experiments.route_sim.course import CourseResult
from tfmoe.experiments.route_sim.ep_slurm import check_tasks  # ep_size=W across SLURM tasks
from tfmoe.experiments.route_sim.plots import sweep_plots, training_plots
from tfmoe.experiments.route_sim.settings import LayerSettings, Settings
from tfmoe.experiments.route_sim.training import StrategyTrace
from tfmoe.rules import capabilities, finite, memory
from tfmoe.rules.memory import Knob
from tfmoe.rules.validate import require_int, require_number

COEF_FIX = "pass a coefficient >= 0 (0 switches it off)"


def _choice(cfg: DictConfig, key: str, options: tuple[str, ...]) -> str:
    value = cfg.get(key)
    if value not in options:
        raise BadInput(f"{key}={value!r} is unknown: use one of {', '.join(options)}")
    return str(value)


def settings(cfg: DictConfig) -> Settings:
    """Validate every key; bad input -> BadInput naming the problem and the fix. Imports no layer (``impl`` is
    loaded by the battery in :func:`run`)."""
    n_experts = require_int(cfg, "n_experts", 1)
    top_k = cfg.get("top_k")
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise BadInput(f"top_k={top_k!r} is not an integer: pass top_k between 1 and n_experts={n_experts}")
    if not 1 <= top_k <= n_experts:
        raise BadInput(f"top_k={top_k} is outside 1..n_experts={n_experts}: pass top_k between 1 and {n_experts}")
    cf = cfg.get("capacity_factor")
    if cf is not None:
        if isinstance(cf, (int, float)) and not isinstance(cf, bool) and cf <= 0:
            raise BadInput(f"capacity_factor={cf} must be > 0: pass a positive factor (1.0 = exactly the mean "
                           "load), or null for dropless routing")
        cf = require_number(cfg, "capacity_factor", minimum=0.0, positive=True)
    strategies = cfg.get("strategies")
    if isinstance(strategies, str):
        strategies = [strategies]
    if not isinstance(strategies, (list, tuple, ListConfig)) or len(strategies) == 0:
        raise BadInput(f"strategies={strategies!r} is not a non-empty list: pass e.g. strategies=[none,aux_loss]")
    for name in strategies:
        if name not in moe.STRATEGIES:
            raise BadInput(f"strategy {name!r} is unknown: use any of {', '.join(moe.STRATEGIES)}")
    if len(set(strategies)) != len(strategies):
        raise BadInput(f"strategies={list(strategies)} lists a strategy twice: list each once")
    tokens = require_int(cfg, "tokens", 1)
    score_func = _choice(cfg, "score_func", moe.SCORE_FUNCS)
    built = Settings(
        tokens=tokens, n_experts=n_experts, top_k=top_k, capacity_factor=cf,
        score_func=score_func, d_model=require_int(cfg, "d_model", 1),
        d_hidden=require_int(cfg, "d_hidden", 1), dispatch=_choice(cfg, "dispatch", moe.DISPATCHES),
        strategies=tuple(str(name) for name in strategies), steps=require_int(cfg, "steps", 0),
        train_tokens=require_int(cfg, "train_tokens", 1), clusters=require_int(cfg, "clusters", 1),
        init_skew=require_number(cfg, "init_skew", minimum=0.0, fix=COEF_FIX),
        lr=require_number(cfg, "lr", minimum=0.0, positive=True),
        aux_loss_coef=require_number(cfg, "aux_loss_coef", minimum=0.0, fix=COEF_FIX),
        z_loss_coef=require_number(cfg, "z_loss_coef", minimum=0.0, fix=COEF_FIX),
        bias_update_rate=require_number(cfg, "bias_update_rate", minimum=0.0, fix=COEF_FIX),
        layer=layer_settings(cfg, n_experts, top_k, score_func),
        expect_divergence=finite.expect_divergence(cfg),
        ep=route_ep.ep_settings(cfg, n_experts, tokens),  # expert parallelism (ep_size)
    )
    if str(cfg.get("device")) == "cpu":  # the host's RAM is the device's: refused before the run starts
        refuse_oversized(built, str(cfg.get("dtype")), memory.host_available_bytes(), "the host's")
    return built


# Bytes per course-case token (fp32), fitted to torch.profiler's measured peak of course_case at 20,000 tokens
# (tests/test_route_sim.py checks the estimate stays within 1.0-1.5x of a real run's peak): the per-token tensors
# scale with d_model (x, the two dispatches' outputs and gathers, the dense fp64 and plain references, twice with a
# capacity), d_hidden (one expert's hidden activations in the fp64 reference), n_experts (logits, probs, the dense
# gate) and top_k (indices, weights, keep masks).
BYTES_PER_TOKEN = {"d_model": 64, "d_hidden": 16, "n_experts": 24, "top_k": 32}
DTYPE_FACTOR = {"fp64": 1.3}  # fp64 runs measured 1.27x fp32's; fp16/bf16 kept at fp32's (the references are fp64)
MEMORY_FRACTION = 0.8
ROW_BYTES = 400  # one metrics row held by the recorder (a dict of a few tags), per step and recorded quantity


def _per_token(z: dict[str, int]) -> int:
    return (BYTES_PER_TOKEN["d_model"] * z["d_model"] + BYTES_PER_TOKEN["d_hidden"] * z["d_hidden"]
            + BYTES_PER_TOKEN["n_experts"] * z["n_experts"] + BYTES_PER_TOKEN["top_k"] * z["top_k"])


def _layer_params(z: dict[str, int], shared_hidden: int = 0) -> int:
    """Parameters of one MoE layer: the experts (d -> d_hidden -> d), the router, a shared expert."""
    d, h = z["d_model"], z["d_hidden"]
    return z["n_experts"] * (2 * d * h + d + h) + d * z["n_experts"] + 2 * d * shared_hidden


def _course_bytes(z: dict[str, int], dtype: str) -> int:
    """The course case: its per-token tensors (fitted) and its layer with the float64 copy the reference makes."""
    e = 8 if dtype == "fp64" else 4
    return int(z["tokens"] * _per_token(z) * DTYPE_FACTOR.get(dtype, 1.0)) + (e + 8) * _layer_params(z)


def estimated_bytes(z: dict[str, int], dtype: str, strategies: int, own_layer: bool) -> int:
    """Peak bytes of the largest part of a run with sizes ``z`` (config key -> value): the course case (its
    per-token tensors, fitted, and the layer with its float64 copy), the training simulation (Adam's four copies of
    the layer, the cluster maps and the per-token gathered maps of a batch, autograd's saved tensors, the recorded
    rows of every step) and the layer battery (the layer and its float64 reference, twice)."""
    e = 8 if dtype == "fp64" else 4
    battery_tokens = z["layer.batch"] * z["layer.seq"]
    battery = 2 * (e + 8) * _layer_params(z, z["layer.shared_hidden"]) + 4 * battery_tokens * _per_token(z)
    if not own_layer:
        return battery
    course = _course_bytes(z, dtype)
    d = z["d_model"]
    training = 0 if z["steps"] == 0 else (16 * _layer_params(z) + 4 * d * d * (z["clusters"] + z["train_tokens"])
                                          + 3 * z["train_tokens"] * _per_token(z)
                                          + z["steps"] * strategies * ROW_BYTES * 10)
    return max(course, training, battery)


def size_knobs(s: Settings) -> dict[str, Knob]:
    """route-sim's size keys as the guard may lower them (n_experts stays >= top_k; steps >= 1, as steps=0 would
    not shrink a size but drop the training simulation)."""
    return {"tokens": Knob(s.tokens), "d_model": Knob(s.d_model), "d_hidden": Knob(s.d_hidden),
            "n_experts": Knob(s.n_experts, minimum=lambda z: z["top_k"]), "top_k": Knob(s.top_k),
            "train_tokens": Knob(s.train_tokens), "clusters": Knob(s.clusters), "steps": Knob(s.steps, minimum=min(s.steps, 1)),  # 1, not 0: steps=0 drops a part, it is no size
            "layer.batch": Knob(s.layer.batch, minimum=2), "layer.seq": Knob(s.layer.seq),
            "layer.shared_hidden": Knob(s.layer.sizes.shared_hidden)}


def estimated_course_bytes(s: Settings, dtype: str) -> int:
    """Peak bytes the course case allocates for ``s.tokens`` tokens (fitted, see BYTES_PER_TOKEN), with its layer."""
    return _course_bytes({k: kb.value for k, kb in size_knobs(s).items()}, dtype)


def refuse_oversized(s: Settings, dtype: str, available: int, where: str) -> None:
    """BadInput naming the estimate, the memory available, the size that dominates the estimate and a value of it
    that fits, when a part of the run would not fit in ``MEMORY_FRACTION`` of ``available``."""
    memory.refuse_oversized(lambda z: estimated_bytes(z, dtype, len(s.strategies), s.layer.impl is None),
                            size_knobs(s), available, where, "route-sim", MEMORY_FRACTION)


def layer_settings(cfg: DictConfig, n_experts: int, top_k: int, score_func: str) -> LayerSettings:
    """The layer battery's keys (``impl``, ``layer.*``), with the sizes it shares with the course case."""
    impl = cfg.get("impl")
    if impl is not None and (not isinstance(impl, str) or not impl.strip()):
        raise BadInput(f"impl={impl!r} is not a string: pass impl=hf:mixtral, impl=pkg.module:Class, or "
                       "impl=null for the package's own layer")
    module_name, _, name = (impl or "x:y").strip().partition(":")
    if not module_name or not name:  # the form, before any run directory (the import itself is the run's)
        raise BadInput(f"impl={impl!r} is not 'pkg.module:Class' nor 'hf:<model type>': write e.g. "
                       "impl=my_moe:ToyMoE or impl=hf:mixtral")
    norm = OmegaConf.select(cfg, "layer.norm_topk_prob")
    if not isinstance(norm, bool):
        raise BadInput(f"layer.norm_topk_prob={norm!r} is not a boolean: pass true or false")
    straight = OmegaConf.select(cfg, "layer.straight_through", default=True)
    if not isinstance(straight, bool):
        raise BadInput(f"layer.straight_through={straight!r} is not a boolean: pass true or false")
    cf = OmegaConf.select(cfg, "layer.capacity_factor", default=None)
    if cf is not None:
        cf = require_number(cfg, "layer.capacity_factor", positive=True)
    sizes = LayerSizes(
        d_model=require_int(cfg, "d_model", 1), d_hidden=require_int(cfg, "d_hidden", 1), n_experts=n_experts,
        top_k=top_k, score_func=score_func, n_group=require_int(cfg, "layer.n_group", 1),
        topk_group=require_int(cfg, "layer.topk_group", 1),
        routed_scaling_factor=require_number(cfg, "layer.routed_scaling_factor", positive=True),
        norm_topk_prob=norm, shared_hidden=require_int(cfg, "layer.shared_hidden", 1),
        bias_scale=require_number(cfg, "layer.bias_scale", minimum=0.0), capacity_factor=cf,
        straight_through=straight,
    )
    lacks = cfg.get("lacks") or ()
    if isinstance(lacks, str):
        lacks = [lacks]
    if not isinstance(lacks, (list, tuple, ListConfig)):
        raise BadInput(f"lacks={lacks!r} is not a list: pass e.g. lacks=[fp16] (or lacks=[] for none)")
    precisions = {key: OmegaConf.select(cfg, f"layer.{key}", default=None) for key in ("router_dtype", "expert_dtype")}
    decl = capabilities.declared(config_lacks=[str(v) for v in lacks],
                                 config_precisions={k: v for k, v in precisions.items()})  # validates, one line
    names = {"router_dtype": "router", "expert_dtype": "experts"}
    mixing = route_layer.mixing_form(OmegaConf.select(cfg, "layer.mixing", default=None), "layer.mixing")
    return LayerSettings(impl=None if impl is None else impl.strip(), sizes=sizes,
                         batch=require_int(cfg, "layer.batch", 2), seq=require_int(cfg, "layer.seq", 1),
                         lacks=tuple(sorted(decl.lacks)), router_dtype=decl.precisions.get(names["router_dtype"]),
                         expert_dtype=decl.precisions.get(names["expert_dtype"]), mixing=mixing)


def run(s: Settings, rec: Recorder) -> None:
    """The layer battery; then, for the package's own layer, the course case and the training simulation."""
    import torch

    from tfmoe.rules.memory import available_memory_bytes

    if s.ep.size > 1:  # expert parallelism: W ranks under torch.distributed.run (route_sim/expert_parallel.py)
        route_ep.run_ep(s, rec)
        return
    # on the run's own device (a CUDA run's memory is not the host's)
    refuse_oversized(s, "fp64" if rec.dtype == torch.float64 else "fp32", available_memory_bytes(rec.device),
                     f"{rec.device}'s")
    lut = route_layer.run_battery(s.layer, rec)
    route_layer.battery_rows(rec, lut.label).print_to(rec.console)
    if s.layer.impl is not None:  # a user's or a transformers layer: the battery is the whole run
        rec.summary(route_layer.battery_summary(rec, lut))
        return
    rec.note("aux loss normalisation: alpha*E*sum_i f_i*P_i with f_i = load_i/(tokens*k) (balanced value alpha, "
             "Megatron-LM form; HF Mixtral's is k*alpha); CV uses the population std over experts")
    rec.note("capacity priority: 1st choices in token order, then 2nd choices, ...; dropped assignments "
             "contribute 0 to the mixture and the layer outputs x + mixture (a fully dropped token passes "
             f"through unchanged); training simulation in fp32 with {s.dispatch} dispatch")
    course = route_course.course_case(s, rec)
    traces: dict[str, StrategyTrace] = {}
    if s.steps > 0:
        traces = route_training.train_strategies(s, rec)
        route_training.check_training(s, rec, traces)
        for name, fig in training_plots(traces, s.n_experts, s.train_tokens, s.top_k).items():
            rec.plot(name, fig)
        route_training.strategies_rows(s, traces).print_to(rec.console)
    rec.summary(route_layer.battery_summary(rec, lut) + "\n\n" + summary(s, course, traces))


def summary(s: Settings, course: CourseResult, traces: dict[str, StrategyTrace]) -> str:
    """summary.md's course-case and training sections."""
    cap = course.capacity if course.capacity is not None else "none (dropless)"
    lines = [
        f"## Course case: {s.tokens} tokens, {s.n_experts} experts, top-{s.top_k}, {s.score_func} router",
        "",
        f"Loads (assignments per expert, before capacity): {course.load.tolist()}; kept: "
        f"{course.processed.tolist()}; capacity {cap}.",
        f"CV {course.cv:.4f}, MaxVio {course.maxvio:.4f}, dropped fraction {course.dropped_fraction:.4f}, "
        f"Switch aux loss {course.balance_loss:.6f} (balanced value {s.aux_loss_coef:g}).",
        "",
    ]
    if traces:
        lines += [
            f"## Training simulation: {s.steps} steps x {s.train_tokens} tokens, init_skew {s.init_skew:g}",
            "",
            "Mean over the last 10% of steps (CV also at the first step):",
            "",
            route_training.strategies_rows(s, traces).markdown(),
            "",
            "dropped: fraction of assignments over capacity; tokens dropped: fraction of tokens with all k "
            "assignments dropped (their output is their input). balance_loss is the Switch aux loss measured "
            "under every strategy; it is trained on only under `aux_loss`.",
        ]
    return "\n".join(lines)


def serve_peer(cfg: DictConfig) -> int | None:
    """In a non-zero task of a SLURM step running route-sim ``ep_size=W``: serve as that task's rank of task 0's run
    and return the exit code; None in every other process (the harness's hook, ``ep_slurm.serve_peer``)."""
    return route_ep_slurm.serve_peer(cfg, settings)


__all__ = ["Settings", "settings", "run", "sweep_plots", "layer_settings", "summary", "tag_values", "serve_peer",
           "check_tasks"]


def tag_values(s: Settings) -> dict[str, tuple[str, ...]]:
    """The tag values a run with these settings records: the training simulation's strategies (none for a user's
    or a transformers layer, or steps=0). An expectation naming another is refused before the run."""
    trains = s.layer.impl is None and s.steps > 0 and (s.ep.size == 1 or s.ep.impl is None)
    if trains and s.ep.size > 1:  # expert-parallel training runs the strategies it supports
        return {"strategy": tuple(route_ep.trained_strategies(s))}
    return {"strategy": tuple(s.strategies) if trains else ()}
