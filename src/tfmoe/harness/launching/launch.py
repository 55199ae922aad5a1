"""Starting experiments through Hydra's real `@hydra.main` path (so multirun and launcher plugins work)."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Any

from tfmoe.contract.errors import BadInput, Terminated
from tfmoe.contract.paths import CHECKOUT_ROOT
from tfmoe.contract.registry import EXPERIMENTS, Experiment
from tfmoe.contract.status import Status, worst_exit_code

# Hydra's own error path (a bad config, a launcher that lost a job) is bad input: exit 2
EXIT_FROM_HYDRA = Status.ERROR.exit_code

HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                          "--config-dir", "-cd", "--experimental-rerun", "--info", "-i"}


def config_dir() -> Path:
    """conf/ of this checkout (editable install), the packaged copy, or $TFMOE_CONF."""
    env = os.environ.get("TFMOE_CONF")
    if env:
        return Path(env).resolve()
    source = CHECKOUT_ROOT / "conf"
    if (source / "base.yaml").exists():
        return source
    from importlib.resources import files

    return Path(str(files("tfmoe.conf")))


def split_args(args: list[str]) -> tuple[list[str], list[str]]:
    """(overrides, hydra flags) from the extra command-line arguments."""
    overrides, flags = [], []
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("-"):
            flags.append(a)
            takes_value = a in HYDRA_FLAGS_WITH_VALUE and a not in {"--info", "-i"}
            optional_value = a in {"--info", "-i"}
            if (takes_value or optional_value) and i + 1 < len(args) and "=" not in args[i + 1] \
                    and not args[i + 1].startswith("-"):
                flags.append(args[i + 1])
                i += 1
        else:
            if "=" not in a:
                raise BadInput(f"{a!r} is not an override: write key=value (e.g. seed=1)")
            overrides.append(a)
        i += 1
    return overrides, flags


_CONFIG_FLAGS = ("--config-name", "-cn", "--config-path", "-cp")


def check_config_flags(exp: Experiment, flags: list[str]) -> None:
    """Refuse Hydra's flags that choose another primary config: each subcommand composes its own
    (conf/<config>.yaml), which is what its overrides are validated against (Hydra would print a multi-line error
    for a name it cannot find, and run another experiment's config under this command for one it can)."""
    from tfmoe.contract.registry import EXPERIMENTS

    for i, flag in enumerate(flags):
        name = flag.split("=", 1)[0]
        if name not in _CONFIG_FLAGS:
            continue
        value = flag.split("=", 1)[1] if "=" in flag else (flags[i + 1] if i + 1 < len(flags) else "")
        other = next((e.name for e in EXPERIMENTS.values() if e.config == value.removesuffix(".yaml")), None)
        hint = f"run `tfmoe {other}` for that experiment" if other and other != exp.name else \
            "change its keys with key=value overrides (`tfmoe " + exp.name + " --cfg job` lists them)"
        raise BadInput(f"{name} {value}: `tfmoe {exp.name}` always composes conf/{exp.config}.yaml: {hint}")


# Keys whose documented forms (the comments in conf/<config>.yaml) have more than one type: the CLI accepts
# every one of them. Without an entry a value must have the default's type (checks: all -> a string only).
CONFIG_FORMS: dict[tuple[str, str], tuple[type, ...]] = {
    ("attn_check", "checks"): (str, list),  # checks: all | [masks, sdpa, ...]
    # zeros | [zeros, nan] | {bool: zeros, additive: nan, causal: uniform}
    ("attn_check", "kernel_checks.fully_masked_expect"): (str, list, dict),
}


_ABSENT = object()


def _type_name(v: Any) -> str:
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a mapping"}.get(type(v), type(v).__name__)


def _compatible(default: Any, value: Any) -> bool:
    if default is None or value is None:
        return True
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, (str, int, float)) and not isinstance(value, bool)
    if isinstance(default, list):
        return isinstance(value, list)
    if isinstance(default, dict):
        return isinstance(value, dict)
    return True


def _example(form: type) -> Any:
    """A value of type ``form`` (what :func:`_compatible` compares against)."""
    return form()


