"""The batteries as a Python API: judge your own attention layer, attention kernel or MoE layer inside a test.

    import tfmoe

    tfmoe.assert_attention_conforms(MyAttention, profile="quick")      # raises AssertionError with the table
    verdict = tfmoe.check_kernel(my_attention_fn, dtype="bf16")         # a Verdict: .passed, .failed, .table()
    tfmoe.assert_moe_conforms(MyMoE, n_experts=4, top_k=2, layer={"seq": 8})

Keyword arguments are the CLI's config keys (``tfmoe attn-check --cfg job`` / ``tfmoe route-sim --cfg job`` list
them); a nested key is a mapping (``cases={"shapes": [[17, 17, 64]]}``) or a dotted name
(``**{"cases.shapes": [[17, 17, 64]]}``). The config is composed from the same ``conf/<experiment>.yaml`` and
``conf/base.yaml`` as the CLI's, validated by the experiment's own ``settings(cfg)`` and run by its own
``run(settings, rec)`` with an in-memory recorder: one implementation, the CLI's verdict. No Hydra launcher, no
subprocess, nothing written unless ``record=DIR`` asks for a normal run directory under ``DIR/<experiment>/``
(``tfmoe show``, ``diff`` and ``failures add`` read it; pass ``--runs DIR`` or run them from DIR's parent as usual).

``profile="quick"`` (the pytest plugin's default) is a reduced case matrix for a test suite (:data:`QUICK`);
``profile="full"`` (the API's default) is the CLI's defaults. Keys you pass win over the profile's.

Stability: the names in ``__all__`` are tfmoe's public API; everything else in the package is private and may
change in any release. A public name or keyword changes only after one minor release in which it warns
(``DeprecationWarning``) and the docs say what replaces it.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import math
import os
import re
import sys
import types
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tfmoe.contract.errors import BadInput

__all__ = ["BadSettings", "CheckResult", "Verdict", "QUICK", "check_attention", "check_kernel", "check_moe",
           "check_model", "assert_attention_conforms", "assert_kernel_conforms", "assert_moe_conforms",
           "assert_model_conforms"]


class BadSettings(BadInput, ValueError):
    """A setting the CLI would refuse with exit 2 (one line naming the key, the value and the fix). A ``ValueError``
    and a :class:`tfmoe.BadInput`."""


# The quick profile: the CLI's keys set to a reduced matrix. Attention: every check group but `chunked`, which judges
# tfmoe's chunked kernel (chunked.impl), not your layer, and costs a T=1024 memory probe. Kernels: five of the
# twelve shapes, still covering decode rows (Tq=1), Tq != Tk both ways, odd head dims and more than one key block;
# every mask and every kv-head count. MoE: the CLI's defaults (the layer battery is already small).
ATTENTION_GROUPS = ("masks", "sdpa", "fully_masked", "gradients", "kv_cache", "chunked", "invariances", "dropout")
QUICK: dict[str, dict[str, Any]] = {
    "attention": {"checks": [g for g in ATTENTION_GROUPS if g != "chunked"]},
    "kernel": {"cases.shapes": [[1, 1, 64], [17, 17, 59], [113, 203, 64], [1, 239, 128], [64, 128, 13]],
               "cases.kv_heads": [6, 2, 1]},
    "moe": {},
    "model": {"lm.steps": 24},  # still past the 16 keys a silently windowed cache keeps in the planted models
}

KINDS = {"attention": "attn-check", "kernel": "attn-check", "moe": "route-sim"}
# a whole causal LM: each experiment judges the claims that live there (tfmoe.experiments.lm_battery)
MODEL_EXPERIMENTS = ("arch", "shift-labels", "decode")
OBJECTS_MODULE = "tfmoe._checked_objects"  # where objects not importable by name are reachable during a check


# ============================================================================================ verdict
@dataclass(frozen=True)
class CheckResult:
    """One check of the battery: ``outcome`` is ``passed``, ``failed`` or ``n/a`` (not applicable to this layer);
    ``observed`` and ``limit`` are the measured value and its threshold (None when the check has none)."""

    name: str
    outcome: str
    observed: float | None
    limit: float | None
    detail: str

    @property
    def passed(self) -> bool:
        """False only for a failed check (n/a is not a failure)."""
        return self.outcome != "failed"


@dataclass(frozen=True)
class Verdict:
    """What the battery found: every check, the likely causes of failures (only when the failure pattern is evidence
    for one: inferred, not proven), the run's notes, and the run directory when ``record=`` wrote one."""

    experiment: str
    impl: str
    checks: tuple[CheckResult, ...]
    likely_causes: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)
    run_dir: Path | None = None

    @property
    def passed(self) -> bool:
        """True when no check failed (n/a checks are listed, never counted as failures)."""
        return not self.failed

    @property
    def failed(self) -> tuple[CheckResult, ...]:
        return tuple(c for c in self.checks if c.outcome == "failed")

    def __getitem__(self, name: str) -> CheckResult:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check {name!r} in this verdict: {', '.join(c.name for c in self.checks)}")

    def table(self) -> str:
        """The verdict as plain text: one line per check, then likely causes and notes."""
        def num(x: float | None) -> str:
            return "" if x is None or x != x else f"{x:.4g}"

        width = max([len(c.name) for c in self.checks] + [5])
        lines = [f"tfmoe {self.experiment} on {self.impl}: "
                 f"{'passed' if self.passed else f'{len(self.failed)} check(s) failed'}",
                 f"  {'check':<{width}}  {'outcome':<7}  {'observed':>10}  {'limit':>10}  detail"]
        for c in self.checks:
            lines.append(f"  {c.name:<{width}}  {c.outcome:<7}  {num(c.observed):>10}  {num(c.limit):>10}  "
                         f"{c.detail}".rstrip())
        lines += [f"  {cause}" for cause in self.likely_causes]
        lines += [f"  note: {n}" for n in self.notes]
        if self.run_dir is not None:
            lines.append(f"  run directory: {self.run_dir}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


# ============================================================================================ public API
def check_attention(layer: Any, /, *, profile: str = "full", record: str | Path | None = None,
                    **settings: Any) -> Verdict:
    """Judge an attention *module* with attn-check's module battery.

    ``layer``: a class in the course's interface (``Class(d_model, n_heads, causal[, dropout])``, ``qkv`` and
    ``out`` Linears, ``forward(x, padding_mask=None) -> (out, weights)``), a factory with that signature returning
    such a module, an :class:`~tfmoe.adapters.base.AttentionAdapter` (class or instance) for any other layout, or a
    spec string as ``impl=`` takes (``"pkg.mod:Name"``, ``"torch:mha"``, ``"hf:llama"``).
    The first argument is positional-only (route-sim has a ``layer`` key). ``settings``: attn-check's keys (``dtype``, ``device``, ``seed``, ``B``, ``T``, ``d_model``, ``n_heads``,
    ``n_kv_heads``, ``causal``, ``checks``, ``lacks``, ...). Raises :class:`BadSettings` where the CLI exits 2."""
    return _check("attention", layer, profile, record, settings)


def check_kernel(fn: Any, /, *, profile: str = "full", record: str | Path | None = None, **settings: Any) -> Verdict:
    """Judge an attention *function* with SDPA's signature ``fn(q, k, v, attn_mask=None, dropout_p=0.0,
    is_causal=False, scale=None, enable_gqa=False)`` on attn-check's kernel case matrix. ``fn`` is the function or a
    spec as ``kernel=`` takes (``"torch:sdpa"``, ``"pkg.mod:fn"``); ``settings`` are the kernel keys (``dtype``,
    ``causal_align``, ``cases={...}``, ``kernel_checks={...}``, ``lacks``, ...)."""
    return _check("kernel", fn, profile, record, settings)


def check_moe(moe: Any, /, *, profile: str = "full", record: str | Path | None = None, **settings: Any) -> Verdict:
    """Judge an MoE layer with route-sim's layer battery against an independent float64 reference. ``moe``: a
    class (or factory) in the course's ToyMoE interface ``Class(d_model, hidden, n_experts, top_k)``, a
    :class:`~tfmoe.adapters.moe_base.MoEAdapter` (class or instance), or a spec as ``impl=`` takes
    (``"hf:mixtral"``, ``"lib:st_moe_pytorch"``, ``"pkg.mod:Name"``); ``settings`` are route-sim's keys
    (``d_model``, ``d_hidden``, ``n_experts``, ``top_k``, ``layer={"seq": 8}``, ``dtype``, ...)."""
    return _check("moe", moe, profile, record, settings)


def check_model(model: Any, /, *, profile: str = "full", record: str | Path | None = None,
                experiments: tuple[str, ...] | list[str] = MODEL_EXPERIMENTS, **settings: Any) -> Verdict:
    """Judge a whole causal LM with the model battery of arch (causality, positions), shift-labels (padding, labels,
    loss) and decode (KV cache, batched generation, half precision): one Verdict over the three, each check named
    ``<experiment>:lm.<check>``. ``model``: a class built with no arguments or a zero-argument factory in Hugging
    Face's causal-LM calling convention, an ``nn.Module`` instance, a
    :class:`~tfmoe.adapters.causal_lm.CausalLMAdapter` (class or instance), or a spec as ``impl=`` takes
    (``"hf:llama"``, ``"pkg.mod:Name"``). ``settings`` are the experiments' keys (``lacks``, ``lm={"steps": 40}``,
    ``dtype``, ``seed``, ...); each goes to the experiments whose config has it. ``experiments`` picks some of
    ``("arch", "shift-labels", "decode")``."""
    return _check("model", model, profile, record, {**settings, "experiments": experiments})


def assert_model_conforms(model: Any, /, **settings: Any) -> Verdict:
    """:func:`check_model`, raising ``AssertionError`` with the verdict's table when a check failed."""
    return _conforms(check_model(model, **settings))


def assert_attention_conforms(layer: Any, /, **settings: Any) -> Verdict:
    """:func:`check_attention`, raising ``AssertionError`` with the verdict's table when a check failed."""
    return _conforms(check_attention(layer, **settings))


def assert_kernel_conforms(fn: Any, /, **settings: Any) -> Verdict:
    """:func:`check_kernel`, raising ``AssertionError`` with the verdict's table when a check failed."""
    return _conforms(check_kernel(fn, **settings))


def assert_moe_conforms(moe: Any, /, **settings: Any) -> Verdict:
    """:func:`check_moe`, raising ``AssertionError`` with the verdict's table when a check failed."""
    return _conforms(check_moe(moe, **settings))


def _conforms(verdict: Verdict) -> Verdict:
    if not verdict.passed:
        raise AssertionError("\n" + verdict.table())
    return verdict


# ============================================================================================ private
def _check(kind: str, target: Any, profile: str, record: str | Path | None, settings: dict[str, Any],
           record_only_failed: bool = False) -> Verdict:
    try:
        with _named(target, kind) as spec:
            if kind == "model":
                settings = dict(settings)
                chosen = _model_experiments(settings.pop("experiments", MODEL_EXPERIMENTS))
                overrides = _overrides(kind, spec, profile, settings)
                return _run_model(overrides, record, record_only_failed, chosen)
            overrides = _overrides(kind, spec, profile, settings)
            return _run(kind, overrides, record, record_only_failed)
    except BadSettings:
        raise
    except BadInput as exc:
        raise BadSettings(str(exc)) from None


def _overrides(kind: str, spec: str | None, profile: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The dotted config keys to set: the profile's, then the caller's, then the layer's."""
    if profile not in ("quick", "full"):
        raise BadSettings(f"profile={profile!r} is unknown: use profile='quick' (a reduced case matrix) or "
                          "profile='full' (the CLI's defaults)")
    own = {"kernel": "kernel", "attention": "impl", "moe": "impl", "model": "impl"}[kind]
    flat = _flatten(settings)
    if own in flat or (kind == "attention" and "kernel" in flat):
        which = {"kernel": "check_kernel(fn, ...)", "attention": "check_attention(layer, ...)",
                 "moe": "check_moe(layer, ...)", "model": "check_model(model, ...)"}[kind]
        raise BadSettings(f"{own}= is the first argument of {which}: pass the layer there, not as a setting")
    out = dict(QUICK[kind]) if profile == "quick" else {}
    if profile == "quick" and kind == "attention" and "dropout_samples" not in flat:
        out["dropout_samples"] = quick_dropout_samples(flat.get("dropout", 0.1))
    out.update(flat)
    out[own] = spec
    return out


def quick_dropout_samples(p: Any) -> int:
    """The quick profile's dropout_samples: enough weights that dropout_rate's fixed limit |rate - p| <= 0.01 is
    5.3 standard deviations of the sampled rate (a false alarm below 1e-7), at least the CLI's minimum 1000 and at
    most its default 100000. p=0.1 -> 25,281 (a quarter of the CLI's draws)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        return 100_000  # the CLI's default; settings(cfg) refuses the bad p in one line
    return int(min(100_000, max(1000, math.ceil((5.3 * math.sqrt(p * (1 - p)) / 0.01) ** 2))))


def _flatten(settings: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"cases": {"shapes": [...]}} -> {"cases.shapes": [...]}; mappings for keys whose value is a mapping
    (expect, kernel_checks.fully_masked_expect) are kept whole by :func:`_compose`."""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and name not in WHOLE_MAPPINGS and value:
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


WHOLE_MAPPINGS = {"expect", "kernel_checks.fully_masked_expect"}


def _plain(value: Any) -> Any:
    """Python values as the config holds them: tuples as lists, torch dtypes as their names."""
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        from tfmoe.rules.capabilities import precision_name

        return precision_name(value, "dtype")
    if isinstance(value, Path):
        return str(value)
    return value


def compose(experiment: str, overrides: Mapping[str, Any]) -> Any:
    """conf/base.yaml + conf/<experiment>.yaml as Hydra composes them (no hydra: node), then ``overrides`` with the
    CLI's checks: an unknown key or a value of another type than the default's is one BadSettings line."""
    from omegaconf import OmegaConf

    from tfmoe.contract.registry import EXPERIMENTS
    from tfmoe.harness.launching.launch import CONFIG_FORMS, _compatible, _example, _type_name, config_dir

    exp = EXPERIMENTS[experiment]
    cfg = _defaults(str(config_dir()), exp.config)
    for key, raw in overrides.items():
        value = _plain(raw)
        if not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", key) or \
                OmegaConf.select(cfg, key, default=_ABSENT) is _ABSENT:
            raise BadSettings(f"unknown setting {key!r} for {experiment}: the keys are those of "
                              f"`tfmoe {experiment} --cfg job`")
        default = OmegaConf.select(cfg, key)
        if OmegaConf.is_config(default):
            default = OmegaConf.to_container(default)
        forms = CONFIG_FORMS.get((exp.config, key))
        ok = (any(_compatible(_example(f), value) for f in forms) if forms is not None
              else _compatible(default, value))
        if not ok:
            expected = (" or ".join(_type_name(_example(f)) for f in forms) if forms is not None
                        else f"{_type_name(default)} like the default")
            raise BadSettings(f"{key}={value!r}: expected {expected} ({key}={default!r}): fix the value")
        OmegaConf.update(cfg, key, value, merge=False, force_add=False)
    return cfg


_ABSENT = object()
_DEFAULTS: dict[tuple[str, str], Any] = {}


def _defaults(conf: str, name: str) -> Any:
    """The experiment's composed defaults (cached per process; a copy each call)."""
    from omegaconf import OmegaConf

    key = (conf, name)
    if key not in _DEFAULTS:
        base = OmegaConf.load(Path(conf) / "base.yaml")
        own = OmegaConf.load(Path(conf) / f"{name}.yaml")
        own.pop("defaults", None)
        merged = OmegaConf.merge(base, own)
        merged.pop("hydra", None)
        OmegaConf.set_struct(merged, True)
        _DEFAULTS[key] = merged
    cfg = OmegaConf.create(OmegaConf.to_container(_DEFAULTS[key]))
    OmegaConf.set_struct(cfg, True)
    return cfg


def _model_experiments(value: Any) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    bad = [n for n in names if n not in MODEL_EXPERIMENTS]
    if bad or not names:
        raise BadSettings(f"experiments={value!r}: pick one or more of {', '.join(MODEL_EXPERIMENTS)}, e.g. "
                          "experiments=('decode',)")
    return tuple(e for e in MODEL_EXPERIMENTS if e in names)


def _run_model(overrides: dict[str, Any], record: str | Path | None, record_only_failed: bool,
               experiments: tuple[str, ...] = MODEL_EXPERIMENTS) -> Verdict:
    """The experiments' model batteries, each given the keys its config has; one Verdict."""
    parts: list[Verdict] = []
    keyed = {e: {k: v for k, v in overrides.items() if _has_key(e, k)} for e in MODEL_EXPERIMENTS}
    for key in overrides:
        if not any(key in keys for keys in keyed.values()):
            raise BadSettings(f"unknown setting {key!r} for check_model: the keys are those of `tfmoe arch --cfg job`, "
                              "`tfmoe shift-labels --cfg job` and `tfmoe decode --cfg job`")
    for experiment in experiments:
        parts.append(_run(experiment, keyed[experiment], record, record_only_failed))
    checks = tuple(CheckResult(f"{v.experiment}:{c.name}", c.outcome, c.observed, c.limit, c.detail)
                   for v in parts for c in v.checks)
    notes: list[str] = []
    for v in parts:
        notes += [n for n in v.notes if n not in notes]
        if v.run_dir is not None:
            notes.append(f"{v.experiment} run directory: {v.run_dir}")
    causes = tuple(f"{v.experiment}: {c}" for v in parts for c in v.likely_causes)
    dirs = [v.run_dir for v in parts if v.run_dir is not None]
    return Verdict(experiment="+".join(experiments), impl=str(overrides.get("impl")), checks=checks,
                   likely_causes=causes, notes=tuple(notes), settings=dict(overrides),
                   run_dir=dirs[0] if dirs else None)


def _has_key(experiment: str, key: str) -> bool:
    from omegaconf import OmegaConf

    from tfmoe.contract.registry import EXPERIMENTS
    from tfmoe.harness.launching.launch import config_dir

    cfg = _defaults(str(config_dir()), EXPERIMENTS[experiment].config)
    return OmegaConf.select(cfg, key, default=_ABSENT) is not _ABSENT


def _run(kind: str, overrides: dict[str, Any], record: str | Path | None, record_only_failed: bool) -> Verdict:
    from rich.console import Console

    from tfmoe.contract.recorder import Recorder
    from tfmoe.contract.registry import EXPERIMENTS
    from tfmoe.contract.runtime import (
        check_seed,
        check_threads,
        resolve_device,
        resolve_dtype,
        seed_everything,
        torch_threads,
    )
    from tfmoe.harness.method.diagnosis import checks_mapping, common_exception, diagnose, same_exception_line

    experiment = KINDS.get(kind, kind)  # a kind, or an experiment's own name (the model battery's three)
    exp = EXPERIMENTS[experiment]
    if record is not None:
        _check_record_dir(Path(record))
    cfg = compose(experiment, overrides)
    module = exp.load()
    s = module.settings(cfg)  # the experiment's own validation (BadInput -> BadSettings)
    seed = check_seed(cfg)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    seed_everything(seed)
    threads = check_threads(cfg)
    rec = Recorder(cfg=cfg, device=device, dtype=dtype, seed=seed, console=Console(file=io.StringIO()),
                   wants_plots=record is not None)
    with torch_threads(threads):
        if device.type == "cpu":
            import torch

            rec.note(f"{torch.get_num_threads()} torch intra-op thread(s) (config threads={threads})")
        module.run(s, rec)
    causes: list[str] = []
    same, found = None, []
    if not rec.all_passed:
        from omegaconf import OmegaConf

        checks = checks_mapping(rec.checks_rows)
        same = common_exception(checks)
        found = diagnose(experiment, checks, rec.metrics_rows, OmegaConf.to_container(cfg, resolve=True))
        causes = ([same_exception_line(same)] if same else []) + [i.line() for i in found]
    verdict = Verdict(
        experiment=experiment, impl=str(overrides.get("kernel" if kind == "kernel" else "impl")),
        checks=tuple(CheckResult(c.check, c.outcome, c.observed, c.threshold, c.detail) for c in rec.checks_rows),
        likely_causes=tuple(causes), notes=tuple(rec.notes), settings=dict(overrides), run_dir=None)
    if record is not None and not (record_only_failed and rec.all_passed):
        try:
            run_dir = _record(Path(record), exp, cfg, overrides, rec, same, found)
        except OSError as exc:  # refused while writing (a full disk, permissions changed): the verdict still shown
            raise BadSettings(f"record={record}: could not write the run ({exc.strerror or exc}: "
                              f"{exc.filename or record}): free space there or pass record= a directory you can "
                              f"write; the verdict, not recorded:\n{verdict.table()}") from None
        return dataclasses.replace(verdict, run_dir=run_dir)
    return verdict


def _check_record_dir(root: Path) -> None:
    """BadSettings before anything runs when ``record=`` names a place no run directory can be written: a file, or
    a directory (or its nearest existing parent) this process cannot write."""
    if root.exists() and not root.is_dir():
        raise BadSettings(f"record={root}: is a file, not a directory: pass record= a directory (it is created)")
    existing = next((p for p in [root, *root.parents] if p.exists()), None)
    if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise BadSettings(f"record={root}: cannot write there ({existing} is not a directory this process can "
                          "write): pass record= a directory you can write")


def _override_text(key: str, value: Any) -> str:
    """A key and value as the CLI's override in Hydra's grammar (what the run records, so `tfmoe show` prints a
    command that runs it again)."""
    return f"{key}={_hydra_value(_plain(value))}"


def _hydra_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str) and not re.fullmatch(r"[A-Za-z_][\w.:/-]*", value) or value in ("true", "false", "null", "nan", "inf"):
        return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(value)


def _record(root: Path, exp: Any, cfg: Any, overrides: Mapping[str, Any], rec: Any, same: str | None,
            found: list) -> Path:
    """A normal run directory under root/<experiment>/ written by the notebook layer."""
    from omegaconf import OmegaConf

    from tfmoe.contract.recorder import device_peak
    from tfmoe.contract.status import Status
    from tfmoe.harness.method.diagnosis import markdown
    from tfmoe.harness.store.notebook import RunWriter, environment, write_run_config
    from tfmoe.harness.store.rundir import utcnow

    run_dir = _new_run_dir(root / exp.name, utcnow().strftime("%Y-%m-%d_%H-%M-%S-%f"))
    name = run_dir.name
    texts = [_override_text(k, v) for k, v in overrides.items()]
    writer = RunWriter(run_dir=run_dir, run_id=name, experiment=exp.name, seed=int(cfg.seed),
                       argv=["tfmoe.checks", *texts], overrides=texts, device=str(rec.device), dtype=str(cfg.dtype))
    writer.env = environment(rec.device)
    writer.start()
    write_run_config(run_dir, OmegaConf.to_yaml(cfg), texts)
    if not rec.all_passed:
        writer.inference_lines = markdown(found, same)
    status = Status.OK if rec.all_passed else Status.FAILED
    writer.finish(rec, status, status.exit_code, None, device_peak(rec.device), None,
                  int(cfg.get("tensor_max_numel", 1_000_000)))
    return run_dir


def _new_run_dir(parent: Path, name: str) -> Path:
    """parent/name made here and by no one else: two processes recording in the same microsecond (pytest-xdist
    workers sharing one --tfmoe-record) get name and name-1, never one directory written twice."""
    parent.mkdir(parents=True, exist_ok=True)
    for n in range(1000):
        run_dir = parent / (name if n == 0 else f"{name}-{n}")
        try:
            run_dir.mkdir()
        except FileExistsError:
            continue
        return run_dir
    raise FileExistsError(f"{parent / name}: 1000 run directories of that name exist")


# ------------------------------------------------------------------------------ the layer, named
_counter = iter(range(1, sys.maxsize))


@contextmanager
def _named(target: Any, kind: str) -> Iterator[str | None]:
    """The spec string the config carries for ``target``: a string as is; a class or function importable as
    'module:qualname' by that name (so a recorded run can be replayed); anything else (a local class, a lambda, an
    adapter instance) is reachable as 'tfmoe._checked_objects:<name>' while the check runs."""
    if target is None or isinstance(target, str):
        if target is None and kind == "model":
            raise BadSettings("check_model(None): pass the model (a class, a factory, an instance, a CausalLMAdapter, "
                              "or a spec such as 'hf:llama')")
        if target is None and kind != "moe":
            raise BadSettings(f"check_{kind}(None): pass the layer (a class, a factory, an adapter or a "
                              "'pkg.mod:Name' spec)")
        yield target
        return
    if kind not in ("kernel", "model"):  # a model is judged as built: an instance is fine
        _refuse_module_instance(target, kind)
    spec = _importable(target)
    if spec is not None:
        yield spec
        return
    holder = sys.modules.get(OBJECTS_MODULE)
    if holder is None:
        holder = types.ModuleType(OBJECTS_MODULE, "objects passed to tfmoe's check functions, during the check")
        sys.modules[OBJECTS_MODULE] = holder
    label = re.sub(r"\W", "_", getattr(target, "__qualname__", None) or type(target).__name__)
    attr = f"{label}_{next(_counter)}"
    setattr(holder, attr, target)
    try:
        yield f"{OBJECTS_MODULE}:{attr}"
    finally:
        delattr(holder, attr)


def _importable(obj: Any) -> str | None:
    module_name, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not (inspect.isclass(obj) or inspect.isfunction(obj)) or not module_name or not qualname \
            or "<" in qualname or module_name == "__main__":
        return None
    found: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return f"{module_name}:{qualname}" if found is obj else None


def _refuse_module_instance(target: Any, kind: str) -> None:
    try:
        import torch.nn as nn
    except ImportError:  # pragma: no cover - torch is a dependency
        return
    if isinstance(target, nn.Module):
        what = {"attention": "Class(d_model, n_heads, causal[, dropout])",
                "moe": "Class(d_model, hidden, n_experts, top_k)", "kernel": "fn(q, k, v, ...)"}[kind]
        raise BadSettings(f"check_{kind} got a {type(target).__name__} instance: pass the class "
                          f"{type(target).__name__} (or a factory {what}), the battery builds fresh layers at each "
                          "size and seed it checks, or an adapter instance for another layout")

