"""The emulated backend: the GPT in pure PyTorch, each GEMM operand quantized as TE would.

BF16 semantics without torch.autocast: GEMM operands are rounded to bf16, products accumulate in
fp32 and the output is rounded to bf16 -- what a bf16 tensor-core GEMM does; embeddings, the
residual stream and norm parameters hold bf16 values (harness.model.gpt.bf16_values), as in TE. On a
CPU without bf16 units the GEMM itself runs in fp32 (about 7x faster there than torch's bf16
matmul, same numbers up to accumulation order); on CUDA it is a native bf16 GEMM.

Quantized recipes swap in `harness.numerics.QuantizedLinear` (the emulated TE Linear) for the
block linears the precision plan assigns them; INT4 QAT fake-quantizes those weights and keeps
BF16 compute. `autocast()` is the emulator's one precision context: like `te.autocast` it drives
delayed scaling's update timing.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness import recipes
from harness.backends.base import Backend, BackendSpec
from harness.backends.hooks import make_hook
from harness.config.schema import ModelConfig
from harness.model.gpt import GPT, MLP, Block, LayerNorm, bf16_values, norm
from harness.numerics import NumericsContext, QuantizedLinear, fast
from harness.numerics.custom import module_quantizers
from harness.numerics.formats import E4M3, cast_fp8
from harness.numerics.te_layernorm import FMA_SITES, kernel_layout, te_layer_norm, te_rsigma

BF16 = torch.bfloat16


def fused_casts(name: str, recipe: str, activation: str) -> dict[str, bool]:
    """QuantizedLinear's fused-cast flags for the linear `name` (e.g. blocks.0.mlp.fc1) under the
    recipe named `recipe`: where TE casts an operand inside the kernel that makes it
    (RecipeSpec.fused_casts says where and why)."""
    leaf = name.rsplit(".", 1)[-1]
    fused = recipes.get(recipe).fused_casts
    fused_in = leaf in fused.get("input", ())
    fused_grad = activation == "gelu" and leaf in fused.get("grad", ())
    # fc1's output feeds the activation: keep it fp32 when the activation's cast or backward is fused
    feeds_fused_act = leaf == "fc1" and "fc2" in fused.get("input", ())
    return {"fused_input_cast": fused_in, "fused_grad_cast": fused_grad, "fp32_output": feeds_fused_act}


def bf16_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, wgrad_fp32: bool = False
) -> torch.Tensor:
    """y = x @ W.T (+ b) with bf16 operands, fp32 accumulation and a bf16 result (autograd-aware).
    `wgrad_fp32`: dW is the wgrad GEMM's fp32 result, not rounded to bf16 (TE's fused wgrad
    accumulation into fp32 main grads); dx and db are bf16 either way."""
    if wgrad_fp32 and torch.is_grad_enabled() and weight.requires_grad:
        return _BF16LinearFP32WGrad.apply(x, weight, bias)
    b = bias.to(BF16) if bias is not None else None
    if x.is_cuda:
        return F.linear(x.to(BF16), weight.to(BF16), b)
    y = F.linear(x.to(BF16).float(), weight.to(BF16).float(), b.float() if b is not None else None)
    return y.to(BF16)


class _BF16LinearFP32WGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        x16, w16 = x.to(BF16), weight.to(BF16)
        ctx.save_for_backward(x16, w16)
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        ctx.b_dtype = bias.dtype if bias is not None else None
        with torch.no_grad():
            return bf16_linear(x16, w16, bias)

    @staticmethod
    def backward(ctx, dy):
        x16, w16 = ctx.saved_tensors
        dy16 = dy.to(BF16)
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = dy16 @ w16 if dy16.is_cuda else (dy16.float() @ w16.float()).to(BF16)
            dx = dx.to(ctx.x_dtype)
        dy2 = dy16.reshape(-1, dy16.shape[-1])  # (M, N) bf16
        if ctx.needs_input_grad[1]:
            # products of bf16 values are exact in fp32: on CUDA a bf16 tensor-core GEMM with fp32
            # output, not an fp32 SIMT one on the upcasts; on a CPU the fp32 GEMM (fast.mm)
            dw = fast.mm(dy2.t(), x16.reshape(-1, x16.shape[-1])).to(ctx.w_dtype)
        if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
            db = dy2.float().sum(0).to(BF16).to(ctx.b_dtype)
        return dx, dw, db


class FakeQuantLinear:
    """A recipe hook's fake-quantized weight (INT4 QAT: straight-through), then the BF16 GEMM."""

    def __init__(self, hook):
        self.hook = hook
        self.calls = 0

    def linear(self, x, weight, bias):
        self.calls += 1
        return bf16_linear(x, self.hook.weight(weight.to(BF16)), bias)

    def __repr__(self) -> str:
        return repr(self.hook)


