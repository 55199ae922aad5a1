"""The experiments `tfmoe` knows: CLI name -> Hydra config name, module and one-line help.

Kept free of heavy imports: `tfmoe --help` reads this without importing torch.

Every experiment is a package ``tfmoe.experiments.<module>`` (its recipe is the package's ``__init__``, its
settings types are in ``settings.py``, one module per concern beside them) and keeps one contract, :class:`ExperimentModule`:

- ``Settings``: a frozen dataclass holding every value the run reads, typed and already validated;
- ``settings(cfg) -> Settings``: builds it once from the composed Hydra config, raising ``BadInput`` (exit 2) with
  one line naming the key and the fix. It imports no user code, touches no device and writes nothing, so a sweep can
  validate every job's settings before any job starts;
- ``run(settings, rec) -> None``: computes and hands every record to ``rec`` (the notebook layer writes them);
- optionally ``sweep_plots(df) -> dict[str, Figure]``: figures drawn from a finished sweep's sweep.parquet;
- optionally ``tag_values(settings) -> dict[str, tuple]``: the values of those metric tags that the settings fix
  before the run (route-sim's strategies, complexity's T and D); an expectation selecting another value is refused
  before anything runs. A tag left out is only known at the end, where a wrong value is named.

``Experiment.load()`` imports the module (torch comes with it) and returns it under that contract.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast


class ExperimentModule(Protocol):
    """What the harness needs of an experiment module (see the module docstring)."""

    Settings: type

    def settings(self, cfg: Any) -> Any: ...

    def run(self, settings: Any, rec: Any) -> None: ...


@dataclass(frozen=True)
class Experiment:
    name: str  # CLI subcommand, also the folder under runs/
    config: str  # conf/<config>.yaml
    module: str  # tfmoe.experiments.<module>
    help: str

    def load(self) -> ExperimentModule:
        """The experiment's module (imports torch)."""
        return cast(ExperimentModule, importlib.import_module(f"tfmoe.experiments.{self.module}"))

    def sweep_plots(self) -> Callable[[Any], dict[str, Any]] | None:
        """The module's optional ``sweep_plots(df)``."""
        return getattr(self.load(), "sweep_plots", None)


EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in [
        Experiment("tokenize", "tokenize", "tokenize",
                   "Compare real tokenizers on Chinese, English, code and numbers (§2.1)."),
        Experiment("attn-check", "attn_check", "attn_check",
                   "Check a multi-head attention module: masks, dtypes, KV cache, chunked attention (§2.2)."),
        Experiment("arch", "arch", "arch",
                   "Encoder / decoder / encoder-decoder data flow and visibility matrices (§2.3)."),
        Experiment("block-stats", "block_stats", "block_stats",
                   "Activations and gradients through Transformer blocks: Pre/Post-Norm, LN/RMSNorm (§2.4)."),
        Experiment("shift-labels", "shift_labels", "shift_labels",
                   "Next-token labels: shifting, padding, ignore_index and padding invariance (§2.5)."),
        Experiment("decode", "decode", "decode",
                   "Decoding strategies and the KV cache on a tiny trained causal LM (§2.5, §2.8)."),
        Experiment("route-sim", "route_sim", "route_sim",
                   "MoE routing: top-k, loads, CV, MaxVio, capacity, balancing strategies (§2.6)."),
        Experiment("complexity", "complexity", "complexity",
                   "Parameters, FLOPs and memory of a block: analytic, counted and measured (§2.7)."),
    ]
}
