"""Checkpoints: tensors through torch.distributed.checkpoint (DCP), everything else as JSON.

    run_dir/checkpoints/
      step_00000040/         one checkpoint, named by the number of optimizer steps done
        .metadata            DCP's index (read back through an allowlisting unpickler, see below)
        __0_0.distcp         DCP's tensor data (read by DCP with torch.load(weights_only=True))
        state.json           the run state: step, config, and every non-tensor leaf of the state tree
        MANIFEST.json        size and crc32 of each file above; written last, so its presence says
                             the checkpoint is whole

The caller hands over a nested state tree (dicts, lists, tuples, numbers, strings, tensors) built from
the components' own `state_dict()`s; `save` splits it into a flat {dotted.name: tensor} dict for DCP
(sharding-ready: each key can later be a DTensor) and a JSON skeleton that names where each tensor
goes; `load` rebuilds the same tree. Nothing is pickled by lowp, and DCP's own `.metadata` pickle
is read through an unpickler that only admits DCP's metadata dataclasses, torch dtypes and sizes,
so opening a checkpoint cannot run code.

Writes are atomic: a temporary directory beside the final one, every file fsynced, one rename, the
parent fsynced. A write that fails (a full disk, a read-only directory) removes its temporary directory
and raises CheckpointError naming the path, the cause and the fix; one cut short by SIGKILL leaves it
behind, and the next start of the run removes it (`remove_partial`). The newest `keep` checkpoints
that pass their manifest are kept (a corrupted one does not count). A checkpoint that fails its
manifest or does not load is skipped with a warning and the next older one is used.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import io
import json
import logging
import os
import pickle
import shutil
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from harness.lifecycle.artifacts import os_error_text

log = logging.getLogger("lowp")

DIRNAME = "checkpoints"
STATE = "state.json"
MANIFEST = "MANIFEST.json"
FORMAT = 1
_PREFIX = "step_"
_TMP = ".tmp-"
_TENSOR, _TUPLE, _ITEMS = "__tensor__", "__tuple__", "__items__"


class CheckpointError(RuntimeError):
    """No usable checkpoint where one was required, or one that cannot be written."""


def _unwrapped(exc: BaseException) -> BaseException:
    """DCP reports each rank's error inside its CheckpointException, a BaseException that an
    `except Exception` misses: the first rank's own error instead (a full disk's OSError, a second
    Ctrl-C's KeyboardInterrupt)."""
    failures = getattr(exc, "failures", None) or {}
    return failures[min(failures)][0] if failures else exc


# -- the state tree <-> (tensors, JSON skeleton) -------------------------------------------------------


def split(tree, prefix: str = "") -> tuple[dict[str, torch.Tensor], object]:
    """Flatten `tree` into {dotted key: tensor} and a JSON-able skeleton with tensor placeholders."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(obj, path: str):
        if isinstance(obj, torch.Tensor):
            key = path or "_"
            assert key not in tensors, key
            if type(obj) is not torch.Tensor and hasattr(obj, "dequantize") and not _is_dtensor(obj):
                obj = (
                    obj.dequantize()
                )  # TE's quantized weights (fp8_param): stored by value, re-quantized on load
            tensors[key] = obj.detach()
            return {_TENSOR: key}
        if isinstance(obj, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in obj):
                return {k: walk(v, f"{path}.{k}" if path else k) for k, v in obj.items()}
            return {_ITEMS: [[k, walk(v, f"{path}.{k}" if path else str(k))] for k, v in obj.items()]}
        if isinstance(obj, tuple):
            return {_TUPLE: [walk(v, f"{path}.{i}") for i, v in enumerate(obj)]}
        if isinstance(obj, list):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(obj)]
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if hasattr(obj, "tolist"):  # numpy arrays and scalars (numpy's RNG state)
            return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
        raise TypeError(f"checkpoint state at {path or '<root>'}: cannot store a {type(obj).__name__}")

    return tensors, walk(tree, prefix)


def _is_dtensor(t) -> bool:
    """FSDP2's sharded tensors: stored shard by shard by DCP, never gathered here."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def join(skeleton, tensors: dict[str, torch.Tensor]):
    """The inverse of `split`."""
    if isinstance(skeleton, list):
        return [join(v, tensors) for v in skeleton]
    if not isinstance(skeleton, dict):
        return skeleton
    if _TENSOR in skeleton:
        return tensors[skeleton[_TENSOR]]
    if "__ndarray__" in skeleton:
        import numpy as np

        return np.asarray(skeleton["__ndarray__"], dtype=skeleton["dtype"])
    if _TUPLE in skeleton:
        return tuple(join(v, tensors) for v in skeleton[_TUPLE])
    if _ITEMS in skeleton:
        return {k: join(v, tensors) for k, v in skeleton[_ITEMS]}
    return {k: join(v, tensors) for k, v in skeleton.items()}


