"""Metric keys (defined once, used by name everywhere) and the processor that decides when to sync.

The train step hands over device tensors; nothing here calls `.item()` except on log steps, so the
measurement does not slow what it measures. Step times come from CUDA events on a GPU (read back
only on log steps) and from perf_counter on a CPU.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

LOSS_TRAIN = "loss/train"
LOSS_EVAL = "loss/eval"
LR = "optim/lr"
GRAD_NORM = "optim/grad_norm"
STEP_MS = "time/step_ms"
TOKENS_PER_S = "throughput/tokens_per_s"
TOKENS_PER_S_PER_GPU = "throughput/tokens_per_s_per_gpu"
TFLOPS = "throughput/tflops"
MFU = "throughput/mfu"
PEAK_MEM_GIB = "memory/peak_allocated_gib"
MOE = "moe"  # MoE router losses, moe/<Megatron's name>: logged beside loss/train, never inside it
MOE_LOAD_BALANCING_LOSS = "moe/load_balancing_loss"
MOE_SEQ_LOAD_BALANCING_LOSS = "moe/seq_load_balancing_loss"
MOE_Z_LOSS = "moe/z_loss"
MOE_TOKENS_PER_EXPERT_MAX_MEAN = "moe/tokens_per_expert_max_mean"  # ratio, 1 when balanced
MOE_EXPERTS_WITHOUT_TOKENS = "moe/experts_without_tokens"  # fraction of the experts
MOE_ROUTER_ENTROPY = "moe/router_entropy"  # nats per token, at most ln(experts)
MOE_DROPPED_TOKENS = "moe/dropped_tokens"  # fraction of the routed token slots (a capacity factor only)
"""The MoE keys above are the mean over the MoE layers; each layer's is `moe_layer_key(key, i)`."""
SCHEDULE_PHASE = "schedule/phase"  # a precision schedule's phase index (0 = the recipe group)
NUMERICS = "numerics"  # telemetry keys: numerics/<layer>/<tensor>/<stat>
LOSS_EVAL_AT_T = "loss/eval_at_t"  # masked diffusion, eval rows: loss/eval_at_t/<t>, nats at mask ratio t
STEP = "step"
TOKENS = "tokens"

ALL_KEYS = (
    LOSS_TRAIN,
    LOSS_EVAL,
    LR,
    GRAD_NORM,
    STEP_MS,
    TOKENS_PER_S,
    TOKENS_PER_S_PER_GPU,
    TFLOPS,
    MFU,
    PEAK_MEM_GIB,
    MOE_LOAD_BALANCING_LOSS,
    MOE_SEQ_LOAD_BALANCING_LOSS,
    MOE_Z_LOSS,
    MOE_TOKENS_PER_EXPERT_MAX_MEAN,
    MOE_EXPERTS_WITHOUT_TOKENS,
    MOE_ROUTER_ENTROPY,
    MOE_DROPPED_TOKENS,
    SCHEDULE_PHASE,
)


def moe_layer_key(key: str, layer: int) -> str:
    """An MoE key of one layer, by the block's index: Megatron's `moe/<name>_layer_<i>`."""
    return f"{key}_layer_{layer}"


class StepTimer:
    """Wall time of each step without host syncs in the timed region (events on CUDA)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[int, object, object]] = []
        self.times_ms: dict[int, float] = {}
        self.cold: set[int] = set()  # steps that began right after a host sync (an empty GPU queue)
        self._start = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self, step: int) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((step, self._start, end))
        else:
            self.times_ms[step] = (time.perf_counter() - self._start) * 1e3

    def collect(self) -> None:
        """Read back finished CUDA events (call on log steps only: it synchronizes)."""
        if self.pending:
            self.pending[-1][2].synchronize()
            for step, s, e in self.pending:
                self.times_ms[step] = s.elapsed_time(e)
            self.pending.clear()

    def median_ms(self, after_step: int) -> float | None:
        """Median of the steps from `after_step` on, leaving out those that began right after a
        host sync (logging, eval, checkpoint): they start with an empty GPU queue, so the CPU's
        launch latency shows in them. They count only if no other step is left."""
        self.collect()
        steady = {s: t for s, t in self.times_ms.items() if s >= after_step}
        warm = [t for s, t in steady.items() if s not in self.cold]
        timed = warm or list(steady.values())
        return statistics.median(timed) if timed else None

    def state_dict(self) -> dict:
        """Step times so far: a resumed run's median spans all its attempts."""
        self.collect()
        return {"times_ms": dict(self.times_ms), "cold": sorted(self.cold)}

    def load_state_dict(self, state: dict) -> None:
        self.times_ms = {int(k): v for k, v in state["times_ms"].items()}
        self.cold = set(state["cold"])


