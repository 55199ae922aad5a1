"""complexity's settings, built and validated by the recipe's ``settings(cfg)`` (:mod:`tfmoe.experiments.complexity`): frozen, typed, already resolved."""

from __future__ import annotations

from dataclasses import dataclass

from tfmoe.components import complexity_model as cm


@dataclass(frozen=True)
class Settings:
    """Every value a complexity run reads, validated by :func:`settings`."""

    dtype: str  # the run's dtype name (a key of DTYPE_BYTES)
    dtype_bytes: int
    groups: tuple[tuple[int, int], ...]  # (T, D) pairs, measured in order
    H: int
    d_ff: int | None
    B: int
    n_layers: int
    vocab: int
    n_experts: int
    top_k: int
    min_run_time: float
    warmup: int
    peak_matmul_n: int
    memory_fraction: float
    threads: int | None

    def shape(self, T: int, D: int) -> cm.BlockShape:
        return cm.BlockShape(B=self.B, T=T, D=D, H=self.H, d_ff=self.d_ff)
