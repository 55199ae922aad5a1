"""The experiments `tfmoe` knows: CLI name -> Hydra config name, module and one-line help.

Kept free of heavy imports: `tfmoe --help` reads this without importing torch.
Each module `tfmoe.experiments.<module>` defines ``run(cfg: DictConfig, rec: Recorder) -> None``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Experiment:
    name: str  # CLI subcommand, also the folder under runs/
    config: str  # conf/<config>.yaml
    module: str  # tfmoe.experiments.<module>
    help: str


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
