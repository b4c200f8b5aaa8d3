"""MoE blocks on the TE backend: TE's attention, TE's norm, lowp's router and dispatch, TE's
`GroupedLinear` experts (Megatron's TEGroupedMLP under --moe-grouped-gemm).

An MoE block is the dense block's `te.TransformerLayer` (the same attention, residual adds and
autocast) whose LayerNormMLP is replaced by `TEMoEMLP`: a TE norm (Megatron's pre_mlp_layernorm,
TENorm) and `harness.model.moe.MoE`, built with `TEExpertOps`. The router, the token permutation and
the padding rows are lowp's (the same code as the emulated backend's, on the GPU); each expert group
is one `te.GroupedLinear`, so TE quantizes every expert on its own under the block's `te.autocast`
(the split-quantize path the emulator follows, docs/numerics_grouped.md); the shared expert's fc1 and
fc2 are `te.Linear`s.

A group keeps its weights as one (num_gemms, out, in) parameter, as the emulated backend does: the
optimizer, checkpoints, exports and FSDP see the same tensor on both backends. TE's own per-GEMM
parameters `weight0..weight{E-1}` are removed and each forward hands TE the E views of that tensor
(TE's `single_grouped_weight` would hold one, but only on its experimental GroupedTensor path, not
the split-quantize path lowp emulates). With fp32 main grads each view carries its slice of the
parameter's `main_grad`, which TE's wgrad GEMM accumulates into (fuse_wgrad_accumulation).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn as nn

from harness.backends import grouped_gemm
from harness.config.schema import ModelConfig
from harness.model.gpt import MLP
from harness.model.moe import MoE

BF16 = torch.bfloat16
KERNELS = {"te": "te.GroupedLinear", "grouped": "torch._grouped_mm + triton fp32 wgrad"}
"""backend.moe_experts -> what runs a BF16 expert group's GEMMs (recorded in run.json)."""
AUTO_GROUPED_MIN_EXPERTS = 128
"""backend.moe_experts=auto runs BF16 groups on lowp's grouped kernels from this many experts up, TE's
GroupedLinear below. Measured on an H200 (benchmarks/RESULTS.md, "The expert MLP alone": forward and
backward, TE with its fused wgrad accumulation into fp32 main grads against the grouped kernels): 2.4x at
128 experts (Qwen3-30B-A3B, 16k tokens) and 5.8x at its 4k-token slice, 1.10x at 256 (DeepSeek-like);
0.89x at 64 experts of FFN 1536 and 0.90-0.94x at 8 (Mixtral-like). TE launches a GEMM per expert, so
its time grows with the expert count where the GEMMs are small; the grouped kernels' fp32 main-grad
read-modify-write costs them the large GEMMs of coarse experts."""


def group_kernels(asked: str, plan) -> dict[str, str]:
    """te or grouped for each expert group of `plan`'s model (a harness.model.plan.PrecisionPlan):
    backend.moe_experts `asked`, resolved for the model, where the group computes in BF16, TE where it
    quantizes."""
    from harness.model.moe import expert_groups

    kernels = resolve(asked, plan.model.num_moe_experts)
    return {g: expert_kernels(kernels, plan.recipe_for(g)) for g in expert_groups(plan.model)}


def resolve(asked: str, num_experts: int | None, available: bool | None = None) -> str:
    """te or grouped: backend.moe_experts with `auto` decided for the model (te for a dense one, and
    where the grouped kernels cannot run here: no triton or no CUDA; `available` overrides that check)."""
    if asked != "auto":
        return asked
    can = grouped_gemm.available() if available is None else available
    return "grouped" if can and (num_experts or 0) >= AUTO_GROUPED_MIN_EXPERTS else "te"


class TEGroupedExperts(nn.Module):
    """One expert group: `weight` (num_gemms, out, in) bf16, `forward(x, m_splits)` by TE's
    GroupedLinear, or with `kernels="grouped"` (BF16 groups only) by lowp's grouped kernels
    (harness.backends.grouped_gemm); `align_size`: the rows harness.model.moe.Experts pads each
    expert to first."""

    def __init__(
        self,
        te,
        name: str,
        num_gemms: int,
        in_features: int,
        out_features: int,
        *,
        fuse_wgrad: bool,
        align_size: int,
        std: float,
        first_microbatch=lambda: None,
        kernels: str = "te",
    ):
        super().__init__()
        self.name, self.num_gemms, self.kernels = name, num_gemms, kernels
        self.in_features, self.out_features = in_features, out_features
        self.align_size, self.first_microbatch = align_size, first_microbatch
        shape = (num_gemms, out_features, in_features)
        self.weight = nn.Parameter(torch.empty(shape, device="cuda", dtype=BF16))
        nn.init.normal_(self.weight, 0.0, std)
        if kernels == "grouped":
            if not grouped_gemm.available():
                raise RuntimeError(
                    "backend.moe_experts=grouped needs triton on CUDA; "
                    "install triton or set backend.moe_experts=te"
                )
            self.gemm = None
            return
        self.gemm = te.GroupedLinear(
            num_gemms,
            in_features,
            out_features,
            bias=False,
            params_dtype=BF16,
            device="cuda",
            fuse_wgrad_accumulation=fuse_wgrad,
            name=name,
        )
        for i in range(num_gemms):  # the views of `weight` take their place at each forward
            delattr(self.gemm, f"weight{i}")

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> torch.Tensor:
        if self.gemm is None:
            ends = list(itertools.accumulate(m_splits))
            offs = torch.tensor(ends, dtype=torch.int32).to(x.device, non_blocking=True)
            return grouped_gemm.GroupedLinear.apply(x.to(BF16), self.weight, offs)
        main_grad = getattr(self.weight, "main_grad", None)
        for i, w in enumerate(self.weight.unbind(0)):
            if main_grad is not None:
                w.main_grad = main_grad[i]  # TE's fused wgrad accumulates into it
            setattr(self.gemm, f"weight{i}", w)  # a plain attribute: TE reads weight{i} with getattr
        return self.gemm(x.to(BF16), m_splits, is_first_microbatch=self.first_microbatch())

    def extra_repr(self) -> str:
        pad = f", rows padded to {self.align_size}" if self.align_size else ""
        kernel = "te.GroupedLinear" if self.gemm is not None else KERNELS["grouped"]
        return f"{self.num_gemms} x ({self.in_features}, {self.out_features}), {kernel}{pad}"


