"""`python -m harness.megatron [overrides] [--format sh|args]`: the Megatron-LM pretrain_gpt.py
command equivalent to a composed lowp config (the flag mapping: harness.interop.megatron)."""

from __future__ import annotations

import sys

from harness import recipes
from harness.interop.megatron import __doc__ as MAPPING_DOC
from harness.interop.megatron import render
from harness.interop.megatron_schedule import render_schedule
from harness.validation import ConfigError, load

FORMATS = ("sh", "args")


def _pop_format(argv: list[str]) -> str:
    fmt = "sh"
    for i, a in enumerate(argv):
        if a == "--format" or a.startswith("--format="):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            del argv[i : i + (1 if "=" in a else 2)]
            fmt = value
            break
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt or '(missing)'}: choose one of {list(FORMATS)}")
    return fmt


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(MAPPING_DOC.strip())
        return 0
    try:
        fmt = _pop_format(argv)
        removed = recipes.legacy_in(argv)
        if removed:
            raise ConfigError(removed)
        cfg = load(argv, for_export=True)
        if cfg.seed < 0:
            raise ConfigError(
                f"seed={cfg.seed}: Megatron needs --seed >= 1 and lowp exports seed N as N+1; use seed >= 0"
            )
        # ConfigError: a setting lowp trains that Megatron cannot express; a schedule: a command a phase
        text = render_schedule(cfg, fmt) if cfg.schedule.phases else render(cfg, fmt)
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
