"""The wheel and the sdist: the sdist builds the same wheel, the wheel holds every file the code loads at run time
(its modules, the Hydra configs, the data files, the examples the docs name), and installing it into an environment
that already holds a supported torch plans no torch change (pip's own resolver, ``--dry-run --report``).

The builds run on a copy of the checkout's source in a temporary directory (no build/ or egg-info in the checkout,
no collision between pytest-xdist workers)."""

from __future__ import annotations

import email
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "src", "conf", "docs/examples")


def _isolation() -> list[str]:
    """--no-isolation where this environment meets the build system (setuptools>=77: the lock's), else pip
    installs it in an isolated build environment (an engineer's venv may hold an older setuptools)."""
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return []
    return ["--no-isolation"] if major >= 77 else []


def _build(args: list[str], source: Path, out: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "build", *_isolation(), *args, "--outdir", str(out), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{'sdist', 'wheel' (built from the sdist, as `python -m build` does), 'direct' (built from the tree)}."""
    pytest.importorskip("build", reason="the dev extra's `build` is not installed")
    root = tmp_path_factory.mktemp("packaging")
    source = root / "source"
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc"))
        else:
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, source / name)
    _build([], source, root / "dist")  # the sdist, then the wheel built from the unpacked sdist
    _build(["--wheel"], source, root / "direct")
    (sdist,) = (root / "dist").glob("*.tar.gz")
    (wheel,) = (root / "dist").glob("*.whl")
    (direct,) = (root / "direct").glob("*.whl")
    return {"sdist": sdist, "wheel": wheel, "direct": direct}


def _record(wheel: Path) -> dict[str, str]:
    """{path: sha256} of every file in the wheel but RECORD itself."""
    with zipfile.ZipFile(wheel) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
        rows = [line.split(",") for line in z.read(record).decode().splitlines() if line]
    return {path: digest for path, digest, _ in rows if path != record}


def _names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


def test_the_sdist_builds_the_same_wheel(dists: dict[str, Path]) -> None:
    from_sdist, direct = _record(dists["wheel"]), _record(dists["direct"])
    assert sorted(set(from_sdist) ^ set(direct)) == []
    assert [p for p in from_sdist if from_sdist[p] != direct[p]] == []
    with tarfile.open(dists["sdist"]) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "conf/base.yaml", "docs/examples/my_attention.py"} <= names


def test_the_wheel_holds_what_the_code_loads(dists: dict[str, Path]) -> None:
    names = _names(dists["wheel"])
    # every module: a subpackage missing from pyproject's package list imports from a checkout, not installed
    modules = {f"tfmoe/{p.relative_to(REPO / 'src' / 'tfmoe').as_posix()}"
               for p in (REPO / "src" / "tfmoe").rglob("*.py")}
    assert sorted(modules - names) == []
    # launch.config_dir(): the Hydra configs as the package tfmoe.conf
    confs = {f"tfmoe/conf/{p.relative_to(REPO / 'conf').as_posix()}" for p in (REPO / "conf").rglob("*.yaml")}
    assert confs and sorted(confs - names) == []
    # importlib.resources.files("tfmoe") / "data" / <file>: every data file the code names, and every one shipped
    data = {f"tfmoe/data/{p.name}" for p in (REPO / "src" / "tfmoe" / "data").iterdir() if p.is_file()
            and p.suffix != ".py"}
    code = "\n".join(p.read_text() for p in (REPO / "src" / "tfmoe").rglob("*.py"))
    named = {f"tfmoe/data/{m}" for m in re.findall(r"[\"'/]([\w.-]+\.(?:txt|tsv|json|csv))[\"']", code)
             if (REPO / "src" / "tfmoe" / "data" / m).exists()}
    assert data and named and sorted((data | named) - names) == []
    # the examples the docs name (docs/examples/<file>), for a user with no checkout
    docs = "\n".join(p.read_text() for p in [REPO / "README.md", *(REPO / "docs").glob("*.md")])
    examples = {f"tfmoe/examples/{m}" for m in re.findall(r"docs/examples/([\w.-]+)", docs)}
    assert examples and sorted(examples - names) == []
    # the console script and the pytest plugin's entry point
    with zipfile.ZipFile(dists["wheel"]) as z:
        entry = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "tfmoe = tfmoe.cli:main" in entry and "tfmoe = tfmoe.api.pytest_plugin" in entry
    # and nothing of the checkout's own: tests, runs, caches
    assert [n for n in names if n.startswith(("tests/", "runs/")) or "__pycache__" in n or n.endswith(".pyc")] == []


def test_the_wheel_declares_ranges_not_pins(dists: dict[str, Path]) -> None:
    """Declared = tested: torch and Hydra as ranges (scripts/test-torch-range.sh runs the floor and the newest)."""
    with zipfile.ZipFile(dists["wheel"]) as z:
        meta = email.message_from_bytes(z.read(next(n for n in z.namelist() if n.endswith("METADATA"))))
    requires = {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0].lower(): r for r in meta.get_all("Requires-Dist")
                if "extra ==" not in r}
    for name in ("torch", "hydra-core", "hydra-joblib-launcher", "hydra-submitit-launcher"):
        assert "==" not in requires[name] and ">=" in requires[name] and "<" in requires[name], requires[name]
    assert meta["Requires-Python"] == "<3.12,>=3.11"


def torch_venvs() -> list[str]:
    """Pythons that hold a supported torch: this one, and the CI venvs of scripts/test-torch-range.sh when built."""
    found = [sys.executable]
    for venv in os.environ.get("TFMOE_TORCH_VENVS", "").split(os.pathsep):
        if venv and Path(venv, "bin", "python").exists():
            found.append(str(Path(venv, "bin", "python")))
    return found


@pytest.mark.parametrize("python", torch_venvs())
def test_installing_the_wheel_keeps_the_torch_there(dists: dict[str, Path], python: str, tmp_path: Path) -> None:
    torch_before = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                                  text=True, timeout=120, check=True).stdout.strip()
    report = tmp_path / "report.json"
    proc = subprocess.run([python, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report),
                           str(dists["wheel"])], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    planned = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert "torch" not in planned, f"pip would replace torch {torch_before} with {planned['torch']}"
    assert set(planned) <= {"tfmoe"}, planned  # every other dependency is already there in a range tfmoe admits
