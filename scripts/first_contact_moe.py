"""First contact, MoE: three public MoE implementations tfmoe has never used (torchao's MOEFeedForwardAOQuantizable,
torchscale's X-MoE MOELayer, mh-moe's SparseMoE), plus layers in other common forms (weight inside the expert, a
latent MoE projecting after the mixture, experts the reference cannot rebuild, a layer holding a ProcessGroup),
each written from ``docs/`` alone (``scripts/first_contact/fc_{torchao,torchscale_moe,mhmoe,forms}.py``), correct
and with real bugs planted, every case through ``tfmoe route-sim``. Same table and verdicts as
``scripts/first_contact.py``.

    bash scripts/first-contact-moe.sh [--only ID] [--markdown FILE] [--json FILE]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import first_contact as fc  # noqa: E402
from first_contact import Case  # noqa: E402


def _route(*a: str) -> tuple[str, ...]:
    return ("route-sim", *a, "steps=0")


FORMS = "tfmoe (layer forms)"
CASES: tuple[Case, ...] = (
    Case("torchao.moe", "torchao", "correct", _route("impl=fc_torchao:Adapter"),
         "adapter as first written: the experts' module named with stacked_fill"),
    Case("torchao.moe.shared", "torchao", "correct", _route("impl=fc_torchao:Shared"),
         "adapter as first written: the experts' module named with stacked_fill"),
    Case("torchao.moe.router-read", "torchao", "correct", _route("impl=fc_torchao:RouterRead"),
         "adapter as the docs now say: probe_targets returns [] (no module returns one expert's output)"),
    Case("torchao.moe.shared.router-read", "torchao", "correct", _route("impl=fc_torchao:SharedRouterRead")),
    Case("torchao.moe.bug-not-renormalised", "torchao", "bug", _route("impl=fc_torchao:BugNotRenormalised")),
    Case("torchao.moe.bug-gelu-experts", "torchao", "bug", _route("impl=fc_torchao:BugGeluExperts")),
    Case("torchscale.xmoe.top1", "torchscale", "correct", _route("impl=fc_torchscale_moe:Top1", "top_k=1")),
    Case("torchscale.xmoe.top2", "torchscale", "correct", _route("impl=fc_torchscale_moe:Top2")),
    Case("torchscale.xmoe.top1.bug-argmin", "torchscale", "bug", _route("impl=fc_torchscale_moe:BugTop1Argmin",
                                                                          "top_k=1")),
    Case("torchscale.xmoe.top2.bug-first-only", "torchscale", "bug",
         _route("impl=fc_torchscale_moe:BugTop2FirstOnly")),
    Case("mhmoe.sparse", "mh-moe", "correct", _route("impl=fc_mhmoe:Adapter")),
    Case("mhmoe.sparse.bug-noisy-eval", "mh-moe", "bug", _route("impl=fc_mhmoe:BugNoisyEval")),
    Case("mhmoe.sparse.bug-expert-scaled", "mh-moe", "bug", _route("impl=fc_mhmoe:BugExpertScaled")),
    Case("forms.inside-weight", FORMS, "correct", _route("impl=fc_forms:InsideWeight")),
    Case("forms.inside-weight.bug-not-renormalised", FORMS, "bug", _route("impl=fc_forms:BugInsideNotRenormalised")),
    Case("forms.latent", FORMS, "correct", _route("impl=fc_forms:LatentAdapter")),
    Case("forms.latent.bug-not-renormalised", FORMS, "bug", _route("impl=fc_forms:BugLatentNotRenormalised")),
    Case("forms.black-box-experts", FORMS, "correct", _route("impl=fc_forms:BlackBox")),
    Case("forms.black-box-experts.bug-argmin", FORMS, "bug", _route("impl=fc_forms:BugBlackBoxArgmin")),
    Case("forms.process-group", FORMS, "correct", _route("impl=fc_forms:WithGroup")),
    Case("forms.inside-weight.declared", FORMS, "correct", _route("impl=fc_forms:InsideWeightDeclared")),
    Case("forms.inside-weight.declared.bug-not-renormalised", FORMS, "bug",
         _route("impl=fc_forms:BugInsideDeclaredNotRenormalised")),
    Case("forms.latent.projected", FORMS, "correct", _route("impl=fc_forms:LatentProjected")),
    Case("forms.latent.projected.bug-not-renormalised", FORMS, "bug",
         _route("impl=fc_forms:BugLatentProjectedNotRenormalised")),
)

# The cause of each outcome that is not the expected one, as analysed on the code before any fix
# (experiments/first-contact/moe.md): case id -> (exit code analysed, cause).
PROBE_FUSED = ("M1 no module returns one expert's output (the combine is fused into the experts' call); the docs "
               "offered only stacked_fill, which read token rows as experts: routing_selection, loads fail")
PICKLE = "M2 the fp16/bf16 checks deep-copy the layer; its ProcessGroup cannot be pickled: crashed (exit 3)"
INSIDE = ("M3 the weight is applied inside the expert: the probe reads 1 on every assignment; routing_weights, "
          "topk_weights_sum fail (likely cause: 'not renormalised', false)")
LATENT = ("M4 a projection after the mixture: the probe reads every weight x the projection's gain (0.128); "
          "routing_weights, topk_weights_sum fail")
REFUSED = "M5 experts the reference cannot rebuild refuse the whole battery (exit 2): nothing judged"
fc.CAUSES = {
    "torchao.moe": (1, PROBE_FUSED), "torchao.moe.shared": (1, PROBE_FUSED),
    "torchscale.xmoe.top1": (3, PICKLE + "; M6 batch_independence fails a capacity counted over the whole batch "
                             "(sequences compete for it by design)"), "torchscale.xmoe.top2": (3, PICKLE),
    "torchscale.xmoe.top1.bug-argmin": (3, PICKLE), "torchscale.xmoe.top2.bug-first-only": (3, PICKLE),
    "forms.process-group": (3, PICKLE), "forms.inside-weight": (1, INSIDE), "forms.latent": (1, LATENT),
    "forms.black-box-experts": (2, REFUSED), "forms.black-box-experts.bug-argmin": (2, REFUSED),
}
fc.CASES = CASES

if __name__ == "__main__":
    raise SystemExit(fc.main())
