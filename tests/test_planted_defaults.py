"""Every planted bug of attn-check's module battery, under the config `tfmoe attn-check impl=...` runs with no
options (issue 28: a planted-bug test that only runs where its check is sharpest proves nothing about the run a
learner makes). Generated from the battery's planted-bug table (tests/test_attn_check.py::BLAME): each planted
layer, with its impl= alone, must fail one of the checks it is planted for. `checks=` restricts the run to that
check's group; it only selects groups and changes no probe (sizes, padding, causal, policies and dtype stay the
defaults). The kernel and MoE batteries' planted bugs run under their defaults in tests/test_attn_kernels.py and
tests/test_route_layer.py."""

from __future__ import annotations

import pytest
from test_attn_check import BLAME

from tfmoe.api.testing import run_recorded
from tfmoe.experiments.attn_check.module_battery import CHECK_GROUPS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# planted layers whose bug is, by design, no bug under the defaults (with the reason)
NOT_A_BUG_BY_DEFAULT = {
    "impl=buggy_attention:DowncastToFp32": "computing in fp32 is correct in the default fp32 run (planted for fp64)",
}


def _default_cases() -> list[tuple[str, set[str]]]:
    by_impl: dict[str, set[str]] = {}
    for overrides, expected, _ in BLAME:
        planted = [o for o in overrides if o.startswith(("impl=", "chunked.impl="))]
        if len(planted) == 1 and expected:
            by_impl.setdefault(planted[0], set()).update(expected)
    by_impl["impl=buggy_attention:IgnoresPaddingMask"] = {"left_padding_match"}
    return sorted((k, v) for k, v in by_impl.items() if k not in NOT_A_BUG_BY_DEFAULT)


CASES = _default_cases()


def test_every_planted_layer_has_a_default_case():
    planted = {o for overrides, _, _ in BLAME for o in overrides if o.startswith(("impl=", "chunked.impl="))}
    assert planted - set(NOT_A_BUG_BY_DEFAULT) <= {impl for impl, _ in CASES}
    assert len(CASES) >= 18


@pytest.mark.parametrize(("planted", "family"), CASES, ids=[c[0].split(":")[-1] for c in CASES])
def test_planted_bug_fails_under_the_default_config(planted, family):
    groups = sorted({CHECK_GROUPS[c] for c in family})
    rec = run_recorded("attn-check", [planted, f"checks=[{','.join(groups)}]"])
    failed = {c.check for c in rec.checks_rows if c.outcome == "failed"}
    assert failed & family, f"{planted} passed the default run ({sorted(failed)} failed; planted for {sorted(family)})"
