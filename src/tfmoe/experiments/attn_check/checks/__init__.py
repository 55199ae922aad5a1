"""The module battery's check groups, one module each, named as ``checks=[...]`` names them.

Every group is a function ``check_<...>(layer)`` of :class:`~tfmoe.experiments.attn_check.layer.LayerUnderTest` that
records its checks on ``layer.rec``; ``shapes`` always runs first (it is the main forward the others read).
"""

GROUPS = ("masks", "sdpa", "fully_masked", "gradients", "kv_cache", "chunked", "invariances", "dropout")
