"""Hydra's per-job composition, sped up for a sweep (sweep_speed.py), composes exactly what Hydra composes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hydra import initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import ConfigCompositionException
from hydra.types import RunMode
from omegaconf import OmegaConf

from tfmoe.harness.launching import runner
from tfmoe.harness.launching.launch import config_dir
from tfmoe.harness.launching.sweep_speed import derivable, faster_composition, parse

REPO = Path(__file__).resolve().parents[1]

# every override form a job of a sweep can carry (one job each), plus jobs that combine them
FORMS = [
    ["a=2"], ["+new=3"], ["++a=5"], ["++fresh=1"], ["~opt"], ["~a=1"], ["s='hello world'"], ['s="a,b=c"'],
    ['s="我"'], ["lst=[3,4,5]"], ["lst=[]"], ["nested={x: 2}"], ["++nested={z: 3}"], ["nested.x=7"], ["+nested.w=1"], ["a=${b}"],
    ["s=null"], ["+d={k: v, n: [1, 2]}"], ["a=1e-3"], ["s=true"], ["model.width=9"], ["s=abc", "a=3", "~opt"],
    ["model=large"], ["model=large", "a=4"],  # a config group: composed by Hydra, not derived
]


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    d = tmp_path / "conf"
    (d / "model").mkdir(parents=True)
    shutil.copy(REPO / "conf" / "base.yaml", d / "base.yaml")
    (d / "model" / "small.yaml").write_text("width: 4\n")
    (d / "model" / "large.yaml").write_text("width: 64\n")
    (d / "t.yaml").write_text("defaults:\n  - base\n  - model: small\n  - _self_\nexperiment: t\na: 1\nb: 10\n"
                              "s: x\nlst: [1, 2]\nnested: {x: 1, y: '${a}'}\nopt: 7\n")
    return d


def _task(cfg) -> dict:
    """The job's own config, resolved (what the experiment reads)."""
    task = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
    try:
        return OmegaConf.to_container(task, resolve=True)
    except Exception as exc:  # e.g. ~a leaves ${a} dangling: the same error either way
        return {"unresolvable": type(exc).__name__}


def _both(loader, master, job):
    """(Hydra's own config or its exception type, the sped-up one or its exception type): the YAML that
    run_job saves as .hydra/config.yaml + hydra.yaml and overrides.yaml, flags, the resolved job config."""
    out = []
    for fast in (False, True):
        undo = faster_composition(loader) if fast else (lambda: None)
        try:
            cfg = loader.load_sweep_config(master, list(job))
            out.append((OmegaConf.to_yaml(cfg), OmegaConf.to_yaml(cfg.hydra.overrides.task), OmegaConf.is_struct(cfg),
                        _task(cfg),
                        OmegaConf.select(cfg, "hydra.sweep.dir"),  # the master's cached run name
                        OmegaConf.is_readonly(cfg.hydra)))
        except ConfigCompositionException as exc:
            out.append(type(exc))
        finally:
            undo()
    return out


def test_derived_job_configs_equal_hydras_for_every_override_form(conf: Path) -> None:
    runner.register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
            loader = GlobalHydra.instance().config_loader()
            master = loader.load_configuration("t", ["a=1,2", "hydra.job.name=custom"], RunMode.MULTIRUN)
            assert master.hydra.sweep.dir  # resolved once, as the sweeper does before any job
            for job in FORMS:
                hydra_cfg, fast_cfg = _both(loader, master, job)
                assert hydra_cfg == fast_cfg, job
                assert not isinstance(hydra_cfg, type), job  # every form composes
                assert derivable(loader, parse(job)) == ("model=large" not in job), job  # derived, not composed
            for bad in (["nosuch=1"], ["+a=1"], ["~nosuch"], ["~a=99"], ["nested.x.y=1"], ["nested={z: 3}"]):  # refused alike
                hydra_cfg, fast_cfg = _both(loader, master, bad)
                assert hydra_cfg is fast_cfg is ConfigCompositionException, bad
            # a sweep's jobs as Hydra's basic sweeper splits them: choice, range, lists, quoted strings
            sweep = ["a=1,2", "b=range(0,2)", "lst=[1],[2,3]", "s=choice('p q',r)", "~opt"]
            jobs = [j for batch in BasicSweeper.split_arguments(parse(sweep), None) for j in batch]
            assert len(jobs) == 2 * 2 * 2 * 2
            master = loader.load_configuration("t", sweep, RunMode.MULTIRUN)
            assert master.hydra.sweep.dir
            for job in jobs:
                hydra_cfg, fast_cfg = _both(loader, master, job)
                assert hydra_cfg == fast_cfg and not isinstance(hydra_cfg, type), job
    finally:
        GlobalHydra.instance().clear()


