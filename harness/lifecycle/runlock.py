"""One writer per run directory: an advisory lock that names its holder.

`run_dir/.lock` is held with flock(2) for the life of the run and holds the holder's pid, host and
start time. flock is released by the kernel when the process dies however it dies (SIGKILL, OOM), so
a lock file left behind by a dead process is taken over, with a warning naming the dead holder.

Where the filesystem has no flock (NFS mounted without lock support, some FUSE filesystems: flock
fails with ENOLCK, EOPNOTSUPP or ENOSYS), the lock is the file `run_dir/.lock.excl`, created with
O_EXCL and holding the holder's record. Nothing removes it when its holder dies, so a stale one is
taken over only when its holder is provably dead: recorded on this host, in this boot and this pid
namespace, and no process has its pid and start time. Any other holder is refused in one line that
names it and the file to delete if it is gone. (A directory that some hosts mount with flock and
others without is locked in two ways that do not see each other: mount it one way everywhere.)
"""

from __future__ import annotations

import datetime as dt
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger("lowp")
NAME = ".lock"
EXCL = ".lock.excl"
NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS}
"""flock(2)'s answers on a filesystem that does not lock (NFS without lockd: ENOLCK)."""
WAIT_S, TRIES = 0.05, 40
"""How long a record being written or a takeover under way is waited for: 2 s in all."""


class RunDirLocked(RuntimeError):
    """Another live process writes this run directory (the message is one line with the fix)."""


class RunLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / NAME
        self.excl = Path(run_dir) / EXCL
        self._fd: int | None = None
        self._record: dict | None = None  # ours, while we hold the fallback lock file

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise RunDirLocked(_held(self.path.parent, holder)) from None
        except OSError as exc:
            os.close(fd)
            if exc.errno not in NO_FLOCK:
                raise
            return self._acquire_excl(exc)
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
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_me()).encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._record is not None:
            if _read_file(self.excl) == self._record:
                self.excl.unlink()
            self._record = None
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

    # -- where flock does not work -------------------------------------------------------------------
    def _acquire_excl(self, no_flock: OSError) -> RunLock:
        """The lock file created with O_EXCL; a provably dead holder's is taken over."""
        me, holder = _me(), {}
        for _ in range(TRIES):
            try:
                fd = os.open(self.excl, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = _read_file(self.excl)
                if holder and _alive(holder) is False:
                    self._take_over(holder)
                elif holder:
                    break  # alive, or not provably dead
                time.sleep(WAIT_S)  # its record is being written, or another takeover is under way
                continue
            except OSError as exc:
                raise RunDirLocked(
                    f"run dir {self.path.parent}: flock(2) does not work on its filesystem "
                    f"({errno.errorcode.get(no_flock.errno, no_flock.errno)}) and the lock file {self.excl} "
                    f"cannot be created ({exc.strerror}); use a run dir on a filesystem that allows one "
                    "of them (hydra.run.dir=...)"
                ) from exc
            try:
                os.write(fd, json.dumps(me).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            self._record = me
            log.warning(
                "run dir %s: flock(2) does not work on its filesystem (%s); locked with %s instead (a run "
                "killed by SIGKILL leaves it behind; a later run on this host takes it over)",
                self.path.parent,
                errno.errorcode.get(no_flock.errno, no_flock.errno),
                self.excl,
            )
            return self
        raise RunDirLocked(
            _held(self.path.parent, holder)
            + f"; this filesystem has no flock: if that process is gone, delete {self.excl}"
        )

    def _take_over(self, stale: dict) -> None:
        """Remove a dead holder's lock file, one process at a time: the one that creates this holder's
        takeover token (O_EXCL) removes it if it still holds that record; the others try again."""
        token = self.excl.with_name(f"{EXCL}.takeover-{stale.get('pid')}-{stale.get('start')}")
        try:
            os.close(os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return
        try:
            if _read_file(self.excl) == stale:
                self.excl.unlink()
                log.warning(
                    "run dir %s: taking over the stale lock of pid %s on host %s (that process is gone)",
                    self.path.parent,
                    stale.get("pid"),
                    stale.get("host"),
                )
        finally:
            token.unlink()


def _held(run_dir: Path, holder: dict) -> str:
    return (
        f"run dir {run_dir} is being written by pid {holder.get('pid', '?')} on host "
        f"{holder.get('host', '?')} (since {holder.get('since', '?')}); wait for that run to end or "
        "start this one in another directory (hydra.run.dir=...)"
    )


def _me() -> dict:
    """This process's record: who holds the lock and what proves, later, that it is gone."""
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "boot": _boot_id(),
        "pid_ns": _pid_ns(),
        "start": _start_ticks(os.getpid()),
    }


def _alive(holder: dict) -> bool | None:
    """False only when the holder is provably dead: its host, boot and pid namespace are ours and no
    process has its pid and start time. None: it cannot be told from here (another host, say)."""
    mine = (socket.gethostname(), _boot_id(), _pid_ns())
    if None in mine or (holder.get("host"), holder.get("boot"), holder.get("pid_ns")) != mine:
        return None
    if not isinstance(holder.get("pid"), int) or holder.get("start") is None:
        return None
    return _start_ticks(holder["pid"]) == holder["start"]


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _pid_ns() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _start_ticks(pid: int) -> int | None:
    """A process's start time since boot (clock ticks, /proc/PID/stat field 22); None: no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _read(fd: int) -> dict:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {}


def _read_file(path: Path) -> dict:
    try:
        raw = path.read_bytes()
        return json.loads(raw) if raw.strip() else {}
    except (OSError, ValueError):
        return {}
