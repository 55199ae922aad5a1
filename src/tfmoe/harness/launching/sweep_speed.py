"""Hydra's per-job composition cost in a sweep, cut without changing what it composes.

Hydra's basic sweeper first composes every job's config to validate the batch, then its launcher composes each
again to run it, and every composition re-reads and re-parses the same YAML files and rebuilds the defaults tree.
For the duration of one multirun, in the launching process only, :func:`faster_composition` wraps the sweep's own
config loader (instance attributes, undone at the end of the sweep):

- each config source returns a deep copy of what it parsed the first time;
- when none of a job's overrides names a config group (``model=small``, ``hydra/launcher=joblib`` as a task
  override) or a ``hydra`` key, the job's config is *derived*: one config composed with no task overrides
  (:func:`base_config`), copied, and the job's value overrides applied to the copy with Hydra's own
  ``_apply_overrides_to_config`` — exactly the steps Hydra's ``_load_configuration_impl`` takes after building the
  defaults list, which such overrides do not change (:func:`derive`). Other jobs are composed by Hydra;
- the sweeper's validation and the launcher each derive the job's config afresh (a few ms; holding 1,000 validated
  configs until their launch would cost far more memory).

tests/test_sweep_speed.py compares derived configs with Hydra's own composition for every override form.
"""

from __future__ import annotations

import copy
import functools
import pickle
from collections.abc import Callable, Sequence
from typing import Any


@functools.cache
def _parser() -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def parse(overrides: Sequence[str]) -> list[Any]:
    """Hydra's own parse of override strings (one parser, built once)."""
    return _parser().parse_overrides(list(overrides))


def derivable(loader: Any, parsed: Sequence[Any]) -> bool:
    """Whether these (task) overrides leave the defaults list alone: plain value overrides on non-hydra keys."""
    repo = getattr(loader, "repository", None)
    if repo is None:
        return False
    for o in parsed:
        key = o.key_or_group
        if o.is_hydra_override() or o.package is not None or "/" in key or o.is_sweep_override():
            return False
        if repo.group_exists(key):
            return False
    return True


def base_config(loader: Any, master: Any, compose: Callable[..., Any] | None = None) -> Any:
    """The sweep's config with the master's hydra overrides and no task overrides (Hydra composes it)."""
    compose = compose or loader.load_sweep_config
    return compose(master_config=master, sweep_overrides=[])


