"""The model battery: a whole causal LM (``impl=`` on decode, shift-labels and arch) judged against itself run
another way — alone vs. in a padded batch, without vs. with its cache, fp32 vs. half precision. No reference shares
code with the model: every expected value is the same model's own output under a setting where the claim is
trivially true (one sequence, no padding, no cache).

The checks, each in the experiment where its claim lives (names ``lm.<check>``):

arch (§2.3, a decoder is causal; positions follow the real tokens)
  causal             visibility matrix: changing token j leaves the logits at every i < j unchanged (no cache)
  causal_cached      the same with a cache: a forward with use_cache=True, and a multi-token chunk after a past
  left_pad_positions one sequence alone vs. behind 1 and 5 pad tokens (mask, and position ids from it)
shift-labels (§2.5, padding and label masks line up position by position)
  batch_invariance.left / .right   each sequence alone vs. inside a left-/right-padded batch, real positions
  padding_content    changing the pad tokens' ids leaves every real logit unchanged
  loss_matches_shifted_ce          the model's .loss vs. tfmoe's fp64 cross-entropy of logits[:, :-1] against
                                   labels[:, 1:], -100 on padding, with left and with right padding
  loss_left_right    the same loss with left and with right padding
decode (§2.5, inference token by token with a KV cache)
  kv_cache_teacher_forcing  a cached prefill of a left-padded batch and then one token per step == one full forward
                            (far enough that a cache keeping only the last N keys is caught)
  generation_batch_vs_alone greedy generation of a left-padded batch == each prompt alone, token for token; a
                            divergence where either run's top two logits are within the rule is a tie, stated
  low_precision.fp16 / .bf16 logits finite and within the dtype's rule of the fp32 model's

Limits: the dtype rule |Δ| <= tol_eps · eps(dtype) · max(1, max|reference logits|) (decode's logit rule). Comparisons
across different batches of a model whose routing depends on the batch by design (an expert capacity, detected or
declared ``lacks=[batch_invariant_routing]``) that exceed the rule are ``n/a`` with the design and the measured gap.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf

from tfmoe.adapters.causal_lm import CausalLMAdapter, LMOutput, ModelUnderTest, load_model
from tfmoe.contract.errors import BadInput
from tfmoe.contract.recorder import Recorder, within
from tfmoe.contract.tables import Rows
from tfmoe.rules import capabilities as caps
from tfmoe.rules.faults import raised_detail, tfmoe_fault

PREFIX = "lm."
OWN_SPEC = "tfmoe:TinyCausalLM"  # decode's own trained LM, run through the same battery (batched generation)
IGNORE = -100  # the labels' ignore_index in Hugging Face's convention (the model shifts the labels itself)
PAD_ID = 0  # the id in padded positions (padding_content changes it)
MAX_TOKENS = 4096  # the longest sequence the battery builds (prompt + lm.steps); the hf: configs hold as many positions
LOW_PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class LMSettings:
    """``impl`` and the ``lm.*`` keys, validated."""

    impl: str
    lacks: tuple[str, ...]
    lengths: tuple[int, ...]  # real tokens per sequence (decode's prompts, arch's sequences)
    steps: int  # decode: tokens decoded one at a time after the prompt
    tol_eps: float
    use_cache: bool  # decode: generate with the model's cache (False: full recompute each step)
    low_precision: tuple[str, ...]


def lm_settings(cfg: DictConfig, own: bool = False) -> LMSettings | None:
    """None without ``impl`` (``own``: the settings for tfmoe's own tiny LM then, decode's batched generation);
    BadInput (one line) for a bad key."""
    impl = cfg.get("impl")
    if impl is None and not own:
        return None
    if own:
        if impl is not None:
            return None
        impl = OWN_SPEC
    if not own and (not isinstance(impl, str) or ":" not in impl):
        raise BadInput(f"impl={impl!r} is not 'pkg.module:Class' nor 'hf:<model type>': write e.g. impl=my_lm:MyLM "
                       "or impl=hf:llama (impl=null: tfmoe's own tiny LM)")
    lacks = cfg.get("lacks") or []
    lacks = [lacks] if isinstance(lacks, str) else list(OmegaConf.to_container(lacks) if OmegaConf.is_config(lacks)
                                                         else lacks)
    caps._names(lacks, "lacks")
    lm = cfg.lm
    lengths = lm.get("lengths", [6, 13, 9])
    if not isinstance(lengths, (list, ListConfig)) or not lengths or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 2 for n in lengths):
        raise BadInput(f"lm.lengths={lengths!r} must be a non-empty list of integers >= 2: e.g. lm.lengths=[6,13,9]")
    steps = lm.get("steps", 40)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise BadInput(f"lm.steps={steps!r} must be an integer >= 1: e.g. lm.steps=40")
    tol = lm.get("tol_eps")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol > 0:
        raise BadInput(f"lm.tol_eps={tol!r} must be a positive number: e.g. lm.tol_eps=64")
    if max(lengths) + steps > MAX_TOKENS:
        raise BadInput(f"lm.steps={steps} after prompts of up to {max(lengths)} tokens (lm.lengths) makes sequences of "
                       f"{max(lengths) + steps} tokens, above the battery's {MAX_TOKENS}: pass lm.steps <= "
                       f"{MAX_TOKENS - max(lengths)}")
    low = lm.get("low_precision", []) or []
    if not all(p in LOW_PRECISIONS for p in low):
        raise BadInput(f"lm.low_precision={list(low)!r} names a dtype other than fp16/bf16: e.g. "
                       "lm.low_precision=[fp16,bf16] (or [] to skip)")
    return LMSettings(impl=impl.strip(), lacks=tuple(lacks), lengths=tuple(int(n) for n in lengths), steps=int(steps),
                      tol_eps=float(tol), use_cache=bool(lm.get("use_cache", True)),
                      low_precision=tuple(str(p) for p in low))


# ------------------------------------------------------------------------------------------- inputs
def pad_batch(seqs: Sequence[Sequence[int]], side: str, device: torch.device,
              pad: int = PAD_ID) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences -> (ids (B, L), mask (B, L) long, 1 = real), padded on ``side``."""
    L = max(len(q) for q in seqs)
    ids = torch.full((len(seqs), L), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(seqs), L), dtype=torch.long, device=device)
    for i, q in enumerate(seqs):
        span = slice(0, len(q)) if side == "right" else slice(L - len(q), L)
        ids[i, span] = torch.tensor(list(q), device=device)
        mask[i, span] = 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids from the mask as Hugging Face's generate builds them: cumsum - 1, padded positions 1."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)  # (B, T)


