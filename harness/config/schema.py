"""Typed config schema: one dataclass per Hydra group, mirrored 1:1 by ``conf/<group>/``.

Field names follow Megatron Core (``TransformerConfig`` / ``arguments.py``) and Transformer Engine
where one exists, so users recognise them and the Megatron export is a rename-free mapping.
Plain dataclasses only: no Hydra import here, so the numerics package can use these types.
The recipe names and what each recipe means live in the registry, `harness.recipes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FP8_FORMATS = ("e4m3", "hybrid")
FP4_FORMATS = ("e2m1",)
STATE_DTYPES = ("fp32", "fp16", "bf16", "fp8")
FP8_FAST_ACCUMULATION = ("fprop", "all")
INT4_SCOPES = ("all_linear", "routed_experts")
TE_EXACT_VERSION = "2.20.2"
"""The TE whose numerics the emulated backend reproduces bit for bit (docs/numerics.md)."""


@dataclass
class RecipeConfig:
    """What each GEMM operand becomes (docs/numerics.md); `name` picks TE's recipe class."""

    name: str = "bf16"
    """bf16, delayed, tensorwise, blockwise, mxfp8, nvfp4, int4_qat or custom."""
    fp8: str | None = None
    """FP8 format (Megatron --fp8-format): e4m3, or hybrid (E4M3 forward, E5M2 gradients); null = off."""
    fp4: str | None = None
    """FP4 format (Megatron --fp4-format): e2m1; null = off. Exclusive with `fp8`."""
    fp8_amax_history_len: int = 1024
    """Delayed scaling: amax history length (the guide's 1024; Megatron's argparse default is 1)."""
    fp8_amax_compute_algo: str = "max"
    """Delayed scaling: `max` over the history or `most_recent`."""
    power_2_scales: bool = False
    """Round per-tensor/per-block scales down to a power of two (blockwise default: true)."""
    amax_epsilon: float = 0.0
    """Lower bound on amax before the scale is computed (current and block scaling)."""
    x_block_dim: int = 1
    """Blockwise: activation scaling dims, 1 = 1x128 blocks, 2 = 128x128 tiles."""
    w_block_dim: int = 2
    """Blockwise: weight scaling dims, 1 = 1x128 blocks, 2 = 128x128 tiles."""
    grad_block_dim: int = 1
    """Blockwise: gradient scaling dims, 1 = 1x128 blocks, 2 = 128x128 tiles."""
    disable_rht: bool = False
    """NVFP4: skip the random Hadamard transform of the wgrad operands."""
    disable_stochastic_rounding: bool = False
    """NVFP4: round gradients to nearest instead of stochastically."""
    disable_2d_quantization: bool = False
    """NVFP4: quantize weights in 1x16 blocks instead of 16x16 tiles."""
    int4_group_size: int = 128
    """INT4 fake-QAT: group size along the input dim (miles: 128, Kimi-K2 32)."""
    int4_scope: str = "all_linear"
    """INT4 fake-QAT: which weights are fake-quantized: `all_linear` (every block linear) or
    `routed_experts` (miles' scope: the routed experts' weights only; attention, the shared expert and
    dense MLPs stay BF16)."""
    quantizer_factory: str | None = None
    """custom: import path `module:function` of `factory(role, recipe_cfg) -> quantizer`."""
    fp8_dpa: bool = False
    """TE FP8 attention: DotProductAttention quantizes Q, K, V, O and their grads (TE recipe field
    `fp8_dpa`; Megatron's TransformerConfig.fp8_dot_product_attention, no flag). backend=te only, where
    TE runs it natively: delayed scaling, or current scaling and MXFP8 from compute capability 10.0."""
    fp8_mha: bool = False
    """TE FP8 multi-head attention: also the QKV GEMM output and the projection input stay FP8 (TE
    recipe field `fp8_mha`; Megatron's TransformerConfig.fp8_multi_head_attention); needs fp8_dpa."""
    fp8_fast_accumulation: str = "fprop"
    """Which FP8 GEMMs use Hopper/Ada's fast accumulation (cuBLASLt FAST_ACCUM, never promoted to fp32)
    instead of TE's split accumulator: fprop (TE's default) or all (dgrad and wgrad too: TE
    Float8CurrentScaling's fp8_gemm_dgrad/fp8_gemm_wgrad = MMParams(use_split_accumulator=False)).
    Changes numerics; tensorwise (Float8CurrentScaling) on backend=te only (Megatron has no flag)."""
    backward_override: str | None = None
    """TE 2.20's `backward_override` (every recipe but delayed; NVTE_BACKWARD_OVERRIDE): null = the
    backward GEMMs on quantized operands; `high_precision` = dgrad and wgrad on the unquantized bf16
    grad, weight and input; `dequantized` = on the bf16 grad and the dequantized forward copies of the
    weight and input (docs/numerics.md, "backward_override")."""
    row_scaled_activation: bool = False
    """NVFP4: activations (inputs) scaled per row, an fp32 global scale per row instead of per tensor
    (TE NVFP4BlockScaling.row_scaled_activation; NVTE_NVFP4_ROW_SCALED_ACTIVATION)."""
    nvfp4_4over6: str = "none"
    """NVFP4 4over6 adaptive block scaling (TE `nvfp4_4over6`; NVTE_NVFP4_4OVER6): for which tensors each
    16-block picks between a block max mapped to 6 and one mapped to 4 by the lower error: none, weights,
    activations or all."""
    nvfp4_4over6_e4m3_use_256: str = "all"
    """NVFP4 4over6: which 4over6 tensors use 256 instead of 448 as the global E4M3 scale bound
    (TE `nvfp4_4over6_e4m3_use_256`): none, weights, activations or all."""
    nvfp4_4over6_err_mode: str = "MAE"
    """NVFP4 4over6: the error that picks the candidate, MAE or MSE (TE `nvfp4_4over6_err_mode`)."""
    enable_2d_quantization: bool = False
    """MXFP8: weights in 32x32 tiles with one E8M0 scale each, so the rowwise and columnwise copies are
    the same codes (TE MXFP8BlockScaling.enable_2d_quantization)."""


