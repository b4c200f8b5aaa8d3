"""Whole training runs of a spec, one after another, packed into one JSON (summaries and loss curves).

    python -m benchmarks.curves --spec markov_300_1b_knobs [--work DIR]

For loss figures that need real runs (e.g. 300 markov steps of the 1.4B memory knobs against two
BF16 seeds): each run is `harness.train.run` into WORK/runs/<label>/ (a complete run directory), and
after every run the whole tree is collected by `analysis.collect` into the result file, so a timeout
keeps the runs that finished. `python -m analysis.report WORK/runs` compares them afterwards.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from analysis.collect import collect
from benchmarks import specs


@dataclass(frozen=True)
class Options:
    pass


def plan(spec: specs.Spec, opts: Options) -> dict[str, list[str]]:
    if not spec.runs:
        raise specs.SpecError(f"spec {spec.name}: a curves spec needs runs (label: [overrides])")
    return spec.run_overrides()


def run(spec: specs.Spec, opts: Options, out: Path, work: Path) -> dict:
    from harness.train import run as train

    result: dict = {"_meta": specs.meta(spec, opts), "errors": {}, "runs": {}}
    for label, overrides in plan(spec, opts).items():
        print(f"[curves] {label}: {' '.join(overrides)}", flush=True)
        try:
            train(specs.load_config(overrides), work / "runs" / label)
        except Exception:  # noqa: BLE001 - the run dir says how it ended; the next run still goes
            result["errors"][label] = traceback.format_exc()[-1500:]
            print(f"[curves] {label} failed:\n{result['errors'][label]}", file=sys.stderr, flush=True)
        result["runs"] = collect(work / "runs")
        specs.write_json(out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    return specs.cli(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