def derive(base: bytes, master: Any, parsed: Sequence[Any]) -> Any:
    """The config Hydra's ``load_sweep_config(master, overrides)`` composes, from ``base`` (the pickled base
    config: unpickling is ~5x cheaper than a deepcopy of the config; see module doc)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl, get_overrides_dirname
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = pickle.loads(base)
    try:
        ConfigLoaderImpl._apply_overrides_to_config(list(parsed), cfg)
        for o in parsed:
            cfg.hydra.overrides.task.append(o.input_line)
        dirname = cfg.hydra.job.config.override_dirname
        cfg.hydra.job.override_dirname = get_overrides_dirname(
            overrides=list(parsed), kv_sep=dirname.kv_sep, item_sep=dirname.item_sep,
            exclude_keys=dirname.exclude_keys)
    except OmegaConfBaseException as e:  # as Hydra's load_configuration reports it
        raise ConfigCompositionException().with_traceback(e.__traceback__) from e
    if master is not None:
        OmegaConf.copy_cache(from_config=master, to_config=cfg)
    return cfg


class JobConfigs:
    """Each job's config of one sweep (``master``): derived from one base config where :func:`derivable`,
    else composed by Hydra (``compose``: the loader's own ``load_sweep_config``)."""

    def __init__(self, loader: Any, master: Any, compose: Callable[..., Any] | None = None,
                 base: Any = None) -> None:
        """``base``: the base config when the caller has composed it already; ``master`` None: no resolver cache
        to copy (the configs are only read, not run)."""
        self.loader, self.master = loader, master
        self.compose = compose or loader.load_sweep_config
        self._base: bytes | None = None if base is None else pickle.dumps(base)
        self._base_failed = False

    def base(self) -> bytes | None:
        if self._base is None and not self._base_failed:
            try:
                self._base = pickle.dumps(base_config(self.loader, self.master, self.compose))
            except Exception:  # e.g. a config that composes only with its overrides: Hydra composes each job
                self._base_failed = True
        return self._base

    def __call__(self, overrides: list[str]) -> Any:
        parsed = parse(overrides)
        base = self.base() if overrides and derivable(self.loader, parsed) else None
        if base is None:
            return self.compose(master_config=self.master, sweep_overrides=list(overrides))
        return derive(base, self.master, parsed)


def faster_composition(loader: Any) -> Callable[[], None]:
    """Wrap ``loader`` (Hydra's ConfigLoaderImpl); returns the function that undoes it."""
    undo: list[Callable[[], None]] = []
    sources = getattr(getattr(loader, "repository", None), "sources", None) or []
    for source in sources:
        read = source.load_config
        parsed_files: dict[str, Any] = {}

        def load_config(config_path: str, read: Any = read, parsed_files: dict[str, Any] = parsed_files) -> Any:
            if config_path not in parsed_files:
                parsed_files[config_path] = read(config_path)
            return copy.deepcopy(parsed_files[config_path])  # Hydra edits what it loads (it pops `defaults`)

        source.load_config = load_config
        undo.append(lambda source=source: source.__dict__.pop("load_config", None))
    compose = loader.load_sweep_config
    sweeps: dict[int, JobConfigs] = {}  # id(master) -> its jobs' configs (JobConfigs holds the master)

    def load_sweep_config(master_config: Any, sweep_overrides: list[str]) -> Any:
        if id(master_config) not in sweeps:
            sweeps[id(master_config)] = JobConfigs(loader, master_config, compose)
        return sweeps[id(master_config)](sweep_overrides)

    loader.load_sweep_config = load_sweep_config
    undo.append(lambda: loader.__dict__.pop("load_sweep_config", None))

    def restore() -> None:
        for u in undo:
            u()

    return restore


def omegaconf_yaml(cfg: Any) -> str:
    """``OmegaConf.to_yaml(cfg)``, byte for byte, through libyaml's emitter (PyYAML's C extension) when it is
    available: the same representers (OmegaConf's string quoting), ~2.5x less CPU than the pure-Python emitter.
    tests/test_sweep_speed.py compares both on every experiment's config."""
    import yaml
    from omegaconf import OmegaConf
    from omegaconf._utils import OmegaConfDumper, get_omega_conf_dumper

    if not getattr(yaml, "__with_libyaml__", False):
        return OmegaConf.to_yaml(cfg)
    get_omega_conf_dumper()  # registers OmegaConf's string representer, as to_yaml does
    dumper = _c_dumper(OmegaConfDumper)
    container = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    return yaml.dump(container, default_flow_style=False, allow_unicode=True, sort_keys=False, Dumper=dumper)


@functools.cache
def _c_dumper(python_dumper: type) -> type:
    import yaml

    class CDumper(yaml.CDumper):  # type: ignore[misc, name-defined]
        pass

    CDumper.add_representer(str, python_dumper.str_representer)
    return CDumper


def faster_job_records() -> Callable[[], None]:
    """For one multirun in the launching process: Hydra's ``.hydra/*.yaml`` saves through :func:`omegaconf_yaml`
    (the same bytes), and tfmoe's own ``git diff`` (code_capture.tfmoe_diff, two git processes per job) taken once
    for the sweep — as the environment's git commit/dirty state already is once per process (notebook.git_state):
    the code a sweep's in-process jobs run is the code imported when it started. Returns the undo."""
    from pathlib import Path

    import hydra.core.utils as hydra_utils

    from tfmoe.harness.store import code_capture

    save, diff = hydra_utils._save_config, code_capture.tfmoe_diff
    taken: list[str | None] = []

    def save_config(cfg: Any, filename: str, output_dir: Path) -> None:  # hydra.core.utils._save_config
        from tfmoe.contract.errors import disk_problem
        from tfmoe.harness.launching.runner import JobNotStarted

        try:
            output_dir.mkdir(parents=True, exist_ok=True)
            with open(str(output_dir / filename), "w", encoding="utf-8") as file:
                file.write(omegaconf_yaml(cfg))
        except OSError as exc:  # a disk that filled since the sweep started: one line, not Hydra's traceback
            said = disk_problem(exc, output_dir.parent)
            if said is None:
                raise
            raise JobNotStarted(said, output_dir.parent) from None

    def tfmoe_diff() -> str | None:
        if not taken:
            taken.append(diff())
        return taken[0]

    hydra_utils._save_config, code_capture.tfmoe_diff = save_config, tfmoe_diff

    def restore() -> None:
        hydra_utils._save_config, code_capture.tfmoe_diff = save, diff

    return restore
