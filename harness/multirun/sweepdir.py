"""A sweep directory belongs to one sweep: what it records, who holds it, how its files are written.

    <sweep dir>/sweep.yaml        the sweep's name, its file and the file's sha256, the command line's extra
                                  overrides, the stamp and jobs.yaml's sha256: written once, at the launch
    <sweep dir>/jobs.yaml         the explicit job list (harness.multirun.spec), written once, atomically
    <sweep dir>/.lock             flock(2)ed by the driver (`harness.sweep`) and the Hydra launcher it starts,
                                  for as long as either lives; holds the driver's pid and host
    <sweep dir>/slurm_jobs.json   run name -> Slurm job id of every job submitted to Slurm

A new launch into a directory that holds anything is refused; `--resume` may change only the launcher
(`hydra/launcher=`, `hydra.launcher.*`), checks the sweep file and jobs.yaml against the record, and is
refused while another driver holds the directory. Every refusal is a SweepError: one line, exit code 2.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import json
import os
import socket
from pathlib import Path

from omegaconf import OmegaConf

from harness.multirun.spec import SweepError, key_of

RECORD = "sweep.yaml"
JOBS = "jobs.yaml"
LOCK = ".lock"
SLURM_JOBS = "slurm_jobs.json"
DRIVER_ENV = "LOWP_SWEEP_DRIVER_PID"  # set for the Hydra launcher: it stops its jobs when this pid is gone


def write_atomic(path: Path, text: str) -> None:
    """All of `text` at `path` or, on any error, the file as it was: a synced temporary file renamed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_launcher_setting(arg: str) -> bool:
    """What --resume may change: the launcher and its settings."""
    return arg.startswith("hydra/launcher=") or key_of(arg).startswith("hydra.launcher.")


