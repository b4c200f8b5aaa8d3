"""The MegaDLMs command of a masked-diffusion config: pretrain_difflm.py's difflm flags for BF16 and
delayed scaling (no --fp8-recipe: the fork predates it), one line naming the fork's limit otherwise."""

from __future__ import annotations

import pytest

from harness import megatron as MG

DLM = ["objective=masked_diffusion", "model=gpt_tiny", "data.vocab_size=255"]


def cli(capsys, *args):
    argv = list(args)
    code = MG.main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("recipe", ["bf16", "delayed"])
def test_bf16_and_delayed_print_pretrain_difflm_with_its_flags(capsys, recipe):
    code, out, err = cli(capsys, *DLM, f"recipe={recipe}", "objective.difflm_varilen_prob=0.05")
    assert code == 0, err
    assert "pretrain_difflm.py" in out and "pretrain_gpt.py" not in out
    for line in ("--model-running-mode difflm-noshift", "--attention-mask-type no_mask", "--mask-token 255",
                 "--difflm-varilen-prob 0.05"):  # fmt: skip
        assert line in out, line
    assert "--fp8-recipe" not in out
    assert ("--fp8-format hybrid" in out) == (recipe == "delayed")
    assert ("--fp8-amax-history-len 1024" in out) == (recipe == "delayed")


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise", "mxfp8", "nvfp4", "int4_qat"])
def test_other_recipes_are_refused_naming_the_forks_limit(capsys, recipe):
    code, out, err = cli(capsys, *DLM, f"recipe={recipe}")
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(lines) == 1 and out == "", err
    assert (
        lines[0].startswith(f"error: recipe={recipe}: MegaDLMs' Megatron fork") and "--fp8-recipe" in lines[0]
    )


def test_an_autoregressive_config_still_prints_pretrain_gpt(capsys):
    code, out, _ = cli(capsys, "model=gpt_tiny", "recipe=tensorwise")
    assert code == 0 and "pretrain_gpt.py" in out and "--fp8-recipe tensorwise" in out
    assert "difflm" not in out
