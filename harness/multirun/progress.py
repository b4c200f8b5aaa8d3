"""Live progress of a sweep: one status line (done, running, queued, failed, ETA), a line per finished job.

The launcher feeds it job states; the numbers of a finished job come from its run directory's
summary.json (recipe, seed, final eval loss, status), the only place that knows how a run ended.
On a terminal the status line is redrawn in place (rich); elsewhere (CI logs, `nohup`) it is printed
when the counts change, at most every `plain_every_s` seconds, so logs are not flooded either.
A sweep that is being stopped goes `quiet()`: the line that stopped it is the last one printed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

FAILED = ("failed", "preempted", "missing")
FINISHED = ("completed", "diverged")  # what --resume skips


def read_summary(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def fmt_loss(x) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) else "-"


def job_line(name: str, summary: dict | None, note: str = "") -> str:
    """`name  recipe  seed  eval loss  status` of one finished job."""
    s = summary or {}
    status = s.get("status") or "missing"
    extra = f"  at step {s['diverged_step']}" if status == "diverged" and s.get("diverged_step") else ""
    if status in ("failed", "missing") and (s.get("error") or note):
        extra = f"  {(s.get('error') or note).splitlines()[0][:120]}"
    recipe = str(s.get("recipe_label") or s.get("recipe") or "-")
    return (
        f"{name:<32} {recipe:<11} seed {str(s.get('seed', '-')):<3} "
        f"eval {fmt_loss(s.get('final_eval_loss')):<8} {status}{extra}"
    )


class _PlainConsole:
    """Where rich is not installed (e.g. a GPU node's own environment): plain lines, no live redraw."""

    is_terminal = False

    def __init__(self, stream):
        self.stream = stream

    def print(self, text, markup: bool = False) -> None:
        print(text, file=self.stream, flush=True)


def console(stream):
    try:
        from rich.console import Console
    except ImportError:
        return _PlainConsole(stream)
    return Console(file=stream, highlight=False, soft_wrap=True)


class SweepProgress:
    def __init__(self, sweep: str, total: int, stream=None, plain_every_s: float = 30.0):
        self.sweep, self.total = sweep, total
        self.console = console(stream or sys.stderr)
        self.t0 = time.monotonic()
        self.done = self.failed = 0
        self.counts = {"running": 0, "queued": total}
        self._live = None
        self._plain_last: tuple | None = None
        self._plain_t = 0.0
        self.plain_every_s = plain_every_s
        self._quiet = False

    def __enter__(self) -> SweepProgress:
        if self.console.is_terminal:
            from rich.live import Live

            self._live = Live(self.status_line(), console=self.console, transient=True, refresh_per_second=2)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
        if not self._quiet and (self._live is not None or self._plain_last != (self.done, self.failed, 0, 0)):
            self.console.print(self.status_line(), markup=False)

    def quiet(self) -> None:
        """Print nothing more (the status line is cleared from a terminal)."""
        if self._live is not None:
            self._live.stop()
            self._live = None
        self._quiet = True

    def eta_s(self) -> float | None:
        if not self.done:
            return None
        return (time.monotonic() - self.t0) / self.done * (self.total - self.done)

    def status_line(self) -> str:
        return (
            f"lowp:{self.sweep}  done {self.done}/{self.total}  running {self.counts['running']}  "
            f"queued {self.counts['queued']}  failed {self.failed}  "
            f"elapsed {fmt_duration(time.monotonic() - self.t0)}  ETA {fmt_duration(self.eta_s())}"
        )

    def update(self, running: int, queued: int) -> None:
        self.counts = {"running": running, "queued": queued}
        if self._quiet:
            return
        if self._live is not None:
            self._live.update(self.status_line())
            return
        key = (self.done, self.failed, running, queued)
        now = time.monotonic()
        final = self.done == self.total  # the last line is always printed
        if key != self._plain_last and (final or now - self._plain_t >= self.plain_every_s):
            self.console.print(self.status_line(), markup=False)
            self._plain_last, self._plain_t = key, now

    def finished(self, name: str, summary: dict | None, note: str = "") -> None:
        self.done += 1
        if (summary or {}).get("status", "missing") in FAILED:
            self.failed += 1
        if not self._quiet:
            self.console.print(f"[{self.done}/{self.total}] {job_line(name, summary, note)}", markup=False)