# -- the record -------------------------------------------------------------------------------------------
def make_record(
    sweep: str, file: Path, overrides: list[str], stamp: str, jobs_yaml: str, n_jobs: int
) -> dict:
    return {
        "sweep": sweep,
        "file": str(file),
        "file_sha256": sha256(file.read_bytes()),
        "overrides": list(overrides),
        "stamp": stamp,
        "jobs": n_jobs,
        "jobs_sha256": sha256(jobs_yaml.encode()),
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def read_record(sweep_dir: Path) -> dict:
    path = sweep_dir / RECORD
    try:
        record = OmegaConf.to_container(OmegaConf.load(path))
        if not isinstance(record, dict) or not {"sweep", "overrides", "jobs_sha256"} <= set(record):
            raise ValueError("fields missing")
    except Exception as exc:  # noqa: BLE001 - whatever is wrong with it: one line
        raise SweepError(
            f"{path} is damaged ({type(exc).__name__}); this directory cannot be resumed"
        ) from None
    return record


def check_free(sweep_dir: Path) -> None:
    """A new launch goes only into a new or empty directory (its own lock file aside)."""
    if not sweep_dir.is_dir() or not [p for p in sweep_dir.iterdir() if p.name != LOCK]:
        return
    if (sweep_dir / RECORD).exists() or (sweep_dir / JOBS).exists():
        held = _sweep_of(sweep_dir)
        raise SweepError(
            f"hydra.sweep.dir={sweep_dir} holds sweep {held}: resume it with --resume {sweep_dir}, "
            "or launch into a new directory (leave out hydra.sweep.dir= for multirun/NAME/<date_time>)"
        )
    raise SweepError(
        f"hydra.sweep.dir={sweep_dir} is not empty and holds no sweep: launch into a new or empty directory"
    )


def _sweep_of(sweep_dir: Path) -> str:
    for name in (RECORD, JOBS):
        try:
            return str(OmegaConf.load(sweep_dir / name)["sweep"])
        except Exception:  # noqa: BLE001 - a damaged file still marks the directory as taken
            continue
    return "(unreadable)"


def check_jobs(record: dict, jobs_path: Path) -> None:
    """jobs.yaml is the file written at the launch, byte for byte."""
    try:
        data = jobs_path.read_bytes()
    except OSError as exc:
        raise SweepError(f"{jobs_path}: {exc.strerror}; this directory cannot be resumed") from None
    if sha256(data) != record["jobs_sha256"]:
        raise SweepError(
            f"{jobs_path} is not the job list written at the launch (its sha256 differs from "
            f"{jobs_path.parent / RECORD}): damaged or edited; it is not used"
        )


def check_file(record: dict, file: Path) -> None:
    """The sweep file is the one launched (by content), where it still exists."""
    if record.get("file_sha256") and file.exists() and sha256(file.read_bytes()) != record["file_sha256"]:
        raise SweepError(
            f"--resume: {file} changed since this sweep was launched (sha256 {record['file_sha256'][:12]} -> "
            f"{sha256(file.read_bytes())[:12]}); restore it, or launch the changed sweep into a new directory"
        )


def resume_args(record: dict, given: list[str], sweep_dir: Path) -> list[str]:
    """The Hydra arguments of a resumed launch: the launch's own, with the launcher replaced (a new
    `hydra/launcher=` drops the old one's settings) or its settings updated. Any other override must be
    the launch's (it may be left out); a difference is refused, named."""
    recorded = record["overrides"]
    for arg in given:
        if is_launcher_setting(arg) or arg in (recorded or []):
            continue
        if key_of(arg) == "hydra.sweep.dir" and Path(arg.split("=", 1)[1]).absolute() == sweep_dir:
            continue
        if recorded is None:
            raise SweepError(
                f"--resume {sweep_dir}: {arg}: this sweep's overrides were not recorded; leave it out"
            )
        was = [o for o in recorded if key_of(o) == key_of(arg)]
        said = f"the launch had {was[0]}" if was else "the launch did not set it"
        raise SweepError(
            f"--resume may change only the launcher (hydra/launcher=, hydra.launcher.*): {arg} differs "
            f"({said}); leave it out, or launch a new sweep"
        )
    kept = [
        o for o in recorded or [] if o.startswith(("hydra.", "hydra/")) and key_of(o) != "hydra.sweep.dir"
    ]
    new = [a for a in given if is_launcher_setting(a)]
    if any(a.startswith("hydra/launcher=") for a in new):
        kept = [o for o in kept if not is_launcher_setting(o)]
    new_keys = {key_of(a) for a in new}
    return [*(o for o in kept if key_of(o) not in new_keys), *new]


class DirError(RuntimeError):
    """The sweep directory could not be made, locked or written (a full disk, permissions): exit code 1."""


def claim(sweep_dir: Path, files: dict[str, str], new: bool) -> SweepLock:
    """Lock `sweep_dir` and write those of `files` (name -> text, in order, each atomically) that it
    lacks. A `new` sweep's directory must be free, and one that cannot be written leaves nothing behind."""
    made = not sweep_dir.exists()
    try:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        lock = SweepLock(sweep_dir).acquire()
    except OSError as exc:
        raise DirError(f"cannot lock the sweep directory {sweep_dir}: {exc.strerror or exc}") from None
    try:
        if new:
            check_free(sweep_dir)  # again, now that this process holds the directory
        for name, text in files.items():
            if not (sweep_dir / name).exists():
                write_atomic(sweep_dir / name, text)
    except SweepError:
        lock.release()
        raise
    except OSError as exc:
        lock.release()
        if new:
            for name in (*files, LOCK):
                (sweep_dir / name).unlink(missing_ok=True)
            if made:
                sweep_dir.rmdir()
        raise DirError(f"cannot write the sweep directory {sweep_dir}: {exc.strerror or exc}") from None
    return lock


# -- the lock ---------------------------------------------------------------------------------------------
class SweepLock:
    """flock(2) on <sweep dir>/.lock, naming its holder; the kernel releases it when the last process
    holding it (the driver, or the launcher that inherited it) dies, however it dies."""

    def __init__(self, sweep_dir: Path):
        self.path = sweep_dir / LOCK
        self.fd: int | None = None
        self.holder: dict = {}

    def acquire(self) -> SweepLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            h = _read_json(fd)
            os.close(fd)
            launcher = f", its launcher pid {h['launcher']}" if h.get("launcher") else ""
            raise SweepError(
                f"sweep {self.path.parent} is held by harness.sweep pid {h.get('pid', '?')} on host "
                f"{h.get('host', '?')} (since {h.get('since', '?')}{launcher}); wait for it to end or "
                "stop it, then --resume"
            ) from None
        self.fd = fd
        self.holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }
        self._write()
        return self

    def note_launcher(self, pid: int) -> None:
        self.holder["launcher"] = pid
        self._write()

    def _write(self) -> None:
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(self.holder).encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> SweepLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_json(fd: int) -> dict:
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}


# -- Slurm job ids ----------------------------------------------------------------------------------------
def slurm_jobs(sweep_dir: Path) -> dict[str, str]:
    """run name -> Slurm job id of the jobs submitted so far (empty where none was)."""
    try:
        return {str(k): str(v) for k, v in json.loads((sweep_dir / SLURM_JOBS).read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def note_slurm_job(sweep_dir: Path, run: str, job_id: str) -> None:
    write_atomic(sweep_dir / SLURM_JOBS, json.dumps({**slurm_jobs(sweep_dir), run: job_id}, indent=1))
