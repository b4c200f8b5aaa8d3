"""The Megatron export under every `parallel` setting: one test per FSDP2 defect, and the matrix of
ddp and fsdp2 x every recipe family x distributed optimizer x tied head x fp8_param x resharding,
each accepted export held against Megatron-LM's own rules (read at d98e8a6, docs/validation_rules.md),
each lowp setting either a flag or a `#` line. In-process: Hydra composes one config per recipe."""

from __future__ import annotations

import copy
import functools
import itertools
import re
import warnings
from pathlib import Path

import pytest

from harness import recipes
from harness.interop.megatron import megatron_args, provider_fields, render
from harness.megatron import main
from harness.validation.megatron_rules import RULES
from harness.validation.reference_sweep import EXAMPLE_FACTORY
from harness.validation.rules import ConfigError, validate
from tests.helpers import compose_cfg
from tests.test_megatron import flag_rule_violations, pairs

REPO = Path(__file__).resolve().parents[1]
FSDP2 = "--use-torch-fsdp2"
UNTIE = "--untie-embeddings-and-output-weights"
NO_RESHARD = "--torch-fsdp2-no-reshard-after-forward"

# Every flag the export may print, each found in Megatron-LM d98e8a6's parser (parse_args's
# option strings, read with that checkout). `--tp-only-amax-red` is not among them: the parser
# stops at it ("unrecognized arguments"); tp_only_amax_red is a TransformerConfig field that
# megatron/training/arguments.py:2335 keeps out of its argparse ("no CLI argument exists").
# `--deterministic-mode` is built from ModelParallelConfig.deterministic_mode (TransformerConfig's
# ArgumentGroupFactory, arguments.py:2373; read at arguments.py:1708).
MEGATRON_PARSER_FLAGS = frozenset(
    """
    --adam-beta1 --adam-beta2 --adam-eps --add-qkv-bias --attention-dropout --bf16 --ckpt-format
    --clip-grad --cross-entropy-loss-fusion --data-path --deterministic-mode --disable-bias-linear
    --eval-interval --eval-iters --exp-avg-dtype --exp-avg-sq-dtype --ffn-hidden-size --first-last-layers-bf16
    --fp4-format --fp4-param-gather --fp4-quantizer-factory --fp4-recipe --fp8-amax-compute-algo
    --fp8-amax-history-len --fp8-format --fp8-margin --fp8-param-gather --fp8-quantizer-factory
    --fp8-recipe --global-batch-size --group-query-attention --hidden-dropout --hidden-size
    --init-method-std --kv-channels --log-interval --lr --lr-decay-style --lr-warmup-iters
    --main-grads-dtype --main-params-dtype --make-vocab-size-divisible-by --max-position-embeddings
    --micro-batch-size --min-lr --mock-data --no-fp8-wgrad --no-gradient-accumulation-fusion
    --norm-epsilon --normalization --num-attention-heads --num-layers --num-layers-at-end-in-bf16
    --num-layers-at-start-in-bf16 --num-query-groups --optimizer-cpu-offload --position-embedding-type
    --qk-layernorm --reuse-grad-buf-for-mxfp8-param-ag --rope-scaling-factor --rotary-base --seed
    --seq-length --split --swiglu --tokenizer-type --torch-fsdp2-no-reshard-after-forward
    --train-data-path --train-iters --untie-embeddings-and-output-weights --use-distributed-optimizer
    --use-precision-aware-optimizer --use-rope-scaling --use-torch-fsdp2 --valid-data-path
    --vocab-size --weight-decay
    --num-experts --moe-aux-loss-coeff --moe-expert-capacity-factor --moe-ffn-hidden-size
    --moe-grouped-gemm --moe-layer-freq --moe-router-bias-update-rate --moe-router-dtype
    --moe-router-enable-expert-bias --moe-router-load-balancing-type --moe-router-padding-for-quantization
    --moe-router-pre-softmax --moe-router-score-function --moe-router-topk
    --moe-router-topk-scaling-factor --moe-shared-expert-gate --moe-shared-expert-intermediate-size
    --moe-token-dispatcher-type --moe-z-loss-coeff
    """.split()  # the MoE flags: parsed by Megatron-LM d98e8a6 in benchmarks.megatron_lm check
)
TE_VERSION = (2, 20)  # backend.te_version's default, the TE Megatron's version checks see


