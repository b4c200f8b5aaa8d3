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


def scale_spread(q) -> float:
    """log2(max / min) over the copy's block decode multipliers that are positive (blocks of zeros
    carry no information); 0 for per-tensor scaling."""
    dec = getattr(q, "dec", None)
    if dec is None:
        src = getattr(q, "_source", None)
        dec = getattr(src, "dec", None) if src is not None else None
    if dec is None:
        return 0.0
    d = dec.float().reshape(-1)
    d = d[torch.isfinite(d) & (d > 0)]
    return float(torch.log2(d.max() / d.min())) if d.numel() else 0.0


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

    def _operand_row(self, layer: str, role: str, c: Candidate, x: torch.Tensor, qt) -> None:
        row = T.tensor_row(layer, role, x, qt)
        row[CANDIDATE], row[SCALE_SPREAD] = c.label, scale_spread(qt)
        self.rows.append(row)

    def _gemm_row(self, layer: str, gemm: str, c: Candidate, y: torch.Tensor, ref: torch.Tensor) -> None:
        self.rows.append({T.LAYER: layer, T.TENSOR: gemm, CANDIDATE: c.label, REL_ERR: rel_err(y, ref)})

    @guarded
    @torch.no_grad()
    def forward(self, layer: str, x: torch.Tensor, weight: torch.Tensor) -> None:
        """x (M, K) the GEMM's high-precision input, weight (N, K): input and weight rows, fprop."""
        if self.rows is None or not self.candidates:
            return
        x, w = x.detach(), weight.detach().to(BF16)
        ref = x.float() @ w.float().t()  # (M, N)
        for c in self.candidates:
            xq, xt = self._copy(c, "input", x, False)
            wq, wt = self._copy(c, "weight", w, False)
            for role, src, qt in (("input", x, xt), ("weight", w, wt)):
                if qt is not None:
                    self._operand_row(layer, role, c, src, qt)
            self._gemm_row(layer, "fprop", c, xq @ wq.t(), ref)
        self._saved.setdefault(layer, []).append((x, w))

    @guarded
    @torch.no_grad()
    def backward(self, layer: str, dy: torch.Tensor) -> None:
        """dy (M, N) the output gradient of the last `forward` of `layer`: grad rows, dgrad, wgrad."""
        if self.rows is None or not self._saved.get(layer):
            return
        x, w = self._saved[layer].pop()
        dy = dy.detach()
        dx_ref = dy.float() @ w.float()  # (M, K)
        dw_ref = dy.float().t() @ x.float()  # (N, K)
        for c in self.candidates:
            dyr, dyt = self._copy(c, "grad", dy, False)
            if dyt is not None:
                self._operand_row(layer, "grad", c, dy, dyt)
            wc, _ = self._copy(c, "weight", w, True)
            self._gemm_row(layer, "dgrad", c, dyr @ wc, dx_ref)
            dyc, _ = self._copy(c, "grad", dy, True)
            xc, _ = self._copy(c, "input", x, True)
            self._gemm_row(layer, "wgrad", c, dyc.t() @ xc, dw_ref)