class EmulatedLinear(nn.Module):
    """nn.Linear-compatible; `quant` (None = BF16) implements the recipe's quantized GEMMs."""

    def __init__(
        self, name: str, in_features: int, out_features: int, bias: bool, quant=None, wgrad_fp32=False
    ):
        super().__init__()
        self.name, self.wgrad_fp32 = name, wgrad_fp32
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.normal_(self.weight, std=0.02)
        self.quant = quant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return bf16_linear(x, self.weight, self.bias, self.wgrad_fp32)
        return self.quant.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        q = ("bf16, dW fp32" if self.wgrad_fp32 else "bf16") if self.quant is None else repr(self.quant)
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, numerics={q}"


EXPERT_ALIGNMENT = {"amax_history": 16, "current": 16, "block": 16, "factory": 16, "mx": 32, "nv": 128}
"""Rows each expert is padded to under a recipe's quantizer scheme (docs/numerics_grouped.md §1.2, §1.4:
Megatron's get_align_size_for_quantization, TE's Fp8Padding); schemes not listed (BF16 GEMMs: bf16,
int4_qat) pad nothing."""


def expert_alignment(recipe) -> int:
    """The row alignment of an expert group running `recipe` (None = BF16): 0 for none."""
    return 0 if recipe is None else EXPERT_ALIGNMENT.get(recipes.get(recipe.name).scheme, 0)


class _AfterBackward(torch.autograd.Function):
    """The identity on (x, weight); `then()` runs in backward once both grads are complete, i.e.
    after every expert's backward: a group is one TE module, so the delayed-scaling backward update
    it owes as the forward's first quantized module follows its last expert (docs/numerics_grouped.md
    §3.1)."""

    @staticmethod
    def forward(ctx, x, weight, then):
        ctx.then = then
        return x.view_as(x), weight.view_as(weight)

    @staticmethod
    def backward(ctx, dx, dw):
        ctx.then()
        return dx, dw, None