@dataclass
class ModuleOverride:
    """Per-module precision override, matched against the module's qualified name (fnmatch)."""

    pattern: str = "*"
    """Glob over module names, e.g. `blocks.0.*` or `*.fc2`."""
    recipe: str = "bf16"
    """bf16 (no quantization) or a recipe family of conf/recipe."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Recipe fields of this module's recipe that differ from its preset (or from the run's recipe
    when `recipe` is the run's), e.g. {fp8_fast_accumulation: all}; validated as recipe.* is."""
    resolved: RecipeConfig | None = None
    """Filled when the config is loaded: the full fields this module runs (run.json records them)."""


@dataclass
class SchedulePhase:
    """One phase of a precision schedule: from its first step on, the run's GEMMs follow its recipe."""

    at_step: int | None = None
    """The phase's first step (optimizer steps done when it starts); exclusive with at_fraction."""
    at_fraction: float | None = None
    """The phase's first step as a fraction of the run's steps (round(fraction x steps)), in (0, 1)."""
    recipe: str | None = None
    """The phase's recipe family (conf/recipe); null = the run's recipe (the `recipe` group)."""
    fields: dict[str, Any] = field(default_factory=dict)
    """Recipe fields that differ from the phase's preset (or from the run's recipe when `recipe` is
    null or the run's), e.g. {backward_override: high_precision}; validated as recipe.* is."""
    resolved: RecipeConfig | None = None
    """Filled when the config is loaded: the full fields this phase runs (run.json records them)."""


@dataclass
class ScheduleConfig:
    """A precision schedule (docs/schedules.md): the `recipe` group runs from step 0, each phase from
    its own first step on; weights, optimizer, LR schedule, data position and RNGs carry over."""

    name: str = "none"
    """Preset name, reported with the run's variant."""
    phases: list[SchedulePhase] = field(default_factory=list)
    """The phases after the first, in step order; empty = one recipe for the whole run."""