def test_faster_composition_gives_hydras_configs_and_is_undone() -> None:
    runner.register_resolvers()  # the run-name resolver the configs use
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            loader = GlobalHydra.instance().config_loader()
            master = loader.load_configuration("shift_labels", ["seed=0,1,2", "pad_side=left,right"],
                                               RunMode.MULTIRUN)
            jobs = [[f"seed={s}", f"pad_side={p}"] for s in range(3) for p in ("left", "right")]
            expected = [OmegaConf.to_container(loader.load_sweep_config(master, job)) for job in jobs]
            undo = faster_composition(loader)
            validated = [loader.load_sweep_config(master, job) for job in jobs]  # the sweeper's validation
            launched = [loader.load_sweep_config(master, job) for job in jobs]  # the launcher's calls
            assert all(a is not b for a, b in zip(validated, launched, strict=True))  # fresh objects, as Hydra's
            assert [OmegaConf.to_container(c) for c in validated] == expected
            assert [OmegaConf.to_container(c) for c in launched] == expected
            assert [(c.seed, c.pad_side) for c in launched] == [(s, p) for s in range(3) for p in ("left", "right")]
            undo()
            assert "load_sweep_config" not in vars(loader)
            assert all("load_config" not in vars(s) for s in loader.repository.sources)
            assert OmegaConf.to_container(loader.load_sweep_config(master, jobs[1])) == expected[1]
    finally:
        GlobalHydra.instance().clear()


TRICKY = ["yes", "Off", "1e3", "0x1F", "null", "~", "a: b", "- x", "#hash", "it's", 'say "hi"', "  lead", "trail ",
          "line1\nline2\n", "x" * 150, " ".join(["word"] * 40), "我爱猫", "tab\there", "", "${a}", "\\back", "é\u2028"]


def test_libyaml_saves_are_byte_identical_to_omegaconfs() -> None:
    """The .hydra/*.yaml of a sweep's jobs (config.yaml, hydra.yaml, overrides.yaml) written through libyaml are
    the bytes OmegaConf.to_yaml writes, for every experiment's config and for awkward strings."""
    from tfmoe.contract.registry import EXPERIMENTS
    from tfmoe.harness.launching.sweep_speed import omegaconf_yaml

    runner.register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            loader = GlobalHydra.instance().config_loader()
            for exp in EXPERIMENTS.values():
                master = loader.load_configuration(exp.config, ["seed=0,1"], RunMode.MULTIRUN)
                cfg = loader.load_sweep_config(master, ["seed=1"])
                task = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"])
                for node in (task, OmegaConf.masked_copy(cfg, "hydra"), cfg.hydra.overrides.task):
                    assert omegaconf_yaml(node) == OmegaConf.to_yaml(node), exp.name
    finally:
        GlobalHydra.instance().clear()
    odd = OmegaConf.create({"s": TRICKY, "nested": {t or "empty": t for t in TRICKY}, "n": [1, 1.5, None, True]})
    assert omegaconf_yaml(odd) == OmegaConf.to_yaml(odd)
