"""Read runs from W&B offline run directories (`wandb/offline-run-*/run-<id>.wandb`).

wandb >= 0.2x no longer ships a Python reader for its transaction log (the old
`wandb.sdk.internal.datastore` moved into the Go `wandb-core`), so the container format is read here:
a LevelDB-style log (https://github.com/google/leveldb/blob/main/doc/log_format.md) with a 7-byte
file header (`:W&B`, magic 0xBEE1, version 0), 32 KiB blocks, 7-byte record headers (CRC-32 of
type byte and data, length, type) and FULL/FIRST/MIDDLE/LAST fragments. Each record is a
`wandb_internal_pb2.Record`, decoded with wandb's own protobuf classes. Nothing is sent anywhere.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from analysis import keys as K
from analysis.columns import rows_to_columns
from analysis.run import Run

_IDENT, _MAGIC, _VERSION = b":W&B", 0xBEE1, 0
_BLOCK = 32768
_HEADER = 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def iter_records(path: str | Path, issues: list[str] | None = None) -> Iterator[Any]:
    """Every `Record` of a `.wandb` file, in order; stops at a torn or corrupt tail (noted in issues)."""
    from wandb.proto import wandb_internal_pb2 as pb

    issues = issues if issues is not None else []
    data = Path(path).read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:_HEADER]) if len(data) >= _HEADER else (b"", 0, 0)
    if (ident, magic, version) != (_IDENT, _MAGIC, _VERSION):
        issues.append(f"{Path(path).name}: not a W&B transaction log (header {data[:_HEADER]!r})")
        return
    off, pending = _HEADER, b""
    while off + _HEADER <= len(data):
        left = _BLOCK - off % _BLOCK
        if left < _HEADER:  # block trailer: zero padding
            off += left
            continue
        crc, length, rtype = struct.unpack("<IHB", data[off : off + _HEADER])
        if rtype == 0 and length == 0:  # zero-filled rest of a block
            off += left
            continue
        chunk = data[off + _HEADER : off + _HEADER + length]
        if len(chunk) != length or zlib.crc32(chunk, zlib.crc32(bytes([rtype]))) != crc:
            issues.append(f"{Path(path).name}: corrupt or torn record at byte {off}; read up to there")
            return
        off += _HEADER + length
        if rtype == _FULL:
            pending, payload = b"", chunk
        elif rtype in (_FIRST, _MIDDLE):
            pending = (b"" if rtype == _FIRST else pending) + chunk
            continue
        elif rtype == _LAST:
            pending, payload = b"", pending + chunk
        else:
            issues.append(f"{Path(path).name}: unknown record type {rtype} at byte {off}; stopped")
            return
        rec = pb.Record()
        rec.ParseFromString(payload)
        yield rec


def _items_to_dict(items: Any) -> dict[str, Any]:
    """W&B history/summary/config items ({key | nested_key, value_json}) as a flat dict."""
    out = {}
    for it in items:
        key = it.key or "/".join(it.nested_key)
        try:
            out[key] = json.loads(it.value_json)
        except ValueError:
            out[key] = it.value_json
    return out


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """Config keys written as `recipe.name` become {"recipe": {"name": ...}}; dict values stay."""
    out: dict[str, Any] = {}
    for k, v in flat.items():
        if k == "_wandb":
            continue
        parts = k.split(".")
        d = out
        for p in parts[:-1]:
            d = d.setdefault(p, {}) if isinstance(d.get(p, {}), dict) else d
        d[parts[-1]] = v
    return out


def read_offline_run(path: str | Path, name: str | None = None) -> Run:
    """A `Run` from one `.wandb` file: config, history rows (those with `tokens`), summary, exit code.

    summary.json fields come from the W&B summary when the harness logged them there; else status is
    `completed` (exit code 0), `failed` (non-zero) or incomplete (no exit record), and the rest is read
    from the config like for a run directory.
    """
    path = Path(path)
    issues: list[str] = []
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    exit_code = None
    for rec in iter_records(path, issues):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            r = rec.run
            info = {"run_id": r.run_id, "project": r.project, "group": r.run_group, "job_type": r.job_type}
            info.update(name=r.display_name, mode="offline", dir=str(path.parent))
            config.update(_items_to_dict(r.config.update))
        elif kind == "config":
            config.update(_items_to_dict(rec.config.update))
        elif kind == "history":
            row = _items_to_dict(rec.history.item)
            row.setdefault(K.STEP, row.get("_step"))
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
        elif kind == "summary":
            summary.update(_items_to_dict(rec.summary.update))
        elif kind == "exit":
            exit_code = rec.exit.exit_code
    config = _nest(config)
    provenance = config.pop("provenance", None) or {}
    summ = {k: summary[k] for k in K.SUMMARY_FIELDS if k in summary}
    if "status" not in summ:
        if exit_code is None:
            issues.append("W&B run has no exit record: reported as incomplete")
            summ = None
        else:
            summ["status"] = K.COMPLETED if exit_code == 0 else K.FAILED
    train, ev = rows_to_columns(rows, path.name, issues)
    name = name or f"wandb:{info.get('run_id') or path.stem}"
    return Run(path.parent, name, config, provenance, info or None, summ, train, ev, issues, "wandb_offline")


def find_offline_runs(root: str | Path) -> list[Path]:
    """Every `run-*.wandb` under `root`, without the `latest-run` link (a second path to one of them,
    which sorts first and may be a resumed run that carries no config)."""
    return sorted(p for p in Path(root).rglob("run-*.wandb") if "latest-run" not in p.parts)
