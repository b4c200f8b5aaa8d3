"""Entry point: compose, validate, train one run, write its artifacts.

    python -m harness.train [group=preset ...] [key=value ...]        one run
    python -m harness.train -m recipe=bf16,tensorwise seed=0,1        a multirun (every job validated first)

`run(cfg, run_dir) -> Summary` is the testable core; `main` only adapts Hydra to it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import shutil
import signal
import sys
import time
import traceback
import warnings
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from harness import artifacts as A
from harness import checkpoint as ckpt
from harness import distributed as D
from harness import metrics as M
from harness import recipes
from harness import resume as R
from harness.artifacts import NullWriter, RunWriter, Summary, provenance, restore_rng, rng_state
from harness.backends import BackendSpec, build_backend, resolve_backend_name
from harness.config import prepare
from harness.config.schema import Config
from harness.config.store import CONF_DIR, register, to_config
from harness.config.validate import ConfigError, ConfigWarning, check_known_keys
from harness.data import build_data
from harness.divergence import DivergenceMonitor
from harness.hardware import device_for
from harness.loggers import NullLogger, open_logger, wandb_config
from harness.memory import SavedTensors, breakdown
from harness.model import count_params, flops_per_token
from harness.numerics import telemetry as T
from harness.optim import clip_grad, lr_at, set_lr
from harness.runlock import RunDirLocked, RunLock
from harness.signals import StopRequest, exit_after_preemption

log = logging.getLogger("lowp")


USER_ERRORS = (ConfigError, RunDirLocked, ckpt.CheckpointError, OSError)
"""Errors of the user's setup, not of lowp: one line, no traceback, exit code 2 (config) or 1."""


def checkpoint_interval(cfg: Config) -> int:
    """Steps between checkpoints: null protects a real run with one every 10% of its steps."""
    if cfg.checkpoint_interval is None:
        return max(1, math.ceil(cfg.steps / 10))
    return cfg.checkpoint_interval


def variant(cfg: Config) -> str:
    return f"{cfg.stability.name}+{cfg.optimizer.name}"


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def backend_spec(cfg: Config) -> BackendSpec:
    """The slices of `cfg` a backend is built from (backend=auto resolved here)."""
    return BackendSpec(
        name=resolve_backend_name(cfg.backend.name, cfg.recipe.name),
        recipe=cfg.recipe,
        stability=cfg.stability,
        model=cfg.model,
        optimizer=cfg.optimizer,
        seed=cfg.seed,
        options=cfg.backend,
    )


def init_weights(model: torch.nn.Module, path: str, model_cfg) -> dict:
    """init_from: the model's weights from a Hugging Face checkpoint, before the optimizer copies
    them into its masters."""
    from harness.hf.weights import init_from_hf

    return init_from_hf(model, path, model_cfg)