class EmulatedGroupedLinear(nn.Module):
    """TE's GroupedLinear (Megatron's TEGroupedMLP experts): `num_gemms` bias-free linears, GEMM i
    on the m_splits[i] rows of `forward(x, m_splits)` that follow GEMM i-1's. Each GEMM is one
    `expert_linear` call, empty experts included (TE's grouped GEMM runs every member), so that a
    recipe quantizes each expert on its own (its own amax, scale and history; blocks inside its
    rows), as TE's split-quantize path does: `quants[i]` is expert i's dense emulated TE Linear
    (QuantizedLinear, or INT4's FakeQuantLinear; None = BF16), docs/numerics_grouped.md §2-§4.
    `align_size`: the rows Megatron pads each expert to before this group (harness.model.moe.Experts).

    One weight (num_gemms, out, in), not a list: weight[i] is TE's weight{i} and the (out, in)
    operand each expert's quantizer sees; the whole tensor is transformers 5's fused expert layout
    (gate_up_proj (E, 2F, h), down_proj (E, h, F)) as it is, and the per-expert layouts (Mixtral's
    w1/w3/w2, Qwen2/3-MoE's gate/up/down_proj) are its slices; the optimizer, FSDP2 and checkpoints
    see one tensor per group. `unbind` hands the GEMMs their slices: one autograd node whose
    backward stacks the experts' weight grads (zeros for an expert no token reached)."""

    def __init__(
        self,
        name: str,
        num_gemms: int,
        in_features: int,
        out_features: int,
        wgrad_fp32=False,
        quants: list | None = None,
        align_size: int = 0,
    ):
        super().__init__()
        self.name, self.wgrad_fp32 = name, wgrad_fp32
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.weight = nn.Parameter(torch.empty(num_gemms, out_features, in_features))
        nn.init.normal_(self.weight, std=0.02)
        self.quants, self.align_size = quants, align_size

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        assert len(m_splits) == self.num_gemms, (self.name, m_splits)
        weight = self.weight
        q0 = self.quants[0] if self.quants else None
        if isinstance(q0, QuantizedLinear) and q0.context.claim_first() and torch.is_grad_enabled():
            x, weight = _AfterBackward.apply(x, weight, q0.context.update_backward)
        parts = zip(x.split(m_splits), weight.unbind(0))
        return torch.cat([self.expert_linear(i, xi, wi) for i, (xi, wi) in enumerate(parts)])  # (M, out)

    def expert_linear(self, index: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Expert `index`'s GEMM on its rows x (m, in). An expert without rows still has its weight
        quantized (TE's loop covers every expert; under delayed scaling its weight amax is recorded)
        but casts no input and no gradient, so it records no amax for them; its dW is zeros
        (docs/numerics_grouped.md §4)."""
        quant = self.quants[index] if self.quants else None
        if quant is None:
            return bf16_linear(x, weight, None, self.wgrad_fp32)
        if x.shape[0] == 0 and isinstance(quant, QuantizedLinear):
            quant.calls += 1
            quant.set_fused(x)
            quant.quantize_weight(weight, x.requires_grad)
            return bf16_linear(x, weight, None, self.wgrad_fp32)  # (0, out); dW zeros
        return quant.linear(x, weight, None)

    def extra_repr(self) -> str:
        dw = ", dW fp32" if self.wgrad_fp32 else ""
        q = "bf16" if not self.quants else repr(self.quants[0])
        pad = f", rows padded to {self.align_size}" if self.align_size else ""
        return f"{self.num_gemms} x ({self.in_features}, {self.out_features}), numerics={q}{dw}{pad}"


def _act(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "gelu":
        return F.gelu(x, approximate="tanh")
    gate, value = x.chunk(2, dim=-1)
    return F.silu(gate) * value


class _FP8StoredActivation(torch.autograd.Function):
    """Megatron's activation_func_fp8_input_store: the input is saved for backward as an
    *unscaled* `x.to(float8_e4m3fn)` (|x| > 448 saturates, |x| <= 2^-10 flushes) and cast back.
    The clamp makes saturation independent of the torch version (2.11's cast gives NaN >= 464)."""

    @staticmethod
    def forward(ctx, x, kind):
        ctx.save_for_backward(cast_fp8(x.detach(), E4M3))
        ctx.kind, ctx.dtype = kind, x.dtype
        return _act(x, kind)

    @staticmethod
    def backward(ctx, dy):
        (stored,) = ctx.saved_tensors
        with torch.enable_grad():
            x = stored.to(ctx.dtype).requires_grad_(True)
            (dx,) = torch.autograd.grad(_act(x, ctx.kind), x, dy)
        return dx, None


class Activation(nn.Module):
    """GELU (tanh approximation, as TE's) or SwiGLU on the fused fc1 output."""

    def __init__(self, name: str, kind: str, fp8_input_store: bool = False):
        super().__init__()
        if kind not in ("gelu", "swiglu"):
            raise ValueError(f"model.activation={kind}: use gelu or swiglu")
        self.name, self.kind, self.fp8_input_store = name, kind, fp8_input_store

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_input_store and torch.is_grad_enabled() and x.requires_grad:
            return _FP8StoredActivation.apply(x, self.kind)
        return _act(x, self.kind)

    def extra_repr(self) -> str:
        return self.kind + (", fp8_input_store" if self.fp8_input_store else "")


class _TEOrderLayerNorm(torch.autograd.Function):
    """Forward: TE's kernel order (harness.numerics.te_layernorm); backward: torch's layer_norm
    backward on the forward's statistics (TE's backward, too, reuses its forward's mu and rsigma)."""

    @staticmethod
    def forward(ctx, x, w, b, eps, fma, fused, bf16_output):
        mu, rs = te_rsigma(x.reshape(-1, x.shape[-1]), eps, fma, fused)  # (rows,), (rows,)
        ctx.save_for_backward(x, w, b, mu, rs)
        return te_layer_norm(x, w, b, eps, fma, stats=(mu, rs), fused=fused, bf16_output=bf16_output)

    @staticmethod
    def backward(ctx, gy):
        x, w, b, mu, rs = ctx.saved_tensors
        stat_shape = (*x.shape[:-1], 1)
        gx, gw, gb = torch.ops.aten.native_layer_norm_backward(
            gy.to(x.dtype).contiguous(), x, x.shape[-1:], mu.view(stat_shape), rs.view(stat_shape), w, b,
            list(ctx.needs_input_grad[:3]),
        )  # fmt: skip
        return gx, gw, gb, None, None, None, None


class TEOrderLayerNorm(LayerNorm):
    """The model's LayerNorm (fp32 from bf16 values); on CUDA, where harness.numerics.te_layernorm
    covers TE's kernel for the shape, the forward reduces in that kernel's order, so that its output
    is TE's to the bit; elsewhere torch's layer_norm. `fma`: where that kernel fuses multiply-adds
    (te_layernorm.FMA_SITES, settled on the H200). `fused`: through torch.compile (same numbers,
    a few kernels instead of hundreds of launches); None = on CUDA (EmulatedBackend.fast_paths)."""

    fma = FMA_SITES
    fused: bool | None = None
    bf16_output = False  # the consumer rounds the output to bf16 anyway (set by EmulatedBackend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None and te_order_norm(x):
            w, b = bf16_values(self.weight), bf16_values(self.bias)
            fused = x.is_cuda if self.fused is None else self.fused
            return _TEOrderLayerNorm.apply(x, w, b, self.eps, self.fma, fused, self.bf16_output)
        return super().forward(x)


def rounds_input_to_bf16(linear: EmulatedLinear) -> bool:
    """Whether this linear's GEMM reads bf16(x): BF16 and INT4 QAT, and quantized recipes that cast
    x from bf16 (not where TE fuses the cast into the norm, from fp32: QuantizedLinear's
    fused_input_cast). Its norm can then write bf16 storage, the same values in half the bytes."""
    quant = linear.quant
    return not isinstance(quant, QuantizedLinear) or not quant.fused_input_cast


def te_order_norm(x: torch.Tensor) -> bool:
    """Whether LayerNorm follows TE's kernel order: fp32 CUDA tensors of a shape te_layernorm covers."""
    if not (x.is_cuda and x.dtype == torch.float32 and x.numel()):
        return False
    return kernel_layout(x.shape[-1], x.numel() // x.shape[-1]) is not None


class EmulatedOps:
    def __init__(self, backend: EmulatedBackend):
        self.backend = backend

    def linear(self, name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        self.backend.linear_names.append(name)
        recipe = self.backend.plan.recipe_for(name)
        quant = None if recipe is None else self.backend.make_numerics(name, recipe)
        return EmulatedLinear(name, in_features, out_features, bias, quant, self.backend.wgrad_fp32(name))

    def grouped_linear(self, name: str, num_gemms: int, in_features: int, out_features: int) -> nn.Module:
        """Experts quantized one by one, each a dense emulated TE Linear named `name.i` (its delayed-
        scaling state and telemetry too), on the fast GEMMs where the dense linears take them (the
        same codes and scales: tests/test_moe_recipes.py on a CPU, tests/test_moe_gpu.py on CUDA)."""
        self.backend.linear_names.append(name)
        recipe = self.backend.plan.recipe_for(name)
        quants = None
        if recipe is not None:
            quants = [
                self.backend.make_numerics(f"{name}.{i}", recipe, expert=True) for i in range(num_gemms)
            ]
        return EmulatedGroupedLinear(
            name,
            num_gemms,
            in_features,
            out_features,
            self.backend.wgrad_fp32(name),
            quants,
            expert_alignment(recipe),
        )

    def activation(self, name: str, kind: str) -> nn.Module:
        return Activation(name, kind, self.backend.spec.optimizer.activation_func_fp8_input_store)

    def norm(self, name: str, cfg: ModelConfig) -> nn.Module:
        module = norm(cfg, TEOrderLayerNorm)
        if isinstance(module, TEOrderLayerNorm):
            module.fused = self.backend.fast_paths
        return module


class EmulatedBackend(Backend):
    """`fast_paths`: None (default) = the fast GEMMs on CUDA tensors and the fused TE-order
    LayerNorm (CUDA only anyway); True = the fast GEMMs on a CPU too; False = the reference path
    everywhere. Codes and scales are the same in all three (harness.numerics.fast)."""

    name = "emulated"
    emulates = True
    fast_paths: bool | None = None

    def __init__(self, spec: BackendSpec, device: torch.device):
        super().__init__(spec, device)
        self.numerics = NumericsContext(device, seed=spec.seed)
        self.linear_names: list[str] = []
        self.modules: dict[str, QuantizedLinear | FakeQuantLinear] = {}
        self._linears: list[nn.Module] = []  # block linears and expert groups: counterfactual rows

    def set_amax_reduction(self, group, reducer) -> None:
        super().set_amax_reduction(group, reducer)
        self.numerics.amax_reducer = reducer  # same arithmetic as TE: MAX of the current amaxes

    def wgrad_fp32(self, name: str) -> bool:
        """TE's block linears (not the LM head, a plain BF16 nn.Linear there) write fp32 weight
        grads when Megatron's fp32 main grads are on; INT4 QAT never fuses them (docs/numerics.md)."""
        return (
            name.startswith("blocks.")
            and self.spec.fuse_wgrad_fp32
            and getattr(self.hook, "fuses_wgrad", True)
        )

    def make_numerics(self, name: str, recipe, expert: bool = False) -> QuantizedLinear | FakeQuantLinear:
        """`expert`: a routed expert's GEMM, whose operands come from permuted tokens and a torch
        activation, so TE fuses no cast into them (docs/numerics_grouped.md §1.5)."""
        spec = recipes.get(recipe.name)
        if spec.hook is not None:
            quant = FakeQuantLinear(make_hook(spec.hook, recipe))
        else:
            stab = self.spec.stability
            quant = QuantizedLinear(
                name,
                recipe,
                self.numerics,
                fp8_wgrad=stab.fp8_wgrad,
                margin=stab.fp8_margin,
                wgrad_fp32=self.wgrad_fp32(name),
                fast_gemm=self.fast_paths,
                **({} if expert else fused_casts(name, recipe.name, self.spec.model.activation)),
            )
            if expert and spec.needs_factory:  # TE's GroupedLinear asks the factory as "grouped_linear"
                quant.quantizers = module_quantizers(recipe, "grouped_linear") or quant.quantizers
        self.modules[name] = quant
        return quant

    def build_model(self) -> nn.Module:
        self.linear_names, self.modules = [], {}  # describe() and verify_active() see this model
        model = GPT(self.spec.model, EmulatedOps(self)).to(self.device)
        self._linears = [
            m
            for m in model.modules()
            if isinstance(m, (EmulatedLinear, EmulatedGroupedLinear)) and m.name.startswith("blocks.")
        ]
        if self.fast_paths is False:  # the reference path: every norm hands over fp32
            return model
        for block in model.blocks:  # a norm whose linear rounds its input to bf16 hands over bf16
            if not isinstance(block, Block):
                continue
            # an MoE layer rounds its input to bf16 first (harness.model.moe.MoE)
            mlp_rounds = not isinstance(block.mlp, MLP) or rounds_input_to_bf16(block.mlp.fc1)
            for ln, rounds in ((block.ln1, rounds_input_to_bf16(block.attn.qkv)), (block.ln2, mlp_rounds)):
                if isinstance(ln, TEOrderLayerNorm):
                    ln.bf16_output = rounds
        return model

    def autocast(self) -> contextlib.AbstractContextManager:
        # bf16 rounding lives in the GEMMs themselves (bf16_linear); this context only times
        # delayed-scaling updates, a counter and a flag when nothing uses them
        return self.numerics.autocast()

    def after_optimizer_step(self, model: nn.Module) -> None:
        self.numerics.weights_changed()  # the quantized weight copies are recomputed on next use

    @contextlib.contextmanager
    def collect_telemetry(self):
        """`with backend.collect_telemetry() as rows:` one row per quantized operand and pass, then
        the counterfactual candidates' rows of every block linear (hooks only inside the block)."""
        with self.numerics.telemetry.collect() as rows:
            if not self.counterfactual.enabled:
                yield rows
                return
            cf: list[dict] = []
            with self.counterfactual.collect(cf), _operand_hooks(self._linears, self.counterfactual):
                yield rows
            rows.extend(cf)

    def describe(self) -> dict:
        out = super().describe()
        out["quantized_modules"] = self.plan.quantized_modules(self.linear_names)
        out["numerics"] = {name: repr(q) for name, q in self.modules.items()}
        o, notes = self.spec.optimizer, []
        if o.fp8_param:
            notes.append(
                "optimizer.fp8_param=true changes no number here: TE quantizes its FP8 primary weights "
                "from bf16(master), exactly what the emulated GEMM quantizes each step (memory not modelled)"
            )
        if o.optimizer_cpu_offload:
            notes.append(
                "optimizer.optimizer_cpu_offload=true: the emulated backend's optimizer already runs "
                "where the model does; the offload changes no number"
            )
        if o.use_distributed_optimizer and self.data_parallel_size == 1:
            notes.append("optimizer.use_distributed_optimizer=true: one process, nothing to shard")
        out["mapping_notes"] = notes
        return out

    def verify_active(self, model: nn.Module, step: int) -> None:
        """Raise if a module the plan quantizes never ran its quantized path."""
        idle = [name for name, q in self.modules.items() if q.calls == 0]
        if idle:
            raise RuntimeError(f"recipe {self.spec.recipe.name}: quantized modules never ran: {idle}")
        states = self.numerics.forward_states.values()
        if step > 0 and states and all(bool((s.scale == 1).all()) for s in states):
            raise RuntimeError("delayed scaling: no scale moved from 1 after the first step")

    def state_dict(self) -> dict:
        return self.numerics.state_dict()

    def load_state_dict(self, state: dict, scales: bool = True) -> None:
        if scales:
            self.numerics.load_state_dict(state)
        elif "sr_generator" in state:  # stochastic rounding's stream goes on across a switch
            self.numerics.generator.set_state(state["sr_generator"])


@contextlib.contextmanager
def _operand_hooks(linears: list[nn.Module], cf):
    """Hand each block linear's high-precision operands to `cf` (harness.numerics.counterfactual):
    bf16(x) and W in forward, bf16(dy) in backward; an expert group's split per expert (its m_splits,
    padding rows included, as its GEMMs see them). Read only, so the step computes what it would."""

    def forward(mod, args, out):
        x = args[0].detach()
        cf.forward(mod.name, x.reshape(-1, x.shape[-1]).to(BF16), mod.weight)
        if out.requires_grad:
            out.register_hook(lambda g, name=mod.name: cf.backward(name, g.reshape(-1, g.shape[-1]).to(BF16)))

    def grouped(mod, args, out):
        x, m_splits = args[0].detach(), list(args[1])
        cf.forward_experts(mod.name, list(x.to(BF16).split(m_splits)), list(mod.weight.unbind(0)))
        if out.requires_grad:
            out.register_hook(
                lambda g, name=mod.name: cf.backward_experts(name, list(g.to(BF16).split(m_splits)))
            )

    handles = [
        m.register_forward_hook(grouped if isinstance(m, EmulatedGroupedLinear) else forward) for m in linears
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
