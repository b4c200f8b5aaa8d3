"""Numerics telemetry on the TE backend: the emulated backend's rows, from TE's own quantizers.

On a telemetry step `collect()` puts forward hooks on every quantizing block's four GEMM modules
(LayerNormLinear QKV, Linear proj, LayerNormMLP fc1/fc2; an MoE block's GroupedLinear expert groups,
a row per expert, and its shared expert's Linears) and a gradient hook on their outputs; the
block's `with` exit removes them all, so the other steps run TE untouched. Each hook takes the GEMM
operand in high precision, quantizes it with a copy of that module's own TE quantizer for the role
(`module.quantizers[...]`: same recipe, scale, block shape and flags as the step's), and reads the row
(harness.numerics.telemetry: amax, scale, underflow, saturation, SQNR) from the returned TE tensor's
codes, scale_inv and `dequantize()`. The copy never writes the module's state: a delayed-scaling
copy gets its own amax buffer, so the amax history is the step's own.

Where TE fuses an operand away (it never exists in high precision), it is recomputed from the
module's parameters: the QKV and fc1 inputs are TE's own `apply_normalization` of the module input;
the fc2 input is act(fc1 GEMM of the dequantized fc1 operands); the fc1 gradient is act'(fc1 out)
times the fc2 dgrad GEMM of the dequantized operands. Those GEMMs run in fp32, so they differ from
TE's FP8 GEMMs by accumulation order only. An operand TE casts inside the kernel that makes it
(harness.recipes' `fused_casts`, as the emulated backend) is taken in fp32, the others in bf16.
The proj input, the weights and the QKV/proj/fc2 gradients are TE's own tensors, unchanged.

Cost on telemetry steps: one extra quantization per operand, the rows' reductions (each row syncs),
two fp32 GEMMs per block, and fc1's output (bf16) kept per block until its backward.

Counterfactual candidates (`telemetry.candidates`, harness.numerics.counterfactual) get the same
high-precision operands, in BF16 blocks too: the input (the norm recomputed as above), bf16(W) (an
FP8 param dequantized) and the output gradient, and an expert group's per expert (its (padded) rows
as TEGroupedExperts hands them to TE's GroupedLinear, its weight views, the output gradient split
alike; the group's rows under the group's name); where TE fuses fc2's input and fc1's gradient away
in a BF16 block they are recomputed from the high-precision fc1 GEMM and fc2 dgrad GEMM. lowp's
emulator quantizes them: TE's own quantizers never see a candidate.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings

import torch
import torch.nn as nn

from harness.numerics import telemetry as T
from harness.numerics.counterfactual import guarded

_FP8_MAX = {"E4M3": 448.0, "E5M2": 57344.0}


class TelemetryWarning(UserWarning):
    """Some TE operand gave no telemetry row (the training step itself ran unchanged)."""


class _Row:
    """A TE quantized tensor in the interface `telemetry.tensor_row` reads (dequantize, codes at
    +-max, the scale of the largest element)."""

    def __init__(self, qt, x: torch.Tensor):
        self.qt, self.x = qt, x
        self._deq = qt.dequantize(dtype=torch.float32)
        codes, scale = self._codes(), self._scale()
        # tensor_row leaves a column None where its hook is None
        self.saturated_count = None if codes is None else lambda: (codes[0].abs() == codes[1]).sum()
        self.telemetry_scale = None if scale is None else lambda: scale

    def dequantize(self) -> torch.Tensor:
        return self._deq

    def _codes(self) -> tuple[torch.Tensor, float] | None:
        """The rowwise element codes as float values (x's shape) and the format's max."""
        data = getattr(self.qt, "_data", None)
        if data is None:
            data = getattr(self.qt, "_rowwise_data", None)
        if data is None:
            return None
        tag = getattr(self.qt, "_fp8_dtype", getattr(self.qt, "_fp4_dtype", ""))
        # TE's DType is an IntEnum (transformer_engine.pytorch.constants), whose str() is its number
        # from Python 3.11 on: read the member's name (kFloat8E4M3), as for the pybind11 enum
        kind = str(getattr(tag, "name", tag))
        for name, fmax in _FP8_MAX.items():
            if name in kind.upper() and data.numel() == self.x.numel():
                dtype = torch.float8_e4m3fn if name == "E4M3" else torch.float8_e5m2
                return data.view(dtype).float().reshape(-1), fmax
        if data.numel() * 2 == self.x.numel():  # NVFP4: two E2M1 codes a byte; 0b111 is 6.0
            b = data.reshape(-1).to(torch.int32)
            mags = torch.stack([b & 0x7, (b >> 4) & 0x7], dim=-1).reshape(-1)
            return torch.where(mags == 7, 6.0, 0.0), 6.0
        return None

    def _scale(self) -> torch.Tensor | None:
        """Per-tensor: 1/scale_inv. Blocks: code/value at the largest |x| (its block's scale, as the
        emulated `telemetry_scale`); NVFP4: the global encode scale 2688/amax."""
        si = getattr(self.qt, "_scale_inv", None)
        if isinstance(si, torch.Tensor) and si.numel() == 1:
            return 1.0 / si.float().reshape(())
        x = self.x.float().reshape(-1)
        if hasattr(self.qt, "_amax_rowwise"):
            amax = x.abs().max()
            return torch.where(amax > 0, 2688.0 / amax, torch.ones_like(amax))
        codes = self._codes()
        if codes is None or not x.numel():
            return None
        i = torch.argmax(x.abs())
        deq = self._deq.reshape(-1)[i].double()
        return codes[0][i].double() / deq if bool(deq != 0) else None


def _own_quantizer(module: nn.Module, fwd: bool, index: int):
    """A rowwise-only copy of the module's TE quantizer `index`; None when it has none (BF16 block)."""
    qs = getattr(module, "quantizers", {}).get("scaling_fwd" if fwd else "scaling_bwd") or []
    if not getattr(module, "fp8", False) or index >= len(qs) or qs[index] is None:
        return None
    q = qs[index].copy() if hasattr(qs[index], "copy") else copy.copy(qs[index])
    # a current-scaling copy allocates on cuda:0; an expert group's GroupedLinear holds no parameter
    device = next((p.device for p in module.parameters()), None)
    device = device or torch.device("cuda", torch.cuda.current_device())
    for buf in ("scale", "amax"):  # own buffers: delayed scaling's amax history stays the step's
        if isinstance(getattr(q, buf, None), torch.Tensor):
            setattr(q, buf, getattr(q, buf).detach().clone().to(device))
    if hasattr(q, "with_amax_reduction"):
        q.with_amax_reduction = False  # this rank's operand, no collective
    q.set_usage(rowwise=True, columnwise=False)
    q.internal, q.optimize_for_gemm = False, False  # a full tensor, scales unswizzled
    return q


def _quantize(q, x: torch.Tensor):
    return q.quantize(x.contiguous())


def _norm(mod: nn.Module, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """The module's norm of x by TE's kernel: fp32 out where TE's norm casts to FP8 itself (`fused`,
    harness.recipes' fused_casts), else in x's dtype (bf16), which TE then quantizes."""
    from transformer_engine.pytorch.module._common import apply_normalization

    w, b = mod.layer_norm_weight, getattr(mod, "layer_norm_bias", None)
    margin = getattr(mod, "fwd_ln_sm_margin", 0)
    for out_dtype in (torch.float32, x.dtype) if fused else (x.dtype,):
        args = (mod.eps, None, out_dtype, mod.normalization, margin, mod.zero_centered_gamma)
        try:
            return apply_normalization(x, None, w, b, *args)[0]
        except RuntimeError:
            if out_dtype == x.dtype:
                raise
    raise AssertionError("unreachable")


def _is_te_quantized(t) -> bool:
    """A TE quantized tensor (torch.Tensor has a `dequantize` of its own, for torch's int8 tensors)."""
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensorStorage

    return isinstance(t, QuantizedTensorStorage)


def _first_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _module_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The input of a TE module's forward, given positionally or by TE's parameter names."""
    x = args[0] if args else kwargs.get("inp", kwargs.get("hidden_states"))
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"no input tensor among the forward's arguments ({sorted(kwargs)})")
    return x.detach()


class TETelemetry:
    """Rows of one forward/backward of a TEGPT, one per (quantized linear, role), as the emulated
    backend writes them; `activation` is the model's MLP activation (gelu or swiglu), `recipe_of`
    maps a linear's name to the recipe TE runs its GEMMs in."""

    def __init__(self, model: nn.Module, activation: str, recipe_of, counterfactual=None):
        """`counterfactual`: a harness.numerics.counterfactual.Counterfactual fed the operands too."""
        self.model, self.activation, self.recipe_of = model, activation, recipe_of
        self.cf = counterfactual if counterfactual is not None and counterfactual.enabled else None
        self.rows: list[dict] | None = None
        self.errors: list[str] = []

    @contextlib.contextmanager
    def collect(self):
        """`with telemetry.collect() as rows:` hooks in place for the block's forward and backward;
        the counterfactual candidates' rows follow the run's own."""
        rows: list[dict] = []
        cf_rows: list[dict] = []
        self.rows, self.errors, handles = rows, [], []
        with contextlib.ExitStack() as stack:
            if self.cf is not None:
                stack.enter_context(self.cf.collect(cf_rows))
            try:
                for i, block in enumerate(self.model.blocks):
                    attn, mlp, p = block.layer.self_attention, block.layer.layernorm_mlp, f"blocks.{i}"
                    hooks = [
                        (attn.layernorm_qkv, self._linear_hook(f"{p}.attn.qkv", True)),
                        (attn.proj, self._linear_hook(f"{p}.attn.proj", False)),
                    ]
                    moe = getattr(mlp, "moe", None)  # an MoE block's TEMoEMLP
                    hooks += (
                        self._moe_hooks(moe, f"{p}.mlp") if moe is not None else [(mlp, self._mlp_hook(p))]
                    )
                    handles += [mod.register_forward_hook(h, with_kwargs=True) for mod, h in hooks]
                yield rows
            finally:
                for h in handles:
                    h.remove()
                self.rows = None
        rows.extend(cf_rows)
        if self.errors:
            warnings.warn(
                f"TE telemetry: {len(self.errors)} operand(s) gave no row, first: {self.errors[0]}",
                TelemetryWarning,
                stacklevel=3,
            )

    # ---- rows ---------------------------------------------------------------------------------
    def _add(self, layer: str, tensor: str, x: torch.Tensor, q):
        """One row of x quantized by q; returns the TE tensor (None, and no row, without q)."""
        if q is None or self.rows is None:
            return None
        with torch.no_grad():
            x = x.detach()
            qt = _quantize(q, x)
            self.rows.append(T.tensor_row(layer, tensor, x, _Row(qt, x)))
        return qt

    def _weight(self, layer: str, w, q):
        """The weight row: bf16(W) through the module's weight quantizer (an FP8 param as it is)."""
        if q is None or self.rows is None:
            return None
        if _is_te_quantized(w):  # fp8_param: the stored codes are the operand
            with torch.no_grad():
                x = w.dequantize(dtype=torch.float32)
                self.rows.append(T.tensor_row(layer, "weight", x, _Row(w, x)))
            return w
        return self._add(layer, "weight", w.detach().to(torch.bfloat16), q)

    def _linear_hook(self, name: str, has_norm: bool):
        """LayerNormLinear (QKV: the input is its norm) or Linear (proj): input, weight, grad rows."""
        return lambda mod, args, kwargs, out: self._linear_rows(mod, name, has_norm, args, kwargs, out)

    @guarded
    def _linear_rows(self, mod, name: str, has_norm: bool, args, kwargs, out) -> None:
        from transformer_engine.pytorch.constants import FP8BwdTensorIdx as B
        from transformer_engine.pytorch.constants import FP8FwdTensorIdx as F

        x = _module_input(args, kwargs)
        x2 = x.reshape(-1, x.shape[-1])  # (B*T, C)
        with torch.no_grad():
            inp = _norm(mod, x2, self._fused(name)["fused_input_cast"]) if has_norm else x2
        self._add(name, "input", inp, _own_quantizer(mod, True, F.GEMM1_INPUT))
        self._weight(name, mod.weight, _own_quantizer(mod, True, F.GEMM1_WEIGHT))
        self._cf_forward(name, inp, mod.weight)
        y = _first_tensor(out)
        if isinstance(y, torch.Tensor) and y.requires_grad:
            y.register_hook(self._grad_hook(name, mod, B.GRAD_OUTPUT1))

    def _grad_hook(self, name: str, mod: nn.Module, index: int, then=None):
        def hook(g: torch.Tensor):
            if self.rows is not None:  # else a backward after the block ended (not the step's)
                self._grad_rows(name, mod, index, then, g)
            return None

        return hook

    @guarded
    def _grad_rows(self, name: str, mod: nn.Module, index: int, then, g: torch.Tensor) -> None:
        g2 = g.detach().reshape(-1, g.shape[-1])  # (B*T, N): the GEMM's grad operand
        if self.cf is not None:
            self.cf.backward(name, g2.to(torch.bfloat16))
        qt = self._add(name, "grad", g2, _own_quantizer(mod, False, index))
        if then is not None:
            then(qt, g2)

    def _moe_hooks(self, moe: nn.Module, prefix: str) -> list:
        """An MoE layer (harness.backends.te_moe): each expert group's rows, one per expert
        (`<group>.<e>`, as the emulated backend names them), and the shared expert's linears."""
        hooks = [(g, self._grouped_hook(f"{prefix}.experts.{fc}")) for fc, g in
                 (("fc1", moe.experts.fc1), ("fc2", moe.experts.fc2))]  # fmt: skip
        if moe.shared_experts is not None:
            for fc in ("fc1", "fc2"):
                mod = getattr(moe.shared_experts, fc)
                hooks.append((mod, self._linear_hook(f"{prefix}.shared_experts.{fc}", False)))
        return hooks

    def _grouped_hook(self, name: str):
        return lambda mod, args, kwargs, out: self._grouped_rows(mod, name, args, kwargs, out)

    @guarded
    def _grouped_rows(self, mod, name: str, args, kwargs, out) -> None:
        """TEGroupedExperts: expert e's rows of the (padded) input and of the output gradient, and
        its weight, through the GroupedLinear's quantizers of GEMM e (TE's offsets: 3 forward
        quantizers a GEMM, input then weight; 2 backward ones, the output gradient first). An expert
        without rows has a weight row only, as in the emulated backend."""
        x, m_splits = _module_input(args, kwargs), args[1] if len(args) > 1 else kwargs["m_splits"]
        gemm = mod.gemm
        for e, xe in enumerate(x.split(list(m_splits))):
            if xe.shape[0]:
                self._add(f"{name}.{e}", "input", xe.to(torch.bfloat16), _own_quantizer(gemm, True, 3 * e))
            self._weight(f"{name}.{e}", mod.weight[e], _own_quantizer(gemm, True, 3 * e + 1))
        if self.cf is not None:  # the group's candidate rows, each expert quantized on its own
            xs = list(x.to(torch.bfloat16).split(list(m_splits)))
            self.cf.forward_experts(name, xs, [_hp(w) for w in mod.weight.unbind(0)])
        y = _first_tensor(out)
        if isinstance(y, torch.Tensor) and y.requires_grad:

            def hook(g: torch.Tensor):
                if self.rows is not None:
                    self._grouped_grads(gemm, name, list(m_splits), g)

            y.register_hook(hook)

    @guarded
    def _grouped_grads(self, gemm, name: str, m_splits: list[int], g: torch.Tensor) -> None:
        if self.cf is not None:
            self.cf.backward_experts(name, list(g.detach().to(torch.bfloat16).split(m_splits)))
        for e, ge in enumerate(g.detach().split(m_splits)):
            if ge.shape[0]:
                self._add(f"{name}.{e}", "grad", ge, _own_quantizer(gemm, False, 2 * e))

    def _mlp_hook(self, prefix: str):
        """LayerNormMLP: fc1 (input: its norm) and fc2 (input: act of the fc1 GEMM) rows; the fc2
        grad is the module's output grad, the fc1 grad is recomputed from it."""
        return lambda mod, args, kwargs, out: self._mlp_rows(mod, prefix, args, kwargs, out)

    @guarded
    def _mlp_rows(self, mod, prefix: str, args, kwargs, out) -> None:
        from transformer_engine.pytorch.constants import FP8BwdTensorIdx as B
        from transformer_engine.pytorch.constants import FP8FwdTensorIdx as F

        fc1, fc2 = f"{prefix}.mlp.fc1", f"{prefix}.mlp.fc2"
        x = _module_input(args, kwargs)
        x2 = x.reshape(-1, x.shape[-1])  # (B*T, C)
        f1, f2 = self._fused(fc1), self._fused(fc2)
        with torch.no_grad():
            ln = _norm(mod, x2, f1["fused_input_cast"])
        q_in1 = self._add(fc1, "input", ln, _own_quantizer(mod, True, F.GEMM1_INPUT))
        q_w1 = self._weight(fc1, mod.fc1_weight, _own_quantizer(mod, True, F.GEMM1_WEIGHT))
        q_w2 = self._weight(fc2, mod.fc2_weight, _own_quantizer(mod, True, F.GEMM2_WEIGHT))
        self._cf_forward(fc1, ln, mod.fc1_weight)
        quantized = q_in1 is not None and q_w1 is not None
        if not quantized and self.cf is None:
            return
        with torch.no_grad():
            # (B*T, F or 2F for swiglu) bf16, kept to backward; a BF16 block's from its bf16 operands
            h = self._fc1_out(mod, q_in1, q_w1) if quantized else self._fc1_out_hp(mod, ln)
            act = _act(h.float(), self.activation)  # fp32: TE's fused act+cast quantizes it unrounded
            act = act if f2["fused_input_cast"] else act.to(torch.bfloat16)
            self._add(fc2, "input", act, _own_quantizer(mod, True, F.GEMM2_INPUT))
        self._cf_forward(fc2, act, mod.fc2_weight)

        def fc1_grad(q_g2, g2: torch.Tensor) -> None:
            with torch.no_grad():  # dact: fc2's dgrad GEMM (bf16 out), then act'(h)
                if q_g2 is not None and q_w2 is not None:
                    dact = (_deq(q_g2) @ _deq(q_w2)).to(torch.bfloat16)  # (B*T, F)
                elif self.cf is not None:
                    dact = (g2.float() @ _hp(mod.fc2_weight).float()).to(torch.bfloat16)
                else:
                    return
                dh = _act_backward(h.float(), dact.float(), self.activation)
                dh = dh if f1["fused_grad_cast"] else dh.to(torch.bfloat16)
            self._add(fc1, "grad", dh, _own_quantizer(mod, False, B.GRAD_OUTPUT1))
            if self.cf is not None:
                self.cf.backward(fc1, dh.to(torch.bfloat16))

        y = _first_tensor(out)
        if isinstance(y, torch.Tensor) and y.requires_grad:
            y.register_hook(self._grad_hook(fc2, mod, B.GRAD_OUTPUT2, then=fc1_grad))

    @staticmethod
    def _fc1_out(mod: nn.Module, q_in, q_w) -> torch.Tensor:
        """fc1's output (bf16) from the dequantized operands TE multiplies, plus its bias."""
        h = q_in.dequantize(dtype=torch.float32) @ _deq(q_w).t()
        bias = getattr(mod, "fc1_bias", None)
        if isinstance(bias, torch.Tensor) and bias.numel():
            h = h + bias.float()
        return h.to(torch.bfloat16)

    @staticmethod
    def _fc1_out_hp(mod: nn.Module, ln: torch.Tensor) -> torch.Tensor:
        """fc1's output (bf16) in a BF16 block: bf16 operands, fp32 accumulation, plus its bias."""
        h = ln.to(torch.bfloat16).float() @ _hp(mod.fc1_weight).float().t()
        bias = getattr(mod, "fc1_bias", None)
        if isinstance(bias, torch.Tensor) and bias.numel():
            h = h + bias.float()
        return h.to(torch.bfloat16)

    def _cf_forward(self, name: str, x: torch.Tensor, w) -> None:
        """The counterfactual candidates' forward rows of one GEMM (bf16 input, bf16 W)."""
        if self.cf is not None and self.rows is not None:
            self.cf.forward(name, x.detach().to(torch.bfloat16), _hp(w))

    def _fused(self, name: str) -> dict[str, bool]:
        """Where TE casts this linear's operands inside the kernel that makes them (fp32, unrounded)."""
        from harness.backends.emulated import fused_casts

        return fused_casts(name, self.recipe_of(name), self.activation)


def _hp(w) -> torch.Tensor:
    """bf16 W: the parameter, or an FP8 param's dequantized codes."""
    if _is_te_quantized(w):
        return w.dequantize(dtype=torch.float32).to(torch.bfloat16)
    return w.detach().to(torch.bfloat16)


def _deq(q) -> torch.Tensor:
    return q.dequantize(dtype=torch.float32)


def _act(x: torch.Tensor, kind: str) -> torch.Tensor:
    from harness.backends.emulated import _act as act

    return act(x, kind)


def _act_backward(h: torch.Tensor, dy: torch.Tensor, kind: str) -> torch.Tensor:
    """d act(h) / dh times dy, in closed form (no autograd call inside the backward hook)."""
    if kind == "gelu":  # tanh approximation, as TE's and the emulated gelu
        c = math.sqrt(2.0 / math.pi)
        t = torch.tanh(c * (h + 0.044715 * h**3))
        return dy * (0.5 * (1 + t) + 0.5 * h * (1 - t * t) * c * (1 + 3 * 0.044715 * h * h))
    gate, value = h.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    return torch.cat([dy * value * sig * (1 + gate * (1 - sig)), dy * gate * sig], dim=-1)