class Trainer:
    """Owns one run's objects; `fit()` runs the loop and returns the summary.

    `cfg` is a loaded config (`harness.config.load`); `writer` receives the run directory's rows and
    `logger` the tracker's (both null sinks when left out: a benchmark timing `train_step` alone)."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        writer: RunWriter | None = None,
        logger=None,
        stop: StopRequest | None = None,
        dist: D.Dist | None = None,
    ):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.dist = dist or D.SINGLE
        self.stop = stop or StopRequest()  # set by a signal: checkpoint and stop at the step boundary
        self.start_step = 0
        self.saved_bytes: int | None = None  # autograd's saved-for-backward bytes, counted on one step
        self.checkpoint_interval = checkpoint_interval(cfg)
        self.divergence = DivergenceMonitor(cfg.divergence)
        self.writer = writer if writer is not None else NullWriter()
        self.logger = logger if logger is not None else NullLogger()
        self.device = device_for(cfg.hardware)
        if self.device.type == "cuda" and self.dist.active:
            # ranks beyond the GPU count share them (gloo tests on one GPU); NCCL needs one GPU each
            self.device = torch.device("cuda", self.dist.launch.local_rank % torch.cuda.device_count())
        seed_everything(cfg.seed)  # the same seed on every rank: the same initial weights
        self.data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, seq_length=cfg.model.seq_length)
        self.backend = build_backend(backend_spec(cfg), self.device)
        self.backend.data_parallel_size = self.dist.world
        self.model = self.backend.build_model()
        self.init = init_weights(self.model, cfg.init_from, cfg.model) if cfg.init_from else None
        self.parallel = D.parallelize(self.model, self.backend, cfg, self.dist)
        self.optimizer = self.parallel.build_optimizer(self.model, cfg.optimizer)
        self.backend.prepare(self.model, self.optimizer)
        self.accum = cfg.global_batch_size // (cfg.micro_batch_size * self.dist.world)
        self.tokens_per_step = cfg.global_batch_size * cfg.model.seq_length
        n = count_params(self.model)
        self.flops_per_token = flops_per_token(cfg.model, n["non_embedding"])
        self.params = n
        self.batches = self.data.train_batches(
            cfg.micro_batch_size, seed=cfg.seed, rank=self.dist.rank, world=self.dist.world
        )
        self.micro_batches_seen = 0
        self.eval_set = self.data.eval_batches(cfg.eval_tokens, cfg.micro_batch_size)
        self.metrics = M.MetricsProcessor(
            device=self.device,
            tokens_per_step=self.tokens_per_step,
            flops_per_token=self.flops_per_token,
            peak_tflops=self._peak("bf16"),
            log_interval=cfg.log_interval,
            dist=self.dist,
        )

    def _peak(self, dtype: str) -> float | None:
        return (self.cfg.hardware.peak_tflops or {}).get(dtype)

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = next(self.batches)
        self.micro_batches_seen += 1
        if self.device.type == "cuda":  # pinned, so the copy is async: no host sync in the timed step
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def train_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """Forward/backward over the accumulation window and one optimizer step; returns tensors."""
        lr = lr_at(step, self.cfg.optimizer, self.cfg.steps)
        set_lr(self.optimizer, lr)
        telemetry = self.cfg.telemetry_interval > 0 and step % self.cfg.telemetry_interval == 0
        total = torch.zeros((), device=self.device)
        scale = self.parallel.loss_divisor(self.accum)  # the micro-batch's share of the global mean
        logs = self.metrics.should_log(step, self.cfg.steps - 1)
        stepper = self.optimizer.in_backward  # optimizer.step_in_backward: backward steps each param
        if stepper is not None:
            stepper.begin(want_norm=logs)
        for micro in range(self.accum):
            self.backend.microbatch(micro, self.accum)
            self.parallel.before_backward(micro, self.accum)
            x, y = self._next_batch()
            with ExitStack() as stack:
                if self.saved_bytes is None and micro == 0:  # the summary's memory: counted once
                    counter = stack.enter_context(SavedTensors(self.model.parameters()).counting())
                rows = (
                    stack.enter_context(self.backend.collect_telemetry())
                    if telemetry and micro == 0
                    else None
                )
                with self.backend.autocast():
                    loss = self.model.loss(x, y) / scale
                loss.backward()
            if self.saved_bytes is None:
                self.saved_bytes = counter.bytes
            if rows:
                self._log_telemetry(step, rows)
            total += loss.detach()
        self.backend.microbatch(None, self.accum)
        self.parallel.reduce_gradients(self.optimizer)  # DDP: one SUM over the ranks per step
        self.dist.sum_([total])  # the global batch's mean loss on every rank
        if self.dist.fsdp:
            total /= self.dist.world
        if stepper is not None:
            grad_norm = stepper.finish()
        else:
            # the norm costs a pass over every gradient: only when clipping needs it or this step logs it
            clip = self.cfg.optimizer.clip_grad
            grad_norm = clip_grad(self.optimizer, clip) if clip > 0 or logs else None
            self.optimizer.step()
        self.backend.after_optimizer_step(self.model)
        self.optimizer.zero_grad()
        return total, grad_norm, lr

    def _log_telemetry(self, step: int, rows: list[dict]) -> None:
        self.writer.numerics([{M.STEP: step + 1, **r} for r in rows])
        flat = {M.STEP: step + 1, M.TOKENS: (step + 1) * self.tokens_per_step}
        for r in rows:
            for stat in T.STATS:
                flat[f"{M.NUMERICS}/{r[T.LAYER]}/{r[T.TENSOR]}/{stat}"] = r.get(stat)
        self.writer.metrics(flat)
        self.logger.log(flat)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if not self.eval_set:
            return None
        losses = []
        for x, y in self.eval_set:
            with self.backend.autocast():
                losses.append(self.model.loss(x.to(self.device), y.to(self.device)))
        return torch.stack(losses).mean().item()

    # -- checkpoints: each component's own state_dict, under one tree -----------------------------------
    def _param_names(self) -> list[str]:
        """Canonical names of the optimizer's parameters, in its order."""
        names = {id(p): self.backend.canonical_name(n) for n, p in self.model.named_parameters()}
        return [names[id(p)] for p in self.optimizer.params]

    def state_dict(self, steps_done: int, summary: Summary) -> dict:
        return {
            "step": steps_done,
            "config": asdict(self.cfg),
            "model": self.backend.model_state_dict(self.model),
            "optimizer": ckpt.key_by_name(self.optimizer.state_dict(), self._param_names()),
            "backend": self.backend.state_dict(),
            "data": self.batches.state_dict(),
            "metrics": self.metrics.state_dict(),
            "divergence": self.divergence.state_dict(),
            "rng": rng_state(),
            "summary": {
                "final_train_loss": summary.final_train_loss,
                "final_eval_loss": summary.final_eval_loss,
            },
        }

    def load_state_dict(self, state: dict, summary: Summary) -> None:
        """`state` holds whole tensors (a checkpoint of any world size): FSDP2 keeps its shards."""
        self.backend.load_model_state_dict(self.model, self.parallel.localize_model(state["model"]))
        optim = ckpt.key_by_index(state["optimizer"], self._param_names())
        self.optimizer.load_state_dict(self.parallel.localize_optimizer(optim, self.optimizer.params))
        self.backend.load_state_dict(state["backend"])
        self.batches.load_state_dict(state["data"])
        self.micro_batches_seen = self.batches.position
        self.metrics.load_state_dict(state["metrics"])
        self.divergence.load_state_dict(state["divergence"])
        for key, value in state["summary"].items():
            setattr(summary, key, value)
        summary.steps, summary.tokens = state["step"], state["step"] * self.tokens_per_step
        restore_rng(state["rng"])  # last: loading (TE's priming forward) must not move the RNGs
        self.start_step = state["step"]

    def checkpoint(self, step: int, summary: Summary) -> None:
        t0 = time.perf_counter()
        try:
            path = ckpt.save(
                self.run_dir,
                step + 1,
                self.state_dict(step + 1, summary),
                self.cfg.checkpoint_keep,
                **({"dist": self.dist, "sharded": self.dist.fsdp} if self.dist.active else {}),
            )
        except OSError as exc:
            raise ckpt.CheckpointError(
                f"cannot write checkpoint {step + 1} under {self.run_dir / ckpt.DIRNAME} "
                f"({exc.strerror or exc}); "
                "free space or make it writable and restart to resume (the earlier checkpoints are intact)"
            ) from exc
        log.info("checkpoint %s (%.2fs)", path, time.perf_counter() - t0)

    def _due(self, interval: int, step: int) -> bool:
        return interval > 0 and (step + 1) % interval == 0 and step + 1 < self.cfg.steps

    def fit(self, summary: Summary) -> Summary:
        cfg, t0 = self.cfg, time.perf_counter()
        warm = min(cfg.bench_warmup_steps, max(cfg.steps - 1, 0))
        interval = self.checkpoint_interval
        for step in range(self.start_step, cfg.steps):
            if step == warm and self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)  # peak of the steady state only
            self.metrics.timer.start()
            try:
                loss, grad_norm, lr = self.train_step(step)
            except FloatingPointError as exc:  # e.g. FP8 optimizer states poisoned by an all-zero moment
                return self._diverged(summary, step, str(exc))
            self.metrics.timer.stop(step)
            self.metrics.record(step, loss, grad_norm, lr)
            summary.steps, summary.tokens = step + 1, (step + 1) * self.tokens_per_step
            if step in (0, cfg.steps - 1):  # TE: the recipe really ran; delayed scales really moved
                self.backend.verify_active(self.model, step)
            synced = saved = False
            if self.metrics.should_log(step, cfg.steps - 1):  # a logged row syncs
                row = self.metrics.row(step)
                summary.final_train_loss = row[M.LOSS_TRAIN]
                self._emit(row, t0)
                cause = self.divergence.check(row)
                if cause:
                    return self._diverged(summary, step, cause)
                synced = True
            if self._due(cfg.eval_interval, step):
                self._eval_row(step, summary)
                synced = True
            if self._due(interval, step):
                self.checkpoint(step, summary)
                synced = saved = True
            if synced:
                self.metrics.timer.cold.add(step + 1)
            if (
                self.dist.active
                and self.dist.any(self.stop.requested, self.device)
                and not self.stop.requested
            ):
                self.stop.signum = (
                    signal.SIGTERM
                )  # a signal reaches the ranks at different times: all stop here
            if self.stop.requested and step + 1 < cfg.steps:
                if not saved and interval >= 0:
                    self.checkpoint(step, summary)
                summary.status = A.PREEMPTED
                log.warning("preempted after step %d/%d; %s", step + 1, cfg.steps, self.resume_hint)
                return summary
        self._eval_row(cfg.steps - 1, summary)
        if interval >= 0:
            self.checkpoint(cfg.steps - 1, summary)
        summary.status = A.COMPLETED
        return summary

    resume_hint = "restart it in its run dir to resume"

    def _diverged(self, summary: Summary, step: int, cause: str) -> Summary:
        summary.status, summary.diverged_step, summary.divergence_cause = A.DIVERGED, step + 1, cause
        log.warning("diverged at step %d: %s", step + 1, cause)
        return summary

    def _eval_row(self, step: int, summary: Summary) -> None:
        loss = self.evaluate()
        if loss is None:
            return
        summary.final_eval_loss = loss
        row = {M.STEP: step + 1, M.TOKENS: (step + 1) * self.tokens_per_step, M.LOSS_EVAL: loss}
        self.writer.metrics(row)
        self.logger.log(row)
        log.info("eval  step %d/%d  loss/eval %.4f", step + 1, self.cfg.steps, loss)

    def _emit(self, row: dict, t0: float) -> None:
        self.writer.metrics(row)
        self.logger.log(row)
        done = row[M.STEP]
        eta = (time.perf_counter() - t0) / done * (self.cfg.steps - done)
        tps = row.get(M.TOKENS_PER_S)
        log.info(
            "step %d/%d  loss %.4f  lr %.2e  %s tok/s  ETA %dm%02ds  %s",
            done,
            self.cfg.steps,
            row[M.LOSS_TRAIN],
            row[M.LR],
            f"{tps:,.0f}" if tps else "-",
            eta // 60,
            eta % 60,
            self.run_dir,
        )

    def finalize(self, summary: Summary) -> None:
        """Throughput (median of steady-state steps), MFU and memory into the summary."""
        cfg = self.cfg
        ms = self.metrics.timer.median_ms(after_step=min(cfg.bench_warmup_steps, max(summary.steps - 1, 0)))
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        if peak is not None:
            peak = int(self.dist.max_scalar(float(peak), self.device))  # the fullest rank
        summary.loss_floor = self.data.loss_floor
        summary.memory = breakdown(
            self.model,
            self.optimizer,
            peak_bytes=peak,
            saved_bytes=self.saved_bytes,
        )  # this rank's (rank 0)
        summary.peak_mem_gib = peak / 2**30 if peak is not None else None
        summary.world_size = self.dist.world
        if ms:
            summary.step_time_ms = ms
            summary.tokens_per_s = self.tokens_per_step / (ms / 1e3)
            summary.tokens_per_s_per_gpu = summary.tokens_per_s / self.dist.world
            spec = recipes.get(cfg.recipe.name)
            summary.mfu_bf16_peak, summary.mfu_recipe_peak = M.summary_mfu(
                summary.tokens_per_s_per_gpu * self.flops_per_token / 1e12,
                bf16_peak=self._peak("bf16"),
                recipe_peak=self._peak(spec.peak_dtype),
                # emulated speed is not the recipe's speed: no MFU claimed for it
                emulated=self.backend.name == "emulated" and spec.quantizes_gemms,
            )


