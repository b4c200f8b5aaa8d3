"""Live progress of a sweep: one status line (done, running, queued, failed, ETA), a line per running
job (step, train loss, tokens/s) and a line per finished job.

The launcher feeds it job states and the run directories of its running jobs; everything else comes
from those directories, so Slurm jobs on other nodes show the same: a running job's step, loss and
tokens/s from the last row of its metrics.jsonl (its step count from run.json), a finished job's
numbers from summary.json (recipe, seed, final eval loss, status), the only place that knows how a run
ended. The ETA adds up each running job's steps left at its own step rate (measured by this process
between polls, else its logged step time) and, for the jobs not started, the mean length of the jobs
seen so far (start-up included), spread over the jobs running at once: it shows from the first logged
step on.
On a terminal the lines are redrawn in place (rich); elsewhere (CI logs, `nohup`, a pipe) the status
line and one line per running job are printed every `plain_every_s` seconds while anything changed
(`hydra.launcher.progress_s`), so logs are neither silent nor flooded.
A sweep that is being stopped goes `quiet()`: the line that stopped it is the last one printed.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

FAILED = ("failed", "preempted", "missing")
FINISHED = ("completed", "diverged")  # what --resume skips


def read_summary(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def last_train_row(run_dir: Path, tail_bytes: int = 32768) -> dict | None:
    """The last complete row of metrics.jsonl with a train loss (eval rows carry loss/eval only)."""
    try:
        with open(Path(run_dir) / "metrics.jsonl", "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:  # the line being written, or one cut at the tail's start
            continue
        if isinstance(row, dict) and "loss/train" in row and "step" in row:
            return row
    return None


def planned_steps(run_dir: Path) -> int | None:
    """The run's step count, from the resolved config in run.json (written when the run starts)."""
    try:
        return int(json.loads((Path(run_dir) / "run.json").read_text())["config"]["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class RunningJob:
    """What this process has seen of one running job: its last row and the pace between polls."""

    since: float  # when it was first seen running (its start-up counts toward its length)
    steps: int | None = None
    step: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    step_ms: float | None = None
    first: tuple[float, int] | None = None  # (when, step) it was first seen logging
    last: tuple[float, int] | None = None

    def seen(self, row: dict, now: float) -> None:
        self.step = int(row["step"])
        self.loss = row.get("loss/train")
        self.tokens_per_s = row.get("throughput/tokens_per_s")
        self.step_ms = row.get("time/step_ms")
        self.first = self.first or (now, self.step)
        if self.last is None or self.step != self.last[1]:
            self.last = (now, self.step)

    def s_per_step(self) -> float | None:
        """Measured between polls (evals and checkpoints included) once it moved, else its step time."""
        if self.first and self.last and self.last[1] > self.first[1]:
            return (self.last[0] - self.first[0]) / (self.last[1] - self.first[1])
        return self.step_ms / 1000 if isinstance(self.step_ms, (int, float)) and self.step_ms > 0 else None

    def left_s(self) -> float | None:
        rate = self.s_per_step()
        return None if rate is None or self.steps is None else max(0, self.steps - self.step) * rate

    def length_s(self) -> float | None:
        """Its start-up (until its first row) and all its steps at its pace."""
        rate = self.s_per_step()
        if rate is None or self.steps is None or self.first is None:
            return None
        return self.first[0] - self.since + self.steps * rate


def fmt_rate(x) -> str:
    if not isinstance(x, (int, float)):
        return "-"
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def live_line(name: str, live: RunningJob) -> str:
    """`  name  step 12/40  loss 4.1234  1.2k tok/s` of one running job."""
    total = live.steps if live.steps is not None else "?"
    return (
        f"  {name:<32} step {live.step}/{total}  loss {fmt_loss(live.loss)}  "
        f"{fmt_rate(live.tokens_per_s)} tok/s  left {fmt_duration(live.left_s())}"
    )


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
        self.running: dict[str, RunningJob] = {}  # name -> what was seen of it, while it runs
        self.lengths: list[float] = []  # seconds each finished job took (seen here, else its wall_time_s)
        self._live = None
        self._plain_last: tuple | None = None
        self._plain_t = 0.0
        self.plain_every_s = plain_every_s
        self._quiet = False

    def __enter__(self) -> SweepProgress:
        if self.console.is_terminal:
            from rich.live import Live

            self._live = Live(self.render(), console=self.console, transient=True, refresh_per_second=2)
            self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
        if not self._quiet and (self._live is not None or self._plain_last != self._key()):
            self.console.print(self.status_line(), markup=False)

    def quiet(self) -> None:
        """Print nothing more (the status line is cleared from a terminal)."""
        if self._live is not None:
            self._live.stop()
            self._live = None
        self._quiet = True

    def eta_s(self) -> float | None:
        """Seconds left: the running jobs' steps left at their own pace, the jobs not started at the
        mean length of the jobs seen so far, over the number running at once; None before any pace."""
        left = [j.left_s() for j in self.running.values()]
        lengths = self.lengths + [t for t in (j.length_s() for j in self.running.values()) if t is not None]
        if not lengths:
            return None
        mean = sum(lengths) / len(lengths)
        work = sum(mean if t is None else t for t in left) + self.counts["queued"] * mean
        return work / max(1, self.counts["running"], len(self.running))

    def status_line(self) -> str:
        return (
            f"lowp:{self.sweep}  done {self.done}/{self.total}  running {self.counts['running']}  "
            f"queued {self.counts['queued']}  failed {self.failed}  "
            f"elapsed {fmt_duration(time.monotonic() - self.t0)}  ETA {fmt_duration(self.eta_s())}"
        )

    def job_lines(self) -> list[str]:
        return [live_line(name, job) for name, job in self.running.items() if job.first is not None]

    def render(self):
        from rich.text import Text

        return Text("\n".join([self.status_line(), *self.job_lines()]))

    def _key(self) -> tuple:
        steps = tuple((n, j.step) for n, j in self.running.items())
        return (self.done, self.failed, self.counts["running"], self.counts["queued"], steps)

    def update(self, running: int, queued: int, run_dirs: dict[str, Path] | None = None) -> None:
        """The launcher's counts, and `run_dirs` (name -> run directory) of the jobs that run now."""
        self.counts = {"running": running, "queued": queued}
        self._read(run_dirs or {})
        if self._quiet:
            return
        if self._live is not None:
            self._live.update(self.render())
            return
        now = time.monotonic()
        final = self.done == self.total  # the last line is always printed
        if self._key() != self._plain_last and (final or now - self._plain_t >= self.plain_every_s):
            for line in [self.status_line(), *self.job_lines()]:
                self.console.print(line, markup=False)
            self._plain_last, self._plain_t = self._key(), now

    def _read(self, run_dirs: dict[str, Path]) -> None:
        now = time.monotonic()
        self.running = {name: self.running.get(name) or RunningJob(since=now) for name in run_dirs}
        for name, run_dir in run_dirs.items():
            job = self.running[name]
            row = last_train_row(run_dir)
            if row is not None:
                job.steps = job.steps or planned_steps(run_dir)
                job.seen(row, now)

    def finished(self, name: str, summary: dict | None, note: str = "") -> None:
        self.done += 1
        seen = self.running.pop(name, None)
        if seen is not None:  # as long as it ran here, start-up included (also a requeued job's wait)
            self.lengths.append(time.monotonic() - seen.since)
        elif isinstance((summary or {}).get("wall_time_s"), (int, float)):
            self.lengths.append(summary["wall_time_s"])
        if (summary or {}).get("status", "missing") in FAILED:
            self.failed += 1
        if not self._quiet:
            self.console.print(f"[{self.done}/{self.total}] {job_line(name, summary, note)}", markup=False)
