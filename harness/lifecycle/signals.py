"""Preemption: a signal asks the run to stop at the next step boundary, with a checkpoint.

SIGTERM (Slurm preemption and `scancel`), SIGINT (Ctrl-C), SIGUSR1 and SIGUSR2 (`sbatch --signal`,
submitit's preemption signal) only set a flag; the training loop checks it after each optimizer step,
writes a checkpoint and ends the run with status `preempted`. A second SIGINT stops at once.

After the run's files are written, `exit_after_preemption()` hands the signal to the handler that was
installed before lowp's: under submitit that is `SignalHandler.checkpoint_and_try_requeue` (USR2),
which asks the Hydra submitit launcher for its checkpoint (the same job again), requeues it with
`scontrol requeue` and exits; the requeued job finds the checkpoint in its run directory and resumes.
Without such a handler the process exits with 128 + the signal number, the shell convention for
"killed by a signal", which launchers and `srun` read as "not finished, requeue me".
"""

from __future__ import annotations

import logging
import signal
import sys

log = logging.getLogger("lowp")
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class StopRequest:
    """Installed for the life of one run; `signum` is the first signal received (None: none yet)."""

    def __init__(self):
        self.signum: int | None = None
        self.previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handler(self, signum, frame) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait for the step
        if self.signum is None:
            self.signum = signum
            log.warning(
                "received %s: checkpointing at the end of this step, then stopping",
                signal.Signals(signum).name,
            )

    def install(self) -> StopRequest:
        for sig in SIGNALS:
            try:
                self.previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread (e.g. a test runner's worker): no signals to catch
                return self
        return self

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def __enter__(self) -> StopRequest:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()


def exit_after_preemption(signum: int, previous_handler=None) -> None:
    """Hand the signal to the launcher's own handler (submitit requeues and exits), else exit 128+signum."""
    if callable(previous_handler) and previous_handler not in (signal.default_int_handler,):
        log.info("passing %s on to the launcher's handler", signal.Signals(signum).name)
        previous_handler(signum, None)  # submitit: checkpoint_and_try_requeue -> requeue -> sys.exit
    sys.exit(128 + signum)
