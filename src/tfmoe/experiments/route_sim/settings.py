"""route-sim's settings, built and validated by the recipe's ``settings(cfg)`` (:mod:`tfmoe.experiments.route_sim`): frozen, typed, already resolved."""

from __future__ import annotations

from dataclasses import dataclass

from tfmoe.adapters.moe_layers import LayerSizes


@dataclass(frozen=True)
class LayerSettings:
    """The battery's part of route-sim's Settings (validated by ``route_sim.settings``)."""

    impl: str | None  # null = the package's own layer, hf:<type>, or pkg.module:Class
    sizes: LayerSizes
    batch: int
    seq: int
    lacks: tuple[str, ...] = ()  # config `lacks`: features the layer declares it lacks (tfmoe.rules.capabilities)
    router_dtype: str | None = None  # config `layer.router_dtype`: the precision its combine weights carry
    expert_dtype: str | None = None  # config `layer.expert_dtype`: the precision its experts compute in
    mixing: str | None = None  # config `layer.mixing`: where the combine weight is applied (route_sim.layer.MIXING)


@dataclass(frozen=True)
class EPSettings:
    """Expert parallelism (``ep_size`` >= 2: route_sim/expert_parallel.py); size 1 runs on one process."""

    size: int = 1  # W ranks
    impl: str | None = None  # null = the package's ExpertParallelMoE, or pkg.module:Class (ToyMoE + group=)
    steps: int = 3  # forward+backward steps per rank
    timeout_s: float = 60.0  # every collective's timeout
    sim_ranks: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512, 1024)  # W the scaling model extrapolates to
    link_gbps: float = 100.0  # the model's link bandwidth per rank (Gbit/s)
    latency_us: float = 10.0  # ...and latency per message (microseconds)


@dataclass(frozen=True)
class Settings:
    """Every value a route-sim run reads, validated by :func:`settings`."""

    tokens: int  # the course case's batch
    n_experts: int
    top_k: int
    capacity_factor: float | None  # None: dropless
    score_func: str
    d_model: int
    d_hidden: int
    dispatch: str  # the training simulation's dispatch (the course case runs both)
    strategies: tuple[str, ...]
    steps: int  # 0 skips the training simulation
    train_tokens: int
    clusters: int
    init_skew: float
    lr: float
    aux_loss_coef: float
    z_loss_coef: float
    bias_update_rate: float
    layer: LayerSettings  # the layer battery's
    expect_divergence: bool = False  # a stress test: the training simulation must go non-finite (tfmoe.rules.finite)
    ep: EPSettings = EPSettings()  # expert parallelism (ep_size)
