"""fully_masked: what a query that sees no key gives, judged against ``fully_masked_policy``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tfmoe.components.comparison import classify_rows
from tfmoe.components.references import output, project, rows_with_a_key, visibility
from tfmoe.experiments.attn_check.layer import LayerUnderTest
from tfmoe.rules.capabilities import fully_masked_accepts, policy_allows_nan

if TYPE_CHECKING:
    from tfmoe.experiments.attn_check.settings import ModuleSettings


def _fully_masked_probe(s: ModuleSettings) -> torch.Tensor:
    """(2,T) padding mask: row 0 all padding (every query sees nothing); row 1 left-padded when causal (its
    first queries see nothing, the rest do), right-padded otherwise (nothing fully masked there)."""
    pm = torch.ones(2, s.T, dtype=torch.bool)
    pm[0] = False
    half = s.T // 2
    if half:
        if s.causal:
            pm[1, :half] = False
        else:
            pm[1, s.T - half:] = False
    return pm


def _count_nonfinite(t: torch.Tensor | None) -> int:
    return 0 if t is None else int((~torch.isfinite(t.detach())).sum())


def check_fully_masked(layer: LayerUnderTest) -> None:
    """5. fully masked query rows: what the module gives there (nan | zeros | mean_of_v | other), judged against
    ``fully_masked_policy``; the other rows are not re-judged against the reference (sdpa_match does that), only
    kept finite, and so are the gradients of a loss over the other rows (a NaN there reaches every weight)."""
    s, rec = layer.s, layer.rec
    policy = s.fully_masked_policy
    pm = _fully_masked_probe(s).to(layer.device)
    x = torch.randn(2, s.T, s.d_model, device=layer.device).to(layer.dtype).requires_grad_(True)
    mask = visibility(s.T, s.T, s.causal, pm, device=layer.device)
    valid = rows_with_a_key(mask, 2, s.T)  # (2,T)
    n_masked = int((~valid).sum())
    module = layer.module
    module.zero_grad(set_to_none=True)
    out, _ = layer.call(module, x, pm)
    g = torch.randn(out.shape, device=layer.device).to(out.dtype)
    loss = (out * g)[valid.to(layer.device)].sum()  # only rows with a visible key reach the loss
    loss.backward()
    sel_valid, sel_masked = valid.to(layer.device), (~valid).to(layer.device)
    nonfinite_other = _count_nonfinite(out[sel_valid])
    nonfinite_masked = _count_nonfinite(out[sel_masked])
    nonfinite_grads = _count_nonfinite(x.grad) + sum(
        _count_nonfinite(t.grad) for t in layer.adapter.parameters(module).values())
    with torch.no_grad():
        xd = x.detach()
        ref = layer.reference(xd, mask)
        rd = ref.dtype
        p = layer.proj().to(rd)
        _, _, v = project(xd.to(rd), p)
        mean_v = output(v.mean(dim=2, keepdim=True).expand_as(v), p)  # uniform over all keys
        zeros = output(torch.zeros_like(v), p)  # a zero context through the output projection (its bias)
        module_kind = classify_rows(out.detach()[sel_masked], mean_v[sel_masked], layer.dtype, zeros[sel_masked])
        sdpa_kind = classify_rows(ref[sel_masked], mean_v[sel_masked], rd, zeros[sel_masked])
    rec.metric("fully_masked_query_rows", n_masked)
    rec.metric("fully_masked_nonfinite_values", nonfinite_masked + nonfinite_other + nonfinite_grads)
    rec.note(f"fully masked query rows ({n_masked} in the probe): module -> {module_kind}; "
             f"torch {torch.__version__} SDPA -> {sdpa_kind}. Policy: excluded from every comparison; "
             f"fully_masked_policy={policy}")
    accepted = fully_masked_accepts(policy, module_kind)
    nan_allowed = policy_allows_nan(policy)
    causes = []
    if nonfinite_other:
        causes.append(f"{nonfinite_other} non-finite values in the outputs of rows that DO see a key")
    if not accepted and nonfinite_masked:
        causes.append(f"the fully masked rows are {module_kind} ({nonfinite_masked} non-finite values): give them a "
                      "finite value (an additive finfo.min mask, or weights set to 0 where a row sees no key), or "
                      "declare fully_masked_policy=nan")
    elif not accepted:
        causes.append(f"the fully masked rows are {module_kind}, the declared policy is {policy}"
                      + (" (set fully_masked_policy=finite if any finite value is your layer's documented policy)"
                         if module_kind == "other" else ""))
    if not nan_allowed and nonfinite_grads:
        causes.append(f"{nonfinite_grads} non-finite gradient values from a loss over the other rows only "
                      "(the fully masked rows' NaN reaches the backward)")
    bad = nonfinite_other + (0 if accepted else max(nonfinite_masked, n_masked)) + (
        0 if nan_allowed else nonfinite_grads)
    rec.check("fully_masked_rows", bad == 0, float(bad), 0.0,
              f"{n_masked} fully masked query rows: module gives {module_kind}, SDPA gives {sdpa_kind}; policy "
              f"{policy}; " + ("; ".join(causes) if causes else
                               f"{nonfinite_grads} non-finite gradient values, none in the rows that see a key"),
              evidence={"x": xd, "padding_mask": pm, "out": out.detach(), "ref": ref})
    module.zero_grad(set_to_none=True)

