"""Shared fixtures: a throw-away working directory and a registered fake experiment."""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def fake_experiment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Registers `fake` (tests/fake_experiment.py) with its own conf dir; returns the Experiment."""
    import fake_experiment as module

    from tfmoe.contract import registry

    conf = tmp_path / "conf"
    conf.mkdir()
    shutil.copy(REPO / "conf" / "base.yaml", conf / "base.yaml")
    (conf / "fake.yaml").write_text("defaults:\n  - base\n  - _self_\nexperiment: fake\nmode: ok\nsteps: 5\nplugin: null\ninput: null\n"
                                    "coef: null\n")
    exp = registry.Experiment("fake", "fake", "fake", "a test experiment")
    monkeypatch.setitem(registry.EXPERIMENTS, "fake", exp)
    monkeypatch.setitem(sys.modules, "tfmoe.experiments.fake", module)
    monkeypatch.setenv("TFMOE_CONF", str(conf))
    monkeypatch.chdir(tmp_path)
    # the CLI registers one command per experiment when it is first imported: an app imported by an earlier test
    # gets `fake` too, for this test only (run_cli(["fake", ...]) must not depend on the order tests run in)
    from tfmoe import cli

    if not any(c.name == "fake" for c in cli.app.registered_commands):
        monkeypatch.setattr(cli.app, "registered_commands", list(cli.app.registered_commands))
        cli.app.command(name="fake", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
            cli._experiment_command(exp))
    return exp


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: one intra-op thread avoids OpenMP hand-offs against other processes on 2 shared cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_configure(config: pytest.Config) -> None:
    # the CLI fuzzer (tests/test_cli_fuzz.py): in the default suite with a small budget; `-m fuzz` selects it alone
    config.addinivalue_line("markers", "fuzz: the schema-driven CLI fuzzer (long run: TFMOE_FUZZ_EXAMPLES=N -m fuzz)")


def sigint_default() -> None:
    """``preexec_fn`` for a child a test sends Ctrl-C: SIGINT back to its default, as a terminal would deliver it.
    A non-interactive shell starts background jobs with SIGINT ignored, the ignore is inherited by pytest and its
    children, and Python started with SIGINT ignored never raises KeyboardInterrupt (F-202)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
