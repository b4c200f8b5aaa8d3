"""The training loop of one run: `Trainer` owns the run's objects (data, backend, model, optimizer,
parallel strategy, metrics), steps them and writes their rows; `fit()` returns the summary.

Built from a loaded config (`harness.validation.load`); `harness.training.job.run` wraps it in a
run directory, and benchmarks time its `train_step` alone.
"""

from __future__ import annotations

import gc
import logging
import math
import random
import signal
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path

import torch

from harness import recipes
from harness.backends import BackendSpec, build_backend
from harness.backends.capability import resolve_backend_name, te_blocker
from harness.backends.hardware import device_for
from harness.config.schema import BackendConfig, Config, ModelConfig, RecipeConfig, eval_budget
from harness.data import build_data
from harness.interop.hf_tokenizer import run_offers
from harness.lifecycle import artifacts as A
from harness.lifecycle import checkpoint as ckpt
from harness.lifecycle import metrics as M
from harness.lifecycle.artifacts import NullWriter, RunWriter, Summary, restore_rng, rng_state
from harness.lifecycle.divergence import DivergenceMonitor
from harness.lifecycle.loggers import NullLogger
from harness.lifecycle.memory import SavedTensors, breakdown
from harness.lifecycle.signals import StopRequest
from harness.model import schedule as S
from harness.model.gpt import count_params, flops_per_token
from harness.model.moe import Routing
from harness.model.objective import build_objective, per_t_row, set_causal
from harness.numerics import telemetry as T
from harness.optim import clip_grad, lr_at, set_lr
from harness.parallel import process as D
from harness.parallel.strategies import parallelize
from harness.validation.legality import uses_te

log = logging.getLogger("lowp")


def checkpoint_interval(cfg: Config) -> int:
    """Steps between checkpoints: null protects a real run with one every 10% of its steps, and
    never more often than every 10 steps (a 3-step run checkpoints once, at its end)."""
    if cfg.checkpoint_interval is None:
        return max(10, math.ceil(cfg.steps / 10))
    return cfg.checkpoint_interval


def rss_gib() -> float:
    """This process's peak resident set (Linux reports KiB, macOS bytes): a CPU run's memory."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**30 if sys.platform == "darwin" else peak / 2**20


def variant(cfg: Config) -> str:
    """The run's stability and optimizer presets (and its schedule's, when it has one), and the expert
    kernels where they are not TE's GroupedLinear (backend.moe_experts changes the GEMMs' accumulation
    order): with the recipe label and backend, what tells a sweep's arms apart."""
    base = f"{cfg.stability.name}+{cfg.optimizer.name}"
    if cfg.schedule.phases:
        base = f"{base}+{cfg.schedule.name}"
    kernels = expert_kernels_of(cfg)
    return f"{base}+{kernels}_experts" if kernels != BackendConfig.moe_experts else base


def expert_kernels_of(cfg: Config) -> str:
    """grouped where some expert group of the run computes in BF16 on lowp's grouped kernels
    (backend.moe_experts, `auto` decided for the model on this machine), else te: also for a dense
    model, on the emulated backend, and where every expert group quantizes (TE's GroupedLinear)."""
    if cfg.model.num_moe_experts is None or not uses_te(cfg):
        return "te"
    from harness.backends.te_moe import group_kernels
    from harness.model.plan import PrecisionPlan

    chosen = group_kernels(cfg.backend.moe_experts, PrecisionPlan(cfg.recipe, cfg.stability, cfg.model))
    return "grouped" if "grouped" in chosen.values() else "te"


def seed_everything(seed: int) -> None:
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def backend_name(cfg: Config) -> str:
    """te or emulated: backend=auto resolved with te_blocker's answer for the run's recipe options."""
    blocked = te_blocker(cfg.recipe, cfg.stability, cfg.model)
    return resolve_backend_name(cfg.backend.name, cfg.recipe.name, blocked)


