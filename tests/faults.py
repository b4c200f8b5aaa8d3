"""Real faults for tests, made in this process through mount(2): a small tmpfs that fills up (ENOSPC)
and a read-only bind mount (EROFS; root ignores file modes, so chmod proves nothing). No exception
is monkeypatched in their place.

They need root (CAP_SYS_ADMIN). Without it a test that needs them skips, unless the environment sets
LOWP_REQUIRE_FAULTS=1 (`.ci/run` does): then it fails, since there a skipped fault test is a
missing test.

    def test_x(tmp_path):
        with tmpfs(tmp_path / "run", 2_600_000):        # writes past 2.6 MB fail: the disk is full
            ...
        with read_only(tmp_path / "run" / "checkpoints"):  # every write under it fails
            ...
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REQUIRE = "LOWP_REQUIRE_FAULTS"
MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096  # <sys/mount.h>
MNT_DETACH = 2


def unavailable(reason: str) -> None:
    """Skip the test, or fail it where faults are required (LOWP_REQUIRE_FAULTS=1)."""
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{REQUIRE}=1 but {reason}")
    pytest.skip(reason)


def require_root() -> None:
    """Real faults need root: skip without it (fail under LOWP_REQUIRE_FAULTS=1)."""
    if os.geteuid() != 0:
        unavailable("real faults (tmpfs, bind mounts) need root")


def _libc():
    """The C library already loaded into this process (ctypes.util.find_library would run ldconfig:
    a process, which the fast lane refuses)."""
    return ctypes.CDLL(None, use_errno=True)


def _mount(source: str, target: Path, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    if _libc().mount(enc(source), enc(str(target)), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(target))


def _unmount(target: Path) -> None:
    """Detach (lazily: a log handler of the run may still hold a file open there)."""
    _libc().umount2(str(target).encode(), MNT_DETACH)


def _mounted(target: Path, source: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    require_root()
    try:
        _mount(source, target, fstype, flags, data)
    except OSError as exc:
        unavailable(f"cannot mount on {target} ({exc.strerror}): no CAP_SYS_ADMIN here?")


@contextlib.contextmanager
def tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of `size_bytes` (rounded up to pages) mounted on `path` (created if missing): writes
    past its size fail with ENOSPC, as on a full disk. Unmounted on exit, with what it held."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _mounted(path, "tmpfs", "tmpfs", 0, f"size={size_bytes}")
    try:
        yield path
    finally:
        _unmount(path)


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[Path]:
    """`path` (a directory, created if missing) bind-mounted read-only onto itself: every write
    under it fails with EROFS, for root too. Writable again on exit."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _mounted(path, str(path), None, MS_BIND)
    try:
        _mount("none", path, None, MS_REMOUNT | MS_BIND | MS_RDONLY)
        yield path
    finally:
        _unmount(path)


CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH = 1, 2  # <linux/capability.h>
_CAP_V3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _caps(new: list[int] | None = None) -> list[int]:
    """This thread's effective capability words; set them first when `new` is given."""
    header, data = _CapHeader(_CAP_V3, 0), (_CapData * 2)()
    libc = _libc()
    if libc.capget(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    if new is not None:
        for word, value in zip(data, new):
            word.effective = value
        if libc.capset(ctypes.byref(header), data) != 0:
            raise OSError(ctypes.get_errno(), "capset")
    return [word.effective for word in data]


@contextlib.contextmanager
def file_modes_enforced() -> Iterator[None]:
    """This thread without CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH, so file modes bind root as
    they bind anyone (capabilities are per thread: the rest of the process keeps them, and they
    stay permitted, so they come back on exit)."""
    require_root()
    before = _caps()
    mask = (1 << CAP_DAC_OVERRIDE) | (1 << CAP_DAC_READ_SEARCH)
    try:
        _caps([before[0] & ~mask, before[1]])
    except OSError as exc:
        unavailable(f"cannot drop CAP_DAC_OVERRIDE ({exc})")
    try:
        yield
    finally:
        _caps(before)
