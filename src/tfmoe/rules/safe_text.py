"""The one rule for text a person types into the notebook (`conclude`, `failures add`) and for text shown from disk
(`show`, summary.md, failures.md): it may say anything, but it may not change how the page reads. Line breaks are
folded into spaces (a field cannot start a heading of its own); control characters (NUL, ESC and the other C0 and
C1 controls), bidi and other format controls (U+202E reverses what follows, U+200B is invisible), surrogates and
private-use characters are refused when typed and shown as escapes (``\\x1b``, ``\\u202e``) when read back. The
zero-width joiner of emoji sequences stays."""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from tfmoe.contract.errors import BadInput

# Line breaks: folded into one space, so that a field's text stays on its line.
LINE_BREAKS = re.compile(r"[\n\r\t\v\f\x1c-\x1e\x85\u2028\u2029]+")
ZERO_WIDTH_JOINER = "\u200d"


def structural(ch: str) -> bool:
    """A character that changes how text reads rather than what it says (control, format, surrogate, private use),
    but the zero-width joiner."""
    return unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co") and ch != ZERO_WIDTH_JOINER


def typed_text(option: str, text: str, where: str, required: bool = True) -> str:
    """A value typed for ``--option`` as the notebook may keep it: line breaks folded into spaces; BadInput when it
    holds a structural character (naming it and ``where`` it would act) or, when ``required``, when it is empty."""
    folded = " ".join(LINE_BREAKS.sub(" ", text).split(" ")).strip()
    bad = next((ch for ch in folded if structural(ch)), None)
    if bad is not None:
        name = unicodedata.name(bad, "a control character")
        raise BadInput(f"--{option} holds U+{ord(bad):04X} ({name}), which would change how {where} reads: "
                       "remove it")
    if required and not folded:
        raise BadInput(f"--{option} is empty: say what you know, e.g. --{option} 'not yet known'")
    return folded


def shown_text(text: Any) -> str:
    """Text read from disk (written by a run, by an older tfmoe, or by hand) as a page may show it: on one line,
    structural characters as escapes instead of acting."""
    folded = LINE_BREAKS.sub(" ", str(text))
    return "".join(ch.encode("unicode_escape").decode("ascii") if structural(ch) else ch for ch in folded)


def cell_text(text: str) -> str:
    """A table cell's text: structural characters as escapes; its line breaks kept (a table wraps them)."""
    if text.isprintable():
        return text
    return "".join(ch.encode("unicode_escape").decode("ascii") if structural(ch) and ch not in "\n\t" else ch
                   for ch in text)
