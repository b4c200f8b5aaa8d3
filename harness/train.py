"""Entry point: compose, validate, train one run, write its artifacts.

    python -m harness.train [group=preset ...] [key=value ...]        one run
    python -m harness.train -m recipe=bf16,tensorwise seed=0,1        a multirun (every job validated first)

`run(cfg, run_dir) -> Summary` is the testable core; `main` only adapts Hydra to it.
"""

from __future__ import annotations

import logging
import math
import random
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

from harness import metrics as M
from harness.artifacts import RunWriter, Summary, provenance, save_checkpoint
from harness.backends import build_backend
from harness.config.schema import Config
from harness.config.store import CONF_DIR, register
from harness.config.validate import ConfigError, ConfigWarning, validate
from harness.data import build_data
from harness.hardware import device_for, resolve_hardware
from harness.loggers import open_logger, wandb_config
from harness.memory import breakdown
from harness.model import count_params, flops_per_token
from harness.optim import build_optimizer, clip_grad, lr_at, set_lr

log = logging.getLogger("lowp")
RECIPE_PEAK = {"delayed": "fp8", "tensorwise": "fp8", "blockwise": "fp8", "mxfp8": "fp8", "nvfp4": "fp4"}


class Preempted(RuntimeError):
    """SIGTERM (Slurm preemption / requeue) arrived during training."""