def validate_overrides(exp: Experiment, overrides: list[str]) -> Any:
    """Refuse (BadInput) unknown keys, bad syntax and values whose type differs from the default's,
    before Hydra starts (Hydra itself would print a multi-line error and exit 1)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import Transformer
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    from tfmoe.harness.launching import runner  # registers the run-name resolver

    del runner
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as exc:
        hint = ""
        if any(not ch.isascii() for o in overrides for ch in o):
            hint = " (Hydra's override grammar needs non-ASCII text quoted, e.g. 'sequences=[[BOS,\"我\",EOS]]')"
        raise BadInput(f"cannot parse overrides {' '.join(overrides)!r}: {str(exc).splitlines()[0]}{hint}") from None
    first_values, checks = [], []
    for o in parsed:
        key = o.key_or_group
        try:
            if o.is_sweep_override():
                text_values = list(o.sweep_string_iterator())
                typed_values = list(o.sweep_iterator(transformer=Transformer.identity))
            else:
                text_values, typed_values = [o.get_value_element_as_str()], [o.value()]
        except Exception:
            text_values, typed_values = [], []
        if not text_values:
            first_values.append(o.input_line)
            continue
        prefix = {"ADD": "+", "DEL": "~", "FORCE_ADD": "++"}.get(o.type.name, "")
        first_values.append(f"{prefix}{key}={text_values[0]}")
        if not o.is_hydra_override() and "/" not in key and o.type.name == "CHANGE":
            checks.append((key, list(zip(text_values, typed_values, strict=False))))
    for o in parsed:
        check_launcher_installed(o.key_or_group, first_values)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            defaults = compose(config_name=exp.config)
            composed = compose(config_name=exp.config, overrides=first_values, return_hydra_config=True)
    except HydraException as exc:
        msg = " ".join(str(exc).split())
        for o in parsed:
            if f"Could not override '{o.key_or_group}'" in str(exc) or f"Key '{o.key_or_group}'" in str(exc):
                raise BadInput(f"unknown config key {o.key_or_group!r} for {exp.name}: "
                               f"`tfmoe {exp.name} --cfg job` lists the keys") from None
        raise BadInput(f"bad override for {exp.name}: {msg[:300]}") from None
    except Exception as exc:  # Hydra raises plain ValueErrors for some malformed overrides
        raise BadInput(f"bad override {' '.join(overrides)!r} for {exp.name}: {' '.join(str(exc).split())[:300]}") from None
    finally:
        GlobalHydra.instance().clear()
    for o in parsed:  # +key=value / ++key=value: Hydra adds any key; the experiment's schema has only its own
        key = o.key_or_group
        if o.type.name in ("ADD", "FORCE_ADD") and not o.is_hydra_override() and "/" not in key \
                and key != "expect" and not key.startswith("expect.") \
                and OmegaConf.select(defaults, key, default=_ABSENT, throw_on_missing=False) is _ABSENT:
            raise BadInput(f"unknown config key {key!r} for {exp.name}: `tfmoe {exp.name} --cfg job` lists the keys")
    for key, values in checks:  # values typed by Hydra's own override grammar (1e-5 is a float there)
        default = OmegaConf.select(defaults, key, throw_on_missing=False)
        if OmegaConf.is_config(default):
            default = OmegaConf.to_container(default)
        forms = CONFIG_FORMS.get((exp.config, key))
        for text, value in values:
            if isinstance(value, str) and "${" in value:
                continue  # an interpolation: OmegaConf resolves and types it later
            if forms is not None:
                if not any(_compatible(_example(form), value) for form in forms):
                    raise BadInput(f"{key}={text}: expected {' or '.join(_type_name(_example(f)) for f in forms)} "
                                   f"(default {key}={default!r}): fix the value")
            elif not _compatible(default, value):
                raise BadInput(f"{key}={text}: expected {_type_name(default)} like the default "
                               f"({key}={default!r}): fix the value")
    return composed


def force_expect(override: str) -> str:
    """``expect={cv: "< 0.1"}`` / ``expect.cv=...`` -> ``++expect...``: Hydra's struct mode refuses new keys in
    the empty default mapping otherwise."""
    if override.startswith(("expect=", "expect.", "+expect=", "+expect.")):
        return "++" + override.lstrip("+")
    return override


def validate_expectations(exp: Experiment, composed: Any, multirun: bool = False) -> None:
    """Refuse a malformed expectation, or one on a metric or tag the experiment does not record, before any
    run (or any job of a sweep) starts; a single run's tag values too, where its settings know them (a sweep's
    jobs: validate_sweep_settings)."""
    from tfmoe.harness.method import expectations
    from tfmoe.harness.method.declared_metrics import declared_for

    parsed = expectations.parse(composed.get("expect"))
    if parsed:
        expectations.validate(parsed, declared_for(exp.name), exp.name)
    if not multirun and any(e.tags for e in parsed) and hasattr(exp.load(), "tag_values"):
        from omegaconf import open_dict, read_write

        cfg = composed.copy()
        with read_write(cfg), open_dict(cfg):
            cfg.pop("hydra", None)
        try:
            settings = exp.load().settings(cfg)
        except BadInput:
            raise  # the run would refuse these settings anyway: say so before anything is written
        except Exception:  # not bad input: the run itself records what happens
            return
        validate_tag_values(exp, parsed, settings)


def validate_tag_values(exp: Experiment, parsed: list[Any], settings: Any) -> None:
    """The expectations' tag selections against the values the experiment's ``tag_values(settings)`` knows."""
    from tfmoe.harness.method import expectations

    known = getattr(exp.load(), "tag_values", None)
    if parsed and known is not None:
        expectations.validate_tag_values(parsed, known(settings), exp.name)


# Launchers that come from an optional extra: hydra/launcher=<name> -> (plugin module, extra)
OPTIONAL_LAUNCHERS = {"ray": ("hydra_plugins.hydra_ray_launcher", "ray")}


def check_launcher_installed(key: str, overrides: list[str]) -> None:
    """``hydra/launcher=ray`` without Hydra's Ray launcher installed: one line naming the extra, not Hydra's error."""
    import importlib.util

    if key != "hydra/launcher":
        return
    for o in overrides:
        name = o.partition("=")[2] if o.startswith("hydra/launcher=") else None
        if name in OPTIONAL_LAUNCHERS:
            module, extra = OPTIONAL_LAUNCHERS[name]
            if importlib.util.find_spec(module) is None:
                raise BadInput(f"hydra/launcher={name} needs Hydra's {name} launcher plugin, not installed: "
                               f"pip install -e '.[{extra}]' (make test installs it)")


# Free space a run directory needs to start: Hydra's .hydra/ files, the log, run.parquet (~10 KB each), the first
# records; below it the run would fail half-written (a run on a full disk then reports its first refused write).
MIN_FREE_BYTES = 128 * 1024


def check_writable(run_root: str) -> None:
    """Refuse an unwritable or full runs root before any run starts (nothing is lost, nothing half-written)."""
    import shutil
    import tempfile

    root = Path(run_root)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
        free = shutil.disk_usage(root).free
    except OSError as exc:
        raise BadInput(f"cannot write runs under {root} ({exc.strerror or exc}): pass run_root=DIR that you "
                       "can write, or fix the permissions") from None
    if free < MIN_FREE_BYTES:
        raise BadInput(f"cannot write runs under {root}: only {free // 1024} KiB free (a run needs at least "
                       f"{MIN_FREE_BYTES // 1024} KiB to start): free space there, or pass run_root=DIR on another disk")


def check_launcher_settings(composed: Any) -> None:
    """A launcher setting that cannot start a single job, refused before the sweep starts (the launcher would raise
    inside Hydra, and every job would be left unstarted): joblib's ``n_jobs`` must be a non-zero integer."""
    from omegaconf import OmegaConf

    target = str(OmegaConf.select(composed, "hydra.launcher._target_", default="") or "")
    if target.endswith("JoblibLauncher"):
        n = OmegaConf.select(composed, "hydra.launcher.n_jobs", default=None)
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n == 0):
            raise BadInput(f"hydra.launcher.n_jobs={n}: joblib needs a non-zero number of worker processes "
                           "(-1: one per CPU): pass hydra.launcher.n_jobs=2")


