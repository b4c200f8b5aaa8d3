"""The GPU tests (`-m gpu`) as one result file: outcome counts and each failure's message, not a transcript.

    python -m benchmarks.gpu_tests --spec gpu_tests [--select "batched_fp8 or precision_aware"]

Runs pytest in this process over tests/ (or --paths) with the `gpu` marker and an optional -k
expression; they skip without CUDA (and TE where a test needs it), which the counts show.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import specs


@dataclass(frozen=True)
class Options:
    paths: tuple[str, ...] = field(default=("tests",), metadata={"help": "test paths, comma-separated"})
    select: str = field(default="", metadata={"help": "a pytest -k expression"})


def plan(spec: specs.Spec, opts: Options) -> dict[str, list[str]]:
    return {}  # no configs of its own: each test composes what it needs


class Outcomes:
    """A pytest plugin keeping each test's outcome (setup skips and call failures alike)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.failures: dict[str, str] = {}

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.counts[report.outcome] = self.counts.get(report.outcome, 0) + 1
            if report.failed:
                self.failures[report.nodeid] = str(report.longrepr)[-1500:]


def run(spec: specs.Spec, opts: Options, out: Path, work: Path) -> dict:
    import pytest

    plugin, t0 = Outcomes(), time.perf_counter()
    args = ["-q", "-m", "gpu", "-p", "no:cacheprovider", *opts.paths] + (
        ["-k", opts.select] if opts.select else []
    )
    code = pytest.main(args, plugins=[plugin])
    result = {
        "_meta": specs.meta(spec, opts),
        "exit_code": int(code),
        "counts": plugin.counts,
        "failures": plugin.failures,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    specs.write_json(out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    return specs.cli(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
