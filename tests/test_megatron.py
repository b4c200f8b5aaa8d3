"""Megatron export: each cookbook preset prints exactly the guide's flags, plus shape and non-defaults."""

from __future__ import annotations

import importlib
import shlex

import pytest

from harness.interop.megatron import MEGATRON_DEFAULTS, RUN_FLAGS, SHAPE_FLAGS, megatron_args, render
from harness.megatron import main
from tests.helpers import compose_cfg, run_cli

# The guide's Configuration Cookbook (Megatron Core Low-Precision Training Guide), verbatim.
COOKBOOK = {
    "hopper_fp8": "--bf16 --fp8-format hybrid --fp8-recipe tensorwise --fp8-param-gather --use-distributed-optimizer",  # noqa: E501
    "blackwell_fp8": "--bf16 --fp8-format e4m3 --fp8-recipe mxfp8 --fp8-param-gather "
    "--reuse-grad-buf-for-mxfp8-param-ag --use-distributed-optimizer",
    "blackwell_fp4": "--bf16 --fp4-format e2m1 --fp4-param-gather --first-last-layers-bf16 "
    "--num-layers-at-start-in-bf16 2 --num-layers-at-end-in-bf16 2 --use-distributed-optimizer",
    "fp8_cpu_offload": "--bf16 --fp8-format hybrid --fp8-recipe delayed --fp8-param-gather "
    "--use-distributed-optimizer --optimizer-cpu-offload",
    "min_memory_optimizer": "--use-precision-aware-optimizer --main-grads-dtype bf16 --exp-avg-dtype fp8 "
    "--exp-avg-sq-dtype fp8",
}
TRAINING = {
    "--lr",
    "--min-lr",
    "--weight-decay",
    "--adam-beta1",
    "--adam-beta2",
    "--adam-eps",
    "--clip-grad",
    "--lr-warmup-iters",
    "--lr-decay-style",
}
# What Megatron-LM requires that the guide's cookbook lines leave out (docs/validation_rules.md).
REQUIRED_EXTRA = {
    "fp8_cpu_offload": {"--use-precision-aware-optimizer"},  # arguments.py:1884
    "min_memory_optimizer": {"--use-distributed-optimizer", "--bf16"},  # core/optimizer/__init__.py:1057
}


def pairs(argv: list[str]) -> dict[str, str | None]:
    out, i = {}, 0
    while i < len(argv):
        has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        out[argv[i]] = argv[i + 1] if has_value else None
        i += 2 if has_value else 1
    return out


@pytest.mark.parametrize("preset", sorted(COOKBOOK))
def test_cookbook_flags_match_the_guide(preset):
    argv, _ = megatron_args(compose_cfg(f"experiment={preset}", "model=gpt_1b"))
    got, want = pairs(argv), pairs(COOKBOOK[preset].split())
    for flag, value in want.items():
        assert flag in got and got[flag] == value, (flag, got.get(flag))
    extra = set(got) - set(want)
    history = {"--fp8-amax-history-len", "--fp8-amax-compute-algo"}
    allowed = (
        set(SHAPE_FLAGS) | set(RUN_FLAGS) | TRAINING | (history if preset == "fp8_cpu_offload" else set())
    )
    allowed |= REQUIRED_EXTRA.get(preset, set())
    assert extra <= allowed, extra - allowed
    assert REQUIRED_EXTRA.get(preset, set()) <= set(got)
    for flag in extra & set(MEGATRON_DEFAULTS):  # printed only where lowp differs from Megatron
        assert got[flag] != str(MEGATRON_DEFAULTS[flag]), flag


def test_delayed_always_prints_history_flags():
    got = pairs(megatron_args(compose_cfg("recipe=delayed"))[0])
    assert got["--fp8-amax-history-len"] == "1024" and got["--fp8-amax-compute-algo"] == "max"


def test_no_fp8_wgrad_prints_flag_and_warning():
    argv, notes = megatron_args(compose_cfg("recipe=tensorwise", "stability.fp8_wgrad=false"))
    assert "--no-fp8-wgrad" in argv
    assert any("silently ignores --no-fp8-wgrad" in n for n in notes)


