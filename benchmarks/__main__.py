"""Run named benchmark specs one after another, each writing OUT/<spec>_<machine>_<date>.json.

    python -m benchmarks SPEC [SPEC ...] [--out DIR] [--work DIR]
    python -m benchmarks --list

Every spec's configs are composed and validated before the first one starts, so a typo in the third
spec does not waste the first two's GPU time. One spec that fails does not stop the ones after it.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from benchmarks import specs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("specs", nargs="*", help="spec names (benchmarks/specs/NAME.yaml) or paths")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")), help="result folder ($OUT)")
    p.add_argument("--work", type=Path, default=None, help="scratch folder for run dirs (default: temp dirs)")
    p.add_argument("--list", action="store_true", help="print every spec with its benchmark and description")
    args = p.parse_args(argv)
    if args.list or not args.specs:
        for name in specs.names():
            s = specs.load_spec(name)
            print(f"{name:<28} {s.benchmark:<26} {s.description}")
        return 0
    try:
        plan = []
        for name in args.specs:
            spec = specs.load_spec(name)
            opts = specs.options_for(specs.module(spec.benchmark).Options, spec.options, f"spec {spec.name}")
            specs.check(spec, opts)
            plan.append((spec, opts))
    except specs.SpecError as exc:
        return specs.fail(exc)
    failed = []
    for spec, opts in plan:
        path = specs.result_path(args.out, spec)
        work = (args.work / spec.name) if args.work else Path(specs.tempdir(spec.name))
        print(f"[{spec.name}] {spec.benchmark}: results -> {path}", flush=True)
        try:
            specs.module(spec.benchmark).run(spec, opts, path, work)
        except Exception:  # noqa: BLE001 - the next spec still runs; what this one wrote stays
            failed.append(spec.name)
            print(f"[{spec.name}] failed:\n{traceback.format_exc(limit=8)}", file=sys.stderr, flush=True)
    print(f"done: {len(plan) - len(failed)} of {len(plan)} specs" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