@dataclass
class StabilityConfig:
    """The guide's stability knobs (Megatron names)."""

    name: str = "none"
    """Preset name, reported as part of a run's variant."""
    fp8_margin: int = 0
    """Extra bits of headroom in delayed scaling: scale = fp8max * 2^-margin / amax."""
    fp8_wgrad: bool = True
    """false = the wgrad GEMM in high precision (--no-fp8-wgrad)."""
    first_last_layers_bf16: bool = False
    """Keep the first and last transformer blocks unquantized (--first-last-layers-bf16)."""
    num_layers_at_start_in_bf16: int = 1
    """How many blocks at the start stay BF16 when first_last_layers_bf16."""
    num_layers_at_end_in_bf16: int = 1
    """How many blocks at the end stay BF16 when first_last_layers_bf16."""
    overrides: list[ModuleOverride] = field(default_factory=list)
    """Per-module overrides by name pattern, applied in order (last match wins)."""
    plan_file: str | None = None
    """A precision plan (`python -m harness.plan`) whose per-module overrides are loaded before
    `overrides` (which still win); null = none."""


@dataclass
class OptimizerConfig:
    """AdamW, its schedule, and the precision-aware optimizer's dtypes (Megatron names)."""

    name: str = "adamw_fp32"
    """Preset name, reported as part of a run's variant."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW), on matrices only."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam beta1, beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    warmup_steps: int = 10
    """Linear warm-up steps; cosine decay to min_lr over the remaining steps."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 = off."""
    master_weights: bool = True
    """Keep fp32 master weights (false = optimizer updates bf16 params directly: anchors.md's setup)."""
    use_precision_aware_optimizer: bool = False
    """TE FusedAdam with low-precision states and main grads (--use-precision-aware-optimizer)."""
    main_grads_dtype: str = "fp32"
    """Dtype of the gradient buffer: fp32 or bf16."""
    main_params_dtype: str = "fp32"
    """Dtype of the master weights: fp32 or fp16."""
    exp_avg_dtype: str = "fp32"
    """First moment dtype: fp32, fp16, bf16 or fp8 (E4M3, per-tensor scale)."""
    exp_avg_sq_dtype: str = "fp32"
    """Second moment dtype: fp32, fp16, bf16 or fp8 (E4M3, per-tensor scale)."""
    fp8_param: bool = False
    """Keep weights quantized (--fp8-param-gather / --fp4-param-gather; TE quantized_model_init)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks (--use-distributed-optimizer)."""
    optimizer_cpu_offload: bool = False
    """Keep optimizer states and step on the host (--optimizer-cpu-offload; delayed only)."""
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    """Reuse the grad buffer for the MXFP8 param all-gather (recommended with mxfp8 + fp8_param)."""
    activation_func_fp8_input_store: bool = False
    """Save the MLP activation input in FP8 (E4M3, unscaled) for backward."""
    step_in_backward: bool = False
    """Update each parameter inside backward once its grad is ready, on a side CUDA stream (same numbers)."""


@dataclass
class HardwareConfig:
    """The accelerator a run targets: peaks for MFU and which recipes run natively."""

    name: str = "cpu"
    """cpu, a100, h100, h200, b200, gb200, or auto (detect)."""
    compute_capability: float | None = None
    """CUDA compute capability (9.0 Hopper, 10.0 Blackwell); null on a CPU."""
    peak_tflops: dict[str, float | None] = field(
        default_factory=lambda: {"bf16": None, "fp8": None, "fp4": None}
    )
    """Dense peak TFLOP/s per dtype from the vendor datasheet (null = none)."""
    measured_tflops: dict[str, float | None] = field(default_factory=lambda: {"bf16": None, "fp8": None})
    """GEMM ceilings measured on this part (anchors.md), where known."""
    native_recipes: list[str] = field(default_factory=lambda: ["bf16"])
    """Recipes TE runs natively on this hardware."""