def test_model_shape_flags():
    got = pairs(
        megatron_args(
            compose_cfg(
                "model=gpt_8b_slice",
                "model.activation=swiglu",
                "model.position_embedding=rope",
                "model.normalization=RMSNorm",
            )
        )[0]
    )
    assert (got["--num-layers"], got["--hidden-size"], got["--ffn-hidden-size"], got["--seq-length"]) == (
        "6",
        "4096",
        "16384",
        "4096",
    )
    assert (
        "--swiglu" in got
        and got["--position-embedding-type"] == "rope"
        and got["--normalization"] == "RMSNorm"
    )
    assert "--untie-embeddings-and-output-weights" in got


def test_what_megatron_cannot_express_is_a_comment():
    text = render(
        compose_cfg("recipe=int4_qat", "+stability.overrides=[{pattern: 'blocks.0.*', recipe: bf16}]"), "args"
    )
    assert "# INT4 fake-QAT" in text and "OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1" in text
    assert "--te-precision-config-file" in text
    text = render(compose_cfg("recipe=blockwise", "recipe.power_2_scales=false"), "args")
    assert "NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1" in text


def test_cli_prints_flags_and_refuses_illegal_configs(capsys):
    assert main(["experiment=hopper_fp8"]) == 0
    assert "--fp8-recipe tensorwise" in capsys.readouterr().out
    assert main(["experiment=fp8_cpu_offload", "recipe=tensorwise"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: optimizer.optimizer_cpu_offload")


@pytest.mark.slow
def test_the_command_line_is_the_same_main():
    res = run_cli(["-m", "harness.megatron", "experiment=hopper_fp8"])
    assert res.returncode == 0 and "--fp8-recipe tensorwise" in res.stdout
    res = run_cli(["-m", "harness.megatron", "experiment=fp8_cpu_offload", "recipe=tensorwise"])
    assert res.returncode == 2 and res.stderr.strip().startswith("error: optimizer.optimizer_cpu_offload")


def test_fast_accumulation_is_a_note_megatron_cannot_follow():
    fast = ("recipe=tensorwise", "recipe.fp8_fast_accumulation=all")
    argv, notes = megatron_args(compose_cfg("model=gpt_tiny", "backend=te", *fast))
    assert pairs(argv)["--fp8-recipe"] == "tensorwise" and not any("fast" in a or "split" in a for a in argv)
    (note,) = [n for n in notes if "fp8_fast_accumulation" in n]
    assert note.startswith("# recipe.fp8_fast_accumulation=all has no Megatron equivalent")
    assert "split accumulator in dgrad and wgrad" in note
    assert not any("fp8_fast_accumulation" in n for n in megatron_args(compose_cfg("recipe=tensorwise"))[1])


def test_lm_head_loss_chunks_is_a_note_not_a_flag():
    argv, notes = megatron_args(compose_cfg("model=gpt_tiny", "model.lm_head_loss_chunks=8"))
    assert not any("chunk" in a for a in argv)
    assert any("lm_head_loss_chunks=8" in n and n.startswith("#") for n in notes)


# ----------------------------------------------------------------------------------------------
# The export is a command that runs (issue 13)


def comments(cfg) -> str:
    return "\n".join(megatron_args(cfg)[1])


def test_run_control_flags_megatron_needs_to_start():
    got = pairs(megatron_args(compose_cfg("steps=30", "eval_interval=0", "eval_tokens=0"))[0])
    assert (got["--train-iters"], got["--micro-batch-size"], got["--global-batch-size"]) == ("30", "8", "8")
    assert got["--eval-interval"] == "30" and got["--eval-iters"] == "0"  # Megatron divides by the interval
    assert got["--attention-dropout"] == "0.0" and got["--hidden-dropout"] == "0.0"  # Megatron's default 0.1
    assert "--no-gradient-accumulation-fusion" in got


def test_eval_tokens_become_whole_global_batches():
    cfg = compose_cfg("model=gpt_tiny", "eval_interval=5", "eval_tokens=1000")  # 8 x 64 = 512 tokens a batch
    argv, notes = megatron_args(cfg)
    got = pairs(argv)
    assert got["--eval-interval"] == "5" and got["--eval-iters"] == "2"
    assert any("eval_tokens=1000 -> --eval-iters 2" in n for n in notes)
    # a run shorter than its eval budget evaluates its training tokens at most, as lowp's trainer does
    argv, notes = megatron_args(compose_cfg("model=gpt_tiny", "steps=1", "eval_tokens=4096"))
    assert pairs(argv)["--eval-iters"] == "1"
    capped = "eval_tokens=4096, capped at the run's 512 training tokens, -> --eval-iters 1"
    assert any(capped in n for n in notes)


@pytest.mark.parametrize("seed, megatron_seed", [(0, "1"), (41, "42")])
def test_seed_is_mapped_to_a_valid_megatron_seed_and_said(seed, megatron_seed):
    cfg = compose_cfg(f"seed={seed}")
    assert pairs(megatron_args(cfg)[0])["--seed"] == megatron_seed
    assert f"seed={seed} -> --seed {megatron_seed}" in comments(cfg)


def test_negative_seed_is_refused_by_the_export(capsys):
    assert main(["seed=-3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: seed=-3") and "seed >= 0" in err


def test_data_flags_for_each_source():
    got = pairs(megatron_args(compose_cfg("data=synthetic"))[0])
    assert (
        "--mock-data" in got and got["--tokenizer-type"] == "NullTokenizer" and got["--vocab-size"] == "256"
    )
    got = pairs(megatron_args(compose_cfg("data=megatron", "data.path=/d/tok_text_document"))[0])
    assert got["--data-path"] == "/d/tok_text_document" and got["--split"] == "95.0,5.0,0"
    assert got["--tokenizer-type"] == "NullTokenizer" and "--mock-data" not in got
    cfg = compose_cfg("data=megatron", "data.path=/d/train", "data.eval_path=/d/valid")
    got = pairs(megatron_args(cfg)[0])
    assert got["--train-data-path"] == "/d/train" and got["--valid-data-path"] == "/d/valid"
    argv, notes = megatron_args(compose_cfg("data=markov"))
    assert not {"--mock-data", "--data-path"} & set(argv)
    assert any(n.startswith("# data=markov has no Megatron dataset") for n in notes)


def test_vocab_megatron_would_pad_is_kept():
    assert (
        pairs(megatron_args(compose_cfg("model.vocab_size=50257"))[0])["--make-vocab-size-divisible-by"]
        == "1"
    )
    assert "--make-vocab-size-divisible-by" not in megatron_args(compose_cfg("model=gpt_1b"))[0]


def test_floats_round_trip_exactly():
    cfg = compose_cfg("optimizer.lr=0.0012345678", "optimizer.min_lr=1.2345678e-05", "optimizer.eps=1e-15")
    got = pairs(megatron_args(cfg)[0])
    assert float(got["--lr"]) == 0.0012345678 and got["--lr"] == "0.0012345678"
    assert float(got["--min-lr"]) == 1.2345678e-05 and float(got["--adam-eps"]) == 1e-15


def test_custom_factory_is_a_dotted_path_megatron_resolves():
    cfg = compose_cfg("recipe=custom", "recipe.quantizer_factory=harness.numerics.custom:tensorwise_factory")
    got = pairs(megatron_args(cfg)[0])
    assert got["--fp8-recipe"] == "custom"
    path = got["--fp8-quantizer-factory"]
    assert path == "harness.numerics.custom.tensorwise_factory"
    module, _, attr = path.rpartition(".")  # what megatron/core/fp8_utils.py does with it
    assert callable(getattr(importlib.import_module(module), attr))


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["optimizer=bf16_params"], "optimizer.master_weights=false"),
        (["optimizer=bf16_params", "optimizer.step_in_backward=true"], "optimizer.step_in_backward=true"),
        (["recipe=blockwise", "recipe.x_block_dim=2", "recipe.w_block_dim=1"], "recipe.x_block_dim=2"),
        (["recipe=blockwise", "recipe.x_block_dim=2", "recipe.w_block_dim=1"], "recipe.w_block_dim=1"),
        (["recipe=tensorwise", "recipe.amax_epsilon=1e-12"], "recipe.amax_epsilon=1e-12"),
        (["recipe=tensorwise", "recipe.power_2_scales=true"], "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1"),
        (["recipe=nvfp4", "recipe.disable_rht=true"], "NVTE_NVFP4_DISABLE_RHT=1"),
        (["recipe=tensorwise", "stability.fp8_wgrad=false"], "NVTE_BACKWARD_OVERRIDE=high_precision"),
    ],
)
def test_settings_megatron_cannot_express_are_comments(overrides, words):
    argv, notes = megatron_args(compose_cfg(*overrides))
    assert any(words in n and n.startswith("#") for n in notes), notes
    assert not any(words.split("=")[0] in a for a in argv)


