"""Hydra's per-job composition, sped up for a sweep (sweep_speed.py), composes exactly what Hydra composes."""

from __future__ import annotations

from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.types import RunMode
from omegaconf import OmegaConf

from tfmoe import runner
from tfmoe.launch import config_dir
from tfmoe.sweep_speed import faster_composition


def _plain(cfg) -> dict:
    return OmegaConf.to_container(cfg, resolve=False)


def test_faster_composition_gives_hydras_configs_and_is_undone() -> None:
    runner.register_resolvers()  # the run-name resolver the configs use
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            loader = GlobalHydra.instance().config_loader()
            master = loader.load_configuration("shift_labels", ["seed=0,1,2", "pad_side=left,right"],
                                               RunMode.MULTIRUN)
            jobs = [[f"seed={s}", f"pad_side={p}"] for s in range(3) for p in ("left", "right")]
            expected = [_plain(loader.load_sweep_config(master, job)) for job in jobs]
            undo = faster_composition(loader)
            validated = [loader.load_sweep_config(master, job) for job in jobs]  # the sweeper's validation
            launched = [loader.load_sweep_config(master, job) for job in jobs]  # the launcher's calls
            assert all(a is b for a, b in zip(validated, launched, strict=True))  # composed once, not twice
            assert [_plain(c) for c in launched] == expected
            assert [(c.seed, c.pad_side) for c in launched] == [(s, p) for s in range(3) for p in ("left", "right")]
            again = loader.load_sweep_config(master, jobs[0])  # a third call composes afresh (cached YAML)
            assert _plain(again) == expected[0] and again is not launched[0]
            undo()
            assert "load_sweep_config" not in vars(loader)
            assert all("load_config" not in vars(s) for s in loader.repository.sources)
            assert _plain(loader.load_sweep_config(master, jobs[1])) == expected[1]
    finally:
        GlobalHydra.instance().clear()