@dataclass
class ModelConfig:
    """GPT shape (Megatron TransformerConfig names)."""

    name: str = "gpt_small"
    """Preset name."""
    num_layers: int = 4
    """Transformer blocks."""
    hidden_size: int = 256
    """Model width."""
    num_attention_heads: int = 4
    """Attention heads."""
    ffn_hidden_size: int = 1024
    """MLP width (for swiglu: the width of each of the two input projections)."""
    seq_length: int = 256
    """Tokens per sequence."""
    vocab_size: int = 256
    """Vocabulary size (the data's vocabulary must fit)."""
    normalization: str = "LayerNorm"
    """LayerNorm or RMSNorm."""
    activation: str = "gelu"
    """gelu or swiglu."""
    position_embedding: str = "learned"
    """learned or rope."""
    add_bias_linear: bool = False
    """Bias in linear layers."""
    init_method_std: float = 0.02
    """Std of the normal weight init."""
    layernorm_epsilon: float = 1e-5
    """Norm epsilon."""
    cross_entropy_loss_fusion: bool = False
    """The cross entropy in one fused kernel on the bf16 logits (Megatron --cross-entropy-loss-fusion
    with --cross-entropy-fusion-impl te: TE's parallel_cross_entropy): no fp32 copy of the logits,
    the logits' gradient written in their own storage. backend=te only."""
    lm_head_loss_chunks: int = 0
    """0: the LM head's logits are made whole, then the loss. N > 0: the LM head and the cross
    entropy run fused over N chunks of tokens and never hold the whole logits (Liger's fused
    linear cross entropy; saves several GiB at vocab 50k)."""
    num_query_groups: int | None = None
    """Grouped-query attention: key/value heads (--num-query-groups); null = num_attention_heads."""
    kv_channels: int | None = None
    """Head size (--kv-channels); null = hidden_size / num_attention_heads (Qwen3 sets its own)."""
    rotary_base: float = 10000.0
    """RoPE theta (--rotary-base; Llama 3: 500000, Qwen3: 1000000)."""
    rope_scaling: bool = False
    """Llama 3.1's RoPE frequency scaling (--use-rope-scaling; HF rope_type llama3), the four below."""
    rope_scaling_factor: float = 8.0
    """Low frequencies divided by this (--rope-scaling-factor; HF factor; Llama 3.2 1B/3B: 32)."""
    rope_low_freq_factor: float = 1.0
    """Wavelengths above original_max / this are scaled fully (HF low_freq_factor)."""
    rope_high_freq_factor: float = 4.0
    """Wavelengths below original_max / this are kept; between the two, interpolated (HF high_freq_factor)."""
    rope_original_max_position_embeddings: int = 8192
    """The context the model was pretrained at (HF original_max_position_embeddings)."""
    untie_embeddings_and_output_weights: bool = True
    """false: the LM head reuses the embedding matrix (tied, as small Llama 3.2 / Qwen3 models)."""
    qk_layernorm: bool = False
    """Normalize each head's queries and keys before RoPE (--qk-layernorm; Qwen3), with `normalization`."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection only (--add-qkv-bias; Qwen2)."""
    hf_config: str | None = None
    """model=hf: the Hugging Face config.json (or its directory) the shape is read from."""
    # mixture of experts (Megatron's TransformerConfig names and defaults; harness/model/moe.py)
    num_moe_experts: int | None = None
    """Routed experts of each MoE layer (--num-experts); null = a dense model."""
    moe_ffn_hidden_size: int | None = None
    """Each routed expert's MLP width (--moe-ffn-hidden-size); null = ffn_hidden_size."""
    moe_router_topk: int = 2
    """Experts each token is routed to (--moe-router-topk)."""
    moe_router_score_function: str = "softmax"
    """softmax or sigmoid (--moe-router-score-function)."""
    moe_router_pre_softmax: bool = False
    """Score function before the top-k selection (--moe-router-pre-softmax); false: softmax over the
    top-k logits (Mixtral; Qwen3-MoE's norm_topk_prob=true)."""
    moe_router_topk_scaling_factor: float | None = None
    """Routing probabilities scaled by this (--moe-router-topk-scaling-factor; DeepSeek-V3: 2.5)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """aux_loss (per micro-batch), seq_aux_loss (per sequence, DeepSeek) or none."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss in the training objective (--moe-aux-loss-coeff); 0 = off."""
    moe_z_loss_coeff: float | None = None
    """Weight of the router z-loss in the training objective (--moe-z-loss-coeff); null = off."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias on the sigmoid scores used for the
    top-k selection only, moved after each step by the tokens each expert got."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of that expert bias update (--moe-router-bias-update-rate)."""
    moe_shared_expert_intermediate_size: int | None = None
    """Width of the shared expert every token also goes through; null = none (Qwen2-MoE: 5632)."""
    moe_shared_expert_gate: bool = False
    """A sigmoid gate on the shared expert's output (Qwen2-MoE's shared_expert_gate)."""
    moe_layer_freq: Any = 1
    """Which layers are MoE: N = every N-th from the first, or a 0/1 list of num_layers
    (--moe-layer-freq; [0, 1, 1, ...] = DeepSeek's first dense layers)."""
    moe_router_dtype: str | None = None
    """Dtype of the router's logits and probabilities: fp32, fp64, or null = the model's (bf16)."""
    moe_expert_capacity_factor: float | None = None
    """Tokens an expert takes at most, as a factor of its even share; the lowest-probability ones
    beyond it are dropped (Megatron's drop policy `probs`); null = dropless."""
    moe_router_padding_for_quantization: bool = False
    """Quantized recipes: pad each expert's tokens to the recipe's alignment by routing real tokens
    at probability 0 (Megatron's pad_routing_map) instead of zero rows; read by the recipes on experts."""


