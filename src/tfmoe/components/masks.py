"""Attention masks as boolean tensors: True = the query may attend to that key."""

from __future__ import annotations

import torch


def causal_mask(T: int, device: torch.device | str | None = None, offset: int = 0,
                T_k: int | None = None) -> torch.Tensor:
    """(T, T_k) lower-triangular mask: query i (at absolute position offset+i) sees keys j <= offset+i."""
    T_k = T + offset if T_k is None else T_k
    q_pos = torch.arange(T, device=device).unsqueeze(1) + offset  # (T, 1)
    k_pos = torch.arange(T_k, device=device).unsqueeze(0)  # (1, T_k)
    return k_pos <= q_pos  # (T, T_k)


def padding_mask_from_lengths(lengths: torch.Tensor | list[int], T: int,
                              device: torch.device | str | None = None) -> torch.Tensor:
    """(B, T) mask, True = real token, for right-padded rows of the given valid lengths (0 <= length <= T)."""
    lengths_t = torch.as_tensor(lengths, device=device).view(-1, 1)  # (B, 1)
    if lengths_t.numel() and (int(lengths_t.min()) < 0 or int(lengths_t.max()) > T):
        raise ValueError(f"lengths {lengths_t.view(-1).tolist()} must lie in [0, T={T}]")
    return torch.arange(T, device=device).unsqueeze(0) < lengths_t  # (B, T)


def key_padding_mask(padding_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) real-token mask -> (B, 1, 1, T): hides padded *keys* (queries are never masked)."""
    return padding_mask.bool()[:, None, None, :]


def combine_masks(T_q: int, T_k: int, causal: bool, padding_mask: torch.Tensor | None,
                  device: torch.device | str | None = None, offset: int = 0) -> torch.Tensor | None:
    """Broadcastable (B or 1, 1, T_q, T_k) boolean mask, or None when nothing is masked."""
    if padding_mask is not None and padding_mask.shape[-1] != T_k:
        raise ValueError(f"padding_mask covers {padding_mask.shape[-1]} keys, the attention has T_k={T_k}")
    mask = None
    if causal:
        mask = causal_mask(T_q, device=device, offset=offset, T_k=T_k)[None, None]  # (1,1,Tq,Tk)
    if padding_mask is not None:
        kpm = key_padding_mask(padding_mask.to(device))  # (B,1,1,Tk)
        mask = kpm if mask is None else (mask & kpm)
    return mask


def visible_queries(mask: torch.Tensor | None, B: int, T_q: int) -> torch.Tensor:
    """(B, T_q): True where the query sees at least one key. Queries that see none ("fully masked rows")
    have no defined attention output: the course module returns 0 for them, other code may return NaN."""
    if mask is None:
        return torch.ones(B, T_q, dtype=torch.bool)
    return mask.any(dim=-1).expand(B, -1, T_q)[:, 0].cpu()  # (B, T_q)
