"""The Hugging Face attention zoo: every self-attention model type of the installed transformers 5.x, with its verdict.

Model types come from transformers' own registry (``CONFIG_MAPPING``); a type is a self-attention type when its
modeling module has a ``<Prefix>Attention`` / ``<Prefix>SelfAttention`` class (the config class's name less
"Config"). Each is built from a tiny config (nothing downloaded) by ``impl=hf:<type>``'s own adapter:

- refused by name: the adapter's exit-2 line (q/k norm, softcap, fused qkv, partial rotary, …, or "not vetted");
- vetted (``tfmoe.adapters.huggingface.VETTED``): judged by real ``tfmoe attn-check`` runs, one Hydra sweep per
  shape family (GQA for the Llama layout), eager and sdpa; the verdict is what their checks say.

:func:`classify` is the pure part the tests use; :func:`section` runs the sweeps (minutes) for ``scripts/zoo.py``.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

TITLE = "Hugging Face attention layers (impl=hf:<model_type>)"
SIZES = ["d_model=16", "n_heads=4", "T=6", "seed=0", "chunked.probe_T=256", "chunked.probe_block_size=16",
         "chunked.timing_repeats=1", "dropout_samples=20000", "gradcheck_T=2", "chunked.memory_ratio_max=0.35"]
ROOT = Path(__file__).resolve().parents[1]
RUNS = Path(os.environ.get("TFMOE_ZOO_RUNS", ROOT / "runs"))  # the sweeps' runs stay under RUNS/zoo-hf-<UTC>/


@dataclass(frozen=True)
class Entry:
    model_type: str
    attention: str  # the attention class's name
    verdict: str  # vetted | refused
    reason: str = ""  # why refused (the adapter's exit-2 line, less the fix)
    layout: str = ""
    rope: str = ""


def attention_types() -> dict[str, str]:
    """model_type -> its attention class's name, for every type in CONFIG_MAPPING whose modeling module has one."""
    import torch.nn as nn
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from tfmoe.adapters.huggingface import attention_class

    out = {}
    for model_type in sorted(CONFIG_MAPPING.keys()):
        try:
            config_cls = CONFIG_MAPPING[model_type]
        except Exception:  # a lazily imported config that cannot import here (missing optional dependency)
            continue
        package = config_cls.__module__.rsplit(".", 1)[0]
        try:
            modeling = importlib.import_module(f"{package}.modeling_{package.rsplit('.', 1)[1]}")
        except Exception:
            continue
        cls = attention_class(modeling, config_cls)
        if cls is not None and issubclass(cls, nn.Module):
            out[model_type] = cls.__name__
    return out


def classify(model_type: str, attention: str = "") -> Entry:
    """Build ``hf:<model_type>``'s layer the way attn-check does (GQA where the config has kv heads) and say
    whether the adapter takes it (vetted) or refuses it, with the adapter's own reason."""
    import torch

    from tfmoe.adapters.huggingface import VETTED, HuggingFace
    from tfmoe.contract.errors import BadInput

    try:
        adapter = HuggingFace(model_type)
        vetted = VETTED.get(model_type)
        kv = 2 if vetted is None or vetted.layout == "llama" else 4
        causal = vetted is None or False not in vetted.causal  # an encoder's row (or bert's) is judged causal=false
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                adapter.build(16, 4, n_kv_heads=kv, causal=causal, dropout=0.0, seed=0, dtype=torch.float32,
                              device=torch.device("cpu"))
            except BadInput as exc:
                if "no num_key_value_heads" not in str(exc):
                    raise
                adapter.build(16, 4, n_kv_heads=4, causal=causal, dropout=0.0, seed=0, dtype=torch.float32,
                              device=torch.device("cpu"))
    except BadInput as exc:
        reason = str(exc).removeprefix(f"impl=hf:{model_type}: ")
        reason = reason.split(": attn-check cannot judge")[0].split(": pick a model type")[0]
        return Entry(model_type, attention, "refused", reason)
    except Exception as exc:  # the tiny config itself cannot be built: refused, with transformers' reason
        return Entry(model_type, attention, "refused",
                     f"its tiny config cannot be built ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})")
    assert vetted is not None
    return Entry(model_type, attention, "vetted", layout=vetted.layout, rope=vetted.rope or "")


