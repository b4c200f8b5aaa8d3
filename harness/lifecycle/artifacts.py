"""The run directory: the contract between the harness and analysis (architecture.md, Artifacts).

run.json         resolved config + provenance + W&B id (written when the run starts)
metrics.jsonl    one object per logged step (metric keys of harness.lifecycle.metrics)
numerics.jsonl   telemetry rows (step, layer, tensor, amax, scale, underflow, saturation, sqnr_db)
summary.json     written atomically at the end, also on failure, preemption and divergence
error.txt        a failed run's error and traceback
checkpoints/     the newest checkpoints (harness.lifecycle.checkpoint: weights, optimizer, schedule,
                 every RNG, data position, scale state); a run started on this directory resumes from them
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import errno
import json
import math
import os
import platform
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def _json_default(obj):
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    return repr(obj)


def _clean(obj):
    """NaN/Inf are not JSON: write them as null so every reader can parse every line."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def dumps(obj) -> str:
    return json.dumps(_clean(obj), default=_json_default, allow_nan=False)


_OS_ERRORS = {  # errno -> (what it means here, the fix)
    errno.ENOSPC: ("the disk is full", "free space there"),
    errno.EDQUOT: ("the disk quota is used up", "free space there or raise the quota"),
    errno.EROFS: ("", "make it writable or use another hydra.run.dir"),
    errno.EACCES: ("", "make it writable for this user or use another hydra.run.dir"),
    errno.EPERM: ("", "make it writable for this user or use another hydra.run.dir"),
    errno.EEXIST: ("a file is in the way", "move that file away"),
    errno.ENOTDIR: ("a file is in the way", "move that file away"),
}


def os_error_text(exc: OSError, where: Path | str | None = None) -> str:
    """A file-system error for an `error:` line: the path (the error's own, else `where`), the cause
    and the fix (`/runs/x/checkpoints: No space left on device (the disk is full); free space there`)."""
    meaning, fix = _OS_ERRORS.get(exc.errno, ("", "check that path"))
    path = exc.filename or where
    cause = (exc.strerror or str(exc)) + (f" ({meaning})" if meaning else "")
    return f"{path}: {cause}; {fix}" if path else f"{cause}; {fix}"


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # ranks of one job may write at once
    try:
        tmp.write_text(json.dumps(_clean(obj), default=_json_default, indent=1, allow_nan=False))
        os.replace(tmp, path)
    except OSError:  # a full disk: no half-written temporary left beside the file
        tmp.unlink(missing_ok=True)
        raise


def git_state() -> dict:
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=5)
            return out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_sha": sha, "git_dirty": bool(status) if status is not None else None}


SLURM_ENV = {
    "job_id": "SLURM_JOB_ID",
    "array_job_id": "SLURM_ARRAY_JOB_ID",
    "array_task_id": "SLURM_ARRAY_TASK_ID",
    "restart_count": "SLURM_RESTART_COUNT",
    "node": "SLURMD_NODENAME",
    "job_name": "SLURM_JOB_NAME",
    "partition": "SLURM_JOB_PARTITION",
}


def slurm_env() -> dict | None:
    """The Slurm job this attempt runs in (None outside Slurm); restart_count 0 on the first run."""
    if "SLURM_JOB_ID" not in os.environ:
        return None
    out = {k: os.environ.get(v) for k, v in SLURM_ENV.items()}
    for k in ("job_id", "array_job_id", "array_task_id"):
        out[k] = int(out[k]) if out[k] and out[k].isdigit() else out[k]
    out["restart_count"] = int(out["restart_count"] or 0)
    return out


def provenance(*, backend: dict, hardware: str, seed: int, data: dict, device: torch.device) -> dict:
    from harness.backends.capability import te_installed_version

    gpu = {"gpu_name": None, "gpu_capability": None}
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        gpu = {"gpu_name": torch.cuda.get_device_name(device), "gpu_capability": f"{major}.{minor}"}
    return {
        **git_state(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "te": te_installed_version(),
        "cuda": torch.version.cuda,
        **gpu,
        "cpu": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "nvte_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NVTE_")},
        **backend,
        "hardware": hardware,
        "seed": seed,
        "data_fingerprint": data.get("fingerprint"),
        "data": data,
        "hostname": socket.gethostname(),
        "slurm": slurm_env(),
        "argv": sys.argv,
        "started_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


# summary.json's `status` values (analysis/keys.py repeats them; tests/test_contract.py checks)
COMPLETED, DIVERGED, FAILED, PREEMPTED = "completed", "diverged", "failed", "preempted"
STATUSES = (COMPLETED, DIVERGED, FAILED, PREEMPTED)