def lm_labels(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Hugging Face's unshifted labels: the ids, -100 where the position is padding *or* its input (the position
    before) is: with left padding the first real token would otherwise be a target predicted from a pad."""
    no_input = torch.ones_like(mask, dtype=torch.bool)
    no_input[:, 1:] = mask[:, :-1] == 0
    return ids.masked_fill((mask == 0) | no_input, IGNORE)  # (B, T)


def random_sequences(lengths: Sequence[int], vocab: int, seed: int) -> list[list[int]]:
    """Token ids in [3, vocab): 0 (padding), 1 and 2 (bos/eos in the hf: configs) never appear as content."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def other_ids(ids: torch.Tensor, vocab: int, seed: int) -> torch.Tensor:
    """Different ids in [3, vocab) at every position."""
    g = torch.Generator().manual_seed(seed + 7919)
    shift = torch.randint(1, vocab - 3, ids.shape, generator=g).to(ids.device)
    return (ids - 3 + shift) % (vocab - 3) + 3


def scale(t: torch.Tensor) -> float:
    return max(1.0, float(t.detach().double().abs().max())) if t.numel() else 1.0


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max())


# ------------------------------------------------------------------------------------------- judging
class Battery:
    """The checks' shared machinery: the model, the rule, the capability model and the fault rule."""

    def __init__(self, rec: Recorder, lm: ModelUnderTest, s: LMSettings) -> None:
        self.rec, self.lm, self.s = rec, lm, s
        self.dev, self.dtype = rec.device, rec.dtype
        self.V = lm.vocab_size
        self.seed = rec.seed
        self.per_position: dict[str, tuple[torch.Tensor, float]] = {}  # side -> ((B, L) |Δ| alone vs batch, limit)

    def limit(self, ref: torch.Tensor, dtype: torch.dtype | None = None) -> float:
        return self.s.tol_eps * torch.finfo(dtype or self.dtype).eps * scale(ref)

    def run(self, name: str, needs: Sequence[str], body: Callable[[str], None]) -> None:
        """Run one check: n/a for a lacked feature (declared or detected) or a NotImplementedError; the user's
        exception fails it (leading the detail); tfmoe's or a shipped adapter's crashes the run."""
        name = PREFIX + name
        for feature in needs:
            if self.lm.lacks(feature):
                self.rec.not_applicable(name, self.lm.declared.why(feature))
                return
        try:
            body(name)
        except NotImplementedError as exc:
            self.rec.not_applicable(name, caps.not_implemented_detail(exc))
        except BadInput:
            raise
        except Exception as exc:
            from tfmoe.adapters.transformers_support import SUPPORTED

            library = self.lm.adapter.library
            err = tfmoe_fault(exc, self.lm.who, library, SUPPORTED if library == "transformers" else "")
            if err is not None:
                raise err from exc
            self.rec.check(name, False, None, None, raised_detail(exc))

    def judge(self, name: str, observed: float, limit: float, detail: str, across_batches: bool = True,
              evidence: dict[str, torch.Tensor] | None = None) -> None:
        """observed <= limit; a miss between different batches of a batch-dependent design is n/a, stated."""
        if not within(observed, limit) and across_batches and self.lm.design and math.isfinite(observed):
            self.rec.not_applicable(name, f"not judged: the model's routing depends on the batch by design "
                                          f"({self.lm.design}); measured max |Δ| {observed:.3g} > {limit:.3g}: {detail}")
            return
        self.rec.check(name, within(observed, limit), observed, limit, detail, evidence)

    def fwd(self, ids: torch.Tensor, mask: torch.Tensor | None = None, pos: torch.Tensor | None = None,
            **kw: Any) -> Any:
        if self.lm.lacks("padding_mask"):
            mask = None
        return self.lm.forward(ids, mask, pos, **kw)

    def cached(self, out: Any) -> Any:
        if out.past is None:
            raise NotImplementedError("the forward returned no cache (past_key_values) for use_cache=True")
        return out.past