# -- DCP's metadata, read without running code -------------------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    """DCP pickles its `.metadata`; admit only the data classes it is made of (Python's documented
    'restricting globals' recipe), so a tampered file raises instead of calling anything."""

    DCP = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch": {"Size"},
        "torch.serialization": {"_get_layout"},  # maps a layout's name to the torch.layout
        "pathlib": {"PosixPath", "PurePosixPath"},
    }

    def find_class(self, module: str, name: str):
        if name in self.DCP.get(module, ()):
            return super().find_class(module, name)
        if module.startswith("torch.distributed.checkpoint.") and module in self.DCP:
            # another torch version's metadata may name more of DCP's own data classes: admit those
            # (dataclasses and enums), never a function or anything else
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not data")


def _reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            from torch.distributed.checkpoint.metadata import StorageMeta

            with open(Path(self.path) / ".metadata", "rb") as fh:
                metadata = _MetadataUnpickler(io.BytesIO(fh.read())).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def _dcp_save(tensors: dict[str, torch.Tensor], path: Path, sharded: bool = False) -> None:
    """sharded: a collective of every rank, each writing its own shards of the DTensors (FSDP2)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(str(path), sync_files=True)
    if sharded:
        _dcp(dcp.save, tensors, storage_writer=writer)
        return
    cpu = {k: v.cpu() for k, v in tensors.items()}  # DCP stages device tensors itself; CPU keeps it simple
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        _dcp(dcp.save, cpu, storage_writer=writer, no_dist=True)