def run(
    cfg: Config, run_dir: Path, stop: StopRequest | None = None, resume_command: str | None = None
) -> Summary:
    """Train (or resume) and write one complete run directory; returns its summary.

    `cfg` comes from `harness.config.load` (or a composed Config: it is prepared here the same way,
    hardware resolved, stability overrides resolved, validated) before anything is written. One
    process at a time writes a run dir (RunLock); with a checkpoint there and resume=auto|must the run
    continues from it; a failure is recorded in summary.json and error.txt, then re-raised.

    Under torchrun or Slurm tasks every rank calls this: the process group starts here (after
    validation), rank 0's run dir is everyone's, and only rank 0 writes run.json, metrics and W&B."""
    config_warnings: list[str] = []
    cfg = prepare(cfg, warnings_out=config_warnings)
    p = cfg.parallel
    dist = D.setup(p.strategy, p.backend, p.timeout_s, device_for(cfg.hardware))
    try:
        run_dir = _shared_run_dir(dist, Path(run_dir))
        if not dist.is_main:
            logging.getLogger("lowp").setLevel(logging.WARNING)  # rank 0 speaks for the job
        return _run(cfg, run_dir, stop, resume_command, config_warnings, dist)
    finally:
        D.teardown(dist)


def _shared_run_dir(dist: D.Dist, run_dir: Path) -> Path:
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