def backend_spec(cfg: Config) -> BackendSpec:
    """The slices of `cfg` a backend is built from (backend=auto resolved here)."""
    return BackendSpec(
        name=backend_name(cfg),
        recipe=cfg.recipe,
        stability=cfg.stability,
        model=cfg.model,
        optimizer=cfg.optimizer,
        seed=cfg.seed,
        options=cfg.backend,
        telemetry=cfg.telemetry,
    )


def _data(cfg: Config):
    """The run's token source; one that does not fit in memory is a ValueError naming its size."""
    try:
        return build_data(cfg.data, vocab_size=cfg.model.vocab_size, seq_length=cfg.model.seq_length)
    except MemoryError as exc:
        raise ValueError(
            f"data.num_tokens={cfg.data.num_tokens}: data={cfg.data.name} does not fit in this machine's "
            f"memory ({exc}); lower data.num_tokens"
        ) from exc


def init_weights(model: torch.nn.Module, path: str, model_cfg: ModelConfig) -> dict:
    """init_from: the model's weights from a Hugging Face checkpoint, before the optimizer copies
    them into its masters."""
    from harness.interop.hf_weights import init_from_hf

    return init_from_hf(model, path, model_cfg)


def _host_copy(tree: dict) -> dict:
    """`tree` with every tensor copied to the host, as a checkpoint stores it (TE's quantized
    weights by value): what a schedule's switch carries into the next phase's model."""
    tensors, skeleton = ckpt.split(tree)
    return ckpt.join(skeleton, {k: v.to("cpu", copy=True) for k, v in tensors.items()})


