"""Counterfactual telemetry: a telemetry step's GEMM operands, quantized as other recipes would.

On a telemetry step each block linear hands its high-precision operands here (the backend's hooks:
harness.backends.emulated, harness.backends.te_telemetry): the input and bf16(W) in forward, the
output gradient in backward. Each candidate (`telemetry.candidates`: a recipe family with fields)
quantizes them with lowp's emulator, exactly as its own run would, and gives one row per operand
(tensor_row's columns plus the spread of its block scales) and one per GEMM (the relative error of
the GEMM's output against the high-precision GEMM on the same operands):

    fprop  y  = x  W^T : x rowwise  x W rowwise
    dgrad  dx = dy W   : dy rowwise x W columnwise
    wgrad  dW = dy^T x : dy columnwise x x columnwise

A routed expert group (`blocks.3.mlp.experts.fc1`: TE's GroupedLinear, harness.model.moe) hands its
experts' operands together (`forward_experts`, `backward_experts`): each expert's rows and weight are
quantized on their own, with their own scale (as GroupedLinear quantizes each GEMM's operands), and
the group gets one row per role and GEMM under the group's name, over all its experts' elements: the
group is one module to a plan (a stability override takes a whole group, and Megatron's per-module
file matches `...mlp.experts.linear_fc1`, never one expert). An expert without rows casts no input
and no gradient (TE's loop quantizes its weight only). The rows are those the group's GEMMs see: under
an FP8/FP4 run the zero rows each expert is padded with count in saturation's denominator (as in the
run's own expert rows) and nowhere else; under a BF16 run nothing is padded, and the zero rows a
candidate's own run would add change no block amax, so the real rows' codes are the same.

Nothing here writes to the training step: the operands are read under no_grad, the candidates'
stochastic rounding draws from a generator of their own, and no quantizer state is shared with the
run's. A candidate that quantizes only weights (int4_qat) leaves the other operands in bf16.

Delayed scaling is no candidate: its scale comes from an amax history that only a run trained
under it has (TE's debug tools make the same choice); `tensorwise` is its counterfactual.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from harness import recipes
from harness.config.schema import RecipeConfig
from harness.numerics import telemetry as T
from harness.numerics.quantizers import make_quantizer
from harness.numerics.telemetry import CANDIDATE, REL_ERR, SCALE_SPREAD

FIELDS = frozenset(f.name for f in dataclasses.fields(RecipeConfig)) - {"name"}

BF16 = torch.bfloat16


@dataclass(frozen=True)
class Candidate:
    label: str
    """The recipe's label (`nvfp4`, `blockwise + ...`): the rows' candidate column."""
    recipe: RecipeConfig
    roles: tuple[str, ...]
    """The operands it quantizes (int4_qat: the weight only)."""


def parse(entries: list[Any]) -> list[Candidate]:
    """`telemetry.candidates` -> candidates: each entry a recipe name or {name: ..., field: value};
    ValueError naming the option and the fix for an entry lowp cannot quantize with."""
    out = []
    for i, entry in enumerate(entries or []):
        where = f"telemetry.candidates[{i}]"
        fields = dict(entry) if isinstance(entry, Mapping) else {"name": entry}
        name = fields.pop("name", None)
        if name not in recipes.names():
            raise ValueError(f"{where}={entry!r}: give a recipe name or {{name: ..., fields}}; recipes: "
                             f"{', '.join(n for n in recipes.names() if recipes.get(n).scheme)}")  # fmt: skip
        spec = recipes.get(name)
        if spec.scheme is None:
            raise ValueError(
                f"{where}={name}: quantizes nothing; the high-precision GEMM is every row's reference"
            )
        if spec.delayed_scaling:
            raise ValueError(f"{where}={name}: its scale needs the amax history of a run trained under it; "
                             "use tensorwise (current scaling) as its counterfactual")  # fmt: skip
        unknown = sorted(set(fields) - FIELDS)
        if unknown:
            raise ValueError(
                f"{where}: unknown recipe field(s) {unknown}; use fields of conf/recipe/{name}.yaml"
            )
        recipe = dataclasses.replace(recipes.default_fields(name), **fields)
        roles = T.TENSORS if spec.quantizes_gemms else ("weight",)
        out.append(Candidate(recipes.label(recipe), recipe, roles))
    labels = [c.label for c in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"telemetry.candidates: {labels} names a candidate twice; list each once")
    return out


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Frobenius norm of the error relative to the reference's (0 where both are zero)."""
    num = float((y.double() - ref.double()).square().sum())
    den = float(ref.double().square().sum())
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return math.sqrt(num / den)


