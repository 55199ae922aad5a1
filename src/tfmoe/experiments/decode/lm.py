"""decode's tiny language model: the character vocabulary of a corpus (plus <eos>), the corpus as one id stream,
and the brief shifted-label training whose loss the run checks against a unigram baseline."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tfmoe.components.lm import TinyCausalLM
from tfmoe.contract.errors import BadInput
from tfmoe.contract.recorder import Recorder

if TYPE_CHECKING:
    from tfmoe.experiments.decode.settings import Settings

EOS = "<eos>"


@dataclass
class CharVocab:
    """Characters of the corpus (sorted) plus <eos> as the last id."""

    chars: list[str]

    @property
    def size(self) -> int:
        return len(self.chars) + 1

    @property
    def eos_id(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        index = {c: i for i, c in enumerate(self.chars)}
        missing = sorted({c for c in text if c not in index})
        if missing:
            raise BadInput(f"prompt has characters outside the vocabulary {missing!r}: use only characters of the "
                           f"corpus ({''.join(self.chars)!r})")
        return [index[c] for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(EOS if i == self.eos_id else self.chars[i] for i in ids)


def load_corpus(path: str | None) -> list[str]:
    """Non-empty lines of the named file, or of the packaged corpus when path is null."""
    if path:
        p = Path(path)
        if not p.is_file():
            raise BadInput(f"corpus_path={path!r} is not a file: name a UTF-8 text file, or null for the built-in corpus")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise BadInput(f"corpus_path={path!r} is not UTF-8 text (bad byte at offset {exc.start}): "
                           "convert it to UTF-8") from None
        except OSError as exc:
            raise BadInput(f"corpus_path={path!r} cannot be read ({exc.strerror}): fix its permissions") from None
    else:
        text = resources.files("tfmoe").joinpath("data/decode_corpus.txt").read_text(encoding="utf-8")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise BadInput(f"corpus {path or 'decode_corpus.txt'} has no text: give a file with at least one line")
    return lines


def corpus_stream(lines: list[str], vocab: CharVocab) -> torch.Tensor:
    """All lines as one id stream, each line followed by <eos>."""
    ids: list[int] = []
    for line in lines:
        ids += vocab.encode(line) + [vocab.eos_id]
    return torch.tensor(ids, dtype=torch.long)


def lm_loss(model: TinyCausalLM, window: torch.Tensor) -> torch.Tensor:
    """Shifted-label loss: inputs window[:, :-1], labels window[:, 1:] (next token at every position)."""
    logits = model(window[:, :-1])  # (B,T,V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), window[:, 1:].reshape(-1))


@torch.no_grad()
def eval_loss(model: TinyCausalLM, stream: torch.Tensor, block: int) -> float:
    """Mean next-token loss over consecutive (non-overlapping) windows of a held-out stream."""
    n = (stream.numel() - 1) // block
    if n == 0:
        return float(lm_loss(model, stream[None]))
    windows = torch.stack([stream[i * block: i * block + block + 1] for i in range(n)])  # (n, block+1)
    return float(lm_loss(model, windows))


def unigram_cross_entropy(train: torch.Tensor, val: torch.Tensor, V: int) -> float:
    """Loss of the best context-free model: add-one unigram frequencies of train, scored on val."""
    counts = torch.bincount(train, minlength=V).double() + 1
    return float(-(counts / counts.sum()).log()[val].mean())


def train_lm(rec: Recorder, s: Settings, train: torch.Tensor, V: int) -> TinyCausalLM:
    """AdamW on random windows of the train stream; the loss of every step is a metrics row."""
    model = TinyCausalLM(V, s.d_model, s.n_heads, s.n_layers, s.max_len).to(rec.device)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(rec.seed)
    block = min(s.block_size, train.numel() - 1)
    model.train()
    for step in rec.progress(range(s.train_steps), total=s.train_steps, description="training the tiny LM"):
        starts = torch.randint(0, train.numel() - block, (s.batch_size,), generator=g)
        window = torch.stack([train[i: i + block + 1] for i in starts.tolist()]).to(rec.device)  # (B, block+1)
        loss = lm_loss(model, window)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        rec.metric("train_loss", float(loss.detach()), step=step)
    return model.eval()
