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

    def __init__(self, on_report=None) -> None:
        self.counts: dict[str, int] = {}
        self.failures: dict[str, str] = {}
        self.durations: dict[str, float] = {}
        self.on_report = on_report  # called after each outcome: a killed call keeps what ran

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.counts[report.outcome] = self.counts.get(report.outcome, 0) + 1
            self.durations[report.nodeid] = round(report.duration, 1)
            if report.failed:
                self.failures[report.nodeid] = str(report.longrepr)[-1500:]
            if self.on_report is not None:
                self.on_report()


def run(spec: specs.Spec, opts: Options, out: Path, work: Path) -> dict:
    import pytest

    t0 = time.perf_counter()

    def result(code) -> dict:
        return {
            "_meta": specs.meta(spec, opts),
            "exit_code": code,  # null while the tests still run (a file from a killed call)
            "counts": plugin.counts,
            "failures": plugin.failures,
            "durations_s": plugin.durations,
            "seconds": round(time.perf_counter() - t0, 1),
        }

    plugin = Outcomes(on_report=lambda: specs.write_json(out, result(None)))
    args = ["-q", "-m", "gpu", "-p", "no:cacheprovider", *opts.paths] + (
        ["-k", opts.select] if opts.select else []
    )
    final = result(int(pytest.main(args, plugins=[plugin])))
    specs.write_json(out, final)
    return final


def main(argv: list[str] | None = None) -> int:
    return specs.cli(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