def _run(cfg, run_dir, stop, resume_command, config_warnings, dist: D.Dist) -> Summary:
    lock = RunLock(run_dir) if dist.is_main else contextlib.nullcontext()
    with _agreed(dist, lock):
        found = _agreed_resume_point(cfg, run_dir, dist)
        previous = R.previous_run_json(run_dir)  # its attempts go on; its W&B run only with its checkpoint
        if found and dist.is_main:
            dropped = R.truncate_rows(run_dir, found[1])
            log.info("resuming %s from %s (rows dropped after its step: %s)", run_dir, found[0].name, dropped)
        backend_name = resolve_backend_name(cfg.backend.name, cfg.recipe.name)
        summary = Summary(
            recipe=cfg.recipe.name,
            recipe_label=recipes.label(cfg.recipe),
            variant=variant(cfg),
            hardware=cfg.hardware.name,
            model=cfg.model.name,
            data=cfg.data.name,
            seed=cfg.seed,
        )
        config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
        tracker = (
            open_logger(
                cfg.logger,
                run_dir=run_dir,
                name=cfg.name or f"{recipes.label(cfg.recipe)} s{cfg.seed}",
                group=_sweep_group(run_dir),
                job_type=cfg.recipe.name,
                tags=[cfg.recipe.name, recipes.label(cfg.recipe), backend_name, variant(cfg)],
                config=config,
                run_id=((previous or {}).get("wandb") or {}).get("run_id") if found else None,
            )
            if dist.is_main
            else contextlib.nullcontext(NullLogger())
        )
        with tracker as logger:
            job = _Job(cfg, run_dir, summary, config, logger, stop or StopRequest(), found, previous, dist)
            return job.train(resume_command, config_warnings)