def test_activation_func_fp8_input_store_is_a_comment_not_a_flag():
    cfg = compose_cfg("model.activation=swiglu", "optimizer.activation_func_fp8_input_store=true")
    argv, notes = megatron_args(cfg)
    assert "--activation-func-fp8-input-store" not in argv  # Megatron has no such flag
    assert any("activation_func_fp8_input_store=true" in n and "--swiglu" in n for n in notes)


def test_format_sh_is_one_runnable_torchrun_line():
    text = render(compose_cfg("experiment=h200_1b", "recipe=tensorwise", "recipe.power_2_scales=true"), "sh")
    body = [ln for ln in text.splitlines() if not ln.startswith("#")]
    assert body[0].startswith("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1 torchrun --nproc-per-node 1 ")
    assert body[0].endswith('/pretrain_gpt.py" \\') and all(ln.endswith(" \\") for ln in body[:-1])
    tokens = shlex.split(" ".join(ln.rstrip("\\") for ln in body))
    assert tokens[tokens.index("--fp8-recipe") + 1] == "tensorwise"


def test_format_args_is_the_bare_flag_list():
    text = render(compose_cfg("recipe=tensorwise"), "args")
    flags = [ln for ln in text.splitlines() if not ln.startswith("#")]
    assert flags and all(ln.startswith("--") for ln in flags) and "torchrun" not in text
    assert shlex.split(" ".join(flags)) == megatron_args(compose_cfg("recipe=tensorwise"))[0]


