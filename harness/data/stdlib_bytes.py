"""Byte-level text of the running interpreter's standard library: real text on every machine.

The `.py` files under sysconfig's stdlib directory, in sorted relative-path order, concatenated
and capped at `data.num_tokens` bytes (the first ~2 MB load in well under a second). Installed
packages (site-packages, dist-packages) and test directories are skipped: the former differ per
machine, the latter hold deliberately odd encodings and syntax. The bytes differ between Python
versions, so the sha256 fingerprint and the Python version are recorded with every run.
"""

from __future__ import annotations

import os
import platform
import sysconfig

import numpy as np

from harness.config.schema import DataConfig
from harness.data.base import StreamData, check_eval_fraction, config_error, fingerprint, split_stream

SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


def stdlib_files(root: str) -> list[str]:
    """Sorted '/'-separated paths of the stdlib's .py files, relative to root."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]
        rel = os.path.relpath(dirpath, root)
        for f in filenames:
            if f.endswith(".py"):
                found.append(f if rel == "." else f"{rel}/{f}".replace(os.sep, "/"))
    return sorted(found)


def read_capped(root: str, files: list[str], cap: int) -> tuple[bytes, int]:
    """The files' bytes concatenated, cut at `cap`; also how many files were (partly) read."""
    parts, total, used = [], 0, 0
    for rel in files:
        if total >= cap:
            break
        with open(os.path.join(root, rel), "rb") as fh:
            data = fh.read(cap - total)
        parts.append(data)
        total += len(data)
        used += 1
    return b"".join(parts), used


def build(cfg: DataConfig, vocab_size: int, seq_length: int) -> StreamData:
    if cfg.vocab_size not in (None, 256):
        raise config_error(
            f"data.vocab_size={cfg.vocab_size}", "stdlib_bytes is byte-level (256 tokens)", "leave it null"
        )
    if cfg.num_tokens < 1:
        raise config_error(
            f"data.num_tokens={cfg.num_tokens}", "must be >= 1", "e.g. data.num_tokens=2000000"
        )
    check_eval_fraction(cfg.eval_fraction)
    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_files(root)
    text, used = read_capped(root, files, cfg.num_tokens)
    stream = np.frombuffer(text, dtype=np.uint8)
    train, eval = split_stream(stream, cfg.eval_fraction)
    params = {"name": "stdlib_bytes", "num_tokens": cfg.num_tokens}
    return StreamData(
        "stdlib_bytes",
        256,
        seq_length,
        train,
        eval if cfg.eval_fraction > 0 else None,
        fingerprint(params, text),
        split_option=f"data.num_tokens={cfg.num_tokens}",
        facts={
            "python_version": platform.python_version(),
            "python_implementation": platform.python_implementation(),
            "stdlib": root,
            "files": used,
            "last_file": files[used - 1] if used else None,
        },
    )
