"""The run lock where flock(2) does not work, on a real filesystem that refuses every lock: a FUSE
passthrough (tests/nolock_fs.py) answering ENOLCK, as an NFS mount whose server runs no lock manager
does. Needs root and /dev/fuse: skipped without them, a failure under LOWP_REQUIRE_FAULTS=1."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import signal

import pytest

from harness import train as T
from harness.lifecycle import runlock
from harness.lifecycle.runlock import RunDirLocked, RunLock
from tests import faults, nolock_fs
from tests.helpers import run_main, tiny_cpu_run


def require_mount() -> None:
    why = nolock_fs.available()
    if why is None:
        return
    faults.unavailable(f"the lockless filesystem cannot be mounted: {why}")


@pytest.fixture
def lockless(tmp_path):
    """A directory on a mounted filesystem without locks."""
    require_mount()
    (tmp_path / "backing").mkdir()
    (tmp_path / "nfs").mkdir()
    with nolock_fs.NoLockFS(tmp_path / "backing", tmp_path / "nfs") as fs:
        yield tmp_path / "nfs"
        for handler in logging.getLogger().handlers[:]:  # Hydra's train.log of an in-process run
            if isinstance(handler, logging.FileHandler) and handler.baseFilename.startswith(str(tmp_path)):
                handler.close()
                logging.getLogger().removeHandler(handler)
    assert not fs.errors, fs.errors


def test_flock_fails_there_for_real(lockless):
    fd = os.open(lockless / "f", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(OSError) as exc:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert exc.value.errno == errno.ENOLCK
    finally:
        os.close(fd)


def test_the_lock_falls_back_to_an_exclusive_lock_file(lockless):
    run_dir = lockless / "run"
    with RunLock(run_dir):
        record = json.loads((run_dir / runlock.EXCL).read_text())
        assert record["pid"] == os.getpid()
        with pytest.raises(
            RunDirLocked, match=rf"pid {os.getpid()} on host .*hydra.run.dir.*delete .*\.lock\.excl"
        ):
            RunLock(run_dir).acquire()
    assert not (run_dir / runlock.EXCL).exists()
    RunLock(run_dir).acquire().release()  # free again


def test_a_lock_file_is_taken_over_only_from_a_holder_provably_dead(lockless, caplog):
    run_dir = lockless / "run"
    run_dir.mkdir()
    me = runlock._me()
    lock_file = run_dir / runlock.EXCL
    for elsewhere in ({"host": "another-node"}, {"boot": "another-boot"}, {"pid_ns": "pid:[1]"}):
        lock_file.write_text(json.dumps({**me, "start": me["start"] - 1, **elsewhere}))
        with pytest.raises(RunDirLocked, match="if that process is gone, delete"):
            RunLock(run_dir).acquire()  # it cannot be told from here: refused
    # the process that had this pid before us, on this host: provably gone
    lock_file.write_text(json.dumps({**me, "start": me["start"] - 1}))
    with RunLock(run_dir):
        assert json.loads(lock_file.read_text())["start"] == me["start"]
    assert "taking over the stale lock" in caplog.text


def test_a_run_trains_and_resumes_where_flock_does_not_work(lockless, capsys):
    run = tiny_cpu_run(2, 4, 4, eval_interval=0, eval_tokens=512, checkpoint_interval=0)
    args = [*run, f"hydra.run.dir={lockless / 'run'}"]
    for _ in range(2):  # the second attempt finds the run complete and resumes at its end
        code, err = run_main(capsys, T.main, "harness.train", *args)
        assert code == 0, err
    run_json = json.loads((lockless / "run" / "run.json").read_text())
    assert [a["resumed_from_step"] for a in run_json["attempts"]] == [None, 2]
    assert json.loads((lockless / "run" / "summary.json").read_text())["status"] == "completed"
    assert not (lockless / "run" / runlock.EXCL).exists()


@pytest.mark.slow  # a forked holder, SIGKILLed
def test_a_holder_killed_by_sigkill_is_taken_over(lockless):
    run_dir = lockless / "run"
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            RunLock(run_dir).acquire()
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(1)
    os.waitpid(pid, 0)
    assert json.loads((run_dir / runlock.EXCL).read_text())["pid"] == pid  # left behind...
    with RunLock(run_dir):  # ...and taken over
        assert json.loads((run_dir / runlock.EXCL).read_text())["pid"] == os.getpid()