class LauncherFailed(Exception):
    """The sweep's launcher itself raised (not a job, not a signal): said in one line, never a traceback."""

    def __init__(self, exc: BaseException) -> None:
        first = " ".join((str(exc).strip().splitlines() or [""])[0].split()).split(". ")[0]
        super().__init__(f"{type(exc).__name__}: {first[:300]}" if first else type(exc).__name__)
        self.cause = exc
        # a worker process killed under the launcher (joblib's TerminatedWorkerError): its job is lost
        self.exit_code = (Status.LOST.exit_code if any(c.__name__ in ("TerminatedWorkerError", "BrokenProcessPool")
                                                       for c in type(exc).__mro__) else Status.CRASHED.exit_code)


_USER_FULL_ERROR = False  # the user asked Hydra for full tracebacks (HYDRA_FULL_ERROR=1)


@contextlib.contextmanager
def launcher_errors_raised() -> Any:
    """While Hydra launches: an exception it would print as a traceback (a launcher's own) is raised instead
    (HYDRA_FULL_ERROR), so launch says it in one line; the user's own HYDRA_FULL_ERROR=1 keeps the traceback too."""
    global _USER_FULL_ERROR
    before = os.environ.get("HYDRA_FULL_ERROR")
    _USER_FULL_ERROR = before == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = before


@contextlib.contextmanager
def signals_deferred() -> Any:
    """While a stopped sweep's records are completed (sweep.parquet, the job list): Ctrl-C and SIGTERM are noted,
    not raised, so a second Ctrl-C never leaves the sweep without its table; the first one noted is re-raised at
    the end (as KeyboardInterrupt or Terminated)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from tfmoe.harness.launching import runner

    got: list[int] = []

    def note(signum: int, frame: Any) -> None:
        got.append(signum)
        runner._SIGNALS_SEEN.append(signum)  # a test's hold (runner.stage) ends on it

    previous = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if got:
        raise KeyboardInterrupt if got[0] == signal.SIGINT else Terminated(got[0])


def sweep_job_overrides(overrides: list[str]) -> list[list[str]] | None:
    """Each job's task overrides, in job order, as Hydra's basic sweeper enumerates them; None for another sweeper
    (it enumerates its own jobs)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    from tfmoe.harness.launching.sweep_speed import parse

    parsed = parse(overrides)
    if any(o.key_or_group == "hydra/sweeper" or o.key_or_group.startswith("hydra.sweeper") for o in parsed):
        return None
    task = [o for o in parsed if not o.is_hydra_override()]
    return [job for batch in BasicSweeper.split_arguments(task, None) for job in batch]


