"""Causal LMs of public libraries, plugged in as docs/checking-your-own-layers.md tells a user to ("Your whole causal
LM"): zero-argument factories for nano-gpt and PaLM-pytorch (no mask, no cache), an adapter for x-transformers'
TransformerWrapper (a mask, left padding as seq_start_pos, its cache). Each library is imported only when its model is
built; the tests skip when it is not installed."""

from __future__ import annotations

from typing import Any

import torch

from tfmoe.adapters.causal_lm import CausalLMAdapter, LMOutput


def nano_gpt_tiny() -> torch.nn.Module:
    """nano-gpt 0.1.0's GPT (forward(x, targets) -> (logits, loss); its targets are already shifted)."""
    from nano_gpt.config import GPTConfig
    from nano_gpt.model import GPT

    return GPT(GPTConfig(block_size=128, vocab_size=96, n_layer=2, n_head=4, n_embd=32), tokenizer=None)


def palm_tiny() -> torch.nn.Module:
    """PaLM-pytorch 0.2.2's PaLM (forward(x) -> logits, rotary positions, no mask, no cache)."""
    from palm_pytorch import PaLM

    return PaLM(num_tokens=96, dim=32, depth=2, dim_head=8, heads=4)


class XTransformersRotary(CausalLMAdapter):
    """x-transformers' TransformerWrapper + Decoder: its cache takes the whole sequence and `cache_age` new tokens."""

    rotary = True
    lacks = ("position_ids", "loss")

    def build(self, seed: int) -> torch.nn.Module:
        from x_transformers import Decoder, TransformerWrapper

        return TransformerWrapper(num_tokens=96, max_seq_len=256, use_abs_pos_emb=not self.rotary,
                                  attn_layers=Decoder(dim=32, depth=2, heads=4, rotary_pos_emb=self.rotary))

    def forward(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None, past: Any, use_cache: bool, labels: Any) -> LMOutput:
        seen = input_ids if past is None else torch.cat([past[1], input_ids], dim=1)
        mask = None if attention_mask is None else attention_mask.bool()
        start = None if mask is None else (~mask).long().cumprod(-1).sum(-1)  # left padding: first real index
        cached = {} if past is None else {"cache": past[0], "cache_age": input_ids.shape[1]}
        logits, inter = model(seen, mask=mask, seq_start_pos=start, return_intermediates=True, **cached)
        return LMOutput(logits[:, -input_ids.shape[1]:], (inter, seen) if use_cache else None)


class XTransformersAbsolute(XTransformersRotary):
    rotary = False
