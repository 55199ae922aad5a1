"""tfmoe's pytest plugin (entry point ``pytest11``; before it is installed: ``pytest -p tfmoe.api.pytest_plugin``).

A thin layer over :mod:`tfmoe.api.checking`:

- markers ``@pytest.mark.tfmoe_attention(MyAttention, **settings)``, ``tfmoe_kernel(fn, **settings)``,
  ``tfmoe_moe(MyMoE, **settings)`` and ``tfmoe_model(MyLM, **settings)`` (a whole causal LM): the marked test first judges the layer and fails, with the verdict's table,
  when a check fails (then its own body runs);
- the fixture ``tfmoe_check``: ``tfmoe.assert_attention_conforms(...)`` and the other five functions of the API, with
  the test run's profile and record directory applied;
- ``--tfmoe-profile quick|full`` (default quick: the reduced case matrix, :data:`tfmoe.api.checking.QUICK`; full: the
  CLI's defaults); a ``profile=`` given in a call or a marker wins;
- ``--tfmoe-record DIR``: every check that fails leaves a normal run directory under ``DIR/<experiment>/``
  (``tfmoe show``, ``diff``, ``failures add`` read it), its path in the failure's table.

Importing this module imports neither torch nor tfmoe's batteries (they load on the first check).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

MARKERS = {"tfmoe_attention": "attention", "tfmoe_kernel": "kernel", "tfmoe_moe": "moe", "tfmoe_model": "model"}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tfmoe", "tfmoe: judge attention / kernel / MoE layers")
    group.addoption("--tfmoe-profile", choices=("quick", "full"), default="quick",
                    help="quick: a reduced case matrix (default); full: the CLI's defaults")
    group.addoption("--tfmoe-record", metavar="DIR", default=None,
                    help="keep a run directory of every failed check under DIR/<experiment>/")


def pytest_configure(config: pytest.Config) -> None:
    for name, kind in MARKERS.items():
        config.addinivalue_line("markers", f"{name}(layer, **settings): judge the {kind} layer with tfmoe's battery "
                                           "before the test; a failed check fails the test with the table")


class Checker:
    """The ``tfmoe_check`` fixture: tfmoe.api.checking' functions with the test run's ``--tfmoe-profile`` and
    ``--tfmoe-record`` (failed checks only) applied."""

    def __init__(self, profile: str, record: str | None) -> None:
        self.profile, self.record = profile, record

    def _run(self, kind: str, target: Any, settings: dict[str, Any]) -> Any:
        from tfmoe.api import checking as checks

        profile = settings.pop("profile", self.profile)
        record = settings.pop("record", None)
        if record is not None:
            return checks._check(kind, target, profile, record, settings)
        return checks._check(kind, target, profile, self.record, settings, record_only_failed=True)

    def check_attention(self, layer: Any, /, **settings: Any) -> Any:
        return self._run("attention", layer, settings)

    def check_kernel(self, fn: Any, /, **settings: Any) -> Any:
        return self._run("kernel", fn, settings)

    def check_moe(self, moe: Any, /, **settings: Any) -> Any:
        return self._run("moe", moe, settings)

    def check_model(self, model: Any, /, **settings: Any) -> Any:
        return self._run("model", model, settings)

    def assert_model_conforms(self, model: Any, /, **settings: Any) -> Any:
        return _conforms(self.check_model(model, **settings))

    def assert_attention_conforms(self, layer: Any, /, **settings: Any) -> Any:
        return _conforms(self.check_attention(layer, **settings))

    def assert_kernel_conforms(self, fn: Any, /, **settings: Any) -> Any:
        return _conforms(self.check_kernel(fn, **settings))

    def assert_moe_conforms(self, moe: Any, /, **settings: Any) -> Any:
        return _conforms(self.check_moe(moe, **settings))


def _conforms(verdict: Any) -> Any:
    from tfmoe.api.checking import _conforms as conforms

    return conforms(verdict)


def _checker(config: pytest.Config) -> Checker:
    record = config.getoption("--tfmoe-record")
    if record is not None:
        record = str(Path(record).resolve())
    return Checker(config.getoption("--tfmoe-profile"), record)


@pytest.fixture
def tfmoe_check(request: pytest.FixtureRequest) -> Checker:
    """tfmoe's check functions with this test run's --tfmoe-profile and --tfmoe-record."""
    return _checker(request.config)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """Judge each layer a tfmoe_* marker names before the test body; a failed check fails the test. An unknown
    tfmoe_* marker (a misspelling) fails the test rather than passing it unjudged."""
    unknown = sorted({m.name for m in item.iter_markers() if m.name.startswith("tfmoe_") and m.name not in MARKERS})
    if unknown:
        pytest.fail(f"unknown marker @pytest.mark.{unknown[0]}: tfmoe's markers are {', '.join(MARKERS)}",
                    pytrace=False)
    for name, kind in MARKERS.items():
        for mark in item.iter_markers(name):
            if len(mark.args) != 1:
                pytest.fail(f"@pytest.mark.{name} takes one layer and keyword settings, got {len(mark.args)} "
                            "positional arguments", pytrace=False)
            from tfmoe.contract.errors import BadInput

            try:
                verdict = _checker(item.config)._run(kind, mark.args[0], dict(mark.kwargs))
            except BadInput as exc:
                pytest.fail(f"@pytest.mark.{name}: {exc}", pytrace=False)
            if not verdict.passed:
                pytest.fail(verdict.table(), pytrace=False)
