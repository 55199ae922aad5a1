"""Shared config validation: the value, the bound and the fix are named; bools and non-finite numbers refused."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tfmoe.contract.errors import BadInput
from tfmoe.rules.validate import require_int, require_number

CFG = OmegaConf.create({"n": 3, "zero": 0, "flag": True, "x": 0.5, "neg": -1.0, "inf": float("inf"),
                        "s": "abc", "nested": {"k": 4}})


def test_require_int_normal_boundary_and_nested() -> None:
    assert require_int(CFG, "n") == 3
    assert require_int(CFG, "zero", 0) == 0  # boundary: minimum itself is accepted
    assert require_int(CFG, "nested.k", 4) == 4


@pytest.mark.parametrize(("key", "minimum", "needle"), [
    ("zero", 1, "zero=0 is below 1"), ("flag", 1, "flag=True is not an integer"),
    ("x", 1, "x=0.5 is not an integer"), ("s", 1, "s='abc' is not an integer"), ("missing", 1, "missing=None"),
])
def test_require_int_refuses(key: str, minimum: int, needle: str) -> None:
    with pytest.raises(BadInput, match=needle):
        require_int(CFG, key, minimum)


def test_require_int_uses_the_given_fix() -> None:
    with pytest.raises(BadInput, match="pass n >= 5 please"):
        require_int(CFG, "n", 5, fix="pass n >= 5 please")


def test_require_number_normal_and_boundary() -> None:
    assert require_number(CFG, "x", positive=True) == 0.5
    assert require_number(CFG, "n") == 3.0
    assert require_number(CFG, "zero", minimum=0.0) == 0.0


@pytest.mark.parametrize(("key", "kwargs", "needle"), [
    ("zero", {"positive": True}, "must be > 0"), ("neg", {"minimum": 0.0}, "below 0.0"),
    ("inf", {}, "not a finite number"), ("flag", {}, "not a finite number"), ("s", {}, "not a finite number"),
])
def test_require_number_refuses(key: str, kwargs: dict, needle: str) -> None:
    with pytest.raises(BadInput, match=needle):
        require_number(CFG, key, **kwargs)