# ------------------------------------------------------------------------------------------- arch
def run_arch(s: LMSettings, rec: Recorder) -> None:
    lm = open_model(s, rec)
    b = Battery(rec, lm, s)
    T = max(s.lengths)
    ids = torch.tensor(random_sequences([T, T], b.V, b.seed), device=b.dev)  # (2, T)
    matrix = torch.zeros(T, T, dtype=torch.float64)

    def causal(name: str) -> None:
        ref = b.fwd(ids).logits
        alt = other_ids(ids, b.V, b.seed)
        for j in range(T):  # change token j (and every later one): rows i < j must not move
            probe = torch.cat([ids[:, :j], alt[:, j:]], dim=1)
            out = b.fwd(probe).logits
            matrix[:, j] = (out.double() - ref.double()).abs().amax(dim=(0, 2)).cpu()
        observed = float(torch.triu(matrix, diagonal=1).max())  # [i, j] with i < j: the future leaking back
        limit = b.limit(ref)
        rec.metric("lm.causal_max_abs", observed)
        rec.tensor("lm.visibility", (matrix > limit).to(torch.int8))
        b.judge(name, observed, limit, "max |Δ logits| at positions i < j when tokens j.. change (no cache); "
                f"{'exactly 0' if observed == 0 else 'not exactly 0'}", across_batches=bool(lm.design))

    def causal_cached(name: str) -> None:
        p, t = max(1, T // 3), (T + max(1, T // 3)) // 2  # prefix in the cache; change tokens after t
        alt = torch.cat([ids[:, :t + 1], other_ids(ids, b.V, b.seed)[:, t + 1:]], dim=1)
        full = [b.fwd(x, torch.ones_like(x), use_cache=True).logits for x in (ids, alt)]
        gaps = [max_abs(full[0][:, :t + 1], full[1][:, :t + 1])]
        past = b.cached(b.fwd(ids[:, :p], torch.ones_like(ids[:, :p]), use_cache=True))
        pos = torch.arange(p, T, device=b.dev).expand(ids.shape[0], -1)
        chunks = [b.fwd(x[:, p:], torch.ones_like(x), pos, past=copy.deepcopy(past), use_cache=True).logits
                  for x in (ids, alt)]
        gaps.append(max_abs(chunks[0][:, :t + 1 - p], chunks[1][:, :t + 1 - p]))
        rec.metric("lm.causal_cached_max_abs", max(gaps))
        b.judge(name, max(gaps), b.limit(full[0]),
                f"tokens after position {t} changed: max |Δ logits| at positions <= {t} in a use_cache=True forward "
                f"({gaps[0]:.3g}) and in a {T - p}-token chunk after a {p}-token past ({gaps[1]:.3g})",
                across_batches=bool(lm.design))

    def left_pad_positions(name: str) -> None:
        seq = ids[:1]
        alone = b.fwd(seq, torch.ones_like(seq), positions(torch.ones_like(seq))).logits
        gaps = []
        for k in (1, 5):
            x = torch.cat([torch.full((1, k), PAD_ID, device=b.dev), seq], dim=1)
            mask = torch.cat([torch.zeros(1, k, dtype=torch.long, device=b.dev), torch.ones_like(seq)], dim=1)
            gaps.append(max_abs(b.fwd(x, mask, positions(mask)).logits[:, k:], alone))
        given = "position ids from the mask" if not lm.lacks("position_ids") else "the mask (no position_ids taken)"
        b.judge(name, max(gaps), b.limit(alone), f"one sequence alone vs. behind 1 / 5 pad tokens with {given}: "
                f"max |Δ logits| {gaps[0]:.3g} / {gaps[1]:.3g}")

    b.run("causal", (), causal)
    b.run("causal_cached", ("kv_cache",), causal_cached)
    b.run("left_pad_positions", ("padding_mask",), left_pad_positions)
    finish(rec, lm, "arch", [("visibility", matrix)])


# ------------------------------------------------------------------------------------------- shift-labels
def run_shift_labels(s: LMSettings, rec: Recorder, seqs: list[list[int]], vocab: Sequence[str],
                     pad_id: int) -> Battery:
    """The padding and loss checks on the experiment's own sequences (ids of its vocabulary, < the model's)."""
    lm = open_model(s, rec)
    b = Battery(rec, lm, s)
    if max(max(q) for q in seqs) >= b.V:
        raise BadInput(f"the sequences use ids up to {max(max(q) for q in seqs)} (vocab has {len(vocab)} entries), the "
                       f"model's vocabulary {b.V}: use a vocab of at most {b.V} entries")
    padded = len({len(q) for q in seqs}) > 1

    def invariance(side: str) -> Callable[[str], None]:
        def body(name: str) -> None:
            ids, mask = pad_batch(seqs, side, b.dev, pad_id)
            out = b.fwd(ids, mask, positions(mask)).logits
            gap = torch.zeros(ids.shape, dtype=torch.float64)
            worst, ref_scale = 0.0, 1.0
            for i, q in enumerate(seqs):
                x = torch.tensor([q], device=b.dev)
                alone = b.fwd(x, torch.ones_like(x), positions(torch.ones_like(x))).logits[0]
                real = mask[i].bool()
                d = (out[i][real].double() - alone.double()).abs().amax(-1).cpu()
                gap[i, real.cpu()] = d
                worst, ref_scale = max(worst, float(d.max())), max(ref_scale, scale(alone))
            limit = s.tol_eps * torch.finfo(b.dtype).eps * ref_scale
            b.per_position[side] = (gap, limit)
            rec.metric("lm.batch_invariance_max_abs", worst, pad_side=side)
            b.judge(name, worst, limit, f"each sequence alone vs. inside the {side}-padded batch (mask and position ids "
                    "from it): max |Δ logits| at real positions")
        return body

    def padding_content(name: str) -> None:
        if not padded:
            rec.not_applicable(name, "not judged: every sequence has one length, so nothing is padded")
            return
        gaps, ref_scale = [], 1.0
        for side in ("left", "right"):
            ids, mask = pad_batch(seqs, side, b.dev, pad_id)
            alt = torch.where(mask.bool(), ids, other_ids(ids, b.V, b.seed))
            ref, out = (b.fwd(x, mask, positions(mask)).logits for x in (ids, alt))
            real = mask.bool()
            gaps.append(max_abs(ref[real], out[real]))
            ref_scale = max(ref_scale, scale(ref[real]))
        b.judge(name, max(gaps), s.tol_eps * torch.finfo(b.dtype).eps * ref_scale,
                f"pad ids {pad_id} -> other ids: max |Δ logits| at real positions, left {gaps[0]:.3g}, right "
                f"{gaps[1]:.3g}")

    losses: dict[str, float] = {}

    def loss(name: str) -> None:
        diffs, worst_ref = [], 1.0
        batches = [(side, *pad_batch(seqs, side, b.dev, pad_id)) for side in ("left", "right")] if not \
            lm.lacks("padding_mask") else [("alone", *pad_batch([q], "right", b.dev, pad_id)) for q in seqs]
        for side, ids, mask in batches:
            labels = lm_labels(ids, mask)
            out = b.fwd(ids, mask, positions(mask), labels=labels)
            if out.loss is None:
                raise NotImplementedError("the forward returned no .loss for labels")
            logp = torch.log_softmax(out.logits[:, :-1].double(), dim=-1)
            target = labels[:, 1:]
            valid = target != IGNORE
            ref = -(logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)[valid]).mean()
            model_loss = float(torch.as_tensor(out.loss).double())
            diffs.append(abs(model_loss - float(ref)))
            rec.metric("lm.label_fraction", float(valid.double().mean()), pad_side=side)
            losses[side] = model_loss
            worst_ref = max(worst_ref, abs(float(ref)))
            rec.metric("lm.loss", model_loss, pad_side=side)
            rec.metric("lm.loss_reference", float(ref), pad_side=side)
        how = ("left- and right-padded batches" if not lm.lacks("padding_mask")
               else "each sequence alone (no padding mask)")
        b.judge(name, max(diffs), s.tol_eps * torch.finfo(b.dtype).eps * worst_ref,
                f"|model .loss − fp64 mean CE of logits[:, :-1] vs labels[:, 1:] (-100 where the input or the target is "
                f"padding)|, {how}",
                across_batches=False)

    def left_right(name: str) -> None:
        if not {"left", "right"} <= losses.keys():
            rec.not_applicable(name, "not judged: the model's loss was not measured on both padding sides")
            return
        gap = abs(losses["left"] - losses["right"])
        b.judge(name, gap, s.tol_eps * torch.finfo(b.dtype).eps * max(1.0, abs(losses["right"])),
                f"model .loss with left padding {losses['left']:.6g} vs right padding {losses['right']:.6g}")

    b.run("batch_invariance.left", ("padding_mask",), invariance("left"))
    b.run("batch_invariance.right", ("padding_mask",), invariance("right"))
    b.run("padding_content", ("padding_mask",), padding_content)
    b.run("loss_matches_shifted_ce", ("loss",), loss)
    b.run("loss_left_right", ("loss", "padding_mask"), left_right)
    return b


