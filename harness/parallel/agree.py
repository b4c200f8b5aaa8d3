"""What the ranks of one job agree on before and after training: whose run directory, whether rank 0
could take the run lock, where the run starts, and whether any rank failed. Rank 0 decides and
broadcasts; a failure on one rank reaches the others as an error of their own instead of a hang in
the next collective."""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from harness.config.errors import ConfigError
from harness.parallel.process import Dist


class RankFailed(RuntimeError):
    """Another rank of the job failed where this one did not notice (no collective in between)."""


def shared_run_dir(dist: Dist, run_dir: Path) -> Path:
    """Rank 0's run dir for every rank (Hydra stamps each rank's own time into its default dir);
    a rank's own Hydra dir that holds nothing but Hydra's files is removed."""
    if not dist.active:
        return run_dir
    shared = Path(dist.broadcast_object(str(run_dir.resolve())))
    own = run_dir.resolve()
    if own != shared and own.is_dir():
        leftovers = [q for q in own.iterdir() if q.name != ".hydra" and not q.name.endswith(".log")]
        if not leftovers:
            shutil.rmtree(own, ignore_errors=True)
    return shared


@contextlib.contextmanager
def agreed(dist: Dist, context, refused: type[Exception] = RuntimeError):
    """Enter `context` on rank 0 (the run lock) and tell the others whether it could: a rank that
    finds the run dir locked must not leave the others waiting in the first collective; they raise
    `refused` with rank 0's message."""
    error = None
    try:
        context.__enter__()
    except BaseException as exc:  # noqa: BLE001 - shared with the other ranks, then re-raised
        error = exc
    message = dist.broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if message is not None:
        raise refused(message.split(": ", 1)[-1])
    try:
        yield
    except BaseException:
        if not context.__exit__(*sys.exc_info()):
            raise
    else:
        context.__exit__(None, None, None)


def agreed_start(dist: Dist, decide: Callable[[], tuple | None], load: Callable[[Path], tuple]):
    """Rank 0 decides where the run starts (`decide`: (path, ...) or None; it may move old files
    aside); every other rank loads the same checkpoint with `load(path)`."""
    if not dist.active:
        return decide()
    found, error = None, None
    if dist.is_main:
        try:
            found = decide()
        except BaseException as exc:  # noqa: BLE001 - shared with the other ranks, then re-raised
            error = exc
    decision = dist.broadcast_object(
        ("error", f"{type(error).__name__}: {error}") if error else ("path", str(found[0]) if found else None)
    )
    if error is not None:
        raise error
    kind, value = decision
    if kind == "error":
        raise ConfigError(value.split(": ", 1)[-1])
    if dist.is_main or value is None:
        return found
    return load(Path(value))


def any_failed(dist: Dist, failed: bool) -> bool | None:
    """Every rank's way out, once: whether any rank failed (None: a failing rank whose peers are gone
    already, so there is nothing to agree with). Failing ranks take part too."""
    try:
        return dist.any(failed)
    except Exception:  # noqa: BLE001 - a peer gone: the collective fails, the failure is known
        if failed:
            return None
        raise
