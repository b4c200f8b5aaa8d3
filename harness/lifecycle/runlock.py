"""One writer per run directory: an advisory lock that names its holder.

`run_dir/.lock` is held with flock(2) for the life of the run and holds the holder's pid, host and
start time. flock is released by the kernel when the process dies however it dies (SIGKILL, OOM), so
a lock file left behind by a dead process is taken over, with a warning naming the dead holder.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import logging
import os
import socket
from pathlib import Path

log = logging.getLogger("lowp")
NAME = ".lock"


class RunDirLocked(RuntimeError):
    """Another live process writes this run directory (the message is one line with the fix)."""


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / NAME
        self._fd: int | None = None

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise RunDirLocked(
                f"run dir {self.path.parent} is being written by pid {holder.get('pid', '?')} on host "
                f"{holder.get('host', '?')} (since {holder.get('since', '?')}); wait for that run to end or "
                "start this one in another directory (hydra.run.dir=...)"
            ) from None
        old = _read(fd)
        if old.get("pid") is not None and (old.get("pid"), old.get("host")) != (
            os.getpid(),
            socket.gethostname(),
        ):
            log.warning(
                "run dir %s: taking over the stale lock of pid %s on host %s (that process is gone)",
                self.path.parent,
                old.get("pid"),
                old.get("host"),
            )
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        os.ftruncate(self._fd, 0)  # an empty lock file is not stale: nobody held it at a crash
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
