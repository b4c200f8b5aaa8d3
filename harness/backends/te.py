"""The native backend: Transformer Engine modules under one `te.autocast` (the only call site).

Blocks are fused `te.TransformerLayer`s (LayerNormLinear QKV, fused attention, LayerNormMLP); the
embeddings, final norm and LM head are plain PyTorch in BF16, as Megatron's output layer (never
TE, so never quantized). The TE recipe object is built from config with every field set explicitly;
the `NVTE_*` variables TE reads at import are set from config before TE is imported (validation
already refused a conflicting environment). First/last-N BF16 blocks run inside a nested
`te.autocast(enabled=False)`, as Megatron does; a block whose stability override names another
recipe (or other fields) gets a nested autocast of it.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn as nn

from harness import recipes
from harness.backends.base import Backend, BackendSpec
from harness.backends.te_env import set_nvte_env
from harness.backends.te_moe import moe_mlp
from harness.backends.te_qkv import install_packed_qkv_grad
from harness.backends.te_recipe import TE_GEMM_NAMES, build_te_recipe, split_block_recipe
from harness.config.schema import ModelConfig, OptimizerConfig, RecipeConfig
from harness.model.gpt import GPT, head_dims, norm, rope_inv_freq
from harness.model.moe import moe_layer_pattern

LINEARS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
MOE_LINEARS = ("attn.qkv", "attn.proj", "mlp.experts.fc1", "mlp.experts.fc2")
SHARED_LINEARS = ("mlp.shared_experts.fc1", "mlp.shared_experts.fc2")
# the GEMM weights INT4 QAT fake-quantizes, by their canonical (emulated GPT) names
GEMM_WEIGHT = re.compile(
    r"blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(fc1|fc2|experts\.fc[12]|shared_experts\.fc[12]))\.weight"
)


def block_linears(m: ModelConfig, index: int) -> tuple[str, ...]:
    """The quantizable linears of block `index`, relative to it (an MoE block's experts are groups)."""
    if not moe_layer_pattern(m)[index]:
        return LINEARS
    return MOE_LINEARS + (SHARED_LINEARS if m.moe_shared_expert_intermediate_size else ())


class TEBlock(nn.Module):
    """One te.TransformerLayer; `context` (None = inherit the outer autocast) overrides its recipe.
    `moe_mlp`: an MoE block's MLP (harness.backends.te_moe.TEMoEMLP), in place of its LayerNormMLP.
    `causal` False (harness.model.objective.set_causal): TE's attention with attn_mask_type no_mask,
    as MegaDLMs' --attention-mask-type no_mask."""

    causal = True

    def __init__(
        self,
        m: ModelConfig,
        index: int,
        fuse_wgrad: bool,
        context=None,
        first_microbatch=lambda: None,
        moe_mlp: nn.Module | None = None,
    ):
        super().__init__()
        import transformer_engine.pytorch as te

        std, out_std = m.init_method_std, m.init_method_std / math.sqrt(2 * m.num_layers)
        heads, groups, head_dim = head_dims(m)
        self.layer = te.TransformerLayer(
            m.hidden_size,
            m.ffn_hidden_size if moe_mlp is None else 16,  # an MoE block's LayerNormMLP is replaced
            heads,
            num_gqa_groups=groups,
            kv_channels=head_dim,
            # Megatron's qk_layernorm (and Qwen3) normalizes q and k before RoPE; TE's default is after
            qk_norm_type=m.normalization if m.qk_layernorm else None,
            qk_norm_eps=m.layernorm_epsilon,
            qk_norm_before_rope=True,
            layernorm_epsilon=m.layernorm_epsilon,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            self_attn_mask_type="causal",
            attn_input_format="bshd",
            fuse_qkv_params=True,
            params_dtype=torch.bfloat16,
            bias=m.add_bias_linear,
            activation=m.activation,
            normalization=m.normalization,
            layer_number=index + 1,
            name=f"blocks.{index}",  # its GEMMs' quantizer roles (te_recipe.TE_GEMM_NAMES)
            device="cuda",
            init_method=lambda w: nn.init.normal_(w, 0.0, std),
            output_layer_init_method=lambda w: nn.init.normal_(w, 0.0, out_std),
            # Megatron's path: the wgrad GEMM accumulates straight into each weight's fp32 `main_grad`
            # (harness.optim.MainGrads allocates it); no bf16 weight grad is made, no extra add runs
            fuse_wgrad_accumulation=fuse_wgrad,
        )
        if m.add_qkv_bias and not m.add_bias_linear:
            self.layer.self_attention.layernorm_qkv = qkv_with_bias(
                te, m, fuse_wgrad, std, name=f"blocks.{index}.{TE_GEMM_NAMES['attn.qkv']}"
            )
        if moe_mlp is not None:  # the layer's forward calls it as layernorm_mlp(x, is_first_microbatch=)
            self.layer.layernorm_mlp = moe_mlp
        self.context = context
        self.first_microbatch = first_microbatch  # TE's is_first_microbatch for this forward

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        kw = {"rotary_pos_emb": rope, "is_first_microbatch": self.first_microbatch()}
        if not self.causal:
            kw["self_attn_mask_type"] = "no_mask"
        if self.context is None:
            return self.layer(x, **kw)
        with self.context():
            return self.layer(x, **kw)


def qkv_with_bias(te, m: ModelConfig, fuse_wgrad: bool, std: float, name: str | None = None) -> nn.Module:
    """Qwen2's QKV-only bias (Megatron's add_qkv_bias): te.TransformerLayer has one `bias` flag for
    all its linears, so the layer is built without biases and its attention's QKV LayerNormLinear is
    replaced by one with a bias, built with the arguments TE 2.20's MultiheadAttention gives it
    (fuse_qkv_params=True: one fused weight, interleaved per group; no tensor parallelism)."""
    heads, groups, head_dim = head_dims(m)
    return te.LayerNormLinear(
        m.hidden_size,
        (heads + 2 * groups) * head_dim,
        eps=m.layernorm_epsilon,
        fuse_wgrad_accumulation=fuse_wgrad,
        init_method=lambda w: nn.init.normal_(w, 0.0, std),
        bias=True,  # zero-initialised by TE, as the emulated model's
        normalization=m.normalization,
        return_bias=False,
        params_dtype=torch.bfloat16,
        device="cuda",
        ub_name="qkv",
        name=name,
    )


class TEOps:
    """Only the LM head and the final norm are built through ops: a plain BF16 nn.Linear head."""

    def linear(self, name: str, in_features: int, out_features: int, bias: bool) -> nn.Module:
        assert name == "lm_head", name
        return nn.Linear(in_features, out_features, bias=bias)

    def activation(self, name: str, kind: str) -> nn.Module:
        raise AssertionError("TE blocks own their activation")

    def norm(self, name: str, cfg: ModelConfig) -> nn.Module:
        assert name == "ln_f", name  # TE blocks own theirs; the final norm is the model's
        return norm(cfg)


class TEGPT(GPT):
    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.wte(idx)  # (B, T, C) bf16
        if self.wpe is not None:
            x = x + self.wpe.weight[:T]
        rope = self.rope_emb(T) if self.rope_emb is not None else None
        for block in self.blocks:
            x = block(x, rope)
        return self.ln_f(x)


class TEBackend(Backend):
    name = "te"

    def __init__(self, spec: BackendSpec, device: torch.device):
        super().__init__(spec, device)
        self.nvte_env = set_nvte_env(spec.recipe)
        import transformer_engine
        import transformer_engine.pytorch as te

        self.te, self.te_version = te, transformer_engine.__version__
        self.recipe = build_te_recipe(spec.recipe, spec.stability)
        self._seen: dict[str, tuple[bool, str | None]] = {}
        self.first_microbatch: bool | None = None
        self.optimizer_kernel: str | None = None  # set by build_optimizer

    def microbatch(self, index: int | None, count: int) -> None:
        """With gradient accumulation, TE quantizes (and transposes) the weights on the first
        micro-batch and reuses them on the others (is_first_microbatch): the weights do not change
        inside the window. None (TE quantizes every forward) without accumulation, and for eval."""
        self.first_microbatch = None if index is None or count == 1 else index == 0

    def _block_context(self, index: int):
        """None to inherit the run's autocast; else a nested autocast for this block's own recipe."""
        linears = block_linears(self.spec.model, index)
        planned = [recipes.quantizing(self.plan.recipe_for(f"blocks.{index}.{lin}")) for lin in linears]
        if any(r != planned[0] for r in planned):
            recipe = split_block_recipe(index, dict(zip(linears, planned, strict=True)))
            return lambda: self.te.autocast(enabled=True, recipe=recipe, amax_reduction_group=self.amax_group)
        own = planned[0]
        if own == recipes.quantizing(self.spec.recipe):
            return None
        if own is None:
            return lambda: self.te.autocast(enabled=False)
        nested = build_te_recipe(own, self.spec.stability)
        return lambda: self.te.autocast(
            enabled=nested is not None, recipe=nested, amax_reduction_group=self.amax_group
        )

    @staticmethod
    def _name_of(recipe: RecipeConfig | None) -> str:
        """The recipe TE runs the GEMMs in: the baseline for BF16 GEMMs (bf16 itself, INT4 QAT)."""
        return q.name if (q := recipes.quantizing(recipe)) is not None else recipes.BASELINE

    def build_model(self) -> nn.Module:
        m, spec = self.spec.model, self.spec
        fp8_param = spec.optimizer.fp8_param and self.recipe is not None
        first = lambda: self.first_microbatch  # noqa: E731
        moe = moe_layer_pattern(m)
        with self.te.quantized_model_init(enabled=fp8_param, recipe=self.recipe):
            blocks = nn.ModuleList(
                TEBlock(
                    m,
                    i,
                    spec.fuse_wgrad_fp32,
                    self._block_context(i),
                    first,
                    moe_mlp(self.te, self, m, i, spec.fuse_wgrad_fp32, first) if moe[i] else None,
                )
                for i in range(m.num_layers)
            )
        if spec.options.packed_qkv_grad:
            for block in blocks:
                install_packed_qkv_grad(block.layer)
        ops = TEOps()
        model = TEGPT(m, ops, blocks=blocks)
        model.rope_emb = None
        if m.position_embedding == "rope":
            model.rope_emb = self.te.RotaryPositionEmbedding(head_dims(m)[2], rotary_base=m.rotary_base)
            # the emulated model's frequencies (Llama 3.1's scaling included), which TE's forward uses
            model.rope_emb.inv_freq.copy_(rope_inv_freq(m))
        for name, child in model.named_children():
            if name == "rope_emb":  # its inv_freq stays fp32, as in Megatron and HF (bf16 would blur it)
                child.to(device=self.device)
            elif name != "blocks":
                child.to(device=self.device, dtype=torch.bfloat16)
        self._install_probes(model)
        self._model = model
        return model

    def autocast(self):
        return self.te.autocast(
            enabled=self.recipe is not None, recipe=self.recipe, amax_reduction_group=self.amax_group
        )

    def collect_telemetry(self):
        """Rows from TE's own quantizers; hooks exist only inside the block (te_telemetry.py)."""
        from harness.backends.te_telemetry import TETelemetry

        recipe_of = lambda name: self._name_of(self.plan.recipe_for(name))  # noqa: E731
        return TETelemetry(self._model, self.spec.model.activation, recipe_of, self.counterfactual).collect()

    def build_optimizer(self, model: nn.Module, cfg: OptimizerConfig):
        """TE FusedAdam over the bf16 params (harness.optim); whole fp32 masters where the recipe's
        params hold something other than bf16(master) (RecipeSpec.full_master: INT4 QAT's W-hat)."""
        from harness.optim import build_optimizer

        opt = build_optimizer(model, cfg, self.device, native=True, full_master=self.recipe_spec.full_master)
        kernel = getattr(opt.inner, "kernel", None)
        self.optimizer_kernel = kernel() if kernel else type(opt.inner).__name__
        return opt

    # ---- recipe hooks (INT4 fake-QAT: the bf16 params hold W-hat, FusedAdam's fp32 masters hold W) ---
    def _hooked_weights(self, model: nn.Module) -> list[nn.Parameter]:
        """The GEMM weights whose linear the plan quantizes (an expert group's whole tensor)."""
        out = []
        for n, p in model.named_parameters():
            name = self.canonical_name(n)
            if GEMM_WEIGHT.fullmatch(name) and self.plan.recipe_for(name.rsplit(".", 1)[0]) is not None:
                out.append(p)
        return out

    def prepare(self, model: nn.Module, optimizer) -> None:
        if self.hook is not None:
            self.hook.prepare(self._hooked_weights(model), optimizer)

    def after_optimizer_step(self, model: nn.Module) -> None:
        """Straight-through QAT: FusedAdam wrote bf16(master) into each param; the hook replaces it
        by W-hat, so the next forward uses W-hat and its gradient updates the master W."""
        if self.hook is not None:
            self.hook.after_optimizer_step(self._hooked_weights(model))

    # ---- proof that the recipe is really active ------------------------------------------------
    def _install_probes(self, model: nn.Module) -> None:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        def probe(name):
            def hook(module, args):
                if name not in self._seen:
                    enabled = FP8GlobalStateManager.is_fp8_enabled()
                    rec = FP8GlobalStateManager.get_fp8_recipe() if enabled else None
                    self._seen[name] = (enabled, type(rec).__name__ if rec is not None else None)

            return hook

        for i, block in enumerate(model.blocks):
            block.layer.register_forward_pre_hook(probe(f"blocks.{i}"))

    def verify_active(self, model: nn.Module, step: int) -> None:
        """Each block ran with the quantization state the plan says; delayed scales moved off 1.0."""
        for i in range(len(model.blocks)):
            planned = self.plan.recipe_for(f"blocks.{i}.attn.qkv")
            want = self._name_of(planned)
            enabled, rec = self._seen.get(f"blocks.{i}", (None, None))
            if enabled is None:
                raise RuntimeError(f"blocks.{i} never ran its forward: cannot prove the recipe is active")
            if (recipes.quantizing(planned) is not None) != enabled:
                raise RuntimeError(
                    f"blocks.{i} ran with TE quantization enabled={enabled} but the plan says "
                    f"{want}: the recipe is not what the config asked for"
                )
        if step >= 2 and self.recipe_spec.delayed_scaling:
            scales = [
                m.fp8_meta["scaling_fwd"].scale
                for m in model.modules()
                if getattr(m, "fp8_meta", None) and "scaling_fwd" in m.fp8_meta
            ]
            if not scales or all(bool((s == 1.0).all()) for s in scales):
                raise RuntimeError(
                    "delayed scaling: every forward scale is still 1.0 after "
                    f"{step + 1} steps: the amax/scale update is not running"
                )

    # ---- checkpoints: canonical parameter names; the FP8 scaling state as plain tensors ---------------
    def canonical_name(self, name: str) -> str:
        from harness.backends.te_names import canonical_name

        return canonical_name(name)

    def _fp8_metas(self):
        """(module name, fp8_meta key, FP8TensorMeta) of every TE module that keeps scaling state."""
        for name, m in self._model.named_modules():
            meta = getattr(m, "fp8_meta", None) or {}
            for key in ("scaling_fwd", "scaling_bwd"):
                if key in meta:
                    yield name, key, meta[key]

    def state_dict(self) -> dict:
        """Delayed scaling's amax histories and scales, value by value (TE's own `_extra_state` is a
        pickle, so it stays out of the checkpoint); recipes without state give {}, and so does a
        CustomRecipe's meta (a block a plan splits), whose scale and history are None."""
        out: dict = {}
        for name, key, meta in self._fp8_metas():
            out.setdefault(name, {})[key] = {
                a: value.clone()
                for a in ("scale", "amax_history")
                if (value := getattr(meta, a, None)) is not None
            }
        return out

    def _prime(self) -> None:
        """TE makes a module's FP8 metadata at its first forward under autocast; a resumed run loads
        into it before its first step, so one no-grad forward makes it (the loaded values then replace
        whatever that forward recorded, before any quantization uses them)."""
        idx = torch.zeros((1, self.spec.model.seq_length), dtype=torch.long, device=self.device)
        with torch.no_grad(), self.autocast():
            self._model(idx)

    def load_state_dict(self, state: dict, scales: bool = True) -> None:
        """TE draws its random numbers (stochastic rounding) from torch's CUDA generator, which the
        trainer's RNG state carries: `scales=False` loads nothing."""
        if not scales:
            return
        if state and not any(True for _ in self._fp8_metas()):
            self._prime()
        own = {(n, k): meta for n, k, meta in self._fp8_metas()}
        saved = {(n, k) for n, entry in state.items() for k in entry}
        if saved != set(own):
            raise ValueError(f"checkpoint FP8 state covers {sorted(saved)[:3]}, this model {sorted(own)[:3]}")
        for (name, key), meta in own.items():
            for attr, value in state[name][key].items():
                target = getattr(meta, attr)
                if target.shape != value.shape:
                    raise ValueError(
                        f"{name} {key}.{attr}: shape {tuple(value.shape)} in the checkpoint, "
                        f"{tuple(target.shape)} here (recipe.fp8_amax_history_len changed?)"
                    )
                target.copy_(value)

    def _expert_kernels(self) -> dict:
        """MoE models: backend.moe_experts and what runs each expert group's GEMMs."""
        from harness.backends.te_moe import KERNELS, group_kernels, resolve

        if self.spec.model.num_moe_experts is None:
            return {}
        asked = self.spec.options.moe_experts
        resolved = resolve(asked, self.spec.model.num_moe_experts)
        chosen = {g: KERNELS[k] for g, k in group_kernels(asked, self.plan).items()}
        return {"moe_experts": asked, "moe_experts_resolved": resolved, "moe_expert_kernels": chosen}

    def describe(self) -> dict:
        notes, r = [], self.spec.recipe
        if not self.spec.stability.fp8_wgrad and r.backward_override is not None:
            notes.append(
                f"recipe.backward_override={r.backward_override} wins over stability.fp8_wgrad=false "
                "(TE has one backward switch)"
            )
        elif not self.spec.stability.fp8_wgrad:
            notes.append(
                "stability.fp8_wgrad=false mapped to TE backward_override=high_precision "
                "(dgrad and wgrad both in high precision; TE 2.x ignores --no-fp8-wgrad)"
            )
        if self.spec.optimizer.activation_func_fp8_input_store:
            notes.append("activation_func_fp8_input_store has no effect on TE's LayerNormMLP")
        return {
            "backend": "te",
            "recipe_repr": repr(self.recipe)
            if self.recipe is not None
            else "bf16 (no TE autocast quantization)",
            "te_version": self.te_version,
            "nvte_set": self.nvte_env,
            "speed_options": {
                "packed_qkv_grad": self.spec.options.packed_qkv_grad,
                "cross_entropy_loss_fusion": self.spec.model.cross_entropy_loss_fusion,
                "lm_head_loss_chunks": self.spec.model.lm_head_loss_chunks,
                "step_in_backward": self.spec.optimizer.step_in_backward,
                "optimizer_kernel": self.optimizer_kernel,
                **self._expert_kernels(),
            },
            "mapping_notes": notes,
            **self.verification(),
            "block_recipes": self._block_recipes(),
            "quantized_modules": self.plan.quantized_modules(
                [
                    f"blocks.{i}.{lin}"
                    for i in range(self.spec.model.num_layers)
                    for lin in block_linears(self.spec.model, i)
                ]
                + ["lm_head"]
            ),
        }

    def _block_recipes(self) -> dict[str, str]:
        """Each block's recipe, or `per module` where a plan splits it (quantized_modules says how)."""
        out = {}
        for i in range(self.spec.model.num_layers):
            names = {
                self._name_of(self.plan.recipe_for(f"blocks.{i}.{lin}"))
                for lin in block_linears(self.spec.model, i)
            }
            out[f"blocks.{i}"] = names.pop() if len(names) == 1 else "per module (quantized_modules)"
        return out