def _decoders(q) -> torch.Tensor | None:
    """The copy's block decode multipliers, or its one per-tensor scale_inv; None where it has neither."""
    src = getattr(q, "_source", None)
    for obj in (q, src) if src is not None else (q,):
        dec = getattr(obj, "dec", None)
        if dec is None and isinstance(getattr(obj, "_scale_inv", None), torch.Tensor):
            dec = obj._scale_inv
        if dec is not None:
            return dec.float().reshape(-1)
    return None


def scale_spread(q) -> float:
    """log2(max / min) over the copy's block decode multipliers that are positive (blocks of zeros
    carry no information); 0 for per-tensor scaling. An expert group's copy (`Joined`) spreads over
    all its experts' blocks, and per-tensor experts count as its blocks."""
    parts = q.parts if isinstance(q, Joined) else [q]
    found = [d for d in map(_decoders, parts) if d is not None]
    if not found:
        return 0.0
    d = torch.cat(found)
    d = d[torch.isfinite(d) & (d > 0)]
    return float(torch.log2(d.max() / d.min())) if d.numel() else 0.0


class Joined:
    """An expert group's operand: its experts' quantized copies as one tensor for `tensor_row` (the
    dequantized values end to end, the saturated codes summed, the scale of the expert whose source
    holds the group's amax, as a per-tensor row's scale is its amax's)."""

    def __init__(self, parts: list, sources: list[torch.Tensor]):
        self.parts = parts
        if all(getattr(p, "saturated_count", None) is not None for p in parts):
            self.saturated_count = lambda: sum(p.saturated_count() for p in parts)
        if all(getattr(p, "telemetry_scale", None) is not None for p in parts):
            top = max(range(len(parts)), key=lambda i: float(sources[i].abs().max()))
            self.telemetry_scale = parts[top].telemetry_scale

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize().reshape(-1) for p in self.parts])


class CounterfactualWarning(UserWarning):
    """A GEMM gave no counterfactual rows (the training step itself ran unchanged)."""


def guarded(fn):
    """A telemetry hook (here and in harness.backends.te_telemetry) never breaks the step it observes:
    its error is kept in `self.errors` and reported once when the telemetry block ends."""

    @functools.wraps(fn)
    def run(self, *a, **kw):
        try:
            return fn(self, *a, **kw)
        except Exception as e:  # noqa: BLE001 - telemetry must never break the step it observes
            self.errors.append(f"{type(e).__name__}: {e}")
            return None

    return run