def check_utf8(args: list[str]) -> None:
    """Refuse an argument that is not UTF-8 text (Python keeps its bytes as surrogates; parquet, the log and
    Hydra's grammar cannot hold them) before anything is composed or written."""
    for a in args:
        try:
            a.encode("utf-8")
        except UnicodeEncodeError:
            raw = a.encode("utf-8", "surrogateescape")
            raise BadInput(f"argument {raw!r} is not UTF-8 text: retype it in UTF-8 (nothing was run)") from None


def job_settings(module: Any, cfg: Any, devices: bool = True) -> Any:
    """What a run refuses before it starts, in the order the runner meets them: its seed, device, dtype, threads,
    tensor size limit and flush interval (runtime.py), then the experiment's own ``settings(cfg)``. BadInput on the
    first problem. ``devices=False`` (a sweep's jobs, which may run on another machine: a SLURM node's GPU) leaves
    device and dtype to the job."""
    from tfmoe.contract.runtime import (
        check_seed,
        check_tensor_max_numel,
        check_threads,
        resolve_device,
        resolve_dtype,
    )
    from tfmoe.harness.launching.runner import check_flush_every

    check_seed(cfg)
    if devices:
        resolve_dtype(cfg.get("dtype"), resolve_device(cfg.get("device")))
    check_threads(cfg)
    check_tensor_max_numel(cfg)
    check_flush_every(cfg)
    return module.settings(cfg)


