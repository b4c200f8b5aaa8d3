"""Stopping a sweep's driver: SIGINT (Ctrl-C), SIGTERM (`timeout`, `kill`) and SIGHUP (a closed terminal).

The driver runs its children (the Hydra launcher, the report) each in a session of its own, so a
terminal's signals reach only the driver, which relays them: one signal asks the child to stop, a second
kills it with everything it started. The caller then prints one line with the command that resumes.
"""

from __future__ import annotations

import os
import signal
import subprocess


class Interrupted(BaseException):
    """A stop signal while no child was there to stop (a BaseException, as KeyboardInterrupt is, so that
    no `except Exception` on the way swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class CaughtSignals:
    """SIGINT, SIGTERM and SIGHUP caught while inside `with`: `signum` is the first one that came
    (None while none did); the handlers before are back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.signum: int | None = None
        self.previous: dict = {}

    def __enter__(self):
        for sig in self.SIGNALS:
            try:
                self.previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread: no signals to catch
                break
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handler(self, signum, frame) -> None:
        self.signum = self.signum or signum


class StopSignals(CaughtSignals):
    """The driver's stop signals. While it waits on a child (the launcher, the report), the first asks
    that child to stop (SIGTERM: local jobs checkpoint and end, Slurm jobs go on) and a second kills
    the child's whole process group; with no child, the signal raises Interrupted."""

    def __init__(self):
        super().__init__()
        self.child: subprocess.Popen | None = None
        self.starting = False

    def _handler(self, signum, frame) -> None:
        first = self.signum is None
        super()._handler(signum, frame)
        if self.child is not None:
            try:
                if first:
                    self.child.send_signal(signal.SIGTERM)
                else:
                    os.killpg(self.child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        elif not self.starting:
            raise Interrupted(self.signum)

    def run(self, cmd: list[str], started=None, **popen) -> int:
        """Run `cmd` in a session of its own until it ends; returns its exit code."""
        if self.signum:
            raise Interrupted(self.signum)
        self.starting = True
        try:
            self.child = subprocess.Popen(cmd, start_new_session=True, **popen)
            if started is not None:
                started(self.child.pid)
            if self.signum:  # arrived while it started
                self.child.send_signal(signal.SIGTERM)
            return self.child.wait()
        finally:
            self.child, self.starting = None, False