def variant(cfg: Config) -> str:
    return f"{cfg.stability.name}+{cfg.optimizer.name}"


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """Owns one run's objects; `fit()` runs the loop and returns the summary."""

    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.writer: RunWriter | None = None
        self.logger = None
        self.device = device_for(cfg.hardware)
        seed_everything(cfg.seed)
        self.data = build_data(cfg.data, vocab_size=cfg.model.vocab_size, seq_length=cfg.model.seq_length)
        self.backend = build_backend(cfg, self.device)
        self.model = self.backend.build_model()
        self.optimizer = build_optimizer(
            self.model,
            cfg.optimizer,
            self.device,
            self.backend.name,
            full_master=cfg.recipe.name == "int4_qat",
        )
        self.backend.prepare(self.model, self.optimizer)
        self.accum = cfg.global_batch_size // cfg.micro_batch_size
        self.tokens_per_step = cfg.global_batch_size * cfg.model.seq_length
        n = count_params(self.model)
        self.flops_per_token = flops_per_token(cfg.model, n["non_embedding"])
        self.params = n
        self.batches = self.data.train_batches(cfg.micro_batch_size, seed=cfg.seed)
        self.micro_batches_seen = 0
        self.eval_set = self.data.eval_batches(cfg.eval_tokens, cfg.micro_batch_size)
        self.metrics = M.MetricsProcessor(
            device=self.device,
            tokens_per_step=self.tokens_per_step,
            flops_per_token=self.flops_per_token,
            peak_tflops=self._peak("bf16"),
            log_interval=cfg.log_interval,
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
        for micro in range(self.accum):
            self.backend.microbatch(micro, self.accum)
            x, y = self._next_batch()
            with ExitStack() as stack:
                rows = (
                    stack.enter_context(self.backend.collect_telemetry())
                    if telemetry and micro == 0
                    else None
                )
                with self.backend.autocast():
                    loss = self.model.loss(x, y) / self.accum
                loss.backward()
            if rows:
                self._log_telemetry(step, rows)
            total += loss.detach()
        self.backend.microbatch(None, self.accum)
        # the norm costs a pass over every gradient: only when clipping needs it or this step logs it
        clip = self.cfg.optimizer.clip_grad
        logs = self.metrics.should_log(step, self.cfg.steps - 1)
        grad_norm = clip_grad(self.optimizer, clip) if clip > 0 or logs else None
        self.optimizer.step()
        self.backend.after_optimizer_step(self.model)
        self.optimizer.zero_grad()
        return total, grad_norm, lr

    def _log_telemetry(self, step: int, rows: list[dict]) -> None:
        self.writer.numerics([{"step": step + 1, **r} for r in rows])
        flat = {M.STEP: step + 1, M.TOKENS: (step + 1) * self.tokens_per_step}
        for r in rows:
            for stat in ("amax", "scale", "underflow", "saturation", "sqnr_db"):
                flat[f"{M.NUMERICS}/{r['layer']}/{r['tensor']}/{stat}"] = r.get(stat)
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

    def checkpoint(self, step: int) -> None:
        save_checkpoint(
            self.run_dir,
            {
                "step": step + 1,
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "lr_schedule": {
                    "step": step + 1,
                    "cfg": asdict(self.cfg.optimizer),
                    "total_steps": self.cfg.steps,
                },
                "data_position": {"micro_batches": self.micro_batches_seen, "seed": self.cfg.seed},
                "recipe_state": self.backend.state_dict(),
                "config": asdict(self.cfg),
            },
        )

    def _due(self, interval: int, step: int) -> bool:
        return interval > 0 and (step + 1) % interval == 0 and step + 1 < self.cfg.steps

    def fit(self, summary: Summary, logger) -> Summary:
        cfg, t0 = self.cfg, time.perf_counter()
        self.logger = logger
        warm = min(cfg.bench_warmup_steps, max(cfg.steps - 1, 0))
        for step in range(cfg.steps):
            if step == warm and self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)  # peak of the steady state only
            self.metrics.timer.start()
            try:
                loss, grad_norm, lr = self.train_step(step)
            except FloatingPointError as exc:  # e.g. FP8 optimizer states poisoned by an all-zero moment
                summary.status, summary.diverged_step, summary.divergence_cause = (
                    "diverged",
                    step + 1,
                    str(exc),
                )
                log.warning("diverged at step %d: %s", step + 1, exc)
                return summary
            self.metrics.timer.stop(step)
            self.metrics.record(step, loss, grad_norm, lr)
            summary.steps, summary.tokens = step + 1, (step + 1) * self.tokens_per_step
            if step in (0, cfg.steps - 1):  # TE: the recipe really ran; delayed scales really moved
                self.backend.verify_active(self.model, step)
            if self.metrics.should_log(step, cfg.steps - 1):
                row = self.metrics.row(step)
                summary.final_train_loss = row[M.LOSS_TRAIN]
                self._emit(row, t0)
                cause = M.divergence(row, self.metrics.first_loss)
                if cause:
                    summary.status, summary.diverged_step, summary.divergence_cause = (
                        "diverged",
                        step + 1,
                        cause,
                    )
                    log.warning("diverged at step %d: %s", step + 1, cause)
                    return summary
            synced = self.metrics.should_log(step, cfg.steps - 1)  # a logged row syncs
            if self._due(cfg.eval_interval, step):
                self._eval_row(step, summary)
                synced = True
            if self._due(cfg.checkpoint_interval, step):
                self.checkpoint(step)
                synced = True
            if synced:
                self.metrics.timer.cold.add(step + 1)
        self._eval_row(cfg.steps - 1, summary)
        if cfg.checkpoint_interval >= 0:
            self.checkpoint(cfg.steps - 1)
        summary.status = "completed"
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
        summary.loss_floor = self.data.loss_floor
        summary.memory = breakdown(self.model, self.optimizer, peak_bytes=peak)
        summary.peak_mem_gib = peak / 2**30 if peak is not None else None
        if ms:
            summary.step_time_ms = ms
            summary.tokens_per_s = self.tokens_per_step / (ms / 1e3)
            tflops = summary.tokens_per_s * self.flops_per_token / 1e12
            quantized = cfg.recipe.name in RECIPE_PEAK
            emulated_speed = self.backend.name == "emulated" and quantized
            bf16_peak, own_peak = self._peak("bf16"), self._peak(RECIPE_PEAK.get(cfg.recipe.name, "bf16"))
            # emulated speed is not the recipe's speed: no MFU claimed for it
            summary.mfu_bf16_peak = tflops / bf16_peak if bf16_peak and not emulated_speed else None
            summary.mfu_recipe_peak = tflops / own_peak if own_peak and not emulated_speed else None


