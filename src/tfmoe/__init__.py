"""tfmoe: a lab notebook for checking Transformer and Mixture-of-Experts claims.

Public Python API (no torch import at package import time):

    from tfmoe import load_run, load_tensor, load_tensors
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__", "load_run", "load_tensor", "load_tensors"]


def __getattr__(name: str):  # lazy: keep `import tfmoe` (and the CLI) free of torch/pandas
    if name in {"load_run", "load_tensor", "load_tensors"}:
        from tfmoe.harness.store import notebook

        return getattr(notebook, name)
    raise AttributeError(name)