def _dcp(call, *args, **kwargs):
    """A DCP call with its CheckpointException unwrapped (see `_unwrapped`)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return call(*args, **kwargs)
    except CheckpointException as exc:
        raise _unwrapped(exc) from exc


def _dcp_load(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, allocated from its metadata (no template needed)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = _reader(path)
    meta = reader.read_metadata()
    out = {}
    for key, md in meta.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"{path}: entry {key} is not a tensor")
        out[key] = torch.empty(md.size, dtype=md.properties.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        _dcp(dcp.load, out, storage_reader=_reader(path), no_dist=True)
    return out


# -- files --------------------------------------------------------------------------------------------


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, allow_nan=True)
        fh.flush()
        os.fsync(fh.fileno())


def name_of(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def candidates(run_dir: Path) -> list[Path]:
    """Checkpoint directories of a run, newest first (temporary ones are not candidates)."""
    root = Path(run_dir) / DIRNAME
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and p.name[5:].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[len(_PREFIX) :]), reverse=True)


def save(run_dir: Path, step: int, tree: dict, keep: int, dist=None, sharded: bool = False) -> Path:
    """Write `tree` as checkpoint `step` atomically; keep the newest `keep` (>= 1). Returns its path.

    Data parallel (`dist`, a harness.parallel.process.Dist): every rank calls it. Replicated state (DDP):
    rank 0 writes it alone. `sharded` (FSDP2's DTensors): every rank writes its shards into the
    one DCP directory, rank 0 the JSON and the manifest, then renames. Either way the others wait
    until the checkpoint is whole, so no rank runs ahead of a checkpoint that may still fail."""
    if dist is not None and dist.active:
        return _save_ranks(run_dir, step, tree, keep, dist, sharded)
    return _save(run_dir, step, tree, keep)


def _save_ranks(run_dir: Path, step: int, tree: dict, keep: int, dist, sharded: bool) -> Path:
    final = Path(run_dir) / DIRNAME / name_of(step)
    if not sharded:
        error = None
        if dist.is_main:
            try:
                _save(run_dir, step, tree, keep)
            except BaseException as exc:  # noqa: BLE001 - the others must hear of it, then re-raised
                error = exc
        message = dist.broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error
        if message is not None:
            raise CheckpointError(f"rank 0 could not write checkpoint {step}: {message}")
        return final
    pid = dist.broadcast_object(os.getpid())  # one temporary directory for all ranks: rank 0's
    return _save(run_dir, step, tree, keep, dist=dist, tmp_tag=str(pid))


def _save(run_dir: Path, step: int, tree: dict, keep: int, dist=None, tmp_tag: str | None = None) -> Path:
    main = dist is None or dist.is_main
    root = Path(run_dir) / DIRNAME
    final = root / name_of(step)
    tmp = root / f"{_TMP}{final.name}-{tmp_tag or os.getpid()}"
    tensors: dict[str, torch.Tensor] = {}
    try:
        root.mkdir(parents=True, exist_ok=True)
        if main and tmp.exists():
            shutil.rmtree(tmp)
        if dist is not None:
            dist.barrier()
        tensors, skeleton = split(tree)
        if dist is None:
            _dcp_save(tensors, tmp)
        else:
            _dcp_save(tensors, tmp, sharded=True)
        if not main:
            dist.barrier()  # rank 0 finishes the checkpoint
            return final
        _write_json(tmp / STATE, {"format": FORMAT, "step": step, "tree": skeleton})
        files = sorted(p.name for p in tmp.iterdir())
        manifest = {
            "format": FORMAT,
            "step": step,
            "files": {n: [(tmp / n).stat().st_size, _crc(tmp / n)] for n in files},
        }
        _write_json(tmp / MANIFEST, manifest)
        _fsync(tmp)
        if final.exists():  # the same step written again (a resumed run's final checkpoint)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(root)
    except BaseException as exc:
        if main:  # an interrupted write leaves the older checkpoints as they were
            shutil.rmtree(tmp, ignore_errors=True)
        cause = exc if isinstance(exc, OSError) else _no_space(root, exc, tensors)
        if cause is not None:
            raise CheckpointError(
                f"cannot write checkpoint {step}: {os_error_text(cause, root)}, then restart to resume "
                "from the last checkpoint (the earlier checkpoints are kept)"
            ) from exc
        raise
    _VERIFIED[final] = _stamp(final)
    _retain(run_dir, keep)
    if dist is not None:
        dist.barrier()
    return final


def _no_space(root: Path, exc: BaseException, tensors: dict[str, torch.Tensor]) -> OSError | None:
    """A full disk that torch did not report as one: its zip writer (DCP's small items) turns ENOSPC
    into a RuntimeError ('unexpected pos'). The file system says whether the tensors had room."""
    if not isinstance(exc, RuntimeError):
        return None
    try:
        st = os.statvfs(root)
    except OSError:
        return None
    need = sum(t.numel() * t.element_size() for t in tensors.values())
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if st.f_bavail * st.f_frsize < need else None


_VERIFIED: dict[Path, tuple] = {}
"""Checkpoints this process wrote or verified, with the size and mtime of each file then: retention
reads a checkpoint's files again only when one of them changed, not at every save."""


def _stamp(path: Path) -> tuple:
    return tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir()))


