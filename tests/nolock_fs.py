"""A filesystem without locks, mounted for real: a FUSE passthrough of a directory, served by a thread of
this process, that answers every lock request (flock(2), fcntl locks) with ENOLCK, as an NFS mount
does whose server runs no lock manager. Everything else (create, O_EXCL, read, write, rename,
unlink, mkdir) reaches the backing directory. Needs root and /dev/fuse; no library, no process.

    with NoLockFS(backing, mountpoint):
        fcntl.flock(fd_under_mountpoint, fcntl.LOCK_EX)    # OSError: ENOLCK, from the kernel

The kernel speaks FUSE protocol 7.31 to it (include/uapi/linux/fuse.h): every request is a 40-byte
header and its operation's struct; each reply a 16-byte header and the answer. Attributes are never
cached (timeouts 0), so the kernel asks every time and the thread's view is the backing directory's.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import struct
import threading
from pathlib import Path

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, extlen, pad
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr: 88 bytes
ENTRY = struct.Struct("<QQQQII")  # fuse_entry_out before its attr
ATTR_OUT = struct.Struct("<QII")
OPEN_OUT = struct.Struct("<QII")
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")
FUSE_POSIX_LOCKS, FUSE_FLOCK_LOCKS = 1 << 1, 1 << 10  # the kernel then sends locks here, not local
FATTR_MODE, FATTR_SIZE = 1 << 0, 1 << 3
MAX_WRITE = 1 << 17
(LOOKUP, FORGET, GETATTR, SETATTR, MKDIR, UNLINK, RMDIR, RENAME, OPEN, READ, WRITE, STATFS, RELEASE) = (
    1, 2, 3, 4, 9, 10, 11, 12, 14, 15, 16, 17, 18,
)  # fmt: skip
(FSYNC, FLUSH, INIT, OPENDIR, READDIR, RELEASEDIR, FSYNCDIR, GETLK, SETLK, SETLKW, ACCESS, CREATE) = (
    20, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35,
)  # fmt: skip
INTERRUPT, BATCH_FORGET, RENAME2 = 36, 42, 45
NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}


def available() -> str | None:
    """Why this machine cannot mount it (None: it can)."""
    if os.geteuid() != 0:
        return "mounting a filesystem needs root"
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    return None


class NoLockFS:
    """Mount `backing` at `mountpoint` without locks; unmounted on exit. A request the thread failed to
    answer (an exception) is answered EIO and kept in `errors` for the test to report."""

    def __init__(self, backing: Path, mountpoint: Path):
        self.backing, self.mountpoint = Path(backing), Path(mountpoint)
        self.paths: dict[int, Path] = {1: self.backing}
        self.ids: dict[Path, int] = {self.backing: 1}
        self.last_id = 1
        self.errors: list[str] = []
        self.locks_refused = 0

    def __enter__(self) -> NoLockFS:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = os.open("/dev/fuse", os.O_RDWR)
        opts = f"fd={self.fd},rootmode=40000,user_id=0,group_id=0".encode()
        if self.libc.mount(b"nolockfs", str(self.mountpoint).encode(), b"fuse", 0, opts) != 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, f"mount fuse at {self.mountpoint}: {os.strerror(err)}")
        self.thread = threading.Thread(target=self._serve, name="nolockfs", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        """Abort the connection (MNT_FORCE: FUSE's umount_begin), so the thread's read ends even while a
        file under the mount is open, then detach it (MNT_DETACH)."""
        mountpoint = str(self.mountpoint).encode()
        self.libc.umount2(mountpoint, 1)
        self.libc.umount2(mountpoint, 2)
        self.thread.join(timeout=10)
        assert not self.thread.is_alive(), "the FUSE thread did not end"  # its fd must not be reused
        os.close(self.fd)

    # -- the request loop ------------------------------------------------------------------------------
    def _serve(self) -> None:
        while True:
            try:
                data = os.read(self.fd, MAX_WRITE + 4096)
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                return  # ENODEV: unmounted
            _, opcode, unique, nodeid, *_ = IN_HEADER.unpack_from(data)
            if opcode in NO_REPLY:
                continue
            try:
                error, payload = 0, self._handle(opcode, nodeid, data[IN_HEADER.size :])
            except OSError as exc:
                error, payload = -(exc.errno or errno.EIO), b""
            except Exception as exc:  # noqa: BLE001 - answered, so the caller never hangs; reported
                self.errors.append(f"opcode {opcode}: {type(exc).__name__}: {exc}")
                error, payload = -errno.EIO, b""
            if error:
                payload = b""
            try:
                os.write(self.fd, OUT_HEADER.pack(OUT_HEADER.size + len(payload), error, unique) + payload)
            except OSError:
                pass  # the request was interrupted meanwhile (ENOENT)

    def _handle(self, opcode: int, nodeid: int, arg: bytes) -> bytes:
        path = self.paths.get(nodeid)
        if opcode == INIT:
            major, minor, readahead, _ = struct.unpack_from("<IIII", arg)
            flags = FUSE_POSIX_LOCKS | FUSE_FLOCK_LOCKS
            return INIT_OUT.pack(7, min(minor, 31), readahead, flags, 16, 12, MAX_WRITE, 1, 0, 0, 0, 0)
        if opcode in (GETLK, SETLK, SETLKW):
            self.locks_refused += 1
            raise OSError(errno.ENOLCK, "no locks on this filesystem")
        if opcode == LOOKUP:
            return self._entry(path / _name(arg))
        if opcode == GETATTR:
            return ATTR_OUT.pack(0, 0, 0) + _attr(path)
        if opcode == SETATTR:
            valid, _, _, size = struct.unpack_from("<IIQQ", arg)
            mode = struct.unpack_from("<I", arg, 76)[0]
            if valid & FATTR_SIZE:
                os.truncate(path, size)
            if valid & FATTR_MODE:
                os.chmod(path, stat.S_IMODE(mode))
            return ATTR_OUT.pack(0, 0, 0) + _attr(path)
        if opcode == MKDIR:
            mode, umask = struct.unpack_from("<II", arg)
            child = path / _name(arg[8:])
            os.mkdir(child, mode & ~umask)
            return self._entry(child)
        if opcode == CREATE:
            flags, mode, umask, _ = struct.unpack_from("<IIII", arg)
            child = path / _name(arg[16:])
            fd = os.open(child, flags, mode & ~umask)
            return self._entry(child) + OPEN_OUT.pack(fd, 0, 0)
        if opcode == OPEN:
            flags = struct.unpack_from("<I", arg)[0]
            return OPEN_OUT.pack(os.open(path, flags & ~(os.O_CREAT | os.O_EXCL)), 0, 0)
        if opcode == READ:
            fh, offset, size = struct.unpack_from("<QQI", arg)
            return os.pread(fh, size, offset)
        if opcode == WRITE:
            fh, offset, size = struct.unpack_from("<QQI", arg)
            return struct.pack("<II", os.pwrite(fh, arg[40 : 40 + size], offset), 0)
        if opcode == RELEASE:
            os.close(struct.unpack_from("<Q", arg)[0])
            return b""
        if opcode == FSYNC:
            os.fsync(struct.unpack_from("<Q", arg)[0])
            return b""
        if opcode in (FLUSH, ACCESS, RELEASEDIR, FSYNCDIR):
            return b""
        if opcode == OPENDIR:
            return OPEN_OUT.pack(0, 0, 0)
        if opcode == READDIR:
            _, offset, size = struct.unpack_from("<QQI", arg)
            return _dirents(path, offset, size)
        if opcode in (UNLINK, RMDIR):
            child = path / _name(arg)
            (os.unlink if opcode == UNLINK else os.rmdir)(child)
            self.ids.pop(child, None)  # a file made there later is another inode
            return b""
        if opcode in (RENAME, RENAME2):
            newdir = struct.unpack_from("<Q", arg)[0]
            skip = 8 if opcode == RENAME else 16
            if opcode == RENAME2 and struct.unpack_from("<I", arg, 8)[0]:
                raise OSError(errno.EINVAL, "rename flags")
            old, new = arg[skip:].split(b"\0")[:2]
            src, dst = path / os.fsdecode(old), self.paths[newdir] / os.fsdecode(new)
            os.rename(src, dst)
            self._moved(src, dst)
            return b""
        if opcode == STATFS:
            st = os.statvfs(self.backing)
            return struct.pack(
                "<QQQQQIIII24x", st.f_blocks, st.f_bfree, st.f_bavail, st.f_files, st.f_ffree,
                st.f_bsize, st.f_namemax, st.f_frsize, 0,
            )  # fmt: skip
        raise OSError(errno.ENOSYS, "not implemented")

    def _moved(self, src: Path, dst: Path) -> None:
        """The inodes under `src` now live under `dst` (the kernel keeps their node ids)."""
        self.ids.pop(dst, None)
        for nodeid, p in list(self.paths.items()):
            if p == src or src in p.parents:
                new = dst / p.relative_to(src)
                self.ids.pop(p, None)
                self.paths[nodeid], self.ids[new] = new, nodeid

    def _entry(self, path: Path) -> bytes:
        attr = _attr(path)  # FileNotFoundError: ENOENT
        if path not in self.ids:
            self.last_id += 1
            self.ids[path] = self.last_id
        nodeid = self.ids[path]
        self.paths[nodeid] = path
        return ENTRY.pack(nodeid, 0, 0, 0, 0, 0) + attr


def _dirents(path: Path, offset: int, size: int) -> bytes:
    """fuse_dirent records of a directory from entry `offset` on, as many as fit in `size` bytes."""
    out = b""
    names = [".", "..", *sorted(os.listdir(path))]
    for i, name in enumerate(names[offset:], start=offset):
        raw = os.fsencode(name)
        record = struct.pack("<QQII", i + 1, i + 1, len(raw), 0) + raw  # ino, next offset, len, DT_UNKNOWN
        record += b"\0" * (-len(record) % 8)
        if len(out) + len(record) > size:
            break
        out += record
    return out


def _name(arg: bytes) -> str:
    return os.fsdecode(arg.split(b"\0", 1)[0])


def _attr(path: Path) -> bytes:
    st = os.lstat(path)
    return ATTR.pack(
        st.st_ino, st.st_size, st.st_blocks, int(st.st_atime), int(st.st_mtime), int(st.st_ctime),
        st.st_atime_ns % 10**9, st.st_mtime_ns % 10**9, st.st_ctime_ns % 10**9,
        st.st_mode, st.st_nlink, st.st_uid, st.st_gid, st.st_rdev, 4096, 0,
    )  # fmt: skip
