"""Numerics telemetry: how a quantized tensor compares with its high-precision source.

Rows are computed only inside `collect()` (the backend's `collect_telemetry()`); outside it the
quantizers never call into this module, so telemetry costs nothing when off.

An MoE layer's experts each quantize their own operands (`blocks.3.mlp.experts.fc1.5`): with 128
experts that is hundreds of rows per layer and step, so `expert_rows` keeps the N worst experts of
each layer whole and sums up the others as their max and median (`telemetry.moe_experts_per_layer`).
"""

from __future__ import annotations

import contextlib
import math
import re
import statistics

import torch

# the columns of a telemetry row (numerics.jsonl; analysis/keys.py repeats them, test_contract checks)
LAYER, TENSOR = "layer", "tensor"
TENSORS = ("input", "weight", "grad")
AMAX, SCALE, UNDERFLOW, SATURATION, SQNR_DB = "amax", "scale", "underflow", "saturation", "sqnr_db"
STATS = (AMAX, SCALE, UNDERFLOW, SATURATION, SQNR_DB)
# counterfactual rows (harness.numerics.counterfactual): the same columns plus these
CANDIDATE = "candidate"
"""The candidate recipe's label (recipes.label) a counterfactual row quantized with."""
SCALE_SPREAD = "scale_spread_log2"
"""log2(largest / smallest block scale) of an operand's copy; 0 for one scale per tensor."""
REL_ERR = "rel_err"
"""A GEMM row's ||GEMM(candidate operands) - GEMM(high precision)|| / ||GEMM(high precision)||."""
GEMMS = ("fprop", "dgrad", "wgrad")
"""The `tensor` of a counterfactual GEMM row."""
EXPERT = re.compile(r"^(?P<group>.+\.experts)\.(?P<fc>fc[12])\.(?P<expert>\d+)$")
"""An expert's GEMM in a row's layer name: `blocks.3.mlp.experts.fc1.5` (group, fc1, expert 5)."""
OTHERS = ("max", "median")
"""The rows of the experts beyond the N worst, per fc and tensor: `blocks.3.mlp.experts.fc1.max`."""


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (torchao's compute_error); inf when exact."""
    x64, y64 = x.double(), y.double()
    signal = float(x64.square().sum())
    noise = float((x64 - y64).square().sum())
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def tensor_row(layer: str, tensor: str, x: torch.Tensor, q) -> dict:
    """One row: amax, scale, underflow (non-zeros flushed to zero), saturation (codes at +-max), SQNR."""
    x = x.float().reshape(-1)
    deq = q.dequantize().reshape(-1)
    nonzero = x != 0
    n_nonzero = int(nonzero.sum())
    flushed = int((nonzero & (deq == 0)).sum())
    sat = getattr(q, "saturated_count", None)
    scale = getattr(q, "telemetry_scale", None)
    return {
        LAYER: layer,
        TENSOR: tensor,
        AMAX: float(x.abs().max()) if x.numel() else 0.0,
        SCALE: float(scale()) if scale is not None else None,
        UNDERFLOW: flushed / n_nonzero if n_nonzero else 0.0,
        SATURATION: float(sat()) / x.numel() if sat is not None and x.numel() else None,
        SQNR_DB: sqnr_db(x, deq),
    }


def trained(rows: list[dict]) -> list[dict]:
    """The rows of the operands the run itself quantized (no counterfactual candidate's)."""
    return [r for r in rows if CANDIDATE not in r]


class TelemetrySink:
    """Where rows go while collecting; `rows is None` means off."""

    def __init__(self):
        self.rows: list[dict] | None = None

    @property
    def active(self) -> bool:
        return self.rows is not None

    def add(self, layer: str, tensor: str, x: torch.Tensor, q) -> None:
        if self.rows is not None:
            with torch.no_grad():
                self.rows.append(tensor_row(layer, tensor, x, q))

    @contextlib.contextmanager
    def collect(self):
        """`with sink.collect() as rows:` fills `rows` with one dict per quantized operand."""
        rows: list[dict] = []
        previous, self.rows = self.rows, rows
        try:
            yield rows
        finally:
            self.rows = previous


def expert_score(rows: list[dict]) -> float:
    """How good an expert's numerics are at one step: the lowest SQNR (dB) of its rows (fc1 and fc2;
    input, weight, grad); +inf where every operand is exact or none has an SQNR."""
    values = [r[SQNR_DB] for r in rows if isinstance(r.get(SQNR_DB), (int, float))]
    return min((v for v in values if not math.isnan(v)), default=math.inf)


def expert_rows(rows: list[dict], worst: int) -> list[dict]:
    """`rows` with each MoE layer's expert rows reduced: the rows of its `worst` experts (lowest
    `expert_score`; ties: the lower index) as they are, and for the other experts one row per fc,
    tensor and `OTHERS` entry holding that statistic over them (layer `<group>.<fc>.max`). Rows of
    other layers keep their place; a layer's reduced rows take the place of its first expert row."""
    groups: dict[str, list[dict]] = {}
    out: list[dict | str] = []
    for r in rows:
        m = EXPERT.match(r[LAYER])
        if m is None:
            out.append(r)
            continue
        if m["group"] not in groups:
            groups[m["group"]] = []
            out.append(m["group"])  # the layer's place
        groups[m["group"]].append(r)
    reduced = {group: _reduce(group_rows, worst) for group, group_rows in groups.items()}
    return [x for item in out for x in (reduced[item] if isinstance(item, str) else [item])]


def _reduce(rows: list[dict], worst: int) -> list[dict]:
    by_expert: dict[int, list[dict]] = {}
    for r in rows:
        by_expert.setdefault(int(EXPERT.match(r[LAYER])["expert"]), []).append(r)
    ranked = sorted(by_expert, key=lambda e: (expert_score(by_expert[e]), e))
    keep = set(ranked[: max(worst, 0)])
    kept = [r for r in rows if int(EXPERT.match(r[LAYER])["expert"]) in keep]
    others: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        m = EXPERT.match(r[LAYER])
        if int(m["expert"]) not in keep:
            others.setdefault((f"{m['group']}.{m['fc']}", r[TENSOR]), []).append(r)
    summed = [
        {LAYER: f"{layer}.{how}", TENSOR: tensor, **{s: _over(group, s, how) for s in STATS}}
        for (layer, tensor), group in others.items()
        for how in OTHERS
    ]
    return kept + summed


def _over(rows: list[dict], stat: str, how: str) -> float | None:
    values = [r[stat] for r in rows if isinstance(r.get(stat), (int, float))]
    if not values:
        return None
    return max(values) if how == "max" else float(statistics.median(values))