@dataclass
class Summary:
    """summary.json: every field of the contract; null where a run (or backend) cannot fill it."""

    status: str = FAILED
    recipe: str | None = None
    recipe_label: str | None = None
    """The family plus a readable label per recipe field changed from its preset
    (`tensorwise + fast accumulation`); the report's arms and W&B names use it."""
    variant: str | None = None
    backend: str | None = None
    hardware: str | None = None
    model: str | None = None
    data: str | None = None
    seed: int | None = None
    steps: int = 0
    tokens: int = 0
    final_train_loss: float | None = None
    final_eval_loss: float | None = None
    loss_floor: float | None = None
    tokens_per_s: float | None = None
    step_time_ms: float | None = None
    mfu_bf16_peak: float | None = None
    mfu_recipe_peak: float | None = None
    peak_mem_gib: float | None = None
    memory: dict = field(default_factory=dict)
    wall_time_s: float | None = None
    diverged_step: int | None = None
    divergence_cause: str | None = None
    error: str | None = None
    world_size: int = 1
    """Data-parallel ranks; tokens_per_s is the job's, tokens_per_s_per_gpu the mean per rank."""
    tokens_per_s_per_gpu: float | None = None
    failed_rank: int | None = None
    """The rank whose failure ended the run (the earliest to fail), with several ranks."""


def closing_line(summary: Summary, run_dir: Path) -> str:
    """The run's last log line: how it ended, its final losses and throughput, where its files are."""
    end = summary.status
    if summary.status == DIVERGED:
        end = f"diverged at step {summary.diverged_step} ({summary.divergence_cause})"
    parts = [f"{end}: {summary.steps} steps, {summary.tokens:,} tokens in {summary.wall_time_s:.1f} s"]
    for name, loss in (("loss/train", summary.final_train_loss), ("loss/eval", summary.final_eval_loss)):
        if loss is not None:
            parts.append(f"{name} {loss:.4f}")
    if summary.tokens_per_s:
        parts.append(f"{summary.tokens_per_s:,.0f} tok/s")
    if summary.mfu_bf16_peak is not None:
        parts.append(f"MFU {summary.mfu_bf16_peak:.1%} of the BF16 peak")
    files = "summary.json, metrics.jsonl, run.json" + (
        ", checkpoints/" if (run_dir / "checkpoints").is_dir() else ""
    )
    return "  ".join(parts) + f"; artifacts in {run_dir} ({files})"


def earlier_wall_time(run_dir: Path) -> float:
    """Seconds the run's earlier attempts took, from the summary.json the latest of them wrote (its
    wall_time_s already counts the ones before it); 0 without one (an attempt killed by SIGKILL
    writes none: its time is not counted)."""
    try:
        return float(json.loads((Path(run_dir) / "summary.json").read_text()).get("wall_time_s") or 0.0)
    except (OSError, ValueError, AttributeError):
        return 0.0


def write_rank_failure(run_dir: Path, rank: int, error: str, trace: str) -> None:
    """A failing rank's record in the run dir, error.rank<r>.txt: when (first line), what, where."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    text = f"{time.time():.6f} rank {rank}\n{error}\n\n{trace}"
    tmp = run_dir / f".error.rank{rank}.txt.tmp"
    tmp.write_text(text)
    os.replace(tmp, run_dir / f"error.rank{rank}.txt")


def first_rank_failure(run_dir: Path) -> tuple[int, str] | None:
    """(rank, error) of the earliest error.rank<r>.txt: the failure the others' errors follow from."""
    found = []
    for path in Path(run_dir).glob("error.rank*.txt"):
        try:
            stamp, _, rest = path.read_text().partition("\n")
            when, rank = float(stamp.split()[0]), int(stamp.split()[2])
        except (OSError, ValueError, IndexError):
            continue
        found.append((when, rank, rest.partition("\n")[0]))
    if not found:
        return None
    _, rank, error = min(found)
    return rank, error


class RunWriter:
    """Appends metric/telemetry rows (flushed per row, so a crash loses nothing already logged)."""

    def __init__(self, run_dir: Path, append: bool = False):
        """append: a resumed run continues its files (already cut back to the checkpoint's step)."""
        self.dir = Path(run_dir)
        self.mode = "a" if append else "w"  # a fresh run starts fresh files
        self._metrics = None  # opened by the first write: a run refused before it starts leaves no files
        self._numerics = None

    def _open(self) -> None:
        if self._metrics is None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._metrics = open(self.dir / "metrics.jsonl", self.mode)

    def write_run(self, run: dict) -> None:
        self._open()
        write_json_atomic(self.dir / "run.json", run)

    def metrics(self, row: dict) -> None:
        self._open()
        self._metrics.write(dumps(row) + "\n")
        self._metrics.flush()

    def numerics(self, rows: list[dict]) -> None:
        self._open()
        if self._numerics is None:
            self._numerics = open(self.dir / "numerics.jsonl", self.mode)
        self._numerics.write("".join(dumps(r) + "\n" for r in rows))
        self._numerics.flush()

    def summary(self, summary: Summary) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.dir / "summary.json", dataclasses.asdict(summary))

    def error(self, text: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "error.txt").write_text(text)

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
        if self._numerics is not None:
            self._numerics.close()


class NullWriter:
    """RunWriter's interface, writing nothing: for a Trainer that only times train_step."""

    def write_run(self, run: dict) -> None:
        pass

    def metrics(self, row: dict) -> None:
        pass

    def numerics(self, rows: list[dict]) -> None:
        pass

    def summary(self, summary: Summary) -> None:
        pass

    def error(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def rng_state() -> dict:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """The inverse of rng_state (checkpoints hold it as JSON lists and tensors)."""
    import numpy as np

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state(tuple(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(state["cuda"]))