def megatron_refusals(argv: list[str], fields: dict) -> list[str]:
    """What Megatron-LM d98e8a6 refuses, or silently turns off, in this flag list: the rules of
    tests/test_megatron.py's table, the parser, and those of --use-torch-fsdp2 (all in
    megatron/training/arguments.py validate_args unless a file is named)."""
    f = pairs(argv)
    out = flag_rule_violations(argv, fields)
    out += [f"{flag}: not in Megatron's parser" for flag in f if flag not in MEGATRON_PARSER_FLAGS]
    if FSDP2 not in f:
        if NO_RESHARD in f:  # read only under FSDP2: training.py:2627-2629
            out.append(f"{NO_RESHARD} without {FSDP2} does nothing")
        return out
    rules = [
        ("--use-distributed-optimizer" in f, "1038-1039: not supported with MCore's distributed optimizer"),
        ("--no-gradient-accumulation-fusion" not in f, "1040-1041: not with gradient accumulation fusion"),
        (f.get("--ckpt-format", "torch_dist") not in ("torch_dist", "torch_dcp"), "1042-1043: ckpt format"),
        (UNTIE not in f, f"1044-1045: requires {UNTIE}"),
        ("--fp16" in f, "1046-1047: not with fp16"),
        # 1050-1055: turned off (a warning, no error) with TE >= 2.0: printed, never run
        ("--fp8-param-gather" in f and TE_VERSION >= (2, 0), "1050-1055: --fp8-param-gather turned off"),
        ("--fp4-param-gather" in f and TE_VERSION < (2, 7), "1056-1061: --fp4-param-gather turned off"),
        # get_megatron_ddp_config (training.py:2627-2629) builds FSDP2's config from the reshard flag
        # alone, and only the distributed optimizer reads the grad buffer (optimizer.py:800)
        ("--reuse-grad-buf-for-mxfp8-param-ag" in f, "training.py:2627-2629: grad buffer reuse ignored"),
    ]
    # the precision-aware optimizer (and its dtypes, its CPU offload) need the distributed optimizer,
    # refused above: flag_rule_violations holds core/optimizer/__init__.py:1057-1060 and arguments.py:1884
    return out + [f"{FSDP2}: {why}" for broken, why in rules if broken]


@functools.cache
def _base(recipe: str):
    """gpt_tiny with the recipe's preset (a factory for custom), composed once per recipe."""
    factory = [f"recipe.quantizer_factory={EXAMPLE_FACTORY}"] if recipes.get(recipe).needs_factory else []
    return compose_cfg("model=gpt_tiny", f"recipe={recipe}", *factory)


def case(strategy: str, recipe: str, dist_opt: bool, tied: bool, fp8_param: bool, reshard: bool):
    cfg = copy.deepcopy(_base(recipe))
    cfg.parallel.name = cfg.parallel.strategy = strategy
    cfg.parallel.reshard_after_forward = reshard
    cfg.optimizer.use_distributed_optimizer = dist_opt
    cfg.optimizer.fp8_param = fp8_param
    cfg.model.untie_embeddings_and_output_weights = not tied
    return cfg