class TEMoEMLP(nn.Module):
    """In place of te.TransformerLayer's LayerNormMLP: `norm` (TE's RMSNorm/LayerNorm, bf16 out)
    then `moe`; returns (output, None) as the layer's MLP does (no bias to add)."""

    def __init__(self, te, cfg: ModelConfig, moe: MoE):
        super().__init__()
        kind = {"RMSNorm": te.RMSNorm, "LayerNorm": te.LayerNorm}[cfg.normalization]
        self.norm = kind(cfg.hidden_size, eps=cfg.layernorm_epsilon, params_dtype=BF16, device="cuda")
        self.moe = moe

    def forward(self, hidden_states: torch.Tensor, is_first_microbatch=None):
        return self.moe(self.norm(hidden_states)), None


class TEExpertOps:
    """harness.model.moe.ExpertOps (and the shared expert's linears) for one TE MoE block."""

    def __init__(self, backend, cfg: ModelConfig, fuse_wgrad: bool, first_microbatch):
        self.backend, self.cfg, self.fuse_wgrad = backend, cfg, fuse_wgrad
        self.first_microbatch = first_microbatch

    def _std(self, name: str) -> float:
        """Megatron's init: fc2 (the output layer of an MLP) at std / sqrt(2 * layers)."""
        std = self.cfg.init_method_std
        return std / (2 * self.cfg.num_layers) ** 0.5 if name.endswith("fc2") else std

    def grouped_linear(self, name: str, num_gemms: int, in_features: int, out_features: int) -> nn.Module:
        from harness.backends.emulated import expert_alignment

        recipe = self.backend.plan.recipe_for(name)
        return TEGroupedExperts(
            self.backend.te,
            name,
            num_gemms,
            in_features,
            out_features,
            fuse_wgrad=self.fuse_wgrad,
            align_size=expert_alignment(recipe),
            std=self._std(name),
            first_microbatch=self.first_microbatch,
            kernels=expert_kernels(
                resolve(self.backend.spec.options.moe_experts, self.cfg.num_moe_experts), recipe
            ),
        )

    def linear(self, name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        """The shared expert's fc1/fc2: te.Linear, given the step's is_first_microbatch."""
        std = self._std(name)
        mod = self.backend.te.Linear(
            in_features,
            out_features,
            bias=bias,
            params_dtype=BF16,
            device="cuda",
            fuse_wgrad_accumulation=self.fuse_wgrad,
            init_method=lambda w: nn.init.normal_(w, 0.0, std),
            name=name,
        )
        first = self.first_microbatch
        mod.register_forward_pre_hook(
            lambda m, args, kwargs: (args, {**kwargs, "is_first_microbatch": first()}), with_kwargs=True
        )
        return mod

    def activation(self, name: str, kind: str) -> nn.Module:
        from harness.backends.emulated import Activation

        return Activation(name, kind, self.backend.spec.optimizer.activation_func_fp8_input_store)


def moe_mlp(te, backend, cfg: ModelConfig, index: int, fuse_wgrad: bool, first_microbatch) -> TEMoEMLP:
    """Block `index`'s MoE MLP on TE: its router and gate parameters in bf16 on the GPU (TE's params
    are bf16, FusedAdam keeps fp32 masters), the expert bias and token counts in fp32 (Megatron's)."""
    ops = TEExpertOps(backend, cfg, fuse_wgrad, first_microbatch)
    prefix = f"blocks.{index}.mlp"
    shared_size = cfg.moe_shared_expert_intermediate_size
    shared = MLP(cfg, ops, f"{prefix}.shared_experts", shared_size) if shared_size else None
    moe = MoE(cfg, ops, prefix, shared)
    moe.to("cuda")
    with torch.no_grad():
        for p in (moe.router.weight, moe.shared_experts_gate):
            if p is not None:
                p.data = p.data.to(BF16)
    return TEMoEMLP(te, cfg, moe)


def expert_kernels(asked: str, recipe) -> str:
    """What runs an expert group's GEMMs: backend.moe_experts for a group that computes in BF16
    (`recipe` None: the plan's BF16), TE's GroupedLinear for one that quantizes."""
    return asked if recipe is None else "te"
