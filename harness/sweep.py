"""`python -m harness.sweep NAME [overrides] [--dry-run] [--resume DIR]`: launch a named sweep
(harness.multirun.launch, whose docstring is the help text)."""

from __future__ import annotations

import sys

from harness.multirun.launch import main  # noqa: F401 - the command (lowp-sweep)

if __name__ == "__main__":
    sys.exit(main())
