"""`python -m harness.sweep NAME [overrides] [--dry-run] [--resume DIR]`: launch a named sweep
(harness.multirun.launch, whose docstring is the help text); `python -m harness.sweep status|logs|cancel
DIR ...`: watch or stop one from any shell (harness.multirun.control)."""

from __future__ import annotations

import sys

from harness.multirun.launch import main  # noqa: F401 - the command (lowp-sweep)

if __name__ == "__main__":
    sys.exit(main())
