"""docs/layout.md's "How to add an experiment", run as written: its config and recipe blocks, registered, through the CLI."""

from __future__ import annotations

import re
import shutil
import sys
import textwrap
import types
from pathlib import Path

import pytest

from tfmoe.api.testing import launched

REPO = Path(__file__).resolve().parents[1]


def readme_blocks() -> tuple[str, str]:
    """The yaml and python code blocks of docs/layout.md's "How to add an experiment" section."""
    text = (REPO / "docs" / "layout.md").read_text(encoding="utf-8")
    section = text.split("## How to add an experiment", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(yaml|python)\n(.*?)```", section, re.S)
    kinds = dict((kind, textwrap.dedent(body)) for kind, body in blocks)
    assert set(kinds) == {"yaml", "python"}, "docs/layout.md's how-to lost its config or recipe block"
    return kinds["yaml"], kinds["python"]


@pytest.fixture
def my_exp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from tfmoe.contract import registry

    config, recipe = readme_blocks()
    conf = tmp_path / "conf"
    conf.mkdir()
    shutil.copy(REPO / "conf" / "base.yaml", conf / "base.yaml")
    (conf / "my_exp.yaml").write_text(config)
    module = types.ModuleType("tfmoe.experiments.my_exp")
    monkeypatch.setitem(sys.modules, "tfmoe.experiments.my_exp", module)  # dataclasses look their module up
    exec(compile(recipe, "docs/layout.md#how-to-add-an-experiment", "exec"), module.__dict__)
    exp = registry.Experiment("my-exp", "my_exp", "my_exp", "one-line help")
    monkeypatch.setitem(registry.EXPERIMENTS, "my-exp", exp)
    monkeypatch.setenv("TFMOE_CONF", str(conf))
    monkeypatch.chdir(tmp_path)
    return exp, module


def test_the_readme_recipe_keeps_the_contract_and_runs_ok(my_exp) -> None:
    from tfmoe.harness.store.notebook import load_run

    exp, module = my_exp
    assert {"Settings", "settings", "run"} <= set(vars(module))
    code, dirs = launched(exp, ["n=32"])
    assert code == 0 and len(dirs) == 1
    run = load_run(dirs[0])
    assert run.checks["check"].tolist() == ["sum_matches"] and bool(run.checks["passed"].all())
    assert run.checks["observed"].iloc[0] < run.checks["threshold"].iloc[0]


def test_the_readme_recipe_sweeps_and_refuses_bad_input_before_any_job(my_exp, tmp_path: Path) -> None:
    from tfmoe.contract.errors import BadInput

    exp, _ = my_exp
    code, dirs = launched(exp, ["n=8,16"], multirun=True)
    assert code == 0 and len(dirs) == 2
    before = sorted(p for p in (tmp_path / "runs").rglob("*"))
    with pytest.raises(BadInput, match=r"sweep job 1 \(n=0\): n=0 is below 1"):  # the CLI prints it, exits 2
        launched(exp, ["n=8,0"], multirun=True)
    assert sorted(p for p in (tmp_path / "runs").rglob("*")) == before  # nothing ran, nothing was written


def test_the_readme_check_can_fail(my_exp, monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted bug (a sum that drops the last element) fails sum_matches."""
    import torch

    from tfmoe.harness.store.notebook import load_run

    exp, _ = my_exp
    real_sum = torch.Tensor.sum
    monkeypatch.setattr(torch.Tensor, "sum", lambda self, *a, **k: real_sum(self[:-1], *a, **k)
                        if self.dtype == torch.float32 and not a and not k else real_sum(self, *a, **k))
    code, dirs = launched(exp, ["n=32"])
    assert code == 1
    assert not bool(load_run(dirs[0]).checks["passed"].iloc[0])
