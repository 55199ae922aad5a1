"""The run keeps the code it ran: user modules and input files copied with hashes and import root; replay uses the
recorded copy and says when the file changed; diff reports a code difference; a dirty checkout keeps its diff."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from tfmoe.api.testing import launched, run_cli
from tfmoe.harness.store import code_capture

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def user_module(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tests/buggy_attention.py copied to a user folder as `myattn`, that folder on sys.path."""
    folder = workdir / "mycode"
    folder.mkdir()
    path = folder / "myattn.py"
    shutil.copy(REPO / "tests" / "buggy_attention.py", path)
    monkeypatch.syspath_prepend(str(folder))
    yield path
    sys.modules.pop("myattn", None)


def test_module_is_copied_replayed_from_the_copy_and_diffed(workdir: Path, user_module: Path) -> None:
    a = run_cli(["attn-check", "impl=myattn:PlainMHA", "checks=sdpa"], workdir)
    assert a.exit_code == 0, a.stderr
    code = pd.read_parquet(a.run_dir / "code.parquet")
    row = code[code["kind"] == "module"].iloc[0]
    assert (row["key"], row["module"], row["import_root"]) == ("impl", "myattn", str(user_module.parent))
    assert row["sha256"] == code_capture.sha256(user_module) and row["copy"] == "code/myattn.py"
    assert (a.run_dir / "code" / "myattn.py").read_bytes() == user_module.read_bytes()
    # the user edits the module: √d_model instead of √d_head
    text = user_module.read_text()
    user_module.write_text(text.replace("return 1.0 / math.sqrt(self.d_head)", "return 1.0 / math.sqrt(self.d_model)", 1))
    sys.modules.pop("myattn", None)
    rep = run_cli(["replay", str(a.run_dir)], workdir)
    assert "impl: " in rep.stdout and "changed since the run" in rep.stdout and "+1 −1 lines" in rep.stdout
    assert "replaying with the recorded copy code/myattn.py" in rep.stdout
    assert rep.exit_code == 0 and "reproduced" in rep.stdout and "NOT" not in rep.stdout, rep.stdout
    assert "myattn" not in sys.modules or code_capture.CODE_DIR not in str(sys.modules["myattn"].__file__)
    # a plain run now uses the edited file: diff names the code difference (and the failing sdpa_match)
    sys.modules.pop("myattn", None)
    b = run_cli(["attn-check", "impl=myattn:PlainMHA", "checks=sdpa"], workdir)
    assert b.exit_code == 1
    body = json.loads(run_cli(["diff", str(a.run_dir), str(b.run_dir), "--format", "json"], workdir).stdout)
    [changed] = body["code"]
    assert changed["file"] == "impl (module)" and "math.sqrt(self.d_model)" in changed["note"]


def test_tfmoe_own_modules_and_libraries_are_not_copied() -> None:
    refs = code_capture.referenced_code({"impl": "tfmoe.components.attention:MultiHeadSelfAttention",
                                         "other": "torch.nn:Linear", "text": "not/a/file.txt"})
    assert refs == []


def test_input_file_is_copied_and_a_changed_input_replays_from_the_copy(fake_experiment, tmp_path: Path) -> None:
    data = tmp_path / "inputs" / "corpus.txt"
    data.parent.mkdir()
    data.write_text("我爱猫\n")
    code, dirs = launched(fake_experiment, [f"input={data}"])
    assert code == 0
    run_dir = dirs[-1]
    row = code_capture.read(run_dir).iloc[0]
    assert (row["key"], row["kind"], row["copy"]) == ("input", "file", "code/files/input/corpus.txt")
    data.write_text("我爱狗\n")
    [said] = code_capture.changes_since(run_dir)
    assert "changed since the run" in said and "-我爱猫; +我爱狗" in said
    with code_capture.recorded_code(run_dir) as overrides:
        assert overrides == [f"input={(run_dir / 'code/files/input/corpus.txt').resolve()}"]


def test_dirty_checkout_keeps_its_uncommitted_diff(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "checkout"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "src").mkdir()
    (repo / "src" / "model.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    monkeypatch.setattr(code_capture, "TFMOE_ROOT", repo)
    assert code_capture.tfmoe_diff() is None  # clean: nothing to keep
    (repo / "src" / "model.py").write_text("x = 2\n")
    (repo / "src" / "new.py").write_text("y = 1\n")
    diff = code_capture.tfmoe_diff()
    assert "-x = 1" in diff and "+x = 2" in diff and "untracked (not in the diff): src/new.py" in diff
    df = code_capture.capture({}, tmp_path / "run")
    assert list(df["kind"]) == ["tfmoe_diff"] and (tmp_path / "run" / "code" / "tfmoe.diff").read_text() == diff


def test_git_dirty_and_tfmoe_diff_cover_code_and_configs_not_the_notebook(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkout whose only change is the notebook's own files (failures.md, runs/, conclusions, docs, lab reports)
    is clean: `failures add` used to make every later run git_dirty=True and its replay "differ"."""
    from tfmoe.harness.store import notebook

    repo = tmp_path / "checkout"
    for rel, text in {"src/tfmoe/model.py": "x = 1\n", "conf/base.yaml": "seed: 0\n", "pyproject.toml": "[x]\n",
                      "failures.md": "# Failures\n", "docs/page.md": "a\n", "experiments/lab.md": "a\n",
                      "runs/.keep": ""}.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-f", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    package = repo / "src" / "tfmoe"  # git_state starts from the package, a sub-folder of the checkout
    monkeypatch.setattr(code_capture, "TFMOE_ROOT", package)

    def git_state() -> tuple[str | None, bool | None]:
        notebook.git_state.cache_clear()  # cached per process: one answer per run
        return notebook.git_state(package)

    commit, dirty = git_state()
    assert commit and dirty is False
    (repo / "failures.md").write_text("# Failures\n\n## F-1: x\n")
    (repo / "docs/page.md").write_text("b\n")
    (repo / "experiments/lab.md").write_text("b\n")
    (repo / "runs/.keep").write_text("a run\n")
    (repo / "runs/new.parquet").write_text("untracked\n")
    assert git_state() == (commit, False)
    assert code_capture.tfmoe_diff() is None
    for rel in ("src/tfmoe/model.py", "conf/base.yaml", "pyproject.toml"):
        before = (repo / rel).read_text()
        (repo / rel).write_text(before + "# edited\n")
        assert git_state() == (commit, True), rel
        diff = code_capture.tfmoe_diff()
        assert f"+++ b/{rel}" in diff and "failures.md" not in diff and "docs/" not in diff, rel
        (repo / rel).write_text(before)
    (repo / "src/tfmoe/new.py").write_text("y = 1\n")  # untracked code is named, the notebook's files are not
    (repo / "src/tfmoe/model.py").write_text("x = 2\n")
    diff = code_capture.tfmoe_diff()
    assert "untracked (not in the diff): src/tfmoe/new.py" in diff and "runs/new.parquet" not in diff
