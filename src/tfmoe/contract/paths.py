"""Where tfmoe's own files are, named once so that no module counts parent folders from its own ``__file__``
(moving a module used to break those lookups, failures.md F-83)."""

from __future__ import annotations

from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # src/tfmoe (or site-packages/tfmoe)
CHECKOUT_ROOT = PACKAGE_ROOT.parents[1]  # the repository, for an editable install from a checkout

# tfmoe's own code and configs in a checkout, as git pathspecs from its top: what `git_dirty` and code/tfmoe.diff
# cover. The notebook's files (failures.md, runs/, conclusions, docs/, experiments/*.md) are left out: `failures
# add` editing the tracked failures.md must not make every later run "dirty".
CODE_PATHSPECS = (":(top)src", ":(top)conf", ":(top)pyproject.toml")
