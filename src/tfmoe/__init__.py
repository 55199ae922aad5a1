"""tfmoe: a lab notebook for checking Transformer and Mixture-of-Experts claims.

Public Python API (nothing heavy is imported until a name is used: ``import tfmoe`` and the CLI stay torch-free):

    from tfmoe import load_run, load_tensor, load_tensors             # read a run directory
    from tfmoe import check_attention, check_kernel, check_moe         # judge your own layer -> Verdict
    from tfmoe import check_model, assert_model_conforms               # judge your whole causal LM
    from tfmoe import assert_attention_conforms, assert_kernel_conforms, assert_moe_conforms
    from tfmoe import Verdict, CheckResult, BadInput, BadSettings

See docs/checking-your-own-layers.md ("From Python and pytest"). Names not listed here are private.
"""

from __future__ import annotations

__version__ = "0.1.0"

_NOTEBOOK = ("load_run", "load_tensor", "load_tensors")
_CHECKS = ("check_attention", "check_kernel", "check_moe", "check_model", "assert_attention_conforms",
           "assert_kernel_conforms", "assert_moe_conforms", "assert_model_conforms", "Verdict", "CheckResult",
           "BadSettings")

__all__ = ["__version__", *_NOTEBOOK, *_CHECKS, "BadInput"]

def __getattr__(name: str):  # lazy: keep `import tfmoe` (and the CLI) free of torch/pandas
    if name in _NOTEBOOK:
        from tfmoe.harness.store import notebook

        return getattr(notebook, name)
    if name in _CHECKS:
        from tfmoe.api import checking as checks

        return getattr(checks, name)
    if name == "BadInput":
        from tfmoe.contract.errors import BadInput

        return BadInput
    raise AttributeError(name)