class MetricsProcessor:
    """Accumulates per-step tensors on device; emits one row per log step."""

    def __init__(
        self,
        *,
        device: torch.device,
        tokens_per_step: int,
        flops_per_token: float,
        peak_tflops: float | None,
        log_interval: int,
        dist=None,
    ):
        """`dist` (harness.parallel.process.Dist): the loss is already the ranks' mean; tokens are the
        global batch's; throughput is the job's total and per GPU (tokens/s over the ranks), MFU
        per GPU; peak memory the maximum over the ranks."""
        from harness.parallel.process import SINGLE

        self.dist = dist or SINGLE
        self.device = device
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token
        self.peak_tflops = peak_tflops
        self.log_interval = max(1, log_interval)
        self.timer = StepTimer(device)
        self._losses: list[torch.Tensor] = []
        self._moe: dict[str, list[torch.Tensor]] = {}  # router losses per step, by Megatron's name
        self._last: dict = {}
        self.first_loss: float | None = None

    def state_dict(self) -> dict:
        """What the next logged row depends on: the losses (and MoE router losses) since the last row,
        the last step's lr and gradient norm, the first logged loss, and the step times."""
        norm = self._last.get("grad_norm")
        return {
            "losses": torch.stack(self._losses).cpu() if self._losses else None,
            "moe": {name: torch.stack(values).cpu() for name, values in self._moe.items()},
            "last": {**self._last, "grad_norm": None if norm is None else norm.cpu()},
            "first_loss": self.first_loss,
            "timer": self.timer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        losses = state["losses"]
        self._losses = [] if losses is None else list(losses.to(self.device).unbind())
        moe = state.get("moe", {})  # absent from checkpoints of dense-only lowp
        self._moe = {name: list(values.to(self.device).unbind()) for name, values in moe.items()}
        norm = state["last"].get("grad_norm")
        self._last = {**state["last"], "grad_norm": None if norm is None else norm.to(self.device)}
        self.first_loss = state["first_loss"]
        self.timer.load_state_dict(state["timer"])

    def should_log(self, step: int, last_step: int) -> bool:
        return (step + 1) % self.log_interval == 0 or step == last_step or step == 0

    def record(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor | None,
        lr: float,
        moe: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """`moe`: the step's MoE values by Megatron's name (harness.model.moe.Routing.logged)."""
        self._losses.append(loss.detach())
        for name, value in (moe or {}).items():
            self._moe.setdefault(name, []).append(value.detach())
        self._last = {"step": step, "grad_norm": None if grad_norm is None else grad_norm.detach(), "lr": lr}

    def row(self, step: int) -> dict:
        """Sync and build the logged row for `step` (mean train loss since the last row)."""
        self.timer.collect()
        loss = torch.stack(self._losses).float().mean().item() if self._losses else math.nan
        self._losses.clear()
        if self.first_loss is None:
            self.first_loss = loss
        ms = self.timer.times_ms.get(step)
        norm = self._last.get("grad_norm")
        row = {
            STEP: step + 1,
            TOKENS: (step + 1) * self.tokens_per_step,
            LOSS_TRAIN: loss,
            LR: self._last.get("lr"),
            GRAD_NORM: float(norm.item()) if norm is not None else None,
            STEP_MS: ms,
        }
        if self._moe:  # their mean since the last row, as loss/train's; one host sync for all
            means = torch.stack([torch.stack(values).float().mean() for values in self._moe.values()])
            row.update({f"{MOE}/{name}": v for name, v in zip(self._moe, means.tolist())})
        self._moe.clear()
        if ms:
            tps = self.tokens_per_step / (ms / 1e3)
            tflops = tps * self.flops_per_token / 1e12 / self.dist.world  # per GPU, as the peak is
            row[TOKENS_PER_S] = tps
            row[TOKENS_PER_S_PER_GPU] = tps / self.dist.world
            row[TFLOPS] = tflops
            row[MFU] = tflops / self.peak_tflops if self.peak_tflops else None
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30
            row[PEAK_MEM_GIB] = self.dist.max_scalar(peak, self.device)
        return row


def step_line(row: dict, steps: int, eta_s: float, rss_gib: float | None = None) -> str:
    """The log line of a logged row: loss, gradient norm, lr, tokens/s, MFU where a peak is known,
    memory (the device's peak allocated; on a CPU the process's peak resident set, `rss_gib`), ETA."""
    parts = [f"step {row[STEP]}/{steps}", f"loss {row[LOSS_TRAIN]:.4f}"]
    if row.get(GRAD_NORM) is not None:
        parts.append(f"grad {row[GRAD_NORM]:.3g}")
    parts.append(f"lr {row[LR]:.2e}")
    tps = row.get(TOKENS_PER_S)
    parts.append(f"{tps:,.0f} tok/s" if tps else "- tok/s")
    if row.get(MFU) is not None:
        parts.append(f"MFU {row[MFU]:.1%}")
    if row.get(PEAK_MEM_GIB) is not None:
        parts.append(f"mem {row[PEAK_MEM_GIB]:.2f} GiB")
    elif rss_gib is not None:
        parts.append(f"rss {rss_gib:.2f} GiB")
    parts.append(f"ETA {int(eta_s) // 60}m{int(eta_s) % 60:02d}s")
    return "  ".join(parts)


def summary_mfu(
    tflops: float, *, bf16_peak: float | None, recipe_peak: float | None, emulated: bool
) -> tuple[float | None, float | None]:
    """(MFU against the BF16 peak, MFU against the recipe's own peak) for summary.json; none where a
    peak is unknown, and none for an emulated quantized recipe (its speed is not the recipe's)."""
    if emulated:
        return None, None
    return (tflops / bf16_peak if bf16_peak else None, tflops / recipe_peak if recipe_peak else None)