class Trainer:
    """Owns one run's objects; `fit()` runs the loop and returns the summary.

    `cfg` is a loaded config (`harness.validation.load`); `writer` receives the run directory's rows and
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
        self.experts_saved_bytes: int | None = None  # of those, inside an MoE model's routed experts
        self.checkpoint_interval = checkpoint_interval(cfg)
        self.divergence = DivergenceMonitor(cfg.divergence)
        self.writer = writer if writer is not None else NullWriter()
        self.logger = logger if logger is not None else NullLogger()
        self.device = device_for(cfg.hardware)
        if self.device.type == "cuda" and self.dist.active:
            # ranks beyond the GPU count share them (gloo tests on one GPU); NCCL needs one GPU each
            self.device = torch.device("cuda", self.dist.launch.local_rank % torch.cuda.device_count())
        seed_everything(cfg.seed)  # the same seed on every rank: the same initial weights
        self.data = _data(cfg)
        self.phase_recipes = S.phase_recipes(cfg.recipe, cfg.schedule)  # [the recipe group, phases...]
        self.phase_starts = S.starts(cfg.schedule, cfg.steps)
        self.phase = 0
        self.init = None
        # one objective for every phase: variable lengths a multiple of each phase recipe's GEMM multiple
        multiple = math.lcm(*(recipes.get(r.name).gemm_multiple for r in self.phase_recipes))
        offers = run_offers(cfg.objective, cfg.model.hf_config, cfg.init_from)  # an HF tokenizer's mask token
        self.objective = build_objective(
            cfg.objective, cfg.model, self.data, multiple, cfg.seed, self.dist.rank, offers
        )
        self._build(0, init_from=cfg.init_from)
        self.accum = cfg.global_batch_size // (cfg.micro_batch_size * self.dist.world)
        self.tokens_per_step = cfg.global_batch_size * cfg.model.seq_length
        n = count_params(self.model)
        self.flops_per_token = flops_per_token(cfg.model, n["active_non_embedding"], self.objective.causal)
        self.params = n
        self.batches = self.data.train_batches(
            cfg.micro_batch_size, seed=cfg.seed, rank=self.dist.rank, world=self.dist.world
        )
        self.micro_batches_seen = 0
        self.eval_tokens = eval_budget(cfg)
        self.eval_set = self._eval_set()
        self.metrics = M.MetricsProcessor(
            device=self.device,
            tokens_per_step=self.tokens_per_step,
            flops_per_token=self.flops_per_token,
            peak_tflops=self._peak("bf16"),
            log_interval=cfg.log_interval,
            dist=self.dist,
        )

    def _build(self, phase: int, init_from: str | None = None) -> None:
        """The backend, model, parallel strategy and optimizer for phase `phase`'s recipe (0: the
        recipe group's); `init_from`: Hugging Face weights, before the optimizer copies them."""
        spec = replace(backend_spec(self.cfg), recipe=self.phase_recipes[phase])
        self.backend = build_backend(spec, self.device)
        self.backend.data_parallel_size = self.dist.world
        self.model = self.backend.build_model()
        set_causal(self.model, self.objective.causal)
        if init_from:
            self.init = init_weights(self.model, init_from, self.cfg.model)
        self.parallel = parallelize(self.model, self.backend, self.cfg.parallel, self.dist)
        self.optimizer = self.parallel.build_optimizer(self.model, self.cfg.optimizer)
        self.backend.prepare(self.model, self.optimizer)
        self.moe = Routing(self.model)  # MoE layers' router losses and expert biases (none: dense)
        self.phase = phase

    def _rebuild(self, phase: int) -> None:
        """Drop this phase's objects (their memory goes first), then build phase `phase`'s."""
        self.backend = self.model = self.parallel = self.optimizer = self.moe = None
        gc.collect()  # modules in reference cycles (hooks, probes) would keep their device memory
        self._build(phase)

    def enter_phase(self, phase: int) -> None:
        """A precision schedule's switch (docs/schedules.md), before the phase's first step: a new
        backend, model and optimizer for its recipe, built as a warm start builds them (so TE's
        modules get fresh quantizers, which TE 2.20.2 would not give the old modules when only a
        recipe's fields change within one class: transformer_engine/pytorch/module/base.py:1111-1135,
        and every quantized weight copy is made anew), then the weights,
        optimizer state and every RNG carried over, and the scale state only from one delayed-scaling
        recipe to another (S.carries_scale_state); the data position, LR schedule and metrics stay."""
        before, after = self.phase_recipes[self.phase], self.phase_recipes[phase]
        carried = _host_copy(
            {
                "model": self.backend.model_state_dict(self.model),
                "optimizer": ckpt.key_by_name(self.optimizer.state_dict(), self._param_names()),
                "backend": self.backend.state_dict(),
            }
        )
        rng = rng_state()
        self._rebuild(phase)
        self._load_weights(carried)
        self.backend.load_state_dict(carried["backend"], scales=S.carries_scale_state(before, after))
        restore_rng(rng)  # building the new model drew from the RNGs: the run's stream goes on
        log.info(
            "schedule: phase %d (%s) from step %d", phase, recipes.label(after), self.phase_starts[phase]
        )

    def _eval_set(self):
        """The held-out batches; a refusal of a capped budget names the eval_tokens the user set too."""
        try:
            return self.data.eval_batches(self.eval_tokens, self.cfg.micro_batch_size)
        except ValueError as exc:
            if self.eval_tokens == self.cfg.eval_tokens:
                raise
            raise ValueError(
                f"{exc} (eval_tokens={self.cfg.eval_tokens}, capped at the {self.eval_tokens} tokens "
                "this run trains on)"
            ) from exc

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
                    saved = SavedTensors(self.model.parameters(), inside=self.moe.experts)
                    counter = stack.enter_context(saved.counting())
                rows = (
                    stack.enter_context(self.backend.collect_telemetry())
                    if telemetry and micro == 0
                    else None
                )
                with self.backend.autocast():
                    loss = self.objective.loss(self.model, x, y) / scale
                    router_loss = self.moe.take_losses(self.accum)  # MoE: in the objective, not the loss
                (loss if router_loss is None else loss + router_loss / scale).backward()
            if self.saved_bytes is None:
                self.saved_bytes, self.experts_saved_bytes = counter.bytes, counter.inside
            if rows:
                self._log_telemetry(step, rows)
            total += loss.detach()
        self.backend.microbatch(None, self.accum)
        self.parallel.reduce_gradients(self.optimizer)  # DDP: one SUM over the ranks per step
        self.moe.finish_step(self.dist.sum_, self.dist.world)  # MoE: Megatron's finalize_model_grads
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
        rows = T.expert_rows(rows, self.cfg.telemetry.moe_experts_per_layer)  # MoE: N worst experts
        self.writer.numerics([{M.STEP: step + 1, **r} for r in rows])
        flat = {M.STEP: step + 1, M.TOKENS: (step + 1) * self.tokens_per_step}
        for r in T.trained(rows):  # candidates' rows: numerics.jsonl only
            for stat in T.STATS:
                flat[f"{M.NUMERICS}/{r[T.LAYER]}/{r[T.TENSOR]}/{stat}"] = r.get(stat)
        self.writer.metrics(flat)
        self.logger.log(flat)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """The objective's eval loss on the held-out set (masked diffusion: its bound over fixed masks)."""
        if not self.eval_set:
            return None
        self.last_eval = self.objective.evaluate(
            self.model, self.eval_set, self.backend.autocast, self.device
        )
        return self.last_eval["loss"]

    # -- checkpoints: each component's own state_dict, under one tree -----------------------------------
    def _param_names(self) -> list[str]:
        """Canonical names of the optimizer's parameters, in its order."""
        names = {id(p): self.backend.canonical_name(n) for n, p in self.model.named_parameters()}
        return [names[id(p)] for p in self.optimizer.params]

    def state_dict(self, steps_done: int, summary: Summary) -> dict:
        return {
            "step": steps_done,
            "schedule": {"phase": self.phase, "recipe": asdict(self.phase_recipes[self.phase])},
            "config": asdict(self.cfg),
            "model": self.backend.model_state_dict(self.model),
            "optimizer": ckpt.key_by_name(self.optimizer.state_dict(), self._param_names()),
            "backend": self.backend.state_dict(),
            "data": self.batches.state_dict(),
            "metrics": self.metrics.state_dict(),
            "divergence": self.divergence.state_dict(),
            "rng": rng_state(),
            "objective": self.objective.state_dict(),
            "summary": {
                "final_train_loss": summary.final_train_loss,
                "final_eval_loss": summary.final_eval_loss,
            },
        }

    def _load_weights(self, state: dict) -> None:
        self.backend.load_model_state_dict(self.model, self.parallel.localize_model(state["model"]))
        optim = ckpt.key_by_index(state["optimizer"], self._param_names())
        self.optimizer.load_state_dict(self.parallel.localize_optimizer(optim, self.optimizer.params))

    def load_state_dict(self, state: dict, summary: Summary, warm_from: RecipeConfig | None = None) -> None:
        """`state` holds whole tensors (a checkpoint of any world size): FSDP2 keeps its shards.
        The model is first rebuilt for the schedule's phase the checkpoint was saved in. `warm_from`:
        a warm start (cfg.warm_start) from a checkpoint of that recipe, whose scale state is left out
        unless it and this run's recipe are both delayed scaling (as a schedule's switch does)."""
        if warm_from is None:  # a resume: the phase it was saved in (a switch due at its step follows)
            phase = (state.get("schedule") or {}).get("phase", 0)
        else:  # a warm start goes on in the phase this run's schedule has at the checkpoint's step
            phase = S.phase_at(self.cfg.schedule, self.cfg.steps, state["step"])
        if phase != self.phase:
            self._rebuild(phase)
        self._load_weights(state)
        scales = warm_from is None or S.carries_scale_state(warm_from, self.phase_recipes[phase])
        self.backend.load_state_dict(state["backend"], scales=scales)
        self.batches.load_state_dict(state["data"])
        self.micro_batches_seen = self.batches.position
        self.metrics.load_state_dict(state["metrics"])
        self.divergence.load_state_dict(state["divergence"])
        self.objective.load_state_dict(state.get("objective") or {"micro_batches": self.micro_batches_seen})
        for key, value in state["summary"].items():
            setattr(summary, key, value)
        summary.steps, summary.tokens = state["step"], state["step"] * self.tokens_per_step
        restore_rng(state["rng"])  # last: loading (TE's priming forward) must not move the RNGs
        self.start_step = state["step"]

    def checkpoint(self, step: int, summary: Summary) -> None:
        t0 = time.perf_counter()
        path = ckpt.save(  # a full disk or a read-only directory: CheckpointError, cause and fix
            self.run_dir,
            step + 1,
            self.state_dict(step + 1, summary),
            self.cfg.checkpoint_keep,
            **({"dist": self.dist, "sharded": self.dist.fsdp} if self.dist.active else {}),
        )
        where = Path(path).relative_to(self.run_dir) if Path(path).is_relative_to(self.run_dir) else path
        log.info("checkpoint %s (%.2fs)", where, time.perf_counter() - t0)  # the run dir was said once

    def _due(self, interval: int, step: int) -> bool:
        return interval > 0 and (step + 1) % interval == 0 and step + 1 < self.cfg.steps

    def fit(self, summary: Summary) -> Summary:
        cfg, t0 = self.cfg, time.perf_counter()
        warm = min(cfg.bench_warmup_steps, max(cfg.steps - 1, 0))
        interval = self.checkpoint_interval
        for step in range(self.start_step, cfg.steps):
            if step == warm and self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)  # peak of the steady state only
            if (phase := S.phase_at(cfg.schedule, cfg.steps, step)) != self.phase:
                self.enter_phase(phase)
                self.metrics.timer.cold.add(step)  # the switch's rebuild is not a steady step
            self.metrics.timer.start()
            try:
                loss, grad_norm, lr = self.train_step(step)
            except FloatingPointError as exc:  # e.g. FP8 optimizer states poisoned by an all-zero moment
                return self._diverged(summary, step, str(exc))
            self.metrics.timer.stop(step)
            self.metrics.record(step, loss, grad_norm, lr, self.moe.logged)
            summary.steps, summary.tokens = step + 1, (step + 1) * self.tokens_per_step
            first = self.phase_starts[self.phase]
            if step in (first, cfg.steps - 1):  # TE: the recipe really ran; delayed scales really moved
                self.backend.verify_active(self.model, step - first)
            synced = saved = False
            if self.metrics.should_log(step, cfg.steps - 1):  # a logged row syncs
                row = self.metrics.row(step)
                if cfg.schedule.phases:
                    row[M.SCHEDULE_PHASE] = self.phase
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
                if not saved:  # also with checkpoint_interval=-1: a preempted run always resumes
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
        row.update(per_t_row(self.last_eval, M.LOSS_EVAL_AT_T))  # masked diffusion: each mask ratio's loss
        self.writer.metrics(row)
        self.logger.log(row)
        log.info("eval  step %d/%d  loss/eval %.4f", step + 1, self.cfg.steps, loss)

    def _emit(self, row: dict, t0: float) -> None:
        self.writer.metrics(row)
        self.logger.log(row)
        done = row[M.STEP]
        eta = (time.perf_counter() - t0) / done * (self.cfg.steps - done)
        log.info(
            M.step_line(row, self.cfg.steps, eta, rss_gib=None if self.device.type == "cuda" else rss_gib())
        )

    def finalize(self, summary: Summary) -> None:
        """Throughput (median of steady-state steps), MFU and memory into the summary."""
        cfg = self.cfg
        ms = self.metrics.timer.median_ms(after_step=min(cfg.bench_warmup_steps, max(summary.steps - 1, 0)))
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None
        if peak is not None:
            peak = int(self.dist.max_scalar(float(peak), self.device))  # the fullest rank
        summary.loss_floor = self.objective.loss_floor(self.data, self.eval_set, self.device)
        summary.memory = breakdown(
            self.model,
            self.optimizer,
            peak_bytes=peak,
            saved_bytes=self.saved_bytes,
            experts=self.moe.experts,
            experts_saved_bytes=self.experts_saved_bytes,
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
                emulated=self.backend.emulates and spec.quantizes_gemms,
            )