def eager_only(model_type: str) -> bool:
    """Whether the model declares _supports_sdpa=False (impl=hf: then refuses hf.attn_implementation=sdpa)."""
    from tfmoe.adapters.huggingface import HuggingFace, sdpa_declared_false

    adapter = HuggingFace(model_type)
    return bool(sdpa_declared_false(adapter.modeling, adapter.config_cls))


def refusal_kind(reason: str) -> str:
    """A short name for a refusal reason (the zoo's counts)."""
    for key, kind in (("q/k norm", "q/k norm"), ("softcapping", "logit softcapping"), ("fused qkv", "fused qkv"),
                      ("partial RoPE", "partial rotary"), ("scaled RoPE", "scaled RoPE"),
                      ("non-standard scale", "non-standard scale"), ("NoPE", "NoPE / sliding-window-only RoPE"),
                      ("no rotary position_embeddings", "no RoPE inside attention"), ("ALiBi", "ALiBi"),
                      ("relative position", "relative positions"), ("clipping", "q/k/v clipping"),
                      ("scale other than", "non-standard scale"), ("not vetted", "not vetted yet"),
                      ("extra parameters", "extra parameters"), ("layout this adapter does not know", "other layout"),
                      ("required positional argument", "other layout (constructor)"),
                      ("tiny config cannot be built", "tiny config not buildable"),
                      ("is an encoder's", "encoder run as a decoder"),
                      ("approximate attention", "approximate attention"),
                      ("block-sparse attention", "block-sparse attention"),
                      ("position biases added", "position biases"), ("position scores inside", "position biases"),
                      ("no attention mask", "no attention mask"),
                      ("separate query/key/value inputs", "not a plain self-attention call"),
                      ("separate from/to inputs", "not a plain self-attention call"),
                      ("a cross-attention signature", "not a plain self-attention call"),
                      ("2-D RoPE", "2-D / multimodal RoPE"), ("multimodal RoPE", "2-D / multimodal RoPE"),
                      ("RoPE over attention heads", "RoPE over heads"), ("attention sinks", "attention sinks"),
                      ("per-layer-type RoPE", "per-layer-type RoPE"),
                      ("does not repeat kv heads", "eager path without repeat_kv"),
                      ("inputs beyond the mask", "inputs the adapter does not supply"),
                      ("no num_key_value_heads", "other layout")):
        if key in reason:
            return kind
    return "other"