def check_interpolations(cfg: Any, job: str = "") -> None:
    """Resolve every value of a composed config (Hydra's own section aside) as the run will: BadInput, in one line,
    for an interpolation that cannot resolve (``seed=${oc.env:NOPE}``, a key that does not exist, bad ``${`` syntax)
    before any run directory exists. ``${hydra:...}`` values resolve only inside the job and are left to it."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf
    from omegaconf.errors import GrammarParseError, InterpolationResolutionError, MissingMandatoryValue

    raw = OmegaConf.to_container(cfg, resolve=False)
    hc = HydraConfig.instance()
    before = hc.cfg
    try:
        if "hydra" in cfg:
            hc.set_config(cfg)
        for key in raw:
            if key == "hydra" or "${hydra:" in str(raw[key]):
                continue
            try:
                node = cfg[key]
                if OmegaConf.is_config(node):
                    OmegaConf.to_container(node, resolve=True)
            except (InterpolationResolutionError, GrammarParseError, MissingMandatoryValue) as exc:
                where = getattr(exc, "full_key", None) or key
                said = " ".join(str(exc).splitlines()[0].split())[:200]
                raise BadInput(f"{job}{where}: cannot resolve {raw[key]!r}: {said}: set what it names, or give the "
                               f"value itself, e.g. {key}=<value>") from None
    finally:
        hc.cfg = before


def validate_run_settings(exp: Experiment, composed: Any) -> None:
    """A single run's settings, built from its composed config before its run directory exists: the contract
    sweeps keep (:func:`validate_sweep_settings`), so a typo writes nothing. A config whose settings fail other
    than with BadInput (e.g. a ``${hydra:...}`` interpolation, which resolves only inside the job) is left to the
    run to record."""
    from omegaconf import OmegaConf, open_dict

    cfg = OmegaConf.create(OmegaConf.to_container(composed, resolve=False))
    with open_dict(cfg):
        cfg.pop("hydra", None)
    try:
        job_settings(exp.load(), cfg)
    except BadInput:
        raise
    except Exception:  # not bad input: the run itself records what happens
        return


def validate_sweep_settings(exp: Experiment, overrides: list[str], strict: bool = False) -> None:
    """Build every job's settings (the experiment contract's ``settings(cfg)``) before any job of a sweep starts:
    BadInput naming the first refused job's overrides, the problem and the fix. Each job's config is derived
    from one composed config (sweep_speed.JobConfigs), as the sweep itself will compose it. Skipped for sweepers
    other than Hydra's basic one; a job whose config does not compose, or whose settings() fails other than with
    BadInput (e.g. a ``${hydra:...}`` interpolation, which only resolves inside the job), is left to the sweep to
    report, unless ``strict`` (validate-only mode): then any failure refuses the job."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode
    from omegaconf import open_dict, read_write

    from tfmoe.harness.launching.sweep_speed import JobConfigs, parse
    from tfmoe.harness.method import expectations

    module = exp.load()
    jobs = sweep_job_overrides(overrides)
    if not jobs:
        return
    refused: list[tuple[int, list[str], str]] = []
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            loader = GlobalHydra.instance().config_loader()
            hydra_overrides = [o.input_line for o in parse(overrides) if o.is_hydra_override()]

            def compose(master_config: Any, sweep_overrides: list[str]) -> Any:  # load_sweep_config's composition
                return loader.load_configuration(exp.config, [*hydra_overrides, *sweep_overrides], RunMode.RUN)

            try:
                base = compose(None, [])
            except Exception as exc:
                if strict:
                    raise BadInput(f"the config does not compose: {' '.join(str(exc).split())[:300]}") from None
                return  # Hydra reports it when the sweep starts
            configs = JobConfigs(loader, None, compose, base=base)
            for i, job in enumerate(jobs):
                try:
                    cfg = configs(job)
                    check_interpolations(cfg)
                    tasks = launcher_tasks(cfg)
                    with read_write(cfg), open_dict(cfg):  # the job's config, as run_job hands it over
                        del cfg["hydra"]
                    settings = job_settings(module, cfg, devices=False)
                    check_tasks(exp, module, settings, *tasks)
                    validate_tag_values(exp, expectations.parse(cfg.get("expect")), settings)
                except BadInput as exc:
                    refused.append((i, job, str(exc)))
                except Exception as exc:  # not bad input: the job itself records what happens
                    if strict:
                        refused.append((i, job, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"))
    finally:
        GlobalHydra.instance().clear()
    if refused:
        i, job, problem = refused[0]
        more = f" ({len(refused)} of {len(jobs)} jobs refused)" if len(jobs) > 1 else ""
        raise BadInput(f"sweep job {i} ({' '.join(job) or 'no overrides'}): {problem}{more}; nothing was run")


def launcher_tasks(cfg: Any) -> tuple[int, int, str]:
    """(tasks per node, nodes, launcher class) of a job's composed config: submitit's ``hydra.launcher.
    tasks_per_node`` and ``nodes`` (1 and 1 for launchers without them)."""
    from omegaconf import OmegaConf

    per_node = OmegaConf.select(cfg, "hydra.launcher.tasks_per_node", default=1)
    nodes = OmegaConf.select(cfg, "hydra.launcher.nodes", default=1)
    target = str(OmegaConf.select(cfg, "hydra.launcher._target_", default="") or "")
    return int(per_node or 1), int(nodes or 1), target


def check_tasks(exp: Experiment, module: Any, settings: Any, per_node: int, nodes: int, target: str) -> None:
    """A launcher that starts several tasks per job runs the job once per task. Only an experiment whose run spans
    the tasks of a SLURM step takes that: its module's ``check_tasks(settings, tasks)`` (route-sim ``ep_size=W``),
    under ``hydra/launcher=submitit_slurm``. BadInput otherwise: the copies would write one run directory."""
    tasks = per_node * nodes
    if tasks <= 1:
        return
    hook = getattr(module, "check_tasks", None)
    if hook is not None and target.endswith("SlurmLauncher"):
        hook(settings, tasks)
        return
    fix = "hydra.launcher.tasks_per_node=1" + (" hydra.launcher.nodes=1" if nodes > 1 else "")
    spans = "only route-sim ep_size=W under hydra/launcher=submitit_slurm spans a job's tasks"
    raise BadInput(f"hydra.launcher.tasks_per_node={per_node} x nodes={nodes} runs each {exp.name} job {tasks} "
                   f"times into one run directory ({spans}): pass {fix}")


# TFMOE_VALIDATE_ONLY=1: an experiment command does all of its validation (overrides, expectations, every job's
# settings(cfg), Hydra's own flags) and stops before Hydra launches anything; tests/test_docs_commands.py uses it.
VALIDATE_ONLY_ENV = "TFMOE_VALIDATE_ONLY"


def validate_only() -> bool:
    """Whether $TFMOE_VALIDATE_ONLY asks to validate an experiment command without running it."""
    return os.environ.get(VALIDATE_ONLY_ENV, "").strip() not in ("", "0")


def validate_hydra_flags(flags: list[str], overrides: list[str]) -> None:
    """Hydra's own argument parser over the flags: BadInput for a flag Hydra does not know."""
    from hydra._internal.utils import get_args_parser

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            get_args_parser().parse_args([*overrides, *flags])
    except SystemExit as exc:
        if exc.code not in (0, None):
            last = (said.getvalue().strip().splitlines() or ["unknown flag"])[-1]
            raise BadInput(f"{last.split(': error: ', 1)[-1]}: see `tfmoe <experiment> --help`") from None


def output_dir(composed: Any, multirun: bool) -> tuple[str, Path]:
    """(key, directory): where Hydra will put this run (``hydra.run.dir``) or sweep (``hydra.sweep.dir``),
    resolved once here from the composed config (conf/base.yaml's naming rule, or the user's own override of that
    key), so that launch passes it to Hydra and knows it outright."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    hc = HydraConfig.instance()
    before = hc.cfg
    try:
        hc.set_config(composed)  # a user's own dir may use ${hydra:...}
        return key, Path(str(OmegaConf.select(composed, key, throw_on_missing=True)))
    except Exception as exc:
        raise BadInput(f"cannot resolve {key} ({' '.join(str(exc).split())[:200]}): give a plain path, "
                       f"e.g. {key}=runs/mine") from None
    finally:
        hc.cfg = before


# What marks a directory as a run's or a sweep's: its record, Hydra's copy of its config, a sweep's table.
_RECORD_MARKS = ("run.parquet", ".hydra", "sweep.parquet", "multirun.yaml")
# Words the commands that take a run read as a reference, not an id (notebook.resolve_run): never a run's id.
REFERENCE_WORDS = ("latest",)


def check_new_dir(key: str, out: Path, overrides: list[str]) -> None:
    """One writer per run: BadInput when the run (sweep) directory ``out`` already exists with anything in it, or
    lies inside another run's or sweep's directory, whichever way it was named (``hydra.run.dir``,
    ``hydra.sweep.dir``, or ``run_root`` under the default naming). A record is written only by the run that
    made it; nothing is written before this check."""
    given = next((o.split("=", 1)[0].lstrip("+") for o in overrides
                  if o.split("=", 1)[0].lstrip("+") in (key, "run_root")), "run_root")
    named = f"{given}={next((o.split('=', 1)[1] for o in overrides if o.split('=', 1)[0].lstrip('+') == given), '')}"
    fix = (f"leave {key} unset (each run gets a new directory) or name a new one" if given == key
           else "pass run_root=DIR that is not inside a run, e.g. run_root=runs")
    where = out.resolve()
    if key == "hydra.run.dir" and (where.name in REFERENCE_WORDS or where.name.startswith("-")):
        raise BadInput(f"{named}: a run directory named {where.name!r} would give the run the id {where.name!r}, "
                       f"which `show`, `diff` and the other commands read as {'a word' if where.name in REFERENCE_WORDS else 'an option'}: {fix}")
    if where.exists() and (not where.is_dir() or any(where.iterdir())):
        held = next((m for m in _RECORD_MARKS if (where / m).exists()), None)
        what = f"already holds a {'sweep' if held in ('sweep.parquet', 'multirun.yaml') else 'run'} ({held})" \
            if held else "already exists and is not empty"
        raise BadInput(f"{named}: {where} {what}; a run directory is written once, by the run that made it: {fix}")
    for parent in where.parents:
        held = next((m for m in _RECORD_MARKS if (parent / m).exists()), None)
        if held is not None:
            raise BadInput(f"{named}: {where} would lie inside the run directory {parent} (it holds {held}); a run "
                           f"directory is written once, by the run that made it: {fix}")


def dir_override(key: str, path: Path, overrides: list[str]) -> list[str]:
    """``overrides`` with ``key=<path>`` (quoted for Hydra's grammar) in place of any override of ``key``."""
    text = str(path)
    quote = "'" if "'" not in text else '"'
    if quote in text or "\\" in text:
        raise BadInput(f"{key}={text}: Hydra cannot take this path (quotes or backslashes in it): choose another")
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+") != key]
    return [*kept, f"{key}={quote}{text}{quote}"]


def made_dirs(out: Path, multirun: bool) -> tuple[list[Path], list[Path]]:
    """(run directories, sweep directories) that a launch into ``out`` produced: the run directory, or every job
    directory under the sweep directory (whichever process ran it: in-process, joblib, submitit), in job order."""
    from tfmoe.harness.store.rundir import RUN_FILE

    if not multirun:
        return ([out.resolve()] if (out / RUN_FILE).exists() else []), []
    jobs = sorted((p.parent.resolve() for p in out.glob(f"*/{RUN_FILE}")), key=lambda p: (len(p.name), p.name))
    return jobs, ([out] if (out / "sweep.parquet").exists() else [])


def run_experiment(exp: Experiment, args: list[str], multirun: bool = False, quiet: bool = False,
                   made: list[Path] | None = None) -> int:
    """Compose and launch through `@hydra.main`; returns the exit code the runs' statuses call for. ``made``
    receives the run directories (a sweep's job directories), also when the launch is interrupted."""
    import hydra
    from hydra.core.global_hydra import GlobalHydra

    from tfmoe.harness.launching import hydra_callbacks, runner
    from tfmoe.harness.reading.reports import exit_code_of, print_outcome
    from tfmoe.harness.store.sweeps import has_unstarted_jobs

    check_utf8(args)
    overrides, flags = split_args(args)
    check_config_flags(exp, flags)
    overrides = [force_expect(o) for o in overrides]
    composed = validate_overrides(exp, overrides)
    if multirun:
        check_launcher_settings(composed)
    validate_expectations(exp, composed, multirun)
    checking = validate_only()
    if not any(f in ("--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help") for f in flags):
        if multirun or checking:
            validate_sweep_settings(exp, overrides, strict=checking)
        else:
            check_interpolations(composed)
            validate_run_settings(exp, composed)
            if not checking:
                from tfmoe.harness.launching.runner import serve_as_peer

                peer = serve_as_peer(exp, composed)  # `srun -n W`: a task other than the first writes no run
                if peer is not None:
                    return peer
        key, out = output_dir(composed, multirun)
        check_new_dir(key, out, overrides)  # before anything is written, check_writable's probe included
        check_writable(str(composed.run_root))
    key, out = output_dir(composed, multirun)
    overrides = dir_override(key, out, overrides)
    if checking or not any(f in ("--help", "-h", "--hydra-help") for f in flags):
        validate_hydra_flags(flags, overrides)  # an unknown flag: one line (Hydra prints a usage block)
    if checking:
        n = len(sweep_job_overrides(overrides) or [None]) if multirun else 1
        print(f"valid: tfmoe {exp.name}, {n} job(s); nothing was run ({VALIDATE_ONLY_ENV} is set)")
        return 0
    if multirun:
        flags = ["--multirun", *flags]
    runner.LAUNCHER_PID = os.getpid()
    os.environ[runner.LAUNCHER_ENV] = str(os.getpid())  # a launcher's worker processes know whom they serve
    saved_argv = sys.argv
    sys.argv = [f"tfmoe {exp.name}", *overrides, *flags]  # --info takes an optional value: flags last
    GlobalHydra.instance().clear()
    main = hydra.main(version_base="1.3", config_path=str(config_dir()), config_name=exp.config)(runner.execute)
    hydra_failed = False
    failed: LauncherFailed | None = None
    dirs: list[Path] = []
    sweeps: list[Path] = []
    stopped: BaseException | None = None
    try:
        try:
            with runner.stop_reaches_workers(out), launcher_errors_raised():
                main()
        except runner.JobNotStarted as exc:  # the disk filled during the sweep: this job (and the rest) never started
            print(f"error: {exc.said} (its .hydra/ records refused; the sweep stops here)", file=sys.stderr)
            runner.UNRECORDED.add(exc.job_dir.resolve())
        except SystemExit as exc:  # Hydra's own error path: a bad config, or a launcher that lost a job
            hydra_failed = exc.code not in (0, None)
        except (KeyboardInterrupt, Terminated) as exc:  # Ctrl-C / SIGTERM here: say each job's outcome, then stop
            stopped = exc
        except Exception as exc:  # raised through Hydra (launcher_errors_raised): one line, never a traceback
            failed = said_launcher_error(exc)
            hydra_failed = failed is None
    except (KeyboardInterrupt, Terminated) as exc:  # a second Ctrl-C while Hydra unwound the first
        stopped = stopped or exc
    finally:
        with contextlib.suppress(KeyboardInterrupt, Terminated), signals_deferred():
            sys.argv = saved_argv
            GlobalHydra.instance().clear()
            if multirun:
                runner.stage("sweep_records")
            # a sweep that stopped early (a job killed, a launcher error, Ctrl-C/SIGTERM here) still gets its
            # sweep.parquet: the jobs that finished and the state of the others; a further Ctrl-C waits for it
            hydra_callbacks.complete_unfinished_sweeps()
            dirs, sweeps = made_dirs(out, multirun)
            if made is not None:
                made.extend(dirs)
    if stopped is not None:
        if multirun and dirs and not quiet:
            with contextlib.suppress(KeyboardInterrupt, Terminated):
                print_outcome(dirs, sweeps)
        raise stopped
    unrecorded = {d for d in runner.UNRECORDED if d == out.resolve() or out.resolve() in d.parents}
    runner.UNRECORDED.difference_update(unrecorded)
    unwritten = [s for s in hydra_callbacks.UNWRITTEN_SWEEPS if s.resolve() == out.resolve()]
    hydra_callbacks.UNWRITTEN_SWEEPS.clear()
    if unrecorded or unwritten:  # the file system refused a final record: its one stderr line is the outcome
        return worst_exit_code([exit_code_of([d for d in dirs if d not in unrecorded]), Status.ERROR.exit_code])
    if hydra_failed and not sweeps and not dirs:
        return EXIT_FROM_HYDRA
    if not dirs and not sweeps and failed is None:
        return 0  # --cfg / --info: Hydra printed and ran nothing
    if not quiet:
        print_outcome(dirs, sweeps)
    if failed is not None:
        what = f"the sweep's launcher failed ({failed}); {unfinished_jobs(dirs, sweeps)}" if multirun else \
            f"Hydra could not run it ({failed})"
        print(f"error: {what}", file=sys.stderr)
    codes = [exit_code_of(dirs)] if dirs else []
    if any(has_unstarted_jobs(s) for s in sweeps):  # jobs that never ran: a stop (Ctrl-C's code) or the launcher's
        codes.append(failed.exit_code if failed is not None else Status.NOT_STARTED.exit_code)
    if failed is not None:
        codes.append(failed.exit_code)
    if hydra_failed:
        codes.append(EXIT_FROM_HYDRA)
    return worst_exit_code(codes)


def said_launcher_error(exc: Exception) -> LauncherFailed | None:
    """An exception raised through Hydra's launch: Hydra's own (a config error: its message in one line on stderr,
    None) or the launcher's (a LauncherFailed); the traceback goes to stderr only under the user's own
    HYDRA_FULL_ERROR=1."""
    import traceback

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from tfmoe.contract.errors import disk_problem

    said = disk_problem(exc)  # the file system refused Hydra's directories or files: bad input, exit 2
    if said is None and isinstance(exc, (HydraException, OmegaConfBaseException)):
        said = " ".join(str(exc).split())[:400]
    if said is not None:
        print(f"error: {said}", file=sys.stderr)
        return None
    if _USER_FULL_ERROR:
        traceback.print_exception(exc)
    return LauncherFailed(exc)


def unfinished_jobs(dirs: list[Path], sweeps: list[Path]) -> str:
    """'2 of 3 jobs did not run or did not finish' from the sweeps' tables (or the run directories)."""
    import pandas as pd

    total, done = 0, 0
    for s in sweeps:
        with contextlib.suppress(Exception):
            table = pd.read_parquet(s / "sweep.parquet", columns=["job", "status"]).drop_duplicates("job")
            total += len(table)
            done += int(table["status"].isin([st.value for st in Status if st.final and st != Status.NOT_STARTED]).sum())
    if not total:
        return f"{len(dirs)} job(s) started"
    return f"{total - done} of {total} job(s) did not run or did not finish"


def replay(ref: str, runs_root: Path) -> int:
    """Rerun RUN with its recorded overrides (seed included), then diff new against old.

    A replay that cannot start (the experiment refuses its recorded config, e.g. a user module that can no longer
    be imported) is bad input (BadInput: exit 2, one line), not a failed reproduction."""
    from tfmoe.harness.reading import reports
    from tfmoe.harness.store.notebook import load_run, read_run_row, resolve_run
    from tfmoe.harness.store.rundir import RUN_FILE, UnreadableFile

    old_dir = resolve_run(ref, runs_root)
    unreadable: UnreadableFile | None = None
    try:
        old_run = load_run(old_dir).run
    except UnreadableFile as exc:  # run.parquet is readable (the config, seed, code): re-run it all the same
        if exc.path.name == RUN_FILE:
            raise
        unreadable, old_run = exc, read_run_row(old_dir)
    exp = EXPERIMENTS.get(str(old_run["experiment"]))
    if exp is None:
        raise BadInput(f"{old_dir} is a run of unknown experiment {old_run['experiment']!r}")
    overrides = [o for o in list(old_run["overrides"]) if not o.startswith("run_root=")]
    overrides += [f"seed={int(old_run['seed'])}", f"run_root={runs_root}"]
    from tfmoe.harness.store import code_capture

    for line in code_capture.changes_since(old_dir):  # the user's code: replay the recorded copy, say so
        print(line)
    said = io.StringIO()  # the run's own stderr lines: replayed below unless the run could not start
    with code_capture.recorded_code(old_dir) as file_overrides, contextlib.redirect_stderr(said):
        new_dirs: list[Path] = []
        code = run_experiment(exp, _dedupe(overrides + file_overrides), multirun=False, quiet=True, made=new_dirs)
    if len(new_dirs) != 1:
        raise BadInput("replay could not find the new run directory")
    new = load_run(new_dirs[0])
    if code == Status.ERROR.exit_code and new.run["status"] == Status.ERROR and old_run["status"] != Status.ERROR:
        raise BadInput(f"replay of {old_run['run_id']} could not start: {new.run['error']} "
                       f"(the attempt is recorded in {new_dirs[0]})")
    sys.stderr.write(said.getvalue())
    if unreadable is not None:
        print(f"{old_run['run_id']}'s {unreadable.path.name} is unreadable, so there is nothing to compare against: "
              f"the re-run {new.run['run_id']} ({new.run['status']}) in {new_dirs[0]} stands in for it")
        return code
    code = reports.diff(str(old_dir), str(new_dirs[0]), runs_root, False, False, "table")
    stopped = str(old_run["status"]) in (Status.LOST, Status.INTERRUPTED, Status.RUNNING)
    why = {Status.LOST.value: "was lost (its process died without recording its end: killed, out of memory)",
           Status.INTERRUPTED.value: "was interrupted", Status.RUNNING.value: "is still running"}
    if stopped:  # its records stop where it stopped: differences there say nothing about reproducibility
        print(f"the original {old_run['run_id']} {why[str(old_run['status'])]}: it holds only what it recorded "
              f"before it stopped, so {'differences are expected' if code else 'agreement covers only that part'}")
        print("reproduced as far as the original went" if code == 0 else
              "NOT comparable: the original stopped early (see above); compare two complete runs")
        return code
    print("reproduced" if code == 0 else "NOT reproduced: see the differences above")
    return code


def _dedupe(overrides: list[str]) -> list[str]:
    """Last value of each key wins (Hydra refuses the same key twice)."""
    seen: dict[str, str] = {}
    for o in overrides:
        seen[o.split("=", 1)[0]] = o
    return list(seen.values())
