"""Fake-device audit: run one experiment with its device tensors presented as non-CPU, logging every host/device mix.

Without a GPU, a CUDA path can still be read for the one bug class the first GPU run found (F-210, F-214): a tensor
made on the host without ``device=`` and combined with device tensors. Tensors "on the device" are wrapper
subclasses reporting device ``meta`` and holding real CPU data, so the experiment computes real numbers. Any aten op
mixing such a tensor with a host tensor of dim > 0 (except what CUDA allows across devices: indexing with host
indices, ``copy_``, ``.to``) is logged with the project's stack frames, as is ``.numpy()`` on a device tensor and a
random generator whose device differs from its op's. Code under ``device.type == "cuda"`` does not run (read it).
A developer's tool on torch's private dispatch hooks (``_make_wrapper_subclass``, ``TorchDispatchMode``); not in CI.

    .venv/bin/python scripts/fake_device_audit.py arch
    .venv/bin/python scripts/fake_device_audit.py shift-labels pad_side=left

Exit 1 if any mix was logged. Known harness artefacts: complexity's ``activation_bytes_match`` (the wrappers have no
real storage) and ``route-sim impl=hf:qwen2_moe`` (transformers' own non-CPU branch).
"""

from __future__ import annotations

import collections
import sys
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

DEV = torch.device("meta")
ROOT = str(Path(__file__).resolve().parents[1]) + "/"
SRC = ROOT + "src/"
VIOL = collections.OrderedDict()

def where():
    fr = [f for f in traceback.extract_stack() if SRC in f.filename]
    return tuple(f"{f.filename.replace(ROOT, '')}:{f.lineno} {f.name}: {(f.line or '').strip()}" for f in fr[-5:])

def log(kind, msg):
    key = (kind, where())
    if key not in VIOL:
        VIOL[key] = msg

def _is_dev(d):
    if d is None or not isinstance(d, (torch.device, str)):
        return False
    try:
        return torch.device(d).type in ("meta", "cuda")
    except Exception:
        return False

class FC(torch.Tensor):
    @staticmethod
    def __new__(cls, inner):
        assert inner.device.type == "cpu", inner.device
        r = torch.Tensor._make_wrapper_subclass(cls, inner.shape, strides=inner.stride(), dtype=inner.dtype,
              device=DEV, requires_grad=inner.requires_grad, storage_offset=inner.storage_offset())
        r.inner = inner
        return r
    def __repr__(self):
        return f"FC({self.inner!r})"
    __torch_function__ = torch._C._disabled_torch_function_impl
    def tolist(self):
        return self.inner.tolist()
    def __format__(self, spec):
        return self.inner.__format__(spec)
    def numpy(self, *a, **k):
        log("numpy", "Tensor.numpy() on a device tensor")
        return self.inner.numpy(*a, **k)
    def __array__(self, *a, **k):
        log("numpy", "np.asarray/__array__ on a device tensor")
        return self.inner.__array__(*a, **k)
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return handle(func, args, kwargs)

def wrap(out):
    return tree_map(lambda t: FC(t) if isinstance(t, torch.Tensor) and not isinstance(t, FC) else t, out)


def unw(t):
    return t.inner if isinstance(t, FC) else t

ALLOWED = {"index", "_index_put_impl_", "index_put", "index_put_", "copy_", "_to_copy", "copy", "lift_fresh",
           "detach", "alias", "_has_compatible_shallow_copy_type", "set_", "_local_scalar_dense"}

def handle(func, args, kwargs):
    kwargs = dict(kwargs or {})
    name = str(func.overloadpacket.__name__) if hasattr(func, "overloadpacket") else str(func)
    flat, _ = tree_flatten((args, kwargs))
    fcs = [t for t in flat if isinstance(t, FC)]
    cpus = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, FC) and t.dim() > 0]
    metas = [t for t in flat if isinstance(t, torch.Tensor) and not isinstance(t, FC) and t.device.type == "meta"]
    if metas:
        log("harness", f"aten.{name}: a REAL meta tensor reached an op (harness gap)")
    to_dev = _is_dev(kwargs.get("device"))
    if to_dev:
        kwargs["device"] = torch.device("cpu")
        if name != "_to_copy" and fcs and cpus:
            log("mix", f"aten.{name}(device=cuda): device {[tuple(t.shape) for t in fcs]} with CPU {[tuple(t.shape) for t in cpus]}")
        return wrap(func(*tree_map(unw, args), **tree_map(unw, kwargs)))
    if fcs and cpus and name not in ALLOWED:
        log("mix", f"aten.{name}: device {[tuple(t.shape) for t in fcs]} with CPU {[tuple(t.shape) for t in cpus]}")
    if name in ("index", "index_put", "index_put_", "_index_put_impl_") and fcs and not isinstance(args[0], FC):
        log("mix", f"aten.{name}: a CPU tensor indexed with device indices / given device values")
    if name in ("index_put", "index_put_", "_index_put_impl_") and isinstance(args[0], FC):
        vals = args[2] if len(args) > 2 else kwargs.get("values")
        if isinstance(vals, torch.Tensor) and not isinstance(vals, FC) and vals.dim() > 0:
            log("mix", f"aten.{name}: a device tensor given CPU values {tuple(vals.shape)}")
    out = func(*tree_map(unw, args), **tree_map(unw, kwargs))
    if name == "_local_scalar_dense":
        return out
    if name == "_to_copy":
        dev = kwargs.get("device")
        if dev is not None and torch.device(dev).type == "cpu":
            return out
    if not fcs:
        return out
    return wrap(out)

class FCMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return handle(func, args, kwargs)

class FnMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.tensor, torch.as_tensor, torch.asarray, torch.scalar_tensor) and _is_dev(kwargs.get("device")):
            kwargs["device"] = "cpu"
            a = tree_map(unw, args)
            return wrap(func(*a, **kwargs))
        gen = kwargs.get("generator")
        if gen is not None:
            flat, _ = tree_flatten((args, kwargs))
            on_dev = any(isinstance(t, FC) for t in flat) or _is_dev(kwargs.get("device"))
            if on_dev != bool(getattr(gen, "_fake_dev", False)):
                log("gen", f"{getattr(func, '__name__', func)}: generator on {'cuda' if getattr(gen, '_fake_dev', False) else 'cpu'}, op on {'cuda' if on_dev else 'cpu'}")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and isinstance(args[0], FC):
            def fix(ix):
                if isinstance(ix, list):
                    return torch.tensor(ix)
                if isinstance(ix, tuple):
                    return tuple(fix(i) for i in ix)
                return ix
            a = list(args)
            a[1] = fix(a[1])
            if func is torch.Tensor.__setitem__ and isinstance(a[2], (bool, int, float)):
                a[2] = torch.tensor(a[2], dtype=args[0].dtype)
            return func(*a, **kwargs)
        if func is torch.Tensor.type_as and len(args) > 1 and isinstance(args[1], FC) and not isinstance(args[0], FC):
            return FC(args[0].to(args[1].dtype))
        return func(*args, **kwargs)

_RealGen = torch.Generator
class FakeGen(_RealGen):
    def __new__(cls, device="cpu"):
        return _RealGen.__new__(cls, "cpu")
    def __init__(self, device="cpu"):
        self._fake_dev = _is_dev(device)
    @property
    def device(self):
        return DEV if self._fake_dev else torch.device("cpu")

def install():
    torch.__future__.set_swap_module_params_on_conversion(True)
    torch.inference_mode = lambda *a, **k: torch.no_grad()
    torch.Generator = FakeGen
    FnMode().__enter__()
    FCMode().__enter__()

def report(out=sys.stdout):
    for (kind, frames), msg in VIOL.items():
        print(f"[{kind}] {msg}", file=out)
        for f in frames:
            print("     ", f, file=out)


def main() -> int:
    """Run one experiment under the fake device; print its violations. Exit 1 if any."""
    if len(sys.argv) < 2:
        print(__doc__.splitlines()[0] + "\nusage: python scripts/fake_device_audit.py EXPERIMENT [overrides...]")
        return 2
    from tfmoe.api.testing import compose
    from tfmoe.contract.recorder import Recorder
    from tfmoe.contract.registry import EXPERIMENTS
    from tfmoe.contract.runtime import resolve_dtype, seed_everything
    from tfmoe.harness.launching.runner import run_module

    exp, overrides = sys.argv[1], sys.argv[2:]
    cfg = compose(exp, overrides)
    seed_everything(int(cfg.seed))
    rec = Recorder(cfg=cfg, device=DEV, dtype=resolve_dtype(cfg.dtype, torch.device("cpu")), seed=int(cfg.seed))
    install()
    try:
        run_module(EXPERIMENTS[exp], cfg, rec)
        print("run finished")
    except BaseException as e:  # noqa: BLE001 - reported with the project's frames
        print("run raised:", type(e).__name__, str(e)[:500])
        for f in traceback.extract_tb(e.__traceback__)[-25:]:
            print("   ", f.filename.replace(ROOT, ""), f.lineno, f.name, (f.line or "").strip())
    print("==== host/device mixes")
    report()
    return 1 if VIOL else 0


if __name__ == "__main__":
    sys.exit(main())