def _verified(path: Path) -> bool:
    try:
        stamp = _stamp(path)
        if _VERIFIED.get(path) != stamp:
            verify(path)
            _VERIFIED[path] = stamp
    except Exception:  # noqa: BLE001 - any failure to read it means: not a checkpoint to count
        return False
    return True


def _retain(run_dir: Path, keep: int) -> None:
    """Keep the newest `keep` (>= 1) checkpoints that pass their manifest; remove every older one. A
    corrupted checkpoint does not count: it stays only while it is newer than the ones kept."""
    kept = 0
    for path in candidates(run_dir):
        if kept >= max(1, keep):
            shutil.rmtree(path, ignore_errors=True)
            _VERIFIED.pop(path, None)
        elif _verified(path):
            kept += 1


def remove_partial(run_dir: Path) -> list[str]:
    """Remove the temporary directories of checkpoint writes that were killed (SIGKILL, a lost node)
    before their rename; the run's writer calls it at its start, holding the run lock. Returns their
    names."""
    root = Path(run_dir) / DIRNAME
    if not root.is_dir():
        return []
    partial = sorted(p for p in root.iterdir() if p.name.startswith(_TMP) and p.is_dir())
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    if partial:
        log.warning(
            "removed %d partial checkpoint(s) of an interrupted write in %s: %s",
            len(partial),
            root,
            ", ".join(p.name for p in partial),
        )
    return [p.name for p in partial]


def key_by_name(sd: dict, names: list[str]) -> dict:
    """A torch optimizer state_dict with parameter names for its integer ids (optimizer order), so
    the stored state reads the same on every backend and survives a change of parameter order."""
    if "state" not in sd:  # a wrapper (CPU offload) holding a torch state_dict under "inner"
        return {
            k: key_by_name(v, names) if isinstance(v, dict) and k == "inner" else v for k, v in sd.items()
        }
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": {names[i]: st for i, st in sd["state"].items()}, "param_groups": groups}


def key_by_index(sd: dict, names: list[str]) -> dict:
    """The inverse of `key_by_name` for this optimizer's parameter order."""
    if "state" not in sd:
        return {
            k: key_by_index(v, names) if isinstance(v, dict) and k == "inner" else v for k, v in sd.items()
        }
    index = {n: i for i, n in enumerate(names)}
    unknown = sorted(set(sd["state"]) - set(index))
    if unknown:
        raise CheckpointError(f"optimizer state for parameters this model does not have: {unknown[:3]}")
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in sd["param_groups"]]
    return {"state": {index[n]: st for n, st in sd["state"].items()}, "param_groups": groups}


def verify(path: Path) -> None:
    """Raise CheckpointError unless every file the manifest lists is there with its size and crc32."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path.name}: no readable {MANIFEST} (an interrupted write?)") from exc
    for name, (size, crc) in manifest["files"].items():
        f = path / name
        if not f.is_file() or f.stat().st_size != size or _crc(f) != crc:
            raise CheckpointError(f"{path.name}: {name} is missing or corrupted")


def read_state(path: Path) -> dict:
    """state.json of one checkpoint (its `tree` still a skeleton): cheap, for config comparison."""
    return json.loads((path / STATE).read_text())


def load_one(path: Path) -> tuple[int, dict]:
    verify(path)
    state = read_state(path)
    tensors = _dcp_load(path)
    return state["step"], join(state["tree"], tensors)


def iter_valid(run_dir: Path) -> Iterator[tuple[Path, int, dict]]:
    """(path, step, tree) of the newest loadable checkpoint first; each broken one is warned about."""
    for path in candidates(run_dir):
        try:
            step, tree = load_one(path)
        except Exception as exc:  # noqa: BLE001 - any failure to read means: fall back to the previous one
            msg = f"checkpoint {path} is unusable ({exc}); falling back to the previous one"
            log.warning(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            continue
        yield path, step, tree


def load_latest(run_dir: Path) -> tuple[Path, int, dict] | None:
    """The newest usable checkpoint of a run, or None when there is none."""
    return next(iter_valid(run_dir), None)
