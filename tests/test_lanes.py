"""The fast lane's guard (tests/conftest.py): outside `slow`, starting a process fails the test."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest

from tests.conftest import ProcessStartInFastLane


def test_every_way_of_starting_a_process_is_refused_naming_the_test(started_processes):
    here = r"test_lanes\.py::test_every_way_of_starting_a_process_is_refused_naming_the_test"
    starts = {
        "subprocess": (lambda: subprocess.run([sys.executable, "-c", "pass"]), r"python\S* -c pass"),
        "popen": (lambda: subprocess.Popen(["true"]), "true"),
        "fork": (os.fork, r"os\.fork\(\)"),
        "forkpty": (os.forkpty, r"os\.forkpty\(\)"),
        "system": (lambda: os.system("true"), "os.system: true"),
        "posix_spawn": (lambda: os.posix_spawn("/bin/true", ["true"], {}), "os.posix_spawn: true"),
        "posix_spawnp": (lambda: os.posix_spawnp("true", ["true"], {}), "os.posix_spawnp: true"),
        "multiprocessing": (
            lambda: multiprocessing.get_context("fork").Process(target=print, name="p1").start(),
            "multiprocessing process p1",
        ),
        "spawn": (lambda: multiprocessing.get_context("spawn").Process(target=print).start(), "multiproc"),
    }
    for name, (start, what) in starts.items():
        with pytest.raises(ProcessStartInFastLane, match=rf"{here} is not marked slow but started .*{what}"):
            start()
        assert len(started_processes) == 1, name
        started_processes.clear()  # refused as expected: not a failure of this test


def test_a_swallowed_refusal_still_fails_the_test_and_a_fixture_is_guarded_too(pytester):
    pytester.makeconftest("from tests.conftest import *  # noqa: F403\n")
    pytester.makepyfile(
        """
        import subprocess

        import pytest

        def test_swallows():
            try:
                subprocess.run(["true"])
            except BaseException:
                pass

        def test_in_a_fixture(started):
            pass

        @pytest.fixture(scope="module")
        def started():
            subprocess.run(["true"])
        """
    )
    res = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-p", "no:randomly")
    res.assert_outcomes(failed=1, errors=1)
    res.stdout.fnmatch_lines(
        [
            "*test_in_a_fixture is not marked slow but started a process: true*",  # errors come first
            "*test_swallows is not marked slow but started a process: true*",
        ]
    )


@pytest.mark.slow
def test_a_slow_test_may_start_processes():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
