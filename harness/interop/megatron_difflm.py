"""The MegaDLMs command for a masked-diffusion config: `pretrain_difflm.py` with its difflm flags.

MegaDLMs (github.com/JinjieNi/MegaDLMs, read at bdf7545) trains LLaDA-style diffusion LMs on a fork of
Megatron-LM. `python -m harness.megatron objective=masked_diffusion ...` prints its command: the
same model, run and recipe flags as pretrain_gpt.py (harness.interop.megatron), plus the fork's
difflm flags (custom_args/difflm.py):

    --model-running-mode difflm-noshift   (the masked-diffusion loss at each token's own position)
    --attention-mask-type no_mask         (bidirectional attention; the fork's default is causal_bottom_right)
    --mask-token N                        (objective.mask_token, null resolved as the trainer does)
    --difflm-varilen-prob p               (objective.difflm_varilen_prob)

The fork's Megatron predates `--fp8-recipe` (megatron/training/arguments.py,
_add_transformer_engine_args: --fp8-format, --fp8-margin, --fp8-amax-history-len,
--fp8-amax-compute-algo, --no-fp8-wgrad, --fp8-param-gather): FP8 there is TE's delayed scaling.
So BF16 and delayed export; any other recipe is refused in one line naming that limit, as is a flag
the fork's argparse lacks (FORK_LACKS). Differences that are not flags are `#` lines: MegaDLMs draws
t ~ U(0, 1) (objective.eps has no flag), cuts a variable-length batch to U{2..T} unrounded, and
un-shifts its GPT dataset's pair, training on T - 1 tokens of each sequence where lowp trains on T.
"""

from __future__ import annotations

from harness import recipes
from harness.config.errors import ConfigError
from harness.config.schema import DataConfig, ModelConfig, ObjectiveConfig, RecipeConfig
from harness.interop.hf_tokenizer import run_offers
from harness.model.objective import choose_mask_token

FORK = "MegaDLMs' Megatron fork (JinjieNi/MegaDLMs)"
FORK_LACKS = {  # upstream Megatron-LM flags lowp prints that the fork's arguments.py does not define
    "--first-last-layers-bf16": "stability.first_last_layers_bf16",
    "--num-layers-at-start-in-bf16": "stability.num_layers_at_start_in_bf16",
    "--num-layers-at-end-in-bf16": "stability.num_layers_at_end_in_bf16",
    "--fp4-format": "recipe.fp4",
    "--optimizer-cpu-offload": "optimizer.optimizer_cpu_offload",
}


def mask_token(o: ObjectiveConfig, data: DataConfig, model: ModelConfig) -> int:
    """objective.mask_token, or where null what the trainer resolves: a Hugging Face model's tokenizer's
    offer (harness/interop/hf_tokenizer.py; a token file's ids are the trainer's to check, a markov or
    synthetic source draws every id below its vocabulary), else the first id past the data's vocabulary
    (data.vocab_size, else the model's)."""
    if o.mask_token is not None:
        return o.mask_token
    data_vocab = data.vocab_size if data.vocab_size is not None else model.vocab_size
    offers = run_offers(o, model.hf_config, None)
    if not offers:
        return data_vocab
    generated = data.name in ("markov", "synthetic")
    try:
        return choose_mask_token(
            model.vocab_size, data_vocab, offers, lambda t: generated and t < data_vocab
        )[0]
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def check_recipe(r: RecipeConfig) -> None:
    """BF16 or delayed scaling: the fork has no other FP8 recipe (and no FP4)."""
    spec = recipes.get(r.name)
    plain_bf16 = spec.te_recipe_class is None and spec.hook is None
    if not (plain_bf16 or spec.delayed_scaling):
        raise ConfigError(
            f"recipe={r.name}: {FORK} has FP8 delayed scaling only (its arguments.py has no "
            "--fp8-recipe); export this objective with recipe=bf16 or recipe=delayed"
        )


def fork_args(argv: list[str]) -> list[str]:
    """pretrain_gpt.py's argv rewritten for the fork: --fp8-recipe dropped (delayed is implied); a
    flag the fork lacks is a ConfigError naming the lowp option."""
    out, i = [], 0
    while i < len(argv):
        flag = argv[i]
        takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if flag in FORK_LACKS:
            raise ConfigError(f"{FORK_LACKS[flag]}: {FORK} has no {flag}; leave it at its default to export")
        if flag != "--fp8-recipe":
            out += argv[i : i + (2 if takes_value else 1)]
        i += 2 if takes_value else 1
    return out


def difflm_flags(o: ObjectiveConfig, data: DataConfig, model: ModelConfig) -> tuple[list[str], list[str]]:
    """(the fork's difflm argv tokens, `#` notes) of the objective."""
    argv = ["--model-running-mode", "difflm-noshift", "--attention-mask-type", "no_mask"]
    argv += [
        "--mask-token",
        str(mask_token(o, data, model)),
        "--difflm-varilen-prob",
        repr(o.difflm_varilen_prob),
    ]
    notes = [
        "# MegaDLMs pretrain_difflm.py (set MEGADLMS to a checkout): it trains on T - 1 tokens of each "
        "sequence (un-shifting the GPT dataset's pair) where lowp trains on T, and cuts a variable-length "
        "batch to U{2..T} tokens where lowp rounds the length up to the recipe's GEMM multiple"
    ]
    if o.eps:
        notes.append(f"# objective.eps={o.eps!r} has no MegaDLMs flag: its t is U(0, 1)")
    return argv, notes


def difflm_command(
    o: ObjectiveConfig,
    r: RecipeConfig,
    data: DataConfig,
    model: ModelConfig,
    argv: list[str],
    notes: list[str],
) -> tuple[list[str], list[str], str]:
    """(argv, notes, script) for MegaDLMs from pretrain_gpt.py's argv and notes of the same config."""
    check_recipe(r)
    flags, own = difflm_flags(o, data, model)
    return fork_args(argv) + flags, [*notes, *own], '"${MEGADLMS:?a MegaDLMs checkout}/pretrain_difflm.py"'
