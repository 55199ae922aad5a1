"""tfmoe's batteries in your own test suite: copy this file beside your layer and run `pytest`.

The plugin (markers, the `tfmoe_check` fixture, --tfmoe-profile, --tfmoe-record) loads itself once tfmoe is
installed; from a checkout that is not installed, run `pytest -p tfmoe.api.pytest_plugin`.
"""

from __future__ import annotations

import pytest
from my_attention import MyAttention

import tfmoe


def test_my_attention_conforms() -> None:
    # the whole module battery on a reduced case matrix; AssertionError with the verdict's table when a check fails
    tfmoe.assert_attention_conforms(MyAttention, profile="quick")


def test_verdict_in_detail() -> None:
    verdict = tfmoe.check_attention(MyAttention, causal=False, checks=["masks", "sdpa"], d_model=16, n_heads=4)
    assert verdict.passed, verdict.table()
    assert verdict["sdpa_match"].observed <= verdict["sdpa_match"].limit


@pytest.mark.tfmoe_attention(MyAttention, T=6, lengths=[6, 3], checks=["masks", "sdpa", "invariances"])
def test_padding_by_marker() -> None:
    """The marker judges the layer before this body runs (quick profile unless --tfmoe-profile full)."""


def test_with_the_fixture(tfmoe_check) -> None:
    # the test run's --tfmoe-profile and --tfmoe-record (failed checks keep a run directory) apply
    tfmoe_check.assert_attention_conforms(MyAttention, checks=["sdpa", "gradients"])