def run(cfg: Config, run_dir: Path) -> Summary:
    """Validate, train and write one complete run directory; returns its summary."""
    cfg.hardware = resolve_hardware(cfg.hardware)
    config_warnings = validate(cfg)
    run_dir = Path(run_dir)
    try:
        trainer = Trainer(cfg, run_dir)
    except ValueError as exc:  # bad data path, vocab, unsupported recipe: config problems, before any work
        raise ConfigError(str(exc)) from exc
    writer = trainer.writer = RunWriter(run_dir)
    summary = Summary(
        recipe=cfg.recipe.name,
        variant=variant(cfg),
        hardware=cfg.hardware.name,
        model=cfg.model.name,
        data=cfg.data.name,
        seed=cfg.seed,
    )
    t0 = time.perf_counter()
    try:
        summary.backend = trainer.backend.name
        run_json = _run_json(cfg, trainer)
        run_json["config_warnings"] = config_warnings  # printed once; kept for the report
        writer.write_run(run_json)
        name = cfg.name or f"{cfg.recipe.name}-s{cfg.seed}"
        with open_logger(
            cfg.logger,
            run_dir=run_dir,
            name=name,
            group=_sweep_group(run_dir),
            job_type=cfg.recipe.name,
            tags=[cfg.recipe.name, trainer.backend.name, variant(cfg)],
            config=wandb_config(run_json),
        ) as logger:
            run_json["wandb"] = logger.describe()
            writer.write_run(run_json)
            log.info(
                "run dir %s  (backend=%s, recipe=%s, hardware=%s)",
                run_dir,
                trainer.backend.name,
                cfg.recipe.name,
                cfg.hardware.name,
            )
            trainer.fit(summary, logger)
            trainer.finalize(summary)
            summary.wall_time_s = time.perf_counter() - t0
            logger.summary(asdict(summary))
    except BaseException as exc:  # noqa: BLE001 - the summary must say how the run ended, then re-raise
        summary.status = "preempted" if isinstance(exc, (Preempted, KeyboardInterrupt)) else "failed"
        summary.error = f"{type(exc).__name__}: {exc}"
        log.error("run %s: %s\n%s", summary.status, summary.error, traceback.format_exc(limit=8))
        raise
    finally:
        summary.wall_time_s = time.perf_counter() - t0
        writer.summary(summary)
        writer.close()
    return summary


def _run_json(cfg: Config, trainer: Trainer) -> dict:
    prov = provenance(
        backend=trainer.backend.describe(),
        hardware=cfg.hardware.name,
        seed=cfg.seed,
        data=trainer.data.describe(),
        device=trainer.device,
    )
    prov.update(
        params=trainer.params,
        flops_per_token=trainer.flops_per_token,
        tokens_per_step=trainer.tokens_per_step,
        grad_accumulation=trainer.accum,
    )
    return {
        "config": OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True),
        "provenance": prov,
        "wandb": None,
    }


def _sweep_group(run_dir: Path) -> str | None:
    """Multirun jobs share their sweep directory's name as W&B group."""
    try:
        from hydra.core.hydra_config import HydraConfig

        hc = HydraConfig.get()
        if hc.mode and hc.mode.name == "MULTIRUN":
            return Path(hc.sweep.dir).name
    except ValueError:
        pass
    return None


def _on_sigterm(signum, frame):
    raise Preempted(f"signal {signum}")


def _concise_warnings() -> None:
    default = warnings.formatwarning
    warnings.formatwarning = lambda msg, cat, *a, **k: (
        f"warning: {msg}\n" if issubclass(cat, ConfigWarning) else default(msg, cat, *a, **k)
    )


register()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(dcfg: DictConfig) -> float | None:
    from hydra.core.hydra_config import HydraConfig

    _concise_warnings()
    signal.signal(signal.SIGTERM, _on_sigterm)
    cfg: Config = OmegaConf.to_object(dcfg)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        summary = run(cfg, run_dir)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    loss = summary.final_eval_loss if summary.final_eval_loss is not None else summary.final_train_loss
    return loss if loss is not None and math.isfinite(loss) else None


if __name__ == "__main__":
    main()
