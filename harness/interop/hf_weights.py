"""Hugging Face safetensors checkpoints <-> lowp's GPT state dict: the one state-dict adapter.

Names: HF Llama/Mistral/Qwen2/Qwen3 (`model.layers.{i}.self_attn.q_proj.weight`, ...) against lowp's
(`blocks.{i}.attn.qkv.weight`, ...). Layouts: HF keeps q, k, v and gate, up as separate matrices;
lowp (like Megatron and TE's interleaved fused QKV) holds one QKV matrix whose rows are, per query
group, [the group's H/G query heads, its key head, its value head], and one fc1 = [gate; up]
(SwiGLU's silu(gate) * up). A tied model (untie_embeddings_and_output_weights=false) has no
`lm_head.weight` in the file. TE's TransformerLayer names its parameters differently
(harness.backends.te_names, the one map of them): the adapter maps lowp's names to them, layouts
unchanged.

Mixture of experts (harness/model/moe.py): the router `mlp.gate.weight` (E, h) is lowp's
`mlp.router.weight`; the experts are one (E, out, in) tensor per fc in lowp, fc1 = [gate; up] per
expert. Checkpoint files hold them per expert (`mlp.experts.{e}.gate_proj/up_proj/down_proj` for
Qwen2/3-MoE, `block_sparse_moe.experts.{e}.w1/w3/w2` and `block_sparse_moe.gate` for Mixtral), the
layout every transformers version loads and the one written back; transformers 5 holds them fused
(`mlp.experts.gate_up_proj` (E, 2F, h), `mlp.experts.down_proj` (E, h, F)), lowp's fc1/fc2 as they
are, and writes that with save_pretrained(save_original_format=False): both are read. Qwen2-MoE's
shared expert `mlp.shared_expert.*` is lowp's `mlp.shared_experts.fc1/fc2` and its gate
`mlp.shared_expert_gate.weight` (1, h) lowp's `mlp.shared_experts_gate`.

    sd = read_safetensors(PATH)                        # a file, a directory, sharded or not
    lowp_sd = hf_to_lowp(sd, model_cfg)                 # names, fused QKV and fc1
    hf_sd = lowp_to_hf(model.state_dict(), model_cfg)   # and back (export)
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from harness.backends.te_names import te_names
from harness.config.schema import ModelConfig
from harness.model.moe import moe_layer_pattern

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# per-block names that map one to one: lowp suffix -> HF suffix under model.layers.{i}.
BLOCK_1TO1 = {
    "ln1.weight": "input_layernorm.weight",
    "ln2.weight": "post_attention_layernorm.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "attn.proj.bias": "self_attn.o_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp.fc2.weight": "mlp.down_proj.weight",
    "mlp.fc2.bias": "mlp.down_proj.bias",
}
TOP_1TO1 = {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight"}


def safetensors_files(path: str, option: str = "init_from") -> list[Path]:
    """The .safetensors files of a checkpoint: one file, a directory with model.safetensors, or a
    directory with model.safetensors.index.json (shards listed in its weight_map)."""
    p = Path(os.path.expanduser(str(path)))
    if p.is_file():
        if p.name == INDEX:
            return _shards(p, option)
        return [p]
    if (p / INDEX).is_file():
        return _shards(p / INDEX, option)
    if (p / SINGLE).is_file():
        return [p / SINGLE]
    found = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    if len(found) == 1:
        return found
    why = "no such file or directory" if not p.exists() else f"no {SINGLE} or {INDEX} in it"
    raise ValueError(f"{option}={path}: {why}; point it at a Hugging Face safetensors checkpoint")


def _shards(index: Path, option: str) -> list[Path]:
    weight_map = json.loads(index.read_text()).get("weight_map") or {}
    files = sorted({index.parent / f for f in weight_map.values()})
    missing = [f for f in files if not f.is_file()]
    if not files or missing:
        raise ValueError(f"{option}={index}: shard {missing[0] if missing else '(none listed)'} missing")
    return files


def read_safetensors(path: str, option: str = "init_from") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in safetensors_files(path, option):
        part = load_file(str(f))
        dup = sorted(set(part) & set(out))
        if dup:
            raise ValueError(f"{option}={path}: tensor {dup[0]} is in more than one shard")
        out.update(part)
    return out


def _qkv_rows(cfg: ModelConfig) -> tuple[int, int, int]:
    from harness.model.gpt import head_dims

    return head_dims(cfg)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """HF q (H*D, ...), k and v (G*D, ...) -> lowp's fused rows: per group [H/G queries, key, value]."""
    H, G, D = _qkv_rows(cfg)
    rest = q.shape[1:]
    parts = [q.reshape(G, H // G, D, *rest), k.reshape(G, 1, D, *rest), v.reshape(G, 1, D, *rest)]
    return torch.cat(parts, dim=1).reshape((H + 2 * G) * D, *rest)


def split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    H, G, D = _qkv_rows(cfg)
    rest = qkv.shape[1:]
    grouped = qkv.reshape(G, H // G + 2, D, *rest)
    q = grouped[:, : H // G].reshape(H * D, *rest)
    return q, grouped[:, H // G].reshape(G * D, *rest), grouped[:, H // G + 1].reshape(G * D, *rest)


# per-expert projection names: (gate, up, down) of each family's file layout, and its MoE prefix
EXPERT_PROJ = {"mlp": ("gate_proj", "up_proj", "down_proj"), "block_sparse_moe": ("w1", "w3", "w2")}


def moe_prefix(cfg: ModelConfig) -> str:
    """Where a sparse block's router and experts live in the files: Qwen's `mlp` for Qwen3-MoE
    (QK norm) and Qwen2-MoE (a shared expert), else Mixtral's `block_sparse_moe` (as the export's
    architecture is chosen: harness.interop.export.hf_config)."""
    qwen = cfg.qk_layernorm or bool(cfg.moe_shared_expert_intermediate_size)
    return "mlp" if qwen else "block_sparse_moe"


def hf_to_lowp(sd: dict[str, torch.Tensor], cfg: ModelConfig, option: str = "init_from") -> dict:
    """An HF state dict in lowp's names and layouts; every HF tensor is used exactly once."""
    src, out = dict(sd), {}

    def take(name: str, required: bool = True) -> torch.Tensor | None:
        if name not in src:
            if required:
                raise ValueError(
                    f"{option}: the checkpoint has no {name}, which model={cfg.name} needs; "
                    "use model=hf model.hf_config=<the checkpoint's config.json>"
                )
            return None
        return src.pop(name)

    for lowp_name, hf_name in TOP_1TO1.items():
        out[lowp_name] = take(hf_name)
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = take("lm_head.weight")
    else:
        head = take("lm_head.weight", required=False)  # some tied checkpoints still store it
        if head is not None and not torch.equal(head, out["wte.weight"]):
            raise ValueError(
                f"{option}: lm_head.weight differs from the embedding but model.untie_embeddings_and_"
                "output_weights=false ties them; set it true (the checkpoint is untied)"
            )
        out["lm_head.weight"] = out["wte.weight"]
    qkv_bias = cfg.add_bias_linear or cfg.add_qkv_bias
    sparse = moe_layer_pattern(cfg)
    for i in range(cfg.num_layers):
        hf, lw = f"model.layers.{i}.", f"blocks.{i}."
        attn = [take(f"{hf}self_attn.{p}_proj.weight") for p in "qkv"]
        out[lw + "attn.qkv.weight"] = fuse_qkv(*attn, cfg)
        if qkv_bias:
            out[lw + "attn.qkv.bias"] = fuse_qkv(*[take(f"{hf}self_attn.{p}_proj.bias") for p in "qkv"], cfg)
        if sparse[i]:
            out.update(_moe_to_lowp(take, src, hf, lw, cfg))
        else:
            out[lw + "mlp.fc1.weight"] = torch.cat(
                [take(hf + "mlp.gate_proj.weight"), take(hf + "mlp.up_proj.weight")]
            )
        if cfg.add_bias_linear:
            out[lw + "mlp.fc1.bias"] = torch.cat(
                [take(hf + "mlp.gate_proj.bias"), take(hf + "mlp.up_proj.bias")]
            )
        for lowp_suffix, hf_suffix in BLOCK_1TO1.items():
            needed = _block_param_needed(lowp_suffix, cfg, i)
            if needed:
                out[lw + lowp_suffix] = take(hf + hf_suffix)
    if src:
        extra = sorted(src)
        raise ValueError(
            f"{option}: the checkpoint holds {len(extra)} tensors model={cfg.name} has no place for "
            f"(first: {extra[0]}); use model=hf model.hf_config=<the checkpoint's config.json>"
        )
    return out


def _moe_to_lowp(take, src: dict, hf: str, lw: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """One sparse block's router, experts (per expert in the file, or transformers 5's fused
    tensors) and Qwen2-MoE's shared expert and gate, under lowp's names."""
    out: dict[str, torch.Tensor] = {}
    fused = f"{hf}mlp.experts.gate_up_proj" in src
    prefix = "mlp" if fused else moe_prefix(cfg)
    out[lw + "mlp.router.weight"] = take(f"{hf}{prefix}.gate.weight")
    if fused:
        out[lw + "mlp.experts.fc1.weight"] = take(f"{hf}mlp.experts.gate_up_proj")
        out[lw + "mlp.experts.fc2.weight"] = take(f"{hf}mlp.experts.down_proj")
    else:
        gate, up, down = (f"{hf}{prefix}.experts.{{}}.{p}.weight" for p in EXPERT_PROJ[prefix])
        experts = range(cfg.num_moe_experts)
        fc1 = [torch.cat([take(gate.format(e)), take(up.format(e))]) for e in experts]
        out[lw + "mlp.experts.fc1.weight"] = torch.stack(fc1)
        out[lw + "mlp.experts.fc2.weight"] = torch.stack([take(down.format(e)) for e in experts])
    if cfg.moe_shared_expert_intermediate_size:
        shared = f"{hf}mlp.shared_expert."
        fc1 = [take(shared + "gate_proj.weight"), take(shared + "up_proj.weight")]
        out[lw + "mlp.shared_experts.fc1.weight"] = torch.cat(fc1)
        out[lw + "mlp.shared_experts.fc2.weight"] = take(shared + "down_proj.weight")
    if cfg.moe_shared_expert_gate:
        out[lw + "mlp.shared_experts_gate"] = take(f"{hf}mlp.shared_expert_gate.weight")
    return out


def _moe_to_hf(sd: dict, hf: str, lw: str, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """One sparse block in the file layout (per expert), the inverse of _moe_to_lowp."""
    prefix, out = moe_prefix(cfg), {}
    out[f"{hf}{prefix}.gate.weight"] = sd[lw + "mlp.router.weight"]
    gate, up, down = EXPERT_PROJ[prefix]
    fc1, fc2 = sd[lw + "mlp.experts.fc1.weight"], sd[lw + "mlp.experts.fc2.weight"]
    for e in range(fc1.shape[0]):
        g, u = fc1[e].chunk(2)
        base = f"{hf}{prefix}.experts.{e}."
        out[base + gate + ".weight"], out[base + up + ".weight"] = g, u
        out[base + down + ".weight"] = fc2[e]
    if lw + "mlp.shared_experts.fc1.weight" in sd:
        g, u = sd[lw + "mlp.shared_experts.fc1.weight"].chunk(2)
        shared = f"{hf}mlp.shared_expert."
        out[shared + "gate_proj.weight"], out[shared + "up_proj.weight"] = g, u
        out[shared + "down_proj.weight"] = sd[lw + "mlp.shared_experts.fc2.weight"]
    if lw + "mlp.shared_experts_gate" in sd:
        out[f"{hf}mlp.shared_expert_gate.weight"] = sd[lw + "mlp.shared_experts_gate"]
    return out


def _block_param_needed(suffix: str, cfg: ModelConfig, index: int) -> bool:
    if suffix.endswith(".bias"):
        return cfg.add_bias_linear
    if "_norm." in suffix:
        return cfg.qk_layernorm
    if suffix.startswith("mlp."):  # a sparse block's MLP is mapped by _moe_to_lowp
        return not moe_layer_pattern(cfg)[index]
    return True


def lowp_to_hf(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """lowp's (emulated-named) state dict in HF names and layouts; tied: no lm_head.weight."""
    out = {hf: sd[lw] for lw, hf in TOP_1TO1.items()}
    if cfg.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(cfg.num_layers):
        hf, lw = f"model.layers.{i}.", f"blocks.{i}."
        for p, t in zip("qkv", split_qkv(sd[lw + "attn.qkv.weight"], cfg)):
            out[f"{hf}self_attn.{p}_proj.weight"] = t
        if lw + "attn.qkv.bias" in sd:
            for p, t in zip("qkv", split_qkv(sd[lw + "attn.qkv.bias"], cfg)):
                out[f"{hf}self_attn.{p}_proj.bias"] = t
        if lw + "mlp.router.weight" in sd:
            out.update(_moe_to_hf(sd, hf, lw, cfg))
        for kind in ("weight", "bias"):
            if f"{lw}mlp.fc1.{kind}" in sd:
                gate, up = sd[f"{lw}mlp.fc1.{kind}"].chunk(2)
                out[f"{hf}mlp.gate_proj.{kind}"], out[f"{hf}mlp.up_proj.{kind}"] = gate, up
        for lowp_suffix, hf_suffix in BLOCK_1TO1.items():
            if lw + lowp_suffix in sd:
                out[hf + hf_suffix] = sd[lw + lowp_suffix]
    return {k: v.contiguous() for k, v in out.items()}


def load_into(model: torch.nn.Module, lowp_sd: dict[str, torch.Tensor], option: str = "init_from") -> int:
    """Copy a lowp-named state dict into `model` (the emulated GPT or TEGPT), each parameter in its
    own dtype and device; refuses a missing, unused or mis-shaped tensor. Returns tensors copied."""
    te = any(".layer." in n for n, _ in model.named_parameters())
    names = te_names(lowp_sd) if te else {n: n for n in lowp_sd}
    mapped = {names[n]: t for n, t in lowp_sd.items()}
    params = dict(model.named_parameters())  # a tied LM head appears once, as wte.weight
    missing = sorted(set(params) - set(mapped))
    unused = sorted(set(mapped) - set(params) - {"lm_head.weight"})
    if missing or unused:
        what = f"model parameter {missing[0]} has no tensor" if missing else f"tensor {unused[0]} is unused"
        raise ValueError(f"{option}: {what}; the checkpoint and the model config disagree")
    with torch.no_grad():
        for name, p in params.items():
            t = mapped[name]
            if tuple(p.shape) != tuple(t.shape):
                raise ValueError(
                    f"{option}: {name} is {tuple(t.shape)} in the checkpoint but {tuple(p.shape)} in the "
                    "model; use model=hf model.hf_config=<the checkpoint's config.json>"
                )
            p.copy_(t.to(device=p.device, dtype=p.dtype))
    return len(params)


def init_from_hf(model: torch.nn.Module, path: str, cfg: ModelConfig) -> dict:
    """`init_from=PATH`: the HF checkpoint's weights into a freshly built model; provenance back."""
    sd = read_safetensors(path)
    n = load_into(model, hf_to_lowp(sd, cfg))
    files = safetensors_files(path)
    return {"init_from": str(path), "tensors": n, "files": [f.name for f in files]}