@contextlib.contextmanager
def _agreed(dist: D.Dist, context):
    """Enter `context` on rank 0 (the run lock) and tell the others whether it could: a rank that
    finds the run dir locked must not leave the others waiting in the first collective."""
    error = None
    try:
        context.__enter__()
    except BaseException as exc:  # noqa: BLE001 - shared with the other ranks, then re-raised
        error = exc
    message = dist.broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if message is not None:
        raise RunDirLocked(message.split(": ", 1)[-1])
    try:
        yield
    except BaseException:
        if not context.__exit__(*sys.exc_info()):
            raise
    else:
        context.__exit__(None, None, None)


def _agreed_resume_point(cfg: Config, run_dir: Path, dist: D.Dist):
    """Rank 0 decides where the run starts (it may move old files aside); every rank loads that."""
    if not dist.active:
        return _resume_point(cfg, run_dir)
    found, error = None, None
    if dist.is_main:
        try:
            found = _resume_point(cfg, run_dir)
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
    path = Path(value)
    step, tree = ckpt.load_one(path)
    return path, step, tree


def _resume_point(cfg: Config, run_dir: Path) -> tuple[Path, int, dict] | None:
    """The checkpoint this run continues from (None: a fresh start), by the resume rule."""
    if cfg.resume not in ("auto", "never", "must"):
        raise ConfigError(f"resume={cfg.resume}: unknown; use auto, never or must")
    if cfg.resume == "never":
        moved = R.move_aside(run_dir)
        if moved:
            log.warning("resume=never: the earlier files of %s are kept in %s", run_dir, moved)
        return None
    found = ckpt.load_latest(run_dir)
    if found is None and ckpt.candidates(run_dir):
        raise ckpt.CheckpointError(
            f"run dir {run_dir} holds checkpoints but none is usable (see the warnings above); start fresh "
            "with resume=never (moves them aside) or use a new hydra.run.dir"
        )
    if found is None:
        if cfg.resume == "must":
            raise ConfigError(
                f"resume=must but {run_dir} holds no usable checkpoint; "
                "check hydra.run.dir or use resume=auto"
            )
        return None
    saved, requested = found[2]["config"], asdict(cfg)
    keys = R.config_diff(saved, requested)
    if keys:
        raise ConfigError(R.describe_diff(saved, requested, keys, run_dir))
    return found