class Counterfactual:
    """Rows of every candidate for the operands handed to `forward`/`backward` inside `collect()`."""

    def __init__(self, candidates: list[Candidate], seed: int = 0):
        self.candidates = candidates
        self.seed = seed
        self.rows: list[dict] | None = None
        self._saved: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._quantizers: dict[tuple[str, str], Any] = {}
        self.errors: list[str] = []

    @property
    def enabled(self) -> bool:
        return bool(self.candidates)

    @contextlib.contextmanager
    def collect(self, rows: list[dict]):
        """Append rows to `rows` for the block's forward and backward; keep nothing afterwards."""
        self.rows, self._saved, self.errors = rows, {}, []
        try:
            yield rows
        finally:
            self.rows, self._saved = None, {}
        if self.errors:
            warnings.warn(f"counterfactual telemetry: {len(self.errors)} GEMM(s) gave no rows, first: "
                          f"{self.errors[0]}", CounterfactualWarning, stacklevel=3)  # fmt: skip

    def _quantizer(self, c: Candidate, role: str, device: torch.device):
        key = (c.label, role, str(device))
        if key not in self._quantizers:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed + 7919)  # the candidates' own stream: the run's stays untouched
            self._quantizers[key] = make_quantizer(c.recipe, role, scale=torch.ones(()), generator=gen)
        return self._quantizers[key]

    def _copy(self, c: Candidate, role: str, x: torch.Tensor, columnwise: bool):
        """(dequantized fp32 copy in x's orientation, the quantized copy or None where c keeps x)."""
        if role not in c.roles:
            return x.float(), None
        q = self._quantizer(c, role, x.device)
        if hasattr(q, "fused"):
            q.fused = False
        qt = q.quantize(x, columnwise)
        return qt.dequantize().reshape(x.shape).float(), qt

    def _copies(self, c: Candidate, role: str, xs: list[torch.Tensor], columnwise: bool):
        """Each part of an operand quantized on its own (an expert's rows, its weight): (the fp32
        copies, the operand's quantized copy for its row, or None where c keeps it). Parts without
        elements are not cast (their copy is the empty part itself)."""
        out = [self._copy(c, role, x, columnwise) if x.numel() else (x.float(), None) for x in xs]
        qts = [qt for _, qt in out if qt is not None]
        if not qts:
            return [d for d, _ in out], None
        joined = qts[0] if len(xs) == 1 else Joined(qts, [x for x in xs if x.numel()])
        return [d for d, _ in out], joined

    def _operand_row(self, layer: str, role: str, c: Candidate, xs: list[torch.Tensor], qt) -> None:
        x = xs[0] if len(xs) == 1 else torch.cat([x.reshape(-1) for x in xs if x.numel()])
        row = T.tensor_row(layer, role, x, qt)
        row[CANDIDATE], row[SCALE_SPREAD] = c.label, scale_spread(qt)
        self.rows.append(row)

    def _gemm_row(self, layer: str, gemm: str, c: Candidate, ys: list, refs: list) -> None:
        y, ref = (ys[0], refs[0]) if len(ys) == 1 else (_flat(ys), _flat(refs))
        self.rows.append({T.LAYER: layer, T.TENSOR: gemm, CANDIDATE: c.label, REL_ERR: rel_err(y, ref)})

    def forward(self, layer: str, x: torch.Tensor, weight: torch.Tensor) -> None:
        """x (M, K) the GEMM's high-precision input, weight (N, K): input and weight rows, fprop."""
        self.forward_experts(layer, [x], [weight])

    def backward(self, layer: str, dy: torch.Tensor) -> None:
        """dy (M, N) the output gradient of the last `forward` of `layer`: grad rows, dgrad, wgrad."""
        self.backward_experts(layer, [dy])

    @guarded
    @torch.no_grad()
    def forward_experts(self, layer: str, xs: list[torch.Tensor], weights: list[torch.Tensor]) -> None:
        """An expert group's forward: expert e's rows xs[e] (m_e, K) and weight weights[e] (N, K),
        each quantized on its own; one input, weight and fprop row for the group."""
        if self.rows is None or not self.candidates:
            return
        xs = [x.detach() for x in xs]
        ws = [w.detach().to(BF16) for w in weights]
        refs = [x.float() @ w.float().t() for x, w in zip(xs, ws)]  # (m_e, N) each
        for c in self.candidates:
            xq, xt = self._copies(c, "input", xs, False)
            wq, wt = self._copies(c, "weight", ws, False)
            for role, src, qt in (("input", xs, xt), ("weight", ws, wt)):
                if qt is not None:
                    self._operand_row(layer, role, c, src, qt)
            self._gemm_row(layer, "fprop", c, [a @ b.t() for a, b in zip(xq, wq)], refs)
        self._saved.setdefault(layer, []).append((xs, ws))

    @guarded
    @torch.no_grad()
    def backward_experts(self, layer: str, dys: list[torch.Tensor]) -> None:
        """The output gradients dys[e] (m_e, N) of the last `forward_experts` of `layer`: one grad,
        dgrad and wgrad row for the group."""
        if self.rows is None or not self._saved.get(layer):
            return
        xs, ws = self._saved[layer].pop()
        dys = [dy.detach() for dy in dys]
        dx_refs = [dy.float() @ w.float() for dy, w in zip(dys, ws)]  # (m_e, K)
        dw_refs = [dy.float().t() @ x.float() for dy, x in zip(dys, xs)]  # (N, K)
        for c in self.candidates:
            dyr, dyt = self._copies(c, "grad", dys, False)
            if dyt is not None:
                self._operand_row(layer, "grad", c, dys, dyt)
            wc, _ = self._copies(c, "weight", ws, True)
            self._gemm_row(layer, "dgrad", c, [a @ b for a, b in zip(dyr, wc)], dx_refs)
            dyc, _ = self._copies(c, "grad", dys, True)
            xc, _ = self._copies(c, "input", xs, True)
            self._gemm_row(layer, "wgrad", c, [a.t() @ b for a, b in zip(dyc, xc)], dw_refs)


def _flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])
