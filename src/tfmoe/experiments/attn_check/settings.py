"""The two batteries' settings, built and validated by the recipe's ``settings(cfg)``
(:mod:`tfmoe.experiments.attn_check`, whose ``Settings`` holds one of them): frozen, typed, already resolved."""

from __future__ import annotations

from dataclasses import dataclass

from tfmoe.experiments.attn_check.kernel_cases import Case


@dataclass(frozen=True)
class ModuleSettings:
    """Module mode (``impl=``): the layer under test, the main case and what each check group reads."""

    impl: str
    B: int
    T: int
    d_model: int
    n_heads: int
    causal: bool
    lengths: tuple[int, ...]  # valid length per batch row (right padding)
    dropout: float
    mode: str  # full | chunked
    head_counts: tuple[int, ...]
    gradcheck_T: int
    dropout_samples: int
    chunked_impl: str
    block_size: int
    probe_T: int
    probe_heads: int
    probe_d_head: int
    probe_block_size: int
    memory_ratio_max: float
    timing_repeats: int
    groups: tuple[str, ...]  # the check groups to run (checks=...)
    n_kv_heads: int  # already resolved: n_heads when the config leaves it null
    hf_attn_implementation: str  # eager | sdpa
    fully_masked_policy: str  # one of FULLY_MASKED_POLICIES
    padded_query_policy: str = "any"  # one of PADDED_QUERY_POLICIES: what padded query rows must give
    lacks: tuple[str, ...] = ()  # the config's lacks=[...] (tfmoe.rules.capabilities.FEATURES)
    compute_dtype: str | None = None  # the config's compute_dtype (a tfmoe.rules.capabilities.PRECISIONS name)
    lengths_given: bool = False  # lengths= was set (else the default padding, dropped for a layer without padding)

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class KernelSettings:
    """Kernel mode (``kernel=SPEC``): the kernel's spec, its causal convention and the case matrix."""

    spec: str
    causal_align: str | None  # None = the kernel's own convention
    B: int
    Hq: int
    cases: tuple[Case, ...]
    fully_masked_expect: dict[str, tuple[str, ...]]  # per kind of row that sees no key (kernel_cases.ROW_KINDS)
    backward: bool
    grad_factor: float
    module_keys_set: bool  # impl= is set too (kernel mode ignores the module-mode keys: a note says so)
    threads: int | None  # the harness's intra-op threads key: None -> the battery runs on 1 thread on CPU
    dropout_seeds: int = 2  # torch seeds of the dropout family's probe
    lacks: tuple[str, ...] = ()  # the config's top-level lacks=[...] (tfmoe.rules.capabilities), read in kernel mode too


@dataclass(frozen=True)
class Settings:
    """attn-check's settings: one battery's. ``kernel=SPEC`` selects the kernel battery, else the module one."""

    battery: ModuleSettings | KernelSettings
