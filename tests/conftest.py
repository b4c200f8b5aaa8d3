"""Shared fixtures (helpers live in tests/helpers.py so test modules can import them), and the fast
lane's guard: a test not marked `slow` that starts a process fails, naming what it started."""

from __future__ import annotations

import functools
import multiprocessing.process
import os
import platform
import shlex
import subprocess
import types

import pytest

from tests.helpers import REPO, TINY, compose_cfg

pytest_plugins = ["pytester"]  # tests/test_lanes.py runs the guard in a pytest of its own


@pytest.fixture
def cfg_of():
    return compose_cfg


@pytest.fixture
def tiny_overrides():
    return list(TINY)


# -- the fast lane starts no process ------------------------------------------------------------------
class ProcessStartInFastLane(pytest.fail.Exception):
    """A test outside the `slow` lane started a process. A BaseException (as pytest.fail's is), so an
    `except Exception` in the code under test cannot swallow it."""


SPAWNERS = [  # (owner, attribute, how to name what the call starts)
    (subprocess.Popen, "_execute_child", lambda popen, args, *_, **__: _argv(args)),
    (os, "fork", lambda: "os.fork()"),
    (os, "forkpty", lambda: "os.forkpty()"),
    (os, "posix_spawn", lambda path, argv, *_, **__: f"os.posix_spawn: {_argv(argv)}"),
    (os, "posix_spawnp", lambda path, argv, *_, **__: f"os.posix_spawnp: {_argv(argv)}"),
    (os, "system", lambda command: f"os.system: {command}"),
    (
        multiprocessing.process.BaseProcess,
        "start",
        lambda proc: f"multiprocessing process {proc.name} (target {getattr(proc, '_target', None)})",
    ),
]


def _argv(args) -> str:
    text = args if isinstance(args, (str, bytes)) else shlex.join(map(str, args))
    return str(text)[:300]


@functools.cache
def git_state_from_files() -> dict:
    """What harness.lifecycle.artifacts.git_state records, read from the repository's files instead of by
    running git: HEAD's commit (a worktree's .git file points at its git dir); dirtiness unknown."""
    git = REPO / ".git"
    try:
        if git.is_file():  # a worktree: "gitdir: <path>"
            git = (REPO / git.read_text().split(":", 1)[1].strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return {"git_sha": head, "git_dirty": None}
        ref = head.removeprefix("ref: ")
        common = (git / (git / "commondir").read_text().strip()) if (git / "commondir").exists() else git
        for d in (git, common):
            if (d / ref).exists():
                return {"git_sha": (d / ref).read_text().strip(), "git_dirty": None}
        packed = (common / "packed-refs").read_text().splitlines()
        sha = next((ln.split()[0] for ln in packed if ln.endswith(" " + ref)), None)
        return {"git_sha": sha, "git_dirty": None}
    except OSError:
        return {"git_sha": None, "git_dirty": None}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Outside `slow`, every way of starting a process raises ProcessStartInFastLane for the whole
    of the test's protocol: its setup (module- and session-scoped fixtures it is the first to use
    included), call and teardown. A run's provenance asks git for the commit (two processes per
    training) and `platform.processor()` runs `uname -p` once per interpreter: in the fast lane the
    commit is read from the repository's files and the processor is left blank (what platform says
    when it cannot tell; provenance then records platform.machine())."""
    if item.get_closest_marker("slow") is not None or item.get_closest_marker("gpu") is not None:
        return (yield)  # GPU tests (skipped on a CPU) may compile kernels in worker processes
    attempts = item.stash.setdefault(_ATTEMPTS, [])
    with pytest.MonkeyPatch.context() as mp:
        for owner, name, describe in SPAWNERS:
            if hasattr(owner, name):
                mp.setattr(owner, name, _refuse(item.nodeid, owner, name, describe, attempts))
        mp.setattr("harness.lifecycle.artifacts.git_state", git_state_from_files)
        mp.setattr(platform, "processor", lambda: "")
        return (yield)


_ATTEMPTS = pytest.StashKey[list]()


def _refuse(nodeid: str, owner, name: str, describe, attempts: list):
    def refused(*args, **kwargs):
        what = describe(*args, **kwargs)
        attempts.append(what)
        raise ProcessStartInFastLane(
            f"{nodeid} is not marked slow but started a process: {what}\n"
            "The fast lane (-m 'not slow') runs in-process: call the in-process API "
            "(harness.train.run, harness.sweep.main, ...) or mark the test @pytest.mark.slow."
        )

    # named as what it replaces, so pickle still refers to it by name (os.system in a test's payload)
    module = isinstance(owner, types.ModuleType)
    refused.__module__ = owner.__name__ if module else owner.__module__
    refused.__name__, refused.__qualname__ = name, name if module else f"{owner.__qualname__}.{name}"
    return refused


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that caught the guard's error (or started the process from a thread) still fails."""
    report = yield
    attempts = item.stash.get(_ATTEMPTS, [])
    if attempts and report.passed:
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} is not marked slow but started a process: {attempts[0]}"
    attempts.clear()  # each attempt fails one phase once: by its error, or here
    return report


@pytest.fixture
def started_processes(request) -> list[str]:
    """What this test tried to start so far and the guard refused (a test of the guard clears it)."""
    return request.node.stash.setdefault(_ATTEMPTS, [])
