"""The three Transformer families of course §2.3, tiny and built from the package's own modules.

- ``EncoderOnly``  (BERT-like): bidirectional self-attention; every position sees every token.
  Per-position states for tagging, ``classify`` pools them into one label per sequence.
- ``DecoderOnly``  (GPT-like): causal self-attention; position i sees tokens 0..i; LM head.
- ``EncoderDecoder`` (T5 / original Transformer): a bidirectional encoder reads the source; each decoder
  layer runs causal self-attention over the target prefix, then cross-attention whose queries come
  from the decoder and keys/values from the encoder output ("memory"), then an FFN.

All use sinusoidal positions and pre-norm blocks. The ``causal`` flags are parameters so that a test
can plant the classic bug (a decoder with the causal mask switched off) and watch a check fail.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tfmoe.components.attention import MultiHeadCrossAttention, MultiHeadSelfAttention
from tfmoe.components.block import FeedForward, TransformerBlock, make_norm
from tfmoe.components.positions import SinusoidalPositions


class MeanPool(nn.Module):
    """(B,T,D) -> (B,D): mean over real tokens (all tokens when no padding mask)."""

    def forward(self, h: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        if padding_mask is None:
            return h.mean(dim=1)
        m = padding_mask.to(h.dtype).unsqueeze(-1)  # (B,T,1)
        return (h * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)


class EncoderOnly(nn.Module):
    """ids (B,T) -> hidden states (B,T,D); ``classify`` -> class logits (B,C)."""

    def __init__(self, vocab_size: int, d_model: int, n_heads: int, n_layers: int, n_classes: int = 2,
                 causal: bool = False):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)  # V x D
        self.pos = SinusoidalPositions(d_model)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads, causal=causal) for _ in range(n_layers))
        self.norm_f = make_norm("layernorm", d_model)
        self.pool = MeanPool()
        self.cls_head = nn.Linear(d_model, n_classes)

    def forward(self, idx: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.pos(self.tok_emb(idx))  # (B,T,D)
        for block in self.blocks:
            x = block(x, padding_mask)
        return self.norm_f(x)  # (B,T,D)

    def classify(self, idx: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.cls_head(self.pool(self(idx, padding_mask), padding_mask))  # (B,C)


class DecoderOnly(nn.Module):
    """ids (B,T) -> next-token logits (B,T,V) with causal self-attention."""

    def __init__(self, vocab_size: int, d_model: int, n_heads: int, n_layers: int, causal: bool = True):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)  # V x D
        self.pos = SinusoidalPositions(d_model)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads, causal=causal) for _ in range(n_layers))
        self.norm_f = make_norm("layernorm", d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.pos(self.tok_emb(idx))  # (B,T,D)
        for block in self.blocks:
            x = block(x, padding_mask)
        return self.lm_head(self.norm_f(x))  # (B,T,V)


class DecoderLayer(nn.Module):
    """Pre-norm: x += SelfAttn(N1 x) [causal]; x += CrossAttn(N2 x, memory); x += FFN(N3 x)."""

    def __init__(self, d_model: int, n_heads: int, causal: bool = True):
        super().__init__()
        self.norm1 = make_norm("layernorm", d_model)
        self.self_attn = MultiHeadSelfAttention(d_model, n_heads, causal=causal)
        self.norm2 = make_norm("layernorm", d_model)
        self.cross_attn = MultiHeadCrossAttention(d_model, n_heads)
        self.norm3 = make_norm("layernorm", d_model)
        self.ffn = FeedForward(d_model)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, tgt_padding_mask: torch.Tensor | None = None,
                src_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.norm1(x), tgt_padding_mask)[0]  # (B,T_tgt,D)
        x = x + self.cross_attn(self.norm2(x), memory, src_padding_mask)[0]  # Q: x, K/V: memory (B,T_src,D)
        return x + self.ffn(self.norm3(x))  # (B,T_tgt,D)


class EncoderDecoder(nn.Module):
    """(src (B,T_src), tgt (B,T_tgt)) -> logits (B,T_tgt,V)."""

    def __init__(self, src_vocab: int, tgt_vocab: int, d_model: int, n_heads: int, n_layers: int,
                 decoder_causal: bool = True):
        super().__init__()
        self.src_emb = nn.Embedding(src_vocab, d_model)  # V_src x D
        self.src_pos = SinusoidalPositions(d_model)
        self.encoder = nn.ModuleList(TransformerBlock(d_model, n_heads, causal=False) for _ in range(n_layers))
        self.enc_norm = make_norm("layernorm", d_model)
        self.tgt_emb = nn.Embedding(tgt_vocab, d_model)  # V_tgt x D
        self.tgt_pos = SinusoidalPositions(d_model)
        self.decoder = nn.ModuleList(DecoderLayer(d_model, n_heads, causal=decoder_causal)
                                     for _ in range(n_layers))
        self.dec_norm = make_norm("layernorm", d_model)
        self.lm_head = nn.Linear(d_model, tgt_vocab, bias=False)

    def encode(self, src: torch.Tensor, src_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.src_pos(self.src_emb(src))  # (B,T_src,D)
        for block in self.encoder:
            x = block(x, src_padding_mask)
        return self.enc_norm(x)  # memory (B,T_src,D)

    def decode(self, tgt: torch.Tensor, memory: torch.Tensor, tgt_padding_mask: torch.Tensor | None = None,
               src_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.tgt_pos(self.tgt_emb(tgt))  # (B,T_tgt,D)
        for layer in self.decoder:
            y = layer(y, memory, tgt_padding_mask, src_padding_mask)
        return self.lm_head(self.dec_norm(y))  # (B,T_tgt,V)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_padding_mask: torch.Tensor | None = None,
                tgt_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.decode(tgt, self.encode(src, src_padding_mask), tgt_padding_mask, src_padding_mask)
