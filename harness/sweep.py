"""Launch a named sweep: `python -m harness.sweep NAME [overrides...]` runs sweeps/NAME.yaml.

A sweep file holds fixed `overrides` (a list of `key=value`) and `params` (`key: comma,separated`
values swept as a Hydra multirun). Extra command-line overrides win over the file's, e.g.
`hydra/launcher=slurm` to send the same sweep to a cluster. `--list` shows the sweeps.
"""

from __future__ import annotations

import sys
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
    from harness import train

    sys.argv = ["harness.train", *sweep_argv(argv[0], argv[1:])]
    train.main()


if __name__ == "__main__":
    main()