@dataclass
class DataConfig:
    """Token source and its held-out eval split."""

    name: str = "markov"
    """synthetic, markov, stdlib_bytes, stdlib_text, memmap, megatron, blend, hf_dataset or custom."""
    path: str | None = None
    """memmap: a .bin file or a directory with train.bin/val.bin; megatron: dataset prefix."""
    eval_path: str | None = None
    """Optional separate eval file/prefix (else the last eval_fraction is held out)."""
    eval_fraction: float = 0.05
    """Fraction of the token stream held out for eval when there is no eval_path."""
    seed: int = 1234
    """Seed of the source itself (markov transition matrix, synthetic stream)."""
    vocab_size: int | None = None
    """Source vocabulary (markov/synthetic); null = the model's vocab_size."""
    alpha: float = 0.05
    """markov: Dirichlet concentration of each transition row (small = more structure)."""
    num_tokens: int = 2_000_000
    """markov/synthetic: length of the generated stream."""
    token_dtype: str = "uint16"
    """memmap: uint16 or uint32."""
    tokenizer: str | None = None
    """hf_dataset: tokenizer.json, a model directory, a .tiktoken or sentencepiece .model file, a hub name."""
    text_key: str = "text"
    """hf_dataset: the column (parquet, arrow) or JSONL field holding the text."""
    cache_dir: str = "~/.cache/lowp/data"
    """hf_dataset, stdlib_text: where the tokenized files (and stdlib_text's BPE) are kept between runs."""
    _target_: str | None = None
    """custom: import path of a callable (vocab_size, seq_length, **params) -> TokenData (docs/data.md)."""
    params: dict[str, Any] = field(default_factory=dict)
    """custom: keyword arguments of the _target_ callable."""


@dataclass
class BackendConfig:
    """Who executes the recipe."""

    name: str = "auto"
    """te (Transformer Engine), emulated (pure PyTorch numerics), or auto."""
    te_version: str = TE_EXACT_VERSION
    """TE version assumed for validation when TE is not installed."""
    packed_qkv_grad: bool = False
    """backend=te: q, k and v leave the fused QKV output through one autograd node whose backward
    hands attention's packed dQKV buffer back as it is (TE 2.20 selects them one by one: three
    zero-filled full-size copies and two adds a layer). Same numbers, fewer passes."""
    moe_experts: str = "te"
    """backend=te, MoE models: what runs the GEMMs of expert groups that compute in BF16: `te` (TE's
    GroupedLinear, Megatron's TEGroupedMLP: a GEMM per expert, the wgrad added to the fp32 main grad
    inside its GEMM), `grouped` (one grouped kernel per pass: torch._grouped_mm for fprop and dgrad,
    a Triton kernel that adds the fp32 wgrad into the fp32 main grad, as TE's GEMM does) or `auto`
    (grouped from 128 experts up where triton runs, te below: the faster of the two as measured,
    harness.backends.te_moe.AUTO_GROUPED_MIN_EXPERTS). The backend presets set `auto`; `te` here is
    what a run stored before the field resumes with. Groups under a quantizing recipe run on TE's
    GroupedLinear either way (benchmarks/RESULTS.md, "The expert MLP alone")."""
    deterministic: bool = False
    """The same bits every run of a seed (Megatron-LM's --deterministic-mode): NCCL_ALGO=Ring,
    NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 (TE's deterministic attention backward) and
    CUBLAS_WORKSPACE_CONFIG=:4096:8 where unset, and torch.use_deterministic_algorithms(True), for
    the run (harness.backends.determinism). What a paired loss check needs on CUDA, where atomics
    make two runs of one seed part within steps; slower kernels in places."""


