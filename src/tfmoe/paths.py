"""Where tfmoe's own files are, named once so that no module counts parent folders from its own ``__file__``
(moving a module used to break those lookups, failures.md F-83)."""

from __future__ import annotations

from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent  # src/tfmoe (or site-packages/tfmoe)
CHECKOUT_ROOT = PACKAGE_ROOT.parents[1]  # the repository, for an editable install from a checkout
