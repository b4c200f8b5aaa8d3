"""NVFP4 row-scaled activations and 4over6 (TE 2.20) against TE's own reference, plus worked cases.

The golden file (tests/assets/nvfp4_reference/nvfp4_reference.pt) holds TE 2.20.2's
custom_recipes/reference_nvfp4.py NVFP4QuantizerRef output on fixed bf16 inputs in every mode it
accepts (benchmarks/te_reference_nvfp4.py made it); lowp's quantizer must give the same packed codes,
E4M3 scale bytes, global amaxes and dequantized values, atol=0. The worked cases below pin the
4over6 choice on blocks whose errors are computed by hand, in exact arithmetic, in each comment.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.numerics import fast, make_quantizer, resolve_recipe
from harness.numerics.nvfp4 import quantize_nvfp4
from harness.numerics.quantizers import NVFP4Quantizer

GOLDEN = Path(__file__).resolve().parents[1] / "assets/nvfp4_reference/nvfp4_reference.pt"
MAP4_256, MAP6_256, E4M3_448 = 0x7C, 0x78, 0x7E  # E4M3 bytes of 384 (256 x 1.5), 256 and 448


@pytest.fixture(scope="module")
def golden():
    return torch.load(GOLDEN, weights_only=True)


def _modes():
    summary = json.loads(GOLDEN.with_suffix(".json").read_text())
    return sorted({c["case"].split("/")[0] for c in summary["cases"]})


def _quantizer(mode: dict) -> NVFP4Quantizer:
    return NVFP4Quantizer(
        tile_2d=mode["tile"] == [16, 16],
        rht=mode["rht"],
        row_scaled=mode["row_scaled"],
        four_over_six=mode["four_over_six"],
        e4m3_max=mode["e4m3_max"],
        err_mode=mode["err_mode"],
    )


@pytest.mark.parametrize("mode_id", _modes())
def test_matches_te_reference_golden(golden, mode_id):
    cases = {k: c for k, c in golden["cases"].items() if k.startswith(mode_id + "/")}
    assert len(cases) == 9
    for key, c in cases.items():
        x = golden["inputs"][c["input"]]
        qz = _quantizer(c["mode"])
        for copy, (q, s, a, deq) in zip(
            (qz.quantize(x, False), qz.quantize(x, True)),
            (("qx", "sx", "amax_row", "deq"), ("qx_t", "sx_t", "amax_col", "deq_t")),
        ):
            rows, cols = c[s].shape
            assert torch.equal(copy.data, c[q]), (key, q)
            assert torch.equal(copy.scale_inv[:rows, :cols], c[s]), (key, s)
            assert torch.equal(copy.amax, c[a]), (key, a)
            if deq in c:  # TE's dequantize formula on TE's codes; lowp's copy is in x's orientation
                got = copy.dequantize()
                assert torch.equal(got.t() if copy.columnwise else got, c[deq]), (key, deq)


def _one_block(values, err_mode="MAE", e4m3_max=256):
    """One 1x16 block as a (1, 16) tensor (its amax is the tensor's): (scale byte, E2M1 values)."""
    x = torch.tensor([values], dtype=torch.bfloat16)
    q = NVFP4Quantizer(four_over_six=True, e4m3_max=e4m3_max, err_mode=err_mode).quantize(x)
    return int(q.scale_inv[0, 0]), q.elems[0, :16].tolist()


# With the block's amax a the tensor's and the 256 bound, S_enc = 1536 / a: map-to-6's scale is 256
# (k = 6 / a), map-to-4's 384 (k = 4 / a); dequantized, map-to-4 steps are a / 4 x E2M1 and
# map-to-6's a / 6 x E2M1.
GRID4 = [4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, 3.0, 2.0, 1.0]


@pytest.mark.parametrize("err_mode", ["MAE", "MSE"])
def test_map_to_4_wins_when_the_block_sits_on_its_grid(err_mode):
    """a = 4: map-to-4 reproduces every value (error 0); map-to-6 puts 3 on 4.5 -> 4 (2.667, error
    1/3 each), 1.5 on 2.25 -> 2 (1.333) and 0.5 on 0.75 -> 1 (0.667): errors > 0. 4 wins."""
    sf, vals = _one_block(GRID4, err_mode)
    assert sf == MAP4_256 and vals == GRID4


@pytest.mark.parametrize("err_mode", ["MAE", "MSE"])
def test_map_to_6_wins_on_the_e2m1_grid(err_mode):
    """a = 6: map-to-6 is exact; map-to-4 scales by 2/3 and puts 3 on 2 -> 2 (3.0, but 1.5 -> 1 ->
    1.5 and 4 -> 2.667 -> 3 -> 4.5): errors > 0. 6 wins."""
    x = [6.0, 4.0, 3.0, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, 1.0]
    sf, vals = _one_block(x, err_mode)
    assert sf == MAP6_256 and vals == x


def test_a_tie_keeps_map_to_6():
    """Sixteen 2.0s: map-to-6 gives 6 x 256 x 2 / 1536 = 2 and map-to-4 gives 4 x 384 x 2 / 1536 = 2,
    both exact: equal errors keep map-to-6 (TE: `err_map4 < err_map6`). A zero block: both 0."""
    assert _one_block([2.0] * 16) == (MAP6_256, [6.0] * 16)
    assert _one_block([0.0] * 16) == (0, [0.0] * 16)


def test_448_bound_clamps_map_to_4_to_map_to_6():
    """Under the 448 bound a block holding the tensor's amax has base scale 448, map-to-4's 672
    saturates to 448: the two candidates are the same, map-to-6 is kept (why TE defaults to 256)."""
    sf, vals = _one_block(GRID4, e4m3_max=448)
    assert sf == E4M3_448 and vals[0] == 6.0


def test_mae_and_mse_disagree():
    """a = 4. Map-to-4 (step 1): -2.25 -> -2, 2.75 -> 3 (x6), -3.25 -> -3, 3.25 -> 3, others exact:
    nine errors of 1/4: MAE 2.25, MSE 0.5625. Map-to-6 (step 2/3): -2.25 -> -2 (1/4), -3.25 ->
    -3.333 (1/12), -1 -> -1, 2.75 -> 2.667 (1/12, x6), 3.25 -> 3.333 (1/12), -2 -> -2, 1 -> 1,
    4 -> 4, 0: MAE 1.9167, MSE 0.7847 (the 1/4s cost it more squared). MAE keeps 6, MSE takes 4."""
    x = [-2.25, -3.25, -1.0, 2.75, -2.75, 1.0, 2.75, 1.0, 0.0, -4.0, -2.0, -2.75, 3.25, 2.75, 2.75, 4.0]
    assert _one_block(x, "MAE")[0] == MAP6_256
    assert _one_block(x, "MSE")[0] == MAP4_256


def test_row_scaled_rows_are_quantized_as_tensors_of_their_own():
    """Row scaling = each row its own tensor (rowwise copy), each column its own (columnwise copy);
    the amax is one fp32 per line (TE's global_amax_row / global_amax_col)."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(32, 48, generator=g) * torch.logspace(-5, 4, 32)[:, None]).bfloat16()
    row = quantize_nvfp4(x, options=NVFP4Quantizer(row_scaled=True).options)
    col = quantize_nvfp4(x, columnwise=True, options=NVFP4Quantizer(row_scaled=True).options)
    assert torch.equal(row.amax, x.float().abs().amax(1)) and torch.equal(col.amax, x.float().abs().amax(0))
    for i in (0, 7, 31):
        alone = quantize_nvfp4(x[i : i + 1])
        assert torch.equal(row.data[i : i + 1], alone.data)
        assert torch.equal(row.dequantize()[i : i + 1], alone.dequantize())
    for j in (0, 47):
        alone = quantize_nvfp4(x[:, j : j + 1].repeat(1, 16), columnwise=True)
        assert torch.equal(col.dequantize()[:, j], alone.dequantize()[:, 0])
    per_tensor = quantize_nvfp4(x).dequantize()
    assert per_tensor[0].eq(0).all() and not row.dequantize()[0].eq(0).all()  # the 1e-5 row survives


def test_row_scaled_gemm_operand_scales_the_output_lines():
    """values @ B x post is the copy's GEMM: post (M, 1) for the rowwise copy (fprop rows), (1, K)
    for the columnwise one (wgrad columns), amax / (6 x bound) each, as TE's row-scaled GEMM."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(32, 64, generator=g) * torch.logspace(-3, 3, 32)[:, None]).bfloat16()
    qz = NVFP4Quantizer(row_scaled=True)
    row, col = qz.quantize(x, False), qz.quantize(x, True)
    (rv, rp), (cv, cp) = row.gemm_operand(), col.gemm_operand()
    assert rp.shape == (32, 1) and cp.shape == (1, 64)
    assert torch.equal(rp, (row.amax * torch.tensor(1 / 2688.0)).view(32, 1))
    w = torch.randn(16, 64, generator=g).bfloat16()
    y_fast = fast.mm(rv, w.t(), fast.alpha_of(rp, None))  # (32, 16)
    y = row.dequantize() @ w.float().t()  # per-element rounding instead of one per output: 2^-22
    torch.testing.assert_close(y_fast, y, rtol=2.0**-20, atol=2.0**-20 * float(y.abs().max()))
    dy = torch.randn(32, 16, generator=g).bfloat16()
    dw_fast = fast.mm(dy.t(), cv, fast.alpha_of(None, cp))  # (16, 64)
    dw = dy.float().t() @ col.dequantize()
    torch.testing.assert_close(dw_fast, dw, rtol=2.0**-20, atol=2.0**-20 * float(dw.abs().max()))
    four = NVFP4Quantizer(four_over_six=True, e4m3_max=256).quantize(x)
    assert torch.equal(four.gemm_operand()[1], four.amax * torch.tensor(1 / 1536.0))


@pytest.mark.slow  # torch.compile on a CPU (the compiled element cast of the fused path)
@pytest.mark.parametrize(
    "fields",
    [
        {"row_scaled_activation": True},
        {
            "nvfp4_4over6": "all",
            "row_scaled_activation": True,
            "disable_rht": True,
            "nvfp4_4over6_err_mode": "MSE",
        },
    ],
)
def test_fast_linear_with_the_options_differs_by_single_roundings(fields):
    """The Linear on `gemm_operand()` (row-scaled post scales as vectors) against the reference
    Linear: test_fast_path's bound for folded NVFP4 scales."""
    from tests.numerics.test_fast_path import _operands, _run

    ops = _operands()
    ref, got = _run("nvfp4", False, *ops, **fields), _run("nvfp4", True, *ops, **fields)
    for r, f, what in zip(ref[:2], got[:2], ("y", "dx")):
        d = (r - f).abs()
        assert float((d > 0).float().mean()) < 1e-3 and float(d.max()) <= 2**-7 * float(r.abs().max()), what
    assert float((ref[2] - got[2]).abs().max()) <= 2**-18 * float(ref[2].abs().max())


SCOPES = ["none", "weights", "activations", "all"]


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("use_256", SCOPES)
def test_roles_get_the_options_as_te_makes_them(scope, use_256):
    """TE 2.20.2 quantization.py:1690-1750: 4over6 on the scoped non-gradient tensors, 256 for the
    4over6 tensors in its own scope, row scaling on forward activations only."""
    recipe = resolve_recipe(
        "nvfp4",
        nvfp4_4over6=scope,
        nvfp4_4over6_e4m3_use_256=use_256,
        nvfp4_4over6_err_mode="MSE",
        row_scaled_activation=True,
        disable_rht=True,
    )
    for role, kind in (("input", "activations"), ("weight", "weights"), ("grad", None)):
        o = make_quantizer(recipe, role).options
        four = kind is not None and scope in ("all", kind)
        assert o.four_over_six == four, role
        assert o.e4m3_max == (256.0 if four and use_256 in ("all", kind) else 448.0), role
        assert o.row_scaled == (role == "input")
        assert o.err_mode == ("MAE" if role == "grad" else "MSE")


def test_refused_combinations_say_which():
    with pytest.raises(ValueError, match="4over6 does not support RHT or stochastic"):
        NVFP4Quantizer(rht=True, four_over_six=True)
    with pytest.raises(ValueError, match="4over6 does not support RHT or stochastic"):
        make_quantizer(resolve_recipe("nvfp4", nvfp4_4over6="activations"), "input")  # RHT is on
    with pytest.raises(ValueError, match="1x16 blocks only"):
        NVFP4Quantizer(tile_2d=True, row_scaled=True)
    with pytest.raises(ValueError, match="use 'MAE' or 'MSE'"):
        NVFP4Quantizer(four_over_six=True, err_mode="max")
    with pytest.raises(ValueError, match="use 448 or 256"):
        NVFP4Quantizer(four_over_six=True, e4m3_max=300)
    assert NVFP4Quantizer(e4m3_max=256).options.e4m3_max == 448.0  # TE: the bound is 4over6's


def test_tiny_cpu_run_records_the_options(tmp_path, capsys):
    """Two steps of gpt_tiny with row-scaled activations and 4over6 weights: trains, and run.json
    holds the resolved recipe and the quantizers each module built."""
    from harness.train import main
    from tests.helpers import run_main

    args = ["model=gpt_tiny", "recipe=nvfp4", "recipe.row_scaled_activation=true"]
    args += ["recipe.nvfp4_4over6=weights", "recipe.nvfp4_4over6_err_mode=MSE", "logger=none"]
    args += ["steps=2", "log_interval=1", "eval_interval=0", "eval_tokens=128", "checkpoint_interval=-1"]
    args += ["micro_batch_size=2", "global_batch_size=2", f"hydra.run.dir={tmp_path}"]
    code, err = run_main(capsys, main, "harness.train", *args)
    assert code == 0, err
    run = json.loads((tmp_path / "run.json").read_text())
    recipe = run["config"]["recipe"]
    assert recipe["row_scaled_activation"] is True and recipe["nvfp4_4over6"] == "weights"
    assert recipe["nvfp4_4over6_err_mode"] == "MSE" and recipe["nvfp4_4over6_e4m3_use_256"] == "all"
    fc1 = run["provenance"]["numerics"]["blocks.0.mlp.fc1"]
    assert "input=NVFP4(1x16, rht=True, sr=False, row_scaled=True)" in fc1
    assert "weight=NVFP4(16x16, rht=False, sr=False, 4over6=MSE/e4m3_max=256)" in fc1
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"