@dataclass
class WandbConfig:
    """W&B settings; the real client, offline by default."""

    mode: str = "offline"
    """offline (files to `wandb sync`), online, or disabled."""
    project: str = "lowp"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user)."""
    group: str | None = None
    """Run group; null = the sweep directory's name for multiruns."""
    tags: list[str] = field(default_factory=list)
    """Extra tags (recipe and backend are always added)."""


@dataclass
class LoggerConfig:
    """Where metrics go besides the run directory's local files (always written)."""

    name: str = "wandb"
    """wandb or none."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """W&B settings."""


@dataclass
class DivergenceConfig:
    """When a run counts as diverged (it then ends with status `diverged`, exit code 0)."""

    loss_spike_factor: float = 2.0
    """Diverged when the train loss exceeds this factor x its running minimum (0 = no spike check)."""
    patience: int = 3
    """... on this many consecutive logged rows. NaN/Inf loss or gradient norm end a run at once."""


@dataclass
class TelemetryConfig:
    """What numerics telemetry (telemetry_interval) writes beyond one row per quantized operand."""

    moe_experts_per_layer: int = 4
    """Experts per MoE layer and telemetry step whose rows are kept whole: the worst by SQNR (the
    lowest of their operands'); the others' rows are summed up as their max and median."""
    candidates: list[Any] = field(default_factory=list)
    """Counterfactual recipes every block GEMM's operands are also quantized with on telemetry steps
    (numerics.jsonl rows with a `candidate`; training unchanged): a recipe name or {name: ..., field:
    value}, e.g. [mxfp8, nvfp4, {name: blockwise, w_block_dim: 1}]; [] = none."""


OBJECTIVES = ("autoregressive", "masked_diffusion")


@dataclass
class ObjectiveConfig:
    """What the model is trained to predict (docs/diffusion.md). MegaDLMs' names where it has them
    (custom_args/difflm.py: --mask-token, --difflm-varilen-prob); LLaDA's `eps` for the bound on t."""

    name: str = "autoregressive"
    """autoregressive (next token, causal attention) or masked_diffusion (LLaDA-style: recover the
    masked tokens of a sequence, bidirectional attention)."""
    mask_token: int | None = None
    """Masked diffusion: the input id of a masked token; null = the first id the data never produces
    (data.vocab_size), which model.vocab_size must leave room for."""
    difflm_varilen_prob: float = 0.01
    """Masked diffusion: share of micro-batches cut to a random length (MegaDLMs' default 0.01),
    rounded up to the recipe's GEMM multiple."""
    eps: float = 0.0
    """Masked diffusion: t ~ U(eps, 1) as LLaDA's forward_process, t = (1 - eps) u + eps (LLaDA: 1e-3;
    MegaDLMs: 0, plain U(0, 1))."""
    eval_t: list[float] = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    """Masked diffusion: the fixed mask ratios of every eval; loss/eval is the mean of their masked-token
    losses (the midpoint rule for the objective's bound)."""
    eval_mask_seed: int = 0
    """Masked diffusion: seed of the eval masks, not the run's seed, so every seed and recipe meets
    the same masks."""


RESUME_MODES = ("auto", "never", "must")
PARALLEL_STRATEGIES = ("none", "ddp", "fsdp2")


@dataclass
class ParallelConfig:
    """Data parallelism over torch.distributed (docs/distributed.md); the world size comes from the
    launcher's environment (torchrun's WORLD_SIZE/RANK, or Slurm's SLURM_NTASKS/SLURM_PROCID)."""

    name: str = "none"
    """Preset name."""
    strategy: str = "none"
    """none (one process), ddp (gradients all-reduced once per step, Megatron's DDP) or fsdp2
    (torch.distributed.fsdp.fully_shard: parameters, gradients and optimizer state sharded)."""
    backend: str = "auto"
    """Process-group backend: auto (nccl on CUDA, gloo on CPU), nccl or gloo."""
    timeout_s: float = 600.0
    """Collective timeout: a dead or stuck rank makes the others fail after this long, never hang."""
    tp_only_amax_red: bool = False
    """Delayed scaling: reduce amaxes over the tensor-parallel group only (Megatron's
    TransformerConfig.tp_only_amax_red, a model-provider field, not a flag); with no tensor
    parallelism that is no reduction at all. false: MAX over the data-parallel group (TE's default
    amax_reduction_group in Megatron)."""
    reshard_after_forward: bool = True
    """fsdp2: free the gathered parameters after forward (ZeRO-3); false keeps them to backward (ZeRO-2)."""


@dataclass
class Config:
    """The root: groups plus run-level keys (architecture.md `train` row)."""

    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    stability: StabilityConfig = field(default_factory=StabilityConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    divergence: DivergenceConfig = field(default_factory=DivergenceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    name: str | None = None
    """Run name (W&B name); null = derived from recipe and seed."""
    seed: int = 0
    """Seed of init, data order and stochastic rounding."""
    steps: int = 200
    """Optimizer steps."""
    micro_batch_size: int = 8
    """Sequences per micro-batch."""
    global_batch_size: int = 8
    """Sequences per optimizer step over all ranks (accumulation = global / (micro x world size))."""
    eval_interval: int = 50
    """Steps between evals (and at the end); 0 = only at the end."""
    eval_tokens: int = 32768
    """Fixed held-out token budget per eval, at most the tokens the run trains on (steps x
    global_batch_size x seq_length: a short run's evals cost no more than its training)."""
    log_interval: int = 10
    """Steps between logged metric rows."""
    telemetry_interval: int = 0
    """Steps between numerics telemetry rows; 0 = off."""
    checkpoint_interval: int | None = None
    """Steps between checkpoints; null = every 10% of the steps, at most every 10 steps (a run of
    fewer checkpoints only at its end); 0 = only at the end; -1 = only when a signal stops the run
    (a stopped run always resumes)."""
    checkpoint_keep: int = 2
    """How many of the newest usable checkpoints are kept (a corrupted one does not count; a corrupted
    newest falls back to the previous)."""
    resume: str = "auto"
    """auto: resume from the run dir's checkpoint if it has one; never: start fresh (the old files
    are moved aside, not deleted); must: refuse to start without a checkpoint."""
    bench_warmup_steps: int = 5
    """Steps excluded from throughput and peak memory."""
    init_from: str | None = None
    """A Hugging Face safetensors checkpoint (file or directory, sharded or not) the model starts
    from instead of its random init; its config.json is read with model=hf model.hf_config=."""
    warm_start: str | None = None
    """A checkpoint (a run dir or its checkpoints/step_N) this run starts from: weights, optimizer
    state, step and LR position, data position and RNGs, but not the recipe's scale state (a new
    recipe starts as TE starts one it has not run; docs/schedules.md). Not a resume: the recipe may differ."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Free-form tags recorded with the run (not used by the harness)."""


def eval_budget(cfg: Config) -> int:
    """The held-out tokens each evaluation reads: eval_tokens, at most the tokens the run trains on
    (steps x global_batch_size x seq_length). The trainer evaluates it, a sweep checks its data
    against it and the Megatron command's --eval-iters is made from it."""
    return min(cfg.eval_tokens, cfg.steps * cfg.global_batch_size * cfg.model.seq_length)