def test_cli_format_flag(capsys):
    assert main(["recipe=tensorwise", "--format", "args"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("--")
    assert main(["--format=yaml"]) == 2
    err = capsys.readouterr().err
    assert "--format yaml" in err and "'sh'" in err


# ----------------------------------------------------------------------------------------------
# The sweep: every preset x recipe x knob, lowp's decision against the flag-level rule table


def flag_rule_violations(argv: list[str], fields: dict) -> list[str]:
    """docs/validation_rules.md, read off the exported flags (independent of lowp's config rules)."""
    f = pairs(argv)
    out = []
    req = [
        ("--optimizer-cpu-offload", "--use-precision-aware-optimizer"),  # arguments.py:1884
        ("--use-precision-aware-optimizer", "--use-distributed-optimizer"),  # core/optimizer:1057
        ("--fp8-param-gather", "--use-distributed-optimizer"),  # arguments.py:1095
        ("--reuse-grad-buf-for-mxfp8-param-ag", "--fp8-param-gather"),  # ddp config:259
        ("--fp4-param-gather", "--fp4-format"),  # arguments.py:1104
        ("--fp8-recipe", "--fp8-format"),  # else Megatron trains BF16
        ("--mock-data", "--tokenizer-type"),
    ]
    out += [f"{a} without {b}" for a, b in req if a in f and b not in f]
    if "--fp8-format" in f and "--fp4-format" in f:
        out.append("--fp8-format with --fp4-format")
    if "--optimizer-cpu-offload" in f and "--fp8-param-gather" in f and f.get("--fp8-recipe") != "delayed":
        out.append("--optimizer-cpu-offload --fp8-param-gather without --fp8-recipe delayed")  # 1889
    for dtype in ("--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"):
        if dtype in f and "--use-precision-aware-optimizer" not in f:
            out.append(f"{dtype} without --use-precision-aware-optimizer")  # optimizer_config.py:468
    if float(f.get("--min-lr") or 0.0) > float(f["--lr"]):
        out.append("--min-lr above --lr")
    if "--first-last-layers-bf16" in f and f.get("--fp8-recipe") == "delayed":
        out.append("--first-last-layers-bf16 under delayed")  # transformer_config.py:1529
    if "--fp8-format" in f and "--first-last-layers-bf16" in f:
        for flag in ("--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16"):
            if not 0 <= int(f.get(flag) or 1) <= int(f["--num-layers"]):
                out.append(f"{flag} out of range")  # transformer_config.py:1538
    if f.get("--fp8-recipe") == "custom" and "." not in (f.get("--fp8-quantizer-factory") or ""):
        out.append("custom recipe without a dotted factory")
    if fields.get("activation_func_fp8_input_store") and "--swiglu" not in f:
        out.append("activation_func_fp8_input_store without --swiglu")  # transformer_config.py:2467
    if "--activation-func-fp8-input-store" in f:
        out.append("--activation-func-fp8-input-store is no Megatron flag")
    if int(f["--seed"]) < 1 or int(f["--eval-interval"]) < 1:
        out.append("--seed or --eval-interval below 1")  # initialize.py:483, training.py:5436
    if int(f["--max-position-embeddings"]) < int(f["--seq-length"]):
        out.append("--max-position-embeddings below --seq-length")
    return out + moe_flag_rule_violations(f)


def moe_flag_rule_violations(f: dict[str, str | None]) -> list[str]:
    """Megatron-LM's MoE rules (docs/validation_rules.md), read off the exported flags."""
    out = []
    if "--moe-router-padding-for-quantization" in f:
        if "--fp8-format" not in f and "--fp4-format" not in f:
            out.append("router padding without FP8/FP4")  # transformer_config.py:2649
        if f.get("--moe-token-dispatcher-type", "allgather") == "allgather":
            out.append("router padding with the allgather dispatcher")  # transformer_config.py:2655
    score = f.get("--moe-router-score-function", "softmax")
    if "--moe-router-enable-expert-bias" in f and score not in ("sigmoid", "sqrtsoftplus"):
        out.append("expert bias without sigmoid scores")  # transformer_config.py:2617
    topk1 = f.get("--moe-router-topk") == "1" and "--moe-router-pre-softmax" not in f
    if "--num-experts" in f and topk1 and score == "softmax":
        out.append("top-1 softmax without --moe-router-pre-softmax")  # transformer_config.py:2661
    if "--num-experts" not in f and any(k.startswith("--moe-") for k in f):
        out.append("MoE flags without --num-experts")
    if "--num-experts" in f and "--moe-grouped-gemm" not in f:
        out.append("experts without --moe-grouped-gemm (lowp's are TE GroupedLinear)")
    if "--num-experts" in f and "--disable-bias-linear" not in f:
        out.append("MoE with biases")  # experts.py:205, moe_layer.py:568
    return out


def te_rule_violations(cfg) -> list[str]:
    """TE's Float8BlockScaling (recipe/__init__.py:449): no GEMM of two 2D-scaled operands."""
    r = cfg.recipe
    dims = (r.x_block_dim, r.w_block_dim, r.grad_block_dim)
    if r.name == "blockwise" and sum(d == 2 for d in dims) > 1:
        return ["Float8BlockScaling: 2D by 2D"]
    return []


@pytest.fixture(scope="module")
def sweep():
    from harness.interop.megatron import provider_fields
    from harness.validation.reference_sweep import cases, verdict

    out = []
    for label, cfg in cases():
        refused = verdict(cfg)
        argv = megatron_args(cfg)[0]
        out.append(
            (label, cfg, refused, flag_rule_violations(argv, provider_fields(cfg)) + te_rule_violations(cfg))
        )
    return out


@pytest.mark.slow
def test_sweep_accepts_nothing_the_rule_table_refuses(sweep):
    bad = [(label, v) for label, _, refused, v in sweep if refused is None and v]
    assert not bad, bad[:10]


@pytest.mark.slow
def test_sweep_covers_every_preset_rule_and_outcome(sweep):
    from harness.validation.megatron_rules import RULES
    from harness.validation.reference_sweep import presets

    assert len(sweep) > 1500
    for preset in presets():
        tag = f"experiment={preset or '-'} "
        assert any(label.startswith(tag) and refused is None for label, _, refused, _ in sweep), preset
    fired = {rule.name for rule in RULES for _, cfg, _, _ in sweep if rule.check(cfg)}
    assert fired == {rule.name for rule in RULES}
    assert any(v for _, _, refused, v in sweep if refused)  # the table itself refuses something


@pytest.mark.slow
def test_megatron_lm_benchmark_help():
    res = run_cli(["-m", "benchmarks.megatron_lm", "--help"])
    assert res.returncode == 0 and "check" in res.stdout and "pretrain" in res.stdout
    res = run_cli(["-m", "benchmarks.megatron_lm", "check", "--megatron", "/nonexistent", "--out", "/tmp/x"])
    assert res.returncode == 2 and "no megatron/training/arguments.py" in res.stderr


def test_megatron_lm_log_parsing():
    from benchmarks.megatron_lm import megatron_step_ms

    line = (
        " [2026-12-01 11:00:00.000000] iteration {:8d}/{:8d} | consumed samples: {:12d} | "
        "elapsed time per iteration (ms): {:.1f} | learning rate: 3.0E-03 |"
    )
    log = "\n".join(
        line.format(i, 20, 8 * i, ms) for i, ms in ((5, 900.0), (10, 410.5), (15, 400.0), (20, 405.0))
    )
    got = megatron_step_ms(log, warm_iters=5)
    assert got["intervals"][0] == (5, 900.0) and got["step_ms"] == 405.0


def test_cross_entropy_loss_fusion_is_megatrons_flag_with_its_native_kernel():
    argv, notes = megatron_args(compose_cfg("model=gpt_tiny", "model.cross_entropy_loss_fusion=true"))
    assert "--cross-entropy-loss-fusion" in argv
    assert "--cross-entropy-fusion-impl" not in argv  # `te` is refused by Megatron's validate_args
    assert any("--cross-entropy-fusion-impl native" in n for n in notes)
    assert "--cross-entropy-loss-fusion" not in megatron_args(compose_cfg("model=gpt_tiny"))[0]


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_attention_is_a_provider_field(recipe):
    from harness.interop.megatron import nvte_env, provider_fields

    cfg = compose_cfg("model=gpt_tiny", "backend=te", f"recipe={recipe}", "recipe.fp8_dpa=true")
    argv, notes = megatron_args(cfg)
    # Megatron d98e8a6 keeps fp8_dot_product_attention out of its argparse: no flag to print
    assert not any("dot-product-attention" in a or "multi-head-attention" in a for a in argv)
    assert provider_fields(cfg) == {"fp8_dot_product_attention": True}
    assert not any(k.startswith("NVTE_DPA_") for k in nvte_env(cfg))
    assert any("fp8_dot_product_attention=True" in n for n in notes)
    assert not any("recipe.fp8_dpa=True has no Megatron flag" in n for n in notes)
    cfg = compose_cfg(
        "model=gpt_tiny", "backend=te", "recipe=delayed", "recipe.fp8_dpa=true", "recipe.fp8_mha=true"
    )
    assert provider_fields(cfg) == {"fp8_dot_product_attention": True, "fp8_multi_head_attention": True}