def sweep(impls: list[str], extra: list[str], runs: Path,
          attns: tuple[str, ...] = ("eager", "sdpa")) -> dict[str, tuple[str, str, list[str]]]:
    """One ``tfmoe attn-check -m impl=...`` sweep (eager and sdpa): (impl, attn) -> (run id, status, failed)."""
    import pandas as pd

    args = [str(Path(sys.executable).parent / "tfmoe"), "attn-check", "-m", f"impl={','.join(impls)}",
            f"hf.attn_implementation={','.join(attns)}", *SIZES, *extra]
    subprocess.run(args, cwd=runs, env={**os.environ, "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True,
                   check=False)
    out = {}
    for run in sorted(runs.glob("runs/**/run.parquet")):
        meta = pd.read_parquet(run).iloc[0]
        overrides = dict(o.replace("\\:", ":").split("=", 1) for o in meta["overrides"])
        key = (overrides["impl"], overrides["hf.attn_implementation"])
        checks = pd.read_parquet(run.parent / "checks.parquet") if (run.parent / "checks.parquet").exists() else None
        failed = [] if checks is None else list(checks.loc[~checks["passed"], "check"])
        out[key] = (str(meta["run_id"]), str(meta["status"]), failed)
    return out


def section() -> tuple[str, dict[str, int]]:
    import transformers

    from tfmoe.adapters.huggingface import VETTED, takes_kv_heads

    entries = [classify(t, a) for t, a in attention_types().items()]
    vetted = [e for e in entries if e.verdict == "vetted"]
    results: dict[tuple[str, str], tuple[str, str, list[str]]] = {}
    where = RUNS / f"zoo-hf-{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}"  # kept: the run ids below are its runs
    groups: dict[tuple[str, ...], list[str]] = {}  # one sweep per shape family, causal setting and implementations
    for e in vetted:
        row = VETTED[e.model_type]
        extra = (["n_kv_heads=2"] if row.layout == "llama" and takes_kv_heads(e.model_type) else []) + (
            ["causal=false"] if False in row.causal else [])
        attns = ("eager",) if eager_only(e.model_type) else ("eager", "sdpa")
        groups.setdefault((row.layout, ",".join(attns), *extra), []).append(f"hf:{e.model_type}")
    for (layout, attns, *extra), impls in sorted(groups.items()):
        name = "-".join([layout, attns.replace(",", "+"), *(x.replace("=", "") for x in extra)])
        (where / name).mkdir(parents=True, exist_ok=True)
        results.update(sweep(impls, extra, where / name, tuple(attns.split(","))))
    rows, counts = [], Counter()
    for e in entries:
        if e.verdict == "refused":
            kind = refusal_kind(e.reason)
            counts[f"refused: {kind}"] += 1
            rows.append(f"| `{e.model_type}` | {e.attention} | refused ({kind}) | {e.reason} | |")
            continue
        attns = ("eager",) if eager_only(e.model_type) else ("eager", "sdpa")
        judged = [results.get((f"hf:{e.model_type}", a)) for a in attns]
        ok = all(j is not None and j[1] == "ok" for j in judged)
        counts["passes" if ok else "FALSE ALARM"] += 1
        ids = ", ".join(j[0] for j in judged if j is not None)
        failed = "; ".join(f"{a}: {j[1]} {', '.join(j[2])}" for a, j in zip(attns, judged, strict=True)
                           if j is not None and j[1] != "ok")
        row = VETTED[e.model_type]
        what = ", ".join([f"{e.layout}, RoPE {e.rope}" if e.rope else e.layout,
                          *(["encoder (causal=false only)"] if row.causal == (False,) else []),
                          *(["eager only (_supports_sdpa=False)"] if len(attns) == 1 else []),
                          *(["extended mask"] if row.mask == "extended" else [])])
        rows.append(f"| `{e.model_type}` | {e.attention} | {'passes' if ok else '**fails**'} | {what}"
                    f"{'; ' + failed if failed else ''} | {ids} |")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    head = (f"transformers {transformers.__version__}: {len(entries)} of CONFIG_MAPPING's {len(list(CONFIG_MAPPING.keys()))} "
            "model "
            "types have a self-attention class in their modeling module; "
            f"{len(VETTED)} vetted rows in `tfmoe.adapters.huggingface.VETTED`. Vetted types are judged by "
            f"`tfmoe attn-check -m impl=hf:<type>,... hf.attn_implementation=eager,sdpa {' '.join(SIZES)}` "
            f"(n_kv_heads=2 for the Llama layout, causal=false for bert and the encoders, eager only where the model "
            f"declares _supports_sdpa=False), every check group; the run ids are those "
            f"sweeps' jobs, kept under `{where.relative_to(ROOT) if ROOT in where.parents else where}/<layout>/runs/`.")
    table = ["| model type | attention class | verdict | layout / reason | run ids (eager, sdpa) |",
             "|---|---|---|---|---|", *rows]
    return "\n".join([head, "", *table]), dict(sorted(counts.items()))
