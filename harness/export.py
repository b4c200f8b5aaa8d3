"""`python -m harness.export RUN_DIR --format hf|hf-fp8|hf-int4 --out DIR`: a run's weights as a
Hugging Face checkpoint (harness.interop.export)."""

from __future__ import annotations

import sys

from harness.interop.export import export, main  # noqa: F401 - the command and its API

if __name__ == "__main__":
    sys.exit(main())