class _Job:
    """One attempt of one run: what `run` opened, handed to the trainer."""

    def __init__(self, cfg, run_dir, summary, config, logger, stop, found, previous, dist=D.SINGLE):
        self.cfg, self.run_dir, self.summary, self.config, self.logger = cfg, run_dir, summary, config, logger
        self.stop, self.found, self.previous, self.dist = stop, found, previous, dist

    agreed = False

    def _agree(self, failed: bool) -> None:
        """Every rank's way out, once: a rank that failed outside a collective (an eval, the last
        step's summary) would leave the others reporting success. Failing ranks take part too
        (their peers may be gone already: then there is nothing to agree with)."""
        if not self.dist.active or self.agreed:
            return
        self.agreed = True
        try:
            any_failed = self.dist.any(failed)
        except Exception:  # noqa: BLE001 - a peer gone: the collective fails, the failure is known
            if failed:
                return
            raise
        if any_failed and not failed:
            first = A.first_rank_failure(self.run_dir)
            raise RankFailed(f"another rank failed: {first[1] if first else 'see its error.rank*.txt'}")

    def train(self, resume_command: str | None, config_warnings: list[str]) -> Summary:
        """Build the trainer, fit, and write the summary on every way out (atomic, also on failure)."""
        cfg, run_dir, summary, logger, found = self.cfg, self.run_dir, self.summary, self.logger, self.found
        dist = self.dist
        writer = RunWriter(run_dir, append=found is not None) if dist.is_main else NullWriter()
        try:
            trainer = Trainer(cfg, run_dir, writer, logger, self.stop, dist)
        except (
            ValueError
        ) as exc:  # bad data path, vocab, unsupported recipe: config problems, before any work
            raise ConfigError(str(exc)) from exc
        t0 = time.perf_counter()
        try:
            if found:
                trainer.load_state_dict(found[2], summary)
            summary.backend = trainer.backend.name
            run_json = _run_json(self.config, cfg, trainer, self.previous, found[1] if found else None)
            run_json["config_warnings"] = config_warnings  # printed once at validation; kept for the report
            logger.update_config(wandb_config(run_json))  # filterable resolved.* keys (backend that ran, TE)
            writer.write_run({**run_json, "wandb": logger.describe()})
            log.info(
                "run dir %s  (backend=%s, recipe=%s, hardware=%s)",
                run_dir,
                trainer.backend.name,
                cfg.recipe.name,
                cfg.hardware.name,
            )
            if resume_command:
                log.info("to resume this run: %s", resume_command)
                trainer.resume_hint = f"resume with: {resume_command}"
            if trainer.start_step >= cfg.steps:
                summary.status = A.COMPLETED
                log.info("run %s is already complete (step %d)", run_dir, trainer.start_step)
            else:
                trainer.fit(summary)
            trainer.finalize(summary)
            self._agree(failed=False)
            summary.wall_time_s = time.perf_counter() - t0
            if summary.status == A.PREEMPTED:
                logger.mark_preempting()
            logger.summary(asdict(summary))
        except BaseException as exc:  # noqa: BLE001 - the summary must say how the run ended, then re-raise
            summary.status = A.PREEMPTED if isinstance(exc, KeyboardInterrupt) else A.FAILED
            summary.error = f"{type(exc).__name__}: {exc}".strip()
            writer.error(f"{summary.error}\n\n{traceback.format_exc()}")
            if dist.active:
                A.write_rank_failure(run_dir, dist.rank, summary.error, traceback.format_exc())  # first
                self._agree(failed=True)
                _rank_failed(run_dir, dist, summary)
            where = "" if isinstance(exc, USER_ERRORS) else f" (traceback in {run_dir}/error.txt)"
            log.error("run %s: %s%s", summary.status, summary.error, where)
            raise
        finally:
            summary.wall_time_s = time.perf_counter() - t0
            writer.summary(summary)
            writer.close()
        return summary


class RankFailed(RuntimeError):
    """Another rank of the job failed where this one did not notice (no collective in between)."""