# ------------------------------------------------------------------------------------------- decode
def refuse_lacks(lm: ModelUnderTest, s: LMSettings) -> None:
    """Rule 1: decode's main setting (generation with the cache, lm.use_cache=true) needs kv_cache."""
    if s.use_cache and lm.lacks("kv_cache"):
        why = lm.declared.why("kv_cache").removeprefix("not applicable: ")
        raise BadInput(f"impl={s.impl} lacks kv_cache ({why}), which decode's lm.use_cache=true needs: pass "
                       "lm.use_cache=false (generate by full recompute)")


def greedy(b: Battery, ids: torch.Tensor, mask: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding of a left-padded batch: (new tokens (B, n), their logits (B, n, V)). With the cache: a
    prefill and one token per step; without: the whole sequence each step."""
    use_cache = b.s.use_cache and not b.lm.lacks("kv_cache")
    toks, logits, past = [], [], None
    seq, m = ids, mask
    for step in range(n):
        pos = positions(m)
        if use_cache:
            feed, fpos = (seq, pos) if step == 0 else (seq[:, -1:], pos[:, -1:])
            out = b.fwd(feed, m, fpos, past=past, use_cache=True)
            past = b.cached(out)
        else:
            out = b.fwd(seq, m, pos)
        last = out.logits[:, -1].float()  # (B, V)
        nxt = last.argmax(-1)
        toks.append(nxt)
        logits.append(last)
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        m = torch.cat([m, torch.ones_like(m[:, :1])], dim=1)
    return torch.stack(toks, 1), torch.stack(logits, 1)


def top_gap(logits: torch.Tensor) -> float:
    top = logits.double().topk(2).values
    return float(top[0] - top[1])


class OwnLM(CausalLMAdapter):
    """decode's trained TinyCausalLM in Hugging Face's convention: the mask over past and new keys as its padding
    mask, the position ids, a list of its KVCaches as the past (tfmoe's own code: its errors crash the run)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.spec = model, OWN_SPEC

    def build(self, seed: int) -> torch.nn.Module:
        return self.model

    def forward(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None, past: Any, use_cache: bool, labels: torch.Tensor | None) -> LMOutput:
        caches = past if past is not None else (model.new_caches() if use_cache else None)
        logits = model(input_ids, padding_mask=None if attention_mask is None else attention_mask.bool(),
                       position_ids=position_ids, caches=caches)
        return LMOutput(logits, caches if use_cache else None)

    def design(self, model: torch.nn.Module) -> str | None:
        return None


def run_own_decode(model: torch.nn.Module, s: LMSettings, rec: Recorder) -> None:
    """decode without impl=: its trained tiny LM generates a left-padded batch (and decodes it with the cache)
    against each prompt alone, through the same checks as a user's model."""
    max_len = int(getattr(model, "max_len", 0)) or None
    steps = s.steps if max_len is None else min(s.steps, max_len - max(s.lengths))
    if steps < 2:
        rec.note(f"{PREFIX}: batched generation skipped: max_len={max_len} leaves no room after prompts of "
                 f"{max(s.lengths)} tokens (lm.lengths)")
        return
    lm = ModelUnderTest(OwnLM(model), model, caps.Declared(), OWN_SPEC, int(model.vocab_size), None)
    run_decode(replace(s, steps=steps, low_precision=()), rec, lm)


def run_decode(s: LMSettings, rec: Recorder, lm: ModelUnderTest | None = None) -> None:
    own = lm is not None
    if lm is None:
        lm = open_model(s, rec)
    refuse_lacks(lm, s)
    b = Battery(rec, lm, s)
    lengths = list(s.lengths) if not lm.lacks("padding_mask") else [max(s.lengths)] * len(s.lengths)
    if lm.lacks("padding_mask"):
        rec.note("the model takes no attention mask: decode's prompts all have one length (nothing padded)")
    prompts = random_sequences(lengths, b.V, b.seed)
    step_gaps = torch.zeros(0)

    def teacher_forcing(name: str) -> None:
        nonlocal step_gaps
        cont = random_sequences([s.steps] * len(prompts), b.V, b.seed + 1)
        pids, pmask = pad_batch(prompts, "left", b.dev)
        P = pids.shape[1]
        full = torch.cat([pids, torch.tensor(cont, device=b.dev)], dim=1)  # (B, P + steps)
        mask = torch.cat([pmask, torch.ones(len(prompts), s.steps, dtype=torch.long, device=b.dev)], dim=1)
        pos = positions(mask)
        ref = b.fwd(full, mask, pos).logits
        out = b.fwd(full[:, :P], mask[:, :P], pos[:, :P], use_cache=True)
        got, past = [out.logits], b.cached(out)
        for i in range(P, P + s.steps - 1):
            out = b.fwd(full[:, i:i + 1], mask[:, :i + 1], pos[:, i:i + 1], past=past, use_cache=True)
            got.append(out.logits)
            past = b.cached(out)
        cached = torch.cat(got, dim=1)  # (B, P + steps - 1, V)
        ref = ref[:, :cached.shape[1]]
        real = mask[:, :cached.shape[1]].bool()
        gap = ((cached.double() - ref.double()).abs().amax(-1) * real).cpu()  # (B, T)
        step_gaps = gap[:, P - 1:].amax(0)  # per decoded step (the prefill's last position first)
        limit = b.limit(ref[real])
        observed = float(gap.max())
        bad = (step_gaps > limit).nonzero()
        padded = pmask.eq(0).any(-1).cpu()  # rows with left padding
        rec.metric("lm.kv_cache_padded_rows_max_abs", float(gap[padded].max()) if padded.any() else 0.0)
        rec.metric("lm.kv_cache_unpadded_rows_max_abs", float(gap[~padded].max()) if (~padded).any() else 0.0)
        if bad.numel():
            rec.metric("lm.kv_cache_first_bad_step", int(bad[0]))
            rec.metric("lm.kv_cache_first_bad_length", P + int(bad[0]))
        where = (f"; first off at decode step {int(bad[0])} (sequence length {P + int(bad[0])})"
                 if bad.numel() else "")
        rec.metric("lm.kv_cache_max_abs", observed)
        b.judge(name, observed, limit, f"cached prefill of a left-padded batch (prompts {lengths}) + {s.steps - 1} "
                f"single-token steps vs. one full forward: max |Δ logits| at real positions{where}",
                across_batches=bool(lm.design), evidence={"step_gaps": step_gaps})

    def generation(name: str) -> None:
        pids, pmask = pad_batch(prompts, "left", b.dev)
        toks, logits = greedy(b, pids, pmask, s.steps)
        diverged, ties = [], []
        for i, q in enumerate(prompts):
            x = torch.tensor([q], device=b.dev)
            alone_toks, alone_logits = greedy(b, x, torch.ones_like(x), s.steps)
            diff = (alone_toks[0] != toks[i]).nonzero()
            if not diff.numel():
                continue
            k = int(diff[0])
            gap = min(top_gap(logits[i, k]), top_gap(alone_logits[0, k]))
            if gap <= b.limit(alone_logits[0, k]):
                ties.append(f"prompt {i} at step {k} (top-2 gap {gap:.3g})")
            else:
                diverged.append(f"prompt {i} at step {k}: batch {int(toks[i, k])} vs alone {int(alone_toks[0, k])} "
                                f"(top-2 gap {gap:.3g})")
        how = "with the cache" if s.use_cache and not lm.lacks("kv_cache") else "by full recompute"
        batch = "left-padded batch" if not lm.lacks("padding_mask") else "batch (no attention mask: equal lengths)"
        detail = (f"greedy {s.steps} tokens {how}, {batch} of prompts {lengths} vs. each alone: "
                  + ("; ".join(diverged) if diverged else "token for token"))
        if ties:
            detail += "; ties (not failures): " + "; ".join(ties)
            rec.note(f"{PREFIX}{'generation_batch_vs_alone'}: ties — " + "; ".join(ties))
        rec.metric("lm.generation_ties", len(ties))
        if diverged and lm.design:
            rec.not_applicable(name, f"not judged: the model's routing depends on the batch by design ({lm.design}): "
                                     + detail)
            return
        rec.check(name, not diverged, len(diverged), 0, detail)

    def low_precision(p: str) -> Callable[[str], None]:
        def body(name: str) -> None:
            if b.dtype not in (torch.float32, torch.float64):
                rec.not_applicable(name, f"not judged: the run's dtype is {str(b.dtype).removeprefix('torch.')} "
                                         "(judged against fp32 in an fp32 run)")
                return
            lp = LOW_PRECISIONS[p]
            ids, mask = pad_batch(prompts, "left", b.dev)
            ref = b.fwd(ids, mask, positions(mask)).logits
            given = None if lm.lacks("padding_mask") else mask
            how = f"{p} copy of the model (.to({p}))"
            try:
                out = lm.forward(ids, given, positions(mask), model=lm.copy_as(lp)).logits
            except (NotImplementedError, BadInput):
                raise
            except Exception as exc:  # a model written for autocast (fp32 islands inside) cannot run cast: run it so
                with torch.autocast(device_type=b.dev.type, dtype=lp):
                    out = lm.forward(ids, given, positions(mask)).logits
                how = (f"the model under torch.autocast({p}) (cast to {p} it raised {type(exc).__name__}: "
                       f"{' '.join(str(exc).split())[:120]})")
            real = mask.bool()
            got, want = out[real].double(), ref[real].double()
            finite = bool(torch.isfinite(got).all())
            gap = max_abs(got, want) if finite else float("nan")
            b.judge(name, gap, b.limit(want, lp), f"{how} vs. the {str(b.dtype).removeprefix('torch.')} one on the "
                    f"left-padded prompts: {'finite' if finite else 'NON-FINITE logits'}, max |Δ logits| at real "
                    "positions", across_batches=False)
        return body

    b.run("kv_cache_teacher_forcing", ("kv_cache",), teacher_forcing)
    b.run("generation_batch_vs_alone", (), generation)
    for p in s.low_precision:
        b.run(f"low_precision.{p}", (p,), low_precision(p))
    if not own:
        finish(rec, lm, "decode", [])


# ------------------------------------------------------------------------------------------- shared
def open_model(s: LMSettings, rec: Recorder) -> ModelUnderTest:
    lm = load_model(s.impl, rec.seed, rec.device, rec.dtype, s.lacks)
    for feature in sorted(lm.declared.lacks):
        rec.note(f"{PREFIX}: " + lm.declared.why(feature).removeprefix("not applicable: "))
    if lm.design:
        rec.note(f"{PREFIX}: routing depends on the batch by design ({lm.design}): comparisons across batches that "
                 "exceed the rule are n/a, stated with the measured gap")
    rec.note(f"{PREFIX}: impl={s.impl} ({type(lm.model).__name__}, vocabulary {lm.vocab_size}); limits "
             f"{s.tol_eps:g} x eps(dtype) x max(1, max|logits|)")
    return lm


def finish(rec: Recorder, lm: ModelUnderTest, experiment: str, matrices: list[tuple[str, torch.Tensor]]) -> None:
    rows = battery_rows(rec)
    rows.print_to(rec.console)
    rec.summary(f"## Your model: {lm.spec} ({experiment})\n\n" + rows.markdown())
    if matrices and rec.wants_plots:
        rec.plot("lm_visibility", draw_matrix(matrices[0][1], "output position i", "changed token j (and after)",
                                              "visibility: above the diagonal must stay below the limit"))


def battery_rows(rec: Recorder) -> Rows:
    rows = Rows("your model", ("check", "outcome", "observed", "limit", "detail"))
    for c in rec.checks_rows:
        if c.check.startswith(PREFIX):
            rows.add(c.check, c.outcome, "" if c.observed is None else f"{c.observed:.3g}",
                     "" if c.threshold is None else f"{c.threshold:.3g}", c.detail)
    return rows


def draw_matrix(m: torch.Tensor, ylabel: str, xlabel: str, title: str, limit: float | None = None,
                blank: torch.Tensor | None = None) -> Any:
    """log10 of a (rows, positions) matrix of |Δ|; ``blank`` entries (padding) grey; the limit on the colour bar."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    values = torch.log10(m.double().clamp(min=1e-12)).numpy()
    if blank is not None:
        values = np.where(blank.numpy(), np.nan, values)
    cmap = colormaps["viridis"].with_extremes(bad="lightgrey")
    fig = Figure(figsize=(max(4.0, 0.5 * m.shape[1] + 2), max(3.0, 0.45 * m.shape[0] + 1.8)))
    ax = fig.subplots()
    im = ax.imshow(values, cmap=cmap, aspect="auto", vmin=-12, vmax=max(0.0, float(np.nanmax(values))))
    bar = fig.colorbar(im, ax=ax)
    bar.set_label("log10 max |Δ logits|")
    if limit is not None:
        bar.ax.axhline(math.log10(limit), color="red")
        bar.ax.text(1.6, math.log10(limit), " limit", color="red", va="center", fontsize=7,
                    transform=bar.ax.get_yaxis_transform())
    ax.set_xticks(range(m.shape[1]))
    ax.set_yticks(range(m.shape[0]))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def learner_view(rec: Recorder, b: Battery, batch: Any, vocab: Sequence[str], pad_side: str, ignore: int) -> None:
    """§2.5 on the user's model: per position, input, label, attention mask, label mask and |Δ logits| between the
    sequence alone and inside the padded batch; a plot of where they disagree."""
    if pad_side not in b.per_position:
        return
    gap, limit = b.per_position[pad_side]
    table = Rows(f"your model, position by position ({pad_side} padding)",
                 ("seq", "pos", "input", "label", "attention_mask", "label_mask", "|Δ logits| alone vs batch", "agree"))
    L = batch.inputs.shape[1]
    for i in range(batch.inputs.shape[0]):
        for t in range(L):
            lab = int(batch.labels[i, t])
            real = int(batch.attention_mask[i, t]) == 1
            d = float(gap[i, t]) if real else float("nan")
            table.add(i, t, vocab[int(batch.inputs[i, t])], "−100 (ignored)" if lab == ignore else vocab[lab],
                      int(batch.attention_mask[i, t]), int(batch.label_mask[i, t]),
                      "" if not real else f"{d:.3g}", "" if not real else ("yes" if d <= limit else "NO"))
    table.print_to(rec.console)
    rec.summary("## Your model, position by position\n\n|Δ logits| between each sequence alone and inside the "
                f"{pad_side}-padded batch, at its real positions (padding: blank); agree: within {limit:.3g}."
                "\n\n" + table.markdown())
    rec.tensor("lm.per_position_gap", gap)
    if rec.wants_plots:
        L = batch.sequences.shape[1]
        rec.plot("lm_batch_vs_alone", draw_matrix(gap[:, :L], "sequence", "position",
                                                  f"alone vs. inside the {pad_side}-padded batch (grey: padding)",
                                                  limit, batch.mask.cpu() == 0))
