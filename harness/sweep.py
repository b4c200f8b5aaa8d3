"""Launch a named sweep: `python -m harness.sweep NAME [overrides...]` runs sweeps/NAME.yaml.

A sweep file holds fixed `overrides` (a list of `key=value`) and `params` (`key: comma,separated`
values swept as a Hydra multirun). Extra command-line overrides win over the file's, e.g.
`hydra/launcher=slurm` to send the same sweep to a cluster. `--list` shows the sweeps.
`--report` runs `python -m analysis.report` on the sweep directory once every job has finished
(the sweep lands in multirun/<name>/<date_time> unless hydra.sweep.dir= says otherwise).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

SWEEPS = Path(__file__).resolve().parents[1] / "sweeps"


def sweep_argv(name: str, extra: list[str]) -> list[str]:
    path = SWEEPS / f"{name}.yaml"
    if not path.exists():
        known = sorted(p.stem for p in SWEEPS.glob("*.yaml"))
        raise SystemExit(f"error: sweep {name}: no sweeps/{name}.yaml; choose one of {known}")
    spec = OmegaConf.to_container(OmegaConf.load(path))
    keys = {a.split("=", 1)[0].lstrip("+~") for a in extra}
    fixed = [o for o in spec.get("overrides", []) if o.split("=", 1)[0] not in keys]
    params = [f"{k}={v}" for k, v in (spec.get("params") or {}).items() if k not in keys]
    return ["-m", *fixed, *params, *extra]


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(__doc__.strip())
        print("sweeps:", ", ".join(sorted(p.stem for p in SWEEPS.glob("*.yaml"))))
        return
    report = "--report" in argv
    name, extra = argv[0], [a for a in argv[1:] if a != "--report"]
    sweep_dir = next((a.split("=", 1)[1] for a in extra if a.startswith("hydra.sweep.dir=")), None)
    if sweep_dir is None:
        sweep_dir = f"multirun/{name}/{time.strftime('%Y-%m-%d_%H-%M-%S')}"
        extra.append(f"hydra.sweep.dir={sweep_dir}")
    code = subprocess.call([sys.executable, "-m", "harness.train", *sweep_argv(name, extra)])
    if code != 0:
        sys.exit(code)
    if report:
        sys.exit(subprocess.call([sys.executable, "-m", "analysis.report", sweep_dir]))


if __name__ == "__main__":
    main()