def _rank_failed(run_dir: Path, dist: D.Dist, summary: Summary) -> None:
    """Several ranks (this rank's failure recorded): name the earliest failing rank in the summary
    (the others' errors are its consequences: a closed connection, a collective's timeout), and
    write summary.json from this rank too unless it is rank 0 (which writes it anyway): the
    launcher may kill rank 0 before it gets there."""
    first = A.first_rank_failure(run_dir) or (dist.rank, summary.error)
    summary.failed_rank = first[0]
    summary.error = f"rank {first[0]} of {dist.world}: {first[1]}"
    if not dist.is_main:
        A.write_json_atomic(
            Path(run_dir) / "summary.json", asdict(summary)
        )  # not RunWriter: it opens metrics


def _run_json(
    config: dict, cfg: Config, trainer: Trainer, previous: dict | None, resumed_from: int | None
) -> dict:
    prov = provenance(
        backend=trainer.backend.describe(),
        hardware=cfg.hardware.name,
        seed=cfg.seed,
        data=trainer.data.describe(),
        device=trainer.device,
    )
    prov.update(
        recipe_label=recipes.label(cfg.recipe),
        init=trainer.init,
        params=trainer.params,
        flops_per_token=trainer.flops_per_token,
        tokens_per_step=trainer.tokens_per_step,
        grad_accumulation=trainer.accum,
        parallel=trainer.parallel.describe(),
    )
    attempts = (previous or {}).get("attempts", []) + [R.attempt(resumed_from)]
    return {
        "config": config,
        "provenance": prov,
        "wandb": None,
        "attempts": attempts,
    }


def _sweep_group(run_dir: Path) -> str | None:
    """Multirun jobs share a W&B group named after their sweep directory, `<parent>/<name>`: for Hydra's
    default multirun/<date>/<time> that is `<date>/<time>` (unique across days); harness.sweep sets
    `<sweep>/<date_time>` explicitly (logger.wandb.group)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        if hc.mode and hc.mode.name == "MULTIRUN":
            sweep_dir = Path(hc.sweep.dir)
            return f"{sweep_dir.parent.name}/{sweep_dir.name}"
    except ValueError:
        pass
    return None


def _concise_warnings() -> None:
    default = warnings.formatwarning
    warnings.formatwarning = lambda msg, cat, *a, **k: (
        f"warning: {msg}\n" if issubclass(cat, ConfigWarning) else default(msg, cat, *a, **k)
    )


register()


def main() -> float | None:
    """`python -m harness.train`: a removed recipe name is refused before Hydra looks for its preset."""
    removed = recipes.legacy_in(sys.argv[1:])
    if removed:
        print(f"error: {removed}", file=sys.stderr)
        sys.exit(2)
    return _main()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def _main(dcfg: DictConfig) -> float | None:
    """Adapts Hydra to `run`: exit 2 for a config error, 1 for a runtime one (a multirun's job
    returns instead, so the launcher goes on), 128+signal after a preemption, 0 otherwise."""
    from hydra.core.hydra_config import HydraConfig

    _concise_warnings()
    hc = HydraConfig.get()
    multirun = hc.mode is not None and hc.mode.name == "MULTIRUN"
    run_dir = Path(hc.runtime.output_dir)
    stop = StopRequest().install()
    try:
        check_known_keys(dcfg)
        cfg: Config = to_config(dcfg)
        summary = run(cfg, run_dir, stop, R.resume_command(run_dir, list(hc.overrides.task)))
    except KeyboardInterrupt:
        print("error: interrupted twice; the last checkpoint is kept, restart to resume", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - recorded in the run dir by run(); here only the exit code
        code = 2 if isinstance(exc, ConfigError) else 1
        where = "" if isinstance(exc, USER_ERRORS) else f" (traceback in {run_dir / 'error.txt'})"
        print(
            f"error: {exc}{where}" if code == 2 else f"error: {type(exc).__name__}: {exc}{where}",
            file=sys.stderr,
        )
        if multirun:
            return None  # the basic launcher goes on with the next job
        sys.exit(code)
    finally:
        stop.restore()
    if summary.status == A.PREEMPTED:
        exit_after_preemption(stop.signum, stop.previous.get(stop.signum))
    loss = summary.final_eval_loss if summary.final_eval_loss is not None else summary.final_train_loss
    return loss if loss is not None and math.isfinite(loss) else None


if __name__ == "__main__":
    main()