def export(cfg) -> tuple[list[str], list[str]] | str:
    """The export's (argv, notes), or its one-line refusal (what harness.megatron prints, exit 2)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            validate(cfg, for_export=True)
            return megatron_args(cfg)
        except ConfigError as exc:
            return str(exc)


MATRIX = list(
    itertools.product(
        ("ddp", "fsdp2"), recipes.names(), (False, True), (False, True), (False, True), (False, True)
    )
)


def _id(c) -> str:
    strategy, recipe, dist_opt, tied, fp8_param, reshard = c
    on = [n for n, v in (("dist_opt", dist_opt), ("tied", tied), ("fp8_param", fp8_param)) if v]
    return "-".join([strategy, recipe, *on, "reshard" if reshard else "no_reshard"])


@pytest.mark.parametrize("c", MATRIX, ids=[_id(c) for c in MATRIX])
def test_matrix_exports_what_megatron_accepts_and_says_the_rest(c):
    strategy, recipe, dist_opt, tied, fp8_param, reshard = c
    cfg = case(*c)
    out = export(cfg)
    if isinstance(out, str):  # refused: one line naming a lowp option
        assert "\n" not in out and re.match(r"^[a-z_]+(\.[a-z_0-9]+)?=", out), out
        return
    argv, notes = out
    assert megatron_refusals(argv, provider_fields(cfg)) == []
    f, said = pairs(argv), "\n".join(notes)
    fsdp2 = strategy == "fsdp2"
    assert (FSDP2 in f) == fsdp2
    assert (NO_RESHARD in f) == (fsdp2 and not reshard)
    assert UNTIE in f if (fsdp2 or not tied) else UNTIE not in f
    assert ("model.untie_embeddings_and_output_weights=false under parallel=fsdp2" in said) == (
        fsdp2 and tied
    )
    assert ("--use-distributed-optimizer" in f) == (dist_opt and not fsdp2)
    assert ("optimizer.use_distributed_optimizer=true under parallel=fsdp2" in said) == (dist_opt and fsdp2)
    gather = "--fp4-param-gather" if cfg.recipe.fp4 else "--fp8-param-gather"
    kept = fp8_param and (cfg.recipe.fp4 is not None or not fsdp2)
    assert (gather in f) == kept
    assert ("optimizer.fp8_param=true under parallel=fsdp2" in said) == (fp8_param and not kept)


def test_matrix_covers_every_outcome():
    """Both strategies export and refuse; each FSDP2 note and flag is reached."""
    outs = {c: export(case(*c)) for c in MATRIX}
    for strategy in ("ddp", "fsdp2"):
        mine = [o for c, o in outs.items() if c[0] == strategy]
        assert any(isinstance(o, str) for o in mine) and sum(not isinstance(o, str) for o in mine) > 40
    said = "\n".join(n for o in outs.values() if not isinstance(o, str) for n in o[1])
    for words in (
        "untie_embeddings_and_output_weights=false",
        "use_distributed_optimizer=true",
        "fp8_param=true",
    ):
        assert f"optimizer.{words} under" in said or f"model.{words} under" in said, words
    flags = {a for o in outs.values() if not isinstance(o, str) for a in o[0]}
    assert {
        FSDP2,
        NO_RESHARD,
        "--fp4-param-gather",
        "--fp8-param-gather",
        "--use-distributed-optimizer",
    } <= flags


# ----------------------------------------------------------------------------------------------
# One test per defect (issue 31), each through the export as a user runs it (harness.megatron's main)


def export_cli(capsys, *overrides: str) -> tuple[int, list[str], str]:
    """harness.megatron in-process with `--format args`: (exit code, flag lines, stdout + stderr)."""
    code = main(["model=gpt_tiny", *overrides, "--format", "args"])
    out, err = capsys.readouterr()
    return code, [ln for ln in out.splitlines() if ln.startswith("--")], out + err


def test_fsdp2_never_exports_the_distributed_optimizer(capsys):
    code, lines, text = export_cli(capsys, "parallel=fsdp2", "optimizer.use_distributed_optimizer=true")
    assert code == 0 and FSDP2 in lines
    assert "--use-distributed-optimizer" not in lines  # arguments.py:1038-1039 refuses the two together
    assert "# optimizer.use_distributed_optimizer=true under parallel=fsdp2 -> no" in text


def test_fsdp2_unties_a_tied_head_as_megatron_requires_and_says_so(capsys):
    code, lines, text = export_cli(
        capsys, "parallel=fsdp2", "model.untie_embeddings_and_output_weights=false"
    )
    assert code == 0 and FSDP2 in lines and UNTIE in lines  # arguments.py:1044-1045
    assert "# model.untie_embeddings_and_output_weights=false under parallel=fsdp2 has no Megatron" in text
    code, lines, text = export_cli(capsys, "parallel=ddp", "model.untie_embeddings_and_output_weights=false")
    assert code == 0 and UNTIE not in lines and "untie_embeddings" not in text  # DDP keeps it tied


def test_fsdp2_fp8_param_is_said_not_printed_as_a_gather_megatron_turns_off(capsys):
    code, lines, text = export_cli(capsys, "parallel=fsdp2", "recipe=tensorwise", "optimizer.fp8_param=true")
    assert code == 0 and FSDP2 in lines
    assert "--fp8-param-gather" not in lines  # arguments.py:1050-1055 turns it off with TE >= 2.0
    assert "# optimizer.fp8_param=true under parallel=fsdp2 has no Megatron equivalent" in text
    reuse = ("recipe=mxfp8", "optimizer.fp8_param=true", "optimizer.reuse_grad_buf_for_mxfp8_param_ag=true")
    code, lines, text = export_cli(capsys, "parallel=fsdp2", *reuse)
    assert code == 0 and not any("param-gather" in ln or "reuse-grad-buf" in ln for ln in lines)
    assert (
        "# optimizer.fp8_param=true (and reuse_grad_buf_for_mxfp8_param_ag=true) under parallel=fsdp2" in text
    )
    # FP4 param gather survives FSDP2 from TE 2.7 (arguments.py:1056-1061), which NVFP4 needs anyway
    code, lines, _ = export_cli(
        capsys,
        "parallel=fsdp2",
        "recipe=nvfp4",
        "stability=first_last_bf16",
        "model.num_layers=4",
        "optimizer.fp8_param=true",
    )
    assert code == 0 and "--fp4-param-gather" in lines


def test_fp8_param_rule_suggests_the_distributed_optimizer_not_fsdp2(capsys):
    code, _, text = export_cli(capsys, "recipe=tensorwise", "optimizer.fp8_param=true")
    (line,) = text.strip().splitlines()
    assert code == 2 and line.startswith("error: optimizer.fp8_param=true needs optimizer.use_distributed_")
    assert "fsdp" not in line.lower()


def test_fsdp2_no_reshard_after_forward_is_megatrons_flag(capsys):
    code, lines, _ = export_cli(capsys, "parallel=fsdp2", "parallel.reshard_after_forward=false")
    assert code == 0 and NO_RESHARD in lines  # arguments.py:3218
    assert NO_RESHARD not in export_cli(capsys, "parallel=fsdp2")[1]


def test_tp_only_amax_red_is_a_provider_field_not_a_flag(capsys):
    overrides = ("recipe=delayed", "parallel=ddp", "parallel.tp_only_amax_red=true")
    code, lines, text = export_cli(capsys, *overrides)
    assert code == 0 and not any("amax-red" in ln for ln in lines)
    assert "set tp_only_amax_red=True in the model provider's TransformerConfig" in text
    assert provider_fields(compose_cfg("model=gpt_tiny", *overrides))["tp_only_amax_red"] is True


@pytest.mark.parametrize(
    "overrides, start",
    [
        (["model=llama31_tiny"], "model.rope_original_max_position_embeddings=32: "),
        (["model=llama3_tiny", "model.rotary_base=500000.5"], "model.rotary_base=500000.5: "),
    ],
)
def test_rope_megatron_cannot_express_exits_2_with_one_line(capsys, overrides, start):
    code = main([*overrides, "--format", "args"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.startswith(f"error: {start}") and err.count("\n") == 1, err
    assert main(["model=llama31_tiny", "model.rope_original_max_position_embeddings=8192"]) == 0
    assert "--use-rope-scaling" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------
# What FSDP2 brings beyond the six: the precision-aware optimizer, CPU offload, the run's notes


def test_fsdp2_precision_aware_optimizer_is_said_not_printed(capsys):
    code, lines, text = export_cli(capsys, "parallel=fsdp2", "optimizer=min_memory")
    assert code == 0 and not any("precision-aware" in ln or "dtype" in ln for ln in lines)
    assert "# optimizer.use_precision_aware_optimizer=true, main_grads_dtype=bf16" in text
    assert "core/optimizer/__init__.py:1057-1060" in text


def test_fsdp2_cpu_offload_is_refused_in_one_line(capsys):
    overrides = (
        "parallel=fsdp2",
        "recipe=delayed",
        "optimizer=bf16_states",
        "optimizer.optimizer_cpu_offload=true",
    )
    code, lines, text = export_cli(capsys, *overrides)
    assert code == 2 and not lines
    assert (
        text.startswith("error: parallel=fsdp2 with optimizer.optimizer_cpu_offload=true")
        and text.count("\n") == 1
    )
    with pytest.raises(ConfigError, match="parallel=ddp or optimizer.optimizer_cpu_offload=false"):
        megatron_args(compose_cfg("model=gpt_tiny", *overrides))


def test_fsdp2_notes_keep_the_fusion_flag_and_the_connections_variable():
    text = render(compose_cfg("model=gpt_tiny", "parallel=fsdp2"), "sh")
    assert "--use-torch-fsdp2 requires the flag (arguments.py:1040-1041)" in text.replace("\n#   ", " ")
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in text
    ddp = render(compose_cfg("model=gpt_tiny", "parallel=ddp"), "sh")
    assert "drop the flag where apex is installed" in ddp.replace("\n#   ", " ") and "CUDA_DEVICE" not in ddp


def test_every_flag_the_export_can_print_is_in_megatrons_parser():
    """A flag literal added to the export must be checked against Megatron's parser and listed above."""
    sources = ("harness/interop/megatron.py", "harness/interop/megatron_arch.py", "harness/recipes.py")
    literals = {m for s in sources for m in re.findall(r'"(--[a-z0-9][a-z0-9-]*)"', (REPO / s).read_text())}
    assert literals and literals <= MEGATRON_PARSER_FLAGS, literals - MEGATRON_PARSER_FLAGS


def test_docs_hold_the_fsdp2_rules_with_their_sources():
    doc = (REPO / "docs" / "validation_rules.md").read_text()
    section = doc[doc.index("## FSDP2") :]
    for source in ("1038-1039", "1040-1041", "1042-1043", "1044-1045", "1048-1049", "1050-1055", "1056-1061"):
        assert f"arguments.py:{source}" in section, source
    for words in (
        "core/optimizer/__init__.py:1057-1060",
        "arguments.py:3218",
        "arguments.py:2335",
        NO_RESHARD,
    ):
        assert words in section, words
    assert {r.name for r in RULES} <= set(re.findall(r"`([a-z0-9_]+)`", doc))
