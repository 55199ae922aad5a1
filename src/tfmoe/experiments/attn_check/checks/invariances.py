"""invariances: batch independence, batch sizes and head counts."""

from __future__ import annotations

import math

import torch

from tfmoe.components.comparison import compare, max_abs_err
from tfmoe.components.references import visibility
from tfmoe.experiments.attn_check.layer import LayerUnderTest, judged_rows

X_SCALE_OTHER_ROWS = 10.0  # batch-independence probe: the other rows are redrawn at 10x the scale


def full_message(exc: BaseException) -> str:
    """The exception's type and its whole message, its lines joined (load_state_dict's first line alone,
    'Error(s) in loading state_dict for Attention:', says nothing)."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {' '.join(lines)}"


def check_invariances(layer: LayerUnderTest) -> None:
    """9. batch independence, batch sizes, head counts."""
    s, rec = layer.s, layer.rec
    x, pm = layer.x, layer.padding_mask
    if s.B == 1:  # pair the row with a second one (fully real)
        x = torch.cat([x, torch.randn_like(x.float()).to(x.dtype)])
        pm = torch.cat([pm, torch.ones_like(pm)])
    B = x.shape[0]
    pm_arg = None if bool(pm.all()) else pm
    mask = visibility(s.T, s.T, s.causal, pm_arg, device=layer.device)
    valid = judged_rows(s.padded_query_policy, mask, pm_arg, B, s.T)
    with torch.no_grad():
        out_a, _ = layer.call(layer.module, x, pm_arg)
        x_b = x.clone()
        x_b[1:] = (X_SCALE_OTHER_ROWS * torch.randn(x_b[1:].shape, device=layer.device)).to(x.dtype)
        out_b, _ = layer.call(layer.module, x_b, pm_arg)
        ref0 = layer.reference(x[:1], None if mask is None else mask[:1])
        plain0 = layer.plain(x[:1], None if mask is None else mask[:1])
        c0 = compare(out_a[:1], ref0, plain0, layer.dtype, valid[:1])
        diff = max_abs_err(out_b[:1], out_a[:1], valid[:1])
    limit = c0.threshold
    rec.metric("batch_independence_max_diff", diff)
    rec.check_le("batch_independence", diff, limit,
                 f"row 0's output moved by {diff:.3g} when rows 1..{B - 1} were redrawn at {X_SCALE_OTHER_ROWS:g}x scale "
                 f"(limit = row 0's same-dtype noise 2·plain + rounding = {limit:.3g})",
                 evidence={"x": x, "x_other_rows_changed": x_b, "padding_mask": pm})

    worst = 0.0
    with torch.no_grad():
        ref_all = layer.reference(x, mask)
        plain_all = layer.plain(x, mask)
        for b in range(B):
            pm_b = None if pm_arg is None else pm_arg[b:b + 1]
            alone, _ = layer.call(layer.module, x[b:b + 1], pm_b)
            c = compare(out_a[b:b + 1], ref_all[b:b + 1], plain_all[b:b + 1], layer.dtype, valid[b:b + 1])
            d = max_abs_err(alone, out_a[b:b + 1], valid[b:b + 1])
            worst = max(worst, d / c.threshold if c.threshold > 0 else (0.0 if d == 0 else math.inf))
    rec.metric("batch_sizes_worst_ratio", worst)
    rec.check_le("batch_sizes", worst, 1.0, f"each of the {B} rows run alone (B=1) vs inside the batch (B={B}): "
                 "max diff / same-dtype noise limit", evidence={"x": x, "padding_mask": pm})

    if s.n_kv_heads != s.n_heads:
        rec.note(f"head_counts not run: with n_kv_heads={s.n_kv_heads} other head counts change the k/v weight shapes")
        return
    with torch.no_grad():
        c_main = compare(layer.call(layer.module, layer.x, layer.pm_arg)[0], layer.reference(layer.x, layer.mask),
                         layer.plain(layer.x, layer.mask), layer.dtype, layer.valid)
    if not c_main.passed:
        rec.note(f"head_counts not judged: the module is already off the reference at its own n_heads={s.n_heads} "
                 f"(err {c_main.err:.3g} > limit {c_main.threshold:.3g}; sdpa_match judges that); head_counts judges "
                 "a module right at one head count and wrong at another")
        return
    worst, parts, shaped, unbuildable = 0.0, [], [], []
    for h in s.head_counts:
        try:
            module_h = layer.build(n_heads=h, state=layer.state())
        except Exception as exc:  # the layer cannot be rebuilt with h heads and read the same weights
            if isinstance(exc, RuntimeError) and "size mismatch" in str(exc) and "Unexpected key" not in str(exc) \
                    and "Missing key" not in str(exc):
                shaped.append(h)
            else:
                unbuildable.append(f"H={h}: {full_message(exc)}")
            continue
        with torch.no_grad():
            out_h, _ = layer.call(module_h, layer.x, layer.pm_arg)
            p_h = layer.proj(module_h, n_heads=h)
            c = compare(out_h, layer.reference(layer.x, layer.mask, p_h), layer.plain(layer.x, layer.mask, p_h), layer.dtype,
                        layer.valid)
        rec.metric("max_abs_err", c.err, comparison="module_vs_sdpa", n_heads=h,
                   dtype=str(layer.dtype).removeprefix("torch."))
        parts.append(f"H={h}: {c.err:.3g} (limit {c.threshold:.3g})")
        worst = max(worst, c.ratio)
    if shaped:
        rec.note(f"head_counts: H={shaped} not run: {layer.adapter.name}'s parameter shapes depend on n_heads, so the "
                 "same weights cannot be read with that many heads")
    if unbuildable:
        rec.note(f"head_counts not applicable at {len(unbuildable)} head count(s): {layer.adapter.name} cannot be "
                 "rebuilt with that many heads and load the same weights (its structure depends on n_heads); "
                 + "; ".join(unbuildable))
    if not parts:
        if unbuildable or shaped:
            rec.note("head_counts n/a: no other head count could be judged")
        return
    rec.check_le("head_counts", worst, 1.0, "the same weights with other head counts vs SDPA with that many heads "
                 "(err/limit): " + "; ".join(parts), evidence=layer.evidence())

