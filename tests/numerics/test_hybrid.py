"""TE's hybrid recipes (harness.numerics.hybrid), role by role and GEMM by GEMM.

Each factory's roles are written out below from TE 2.20.2's custom_recipes/quantizer_factory_zoo.py
(docstrings and dispatch; file:line in docs/numerics.md, "Hybrid recipes"): for each role the quantizer
of its rowwise copy, of its columnwise copy, and where the columnwise copy is quantized from. Every copy
must equal that component's own output at atol=0; an emulated Linear's three GEMMs must read exactly
fprop = x row x W row, dgrad = dy row x W col, wgrad = dy col x x col.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from harness.config.schema import RecipeConfig
from harness.numerics import hybrid as H
from harness.numerics.context import NumericsContext
from harness.numerics.formats import E4M3
from harness.numerics.linear import QuantizedLinear, _FastQuantizedLinearFn
from harness.numerics.mxfp8 import quantize_mxfp8
from harness.numerics.nvfp4 import quantize_nvfp4
from harness.numerics.quantizers import NVFP4Quantizer, load_factory, quantize_pair

BF16 = torch.bfloat16
HAS_ROW_SCALED = "row_scaled" in inspect.signature(NVFP4Quantizer).parameters
needs_row_scaled = pytest.mark.skipif(
    not HAS_ROW_SCALED, reason="row-scaled NVFP4 (NVFP4Quantizer(row_scaled=...)) is not on this branch"
)


# The components, each computed straight from lowp's one-copy quantizers: copy(x, columnwise) -> Quantized
def _identity(x, c):
    return H.IdentityQuantized(x, c)


def _mx(x, c):  # TE's mxfp8_factory: E4M3 for every role
    return quantize_mxfp8(x, E4M3, columnwise=c)


def _nv_input(x, c):  # nvfp4_factory's input: 1x16, RHT on the columnwise copy
    return quantize_nvfp4(x, columnwise=c, rht=True)


def _nv_grad(x, c):  # nvfp4_factory's grad_output: that and stochastic rounding (global RNG)
    return quantize_nvfp4(x, columnwise=c, rht=True, stochastic=True)


def _nv_weight_2d(x, c):  # nvfp4_factory's weight: 16x16 tiles
    return quantize_nvfp4(x, columnwise=c, tile_2d=True)


def _nv_plain(x, c):  # the zoo's _plain_nvfp4_quantizer
    return quantize_nvfp4(x, columnwise=c)


def _nv_row_scaled(x, c):  # _plain_nvfp4_quantizer(row_scaled_nvfp4=True)
    return NVFP4Quantizer(row_scaled=True).quantize(x, c)


ORIG, DEQ = "original", "rowwise_dequantized"
SAME = {"input": (_nv_input, _nv_input, ORIG), "grad": (_nv_grad, _nv_grad, ORIG)}
ALL_MX = {r: (_mx, _mx, ORIG) for r in ("input", "weight", "grad")}
# factory -> module_type -> role -> (rowwise component, columnwise component, columnwise source)
ROLES = {
    "high_precision_fwd_mxfp8_bwd_factory": {  # zoo:83-103
        "linear": {
            "input": (_identity, _mx, ORIG),
            "weight": (_identity, _mx, ORIG),
            "grad": (_mx, _mx, ORIG),
        }
    },
    "mxfp8_fwd_nvfp4_bwd_factory": {  # zoo:120-158
        "linear": {
            "input": (_mx, _nv_input, ORIG),
            "weight": (_mx, _nv_plain, DEQ),
            "grad": (_nv_grad, _nv_grad, ORIG),
        }
    },
    "nvfp4_1d_weight_factory": {"linear": {**SAME, "weight": (_nv_plain, _nv_plain, DEQ)}},  # zoo:161-191
    "mxfp8_fwd_high_precision_bwd_factory": {  # zoo:199-235
        "linear": {
            "input": (_mx, _identity, DEQ),
            "weight": (_mx, _identity, DEQ),
            "grad": (_identity, _identity, ORIG),
        }
    },
    "nvfp4_row_scaled_fwd_mxfp8_bwd_factory": {  # zoo:238-296
        "linear": ALL_MX,
        "grouped_linear": {
            "input": (_nv_row_scaled, _mx, DEQ),
            "weight": (_nv_plain, _mx, DEQ),
            "grad": (_mx, _mx, ORIG),
        },
    },
    "nvfp4_row_scaled_fwd_high_precision_bwd_factory": {  # zoo:299-348
        "linear": {
            "input": (_nv_row_scaled, _identity, DEQ),
            "weight": (_nv_plain, _identity, DEQ),
            "grad": (_identity, _identity, ORIG),
        }
    },
    "nvfp4_linear_fp8_dpa_factory": {"linear": {**SAME, "weight": (_nv_weight_2d, _nv_weight_2d, ORIG)}},
}
ROW_SCALED = {  # (factory, module_type): the cases that quantize an input with row-scaled NVFP4
    ("nvfp4_row_scaled_fwd_mxfp8_bwd_factory", "grouped_linear"),
    ("nvfp4_row_scaled_fwd_high_precision_bwd_factory", "linear"),
}
CASES = [
    pytest.param(f, mt, marks=[needs_row_scaled] if (f, mt) in ROW_SCALED else [], id=f"{f}-{mt}")
    for f, by_type in ROLES.items()
    for mt in by_type
]
RECIPE = RecipeConfig(name="custom", fp8="e4m3")


def _tensor(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-2, 1, rows)[:, None] * torch.logspace(1, -2, cols)  # rows and columns of
    x = torch.randn(rows, cols, generator=g) * scale  # different ranges: rowwise and columnwise blocks differ
    return x.to(BF16)


def _same(got, want, what):
    assert type(got) is type(want), f"{what}: {type(got).__name__}, expected {type(want).__name__}"
    assert torch.equal(got.dequantize(), want.dequantize()), what
    assert torch.equal(got.data, want.data), f"{what}: codes"
    if want.scale_inv is not None:
        assert torch.equal(got.scale_inv, want.scale_inv), f"{what}: scales"


def _expected_pair(spec, x):
    """(rowwise, columnwise) as the role table says, drawing stochastic rounding in TE's order."""
    row_c, col_c, source = spec
    row = row_c(x, False)
    src = row.dequantize().to(x.dtype) if source == DEQ else x
    return row, col_c(src, True)


def test_every_zoo_factory_is_shipped_under_its_te_name():
    assert set(H.FACTORIES) == set(ROLES) == set(H.NATIVE_RECIPES)
    assert all(load_factory(name) is H.FACTORIES[name] for name in ROLES)
    assert all(load_factory(f"harness.numerics.hybrid:{name}") is H.FACTORIES[name] for name in ROLES)


@pytest.mark.parametrize(("name", "module_type"), CASES)
def test_each_role_and_copy_is_its_named_component(name, module_type):
    factory = load_factory(name)
    for i, (role, spec) in enumerate(ROLES[name][module_type].items()):
        x = _tensor(32, 64, seed=i)
        torch.manual_seed(7)
        got = quantize_pair(factory(role, RECIPE, module_type=module_type), x, True, True)
        torch.manual_seed(7)
        want = _expected_pair(spec, x)
        for copy, g, w in zip(("rowwise", "columnwise"), got, want, strict=True):
            _same(g, w, f"{name} {module_type} {role} {copy}")
        qz = factory(role, RECIPE, module_type=module_type)
        if isinstance(qz, H.HybridQuantizer):  # a columnwise copy asked for alone is the same copy
            _same(qz.quantize(x, True), want[1], f"{name} {module_type} {role} columnwise alone")


def test_the_columnwise_source_matters_and_is_the_bf16_dequantized_rowwise_copy():
    x = _tensor(32, 64, seed=3)
    deq = H.HybridQuantizer(H.mxfp8(), H.plain_nvfp4(), DEQ).quantize(x, True)
    orig = H.HybridQuantizer(H.mxfp8(), H.plain_nvfp4(), ORIG).quantize(x, True)
    assert not torch.equal(deq.dequantize(), orig.dequantize())
    back = H.HybridQuantizer(H.plain_nvfp4(), H.IdentityQuantizer(), DEQ).quantize(x, True)
    assert back.values.dtype == BF16  # TE: rowwise_result.dequantize(dtype=tensor.dtype)
    assert torch.equal(back.values, quantize_nvfp4(x).dequantize().to(BF16))


def test_bad_roles_and_module_types_and_sources_are_refused():
    f = H.mxfp8_fwd_nvfp4_bwd_factory
    with pytest.raises(ValueError, match="roles are"):
        f("grad_output", RECIPE)
    with pytest.raises(ValueError, match="module_type 'dpa'"):
        f("input", RECIPE, module_type="dpa")
    with pytest.raises(ValueError, match="columnwise_source"):
        H.HybridQuantizer(H.mxfp8(), H.mxfp8(), "transposed")
    q = H.mxfp8()
    with pytest.raises(ValueError, match="two quantizer objects"):
        H.HybridQuantizer(q, q)


def test_te_names_and_hardware():
    assert H.short_name("mxfp8_fwd_nvfp4_bwd_factory") == "mxfp8_fwd_nvfp4_bwd_factory"
    assert H.short_name("harness.numerics.hybrid:nvfp4_1d_weight_factory") == "nvfp4_1d_weight_factory"
    assert H.short_name("harness.numerics.custom:tensorwise_factory") is None
    assert H.te_factory("harness.numerics.custom:tensorwise_factory") is None  # no TE import for those
    assert H.te_path("nvfp4_1d_weight_factory") == (
        "transformer_engine.pytorch.custom_recipes.quantizer_factory_zoo.nvfp4_1d_weight_factory"
    )
    assert H.native_on("mxfp8_fwd_nvfp4_bwd_factory", 10.0) == (True, "")
    ok, why = H.native_on("mxfp8_fwd_nvfp4_bwd_factory", 9.0)
    assert not ok and "mxfp8 kernels: TE needs compute capability >= 10.0, not 9.0" in why
    assert not H.native_on("nvfp4_1d_weight_factory", None)[0]


def test_a_bad_short_name_lists_the_shipped_ones():
    with pytest.raises(ValueError) as err:
        load_factory("mxfp8_fwd_nvfp4_bwd")
    msg = str(err.value)
    assert "\n" not in msg and "recipe.quantizer_factory='mxfp8_fwd_nvfp4_bwd'" in msg
    assert all(name in msg for name in H.FACTORIES)


def _linear(name, module_type):
    recipe = RecipeConfig(name="custom", fp8="e4m3", quantizer_factory=name)
    mod = QuantizedLinear("fc", recipe, NumericsContext("cpu"), fast_gemm=False)
    # what the emulator's expert GEMMs will ask for (TE's grouped_linear roles)
    factory = load_factory(name)
    mod.quantizers = {r: factory(r, recipe, module_type=module_type) for r in ("input", "weight", "grad")}
    return mod


def _gemms(spec, x, w, dy):
    """The three GEMMs on the copies the role table names (fp32 products rounded to bf16)."""
    (xr, xc), (wr, wc) = _expected_pair(spec["input"], x), _expected_pair(spec["weight"], w)
    torch.manual_seed(11)
    dyr, dyc = _expected_pair(spec["grad"], dy)
    y = (xr.dequantize() @ wr.dequantize().t()).to(BF16)
    dx = (dyr.dequantize() @ wc.dequantize()).to(BF16)
    dw = (dyc.dequantize().t() @ xc.dequantize()).to(BF16)
    return y, dx, dw, wr


def _run(mod, x, w, dy, fn=None):
    xv, wv = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = mod.linear(xv, wv, None) if fn is None else fn.apply(xv, wv, None, mod)
    torch.manual_seed(11)
    y.backward(dy)
    return y.detach(), xv.grad, wv.grad


@pytest.mark.parametrize(("name", "module_type"), CASES)
def test_linear_gemms_read_fprop_rows_dgrad_grad_row_weight_col_wgrad_cols(name, module_type):
    spec = ROLES[name][module_type]
    x, w, dy = _tensor(32, 64, 0), _tensor(32, 64, 1) * 0.1, _tensor(32, 32, 2)
    y, dx, dw = _run(_linear(name, module_type), x, w, dy)
    want_y, want_dx, want_dw, wr = _gemms(spec, x, w, dy)
    assert torch.equal(y, want_y), "fprop: input rowwise x weight rowwise"
    assert torch.equal(dx, want_dx), "dgrad: grad rowwise x weight columnwise"
    assert torch.equal(dw, want_dw), "wgrad: grad columnwise x input columnwise"
    wc = _expected_pair(spec["weight"], w)[1]
    if not torch.equal(wr.dequantize(), wc.dequantize()):  # the copies differ: dgrad tells them apart
        torch.manual_seed(11)
        dyr = _expected_pair(spec["grad"], dy)[0]
        assert not torch.equal(dx, (dyr.dequantize() @ wr.dequantize()).to(BF16))


@pytest.mark.parametrize(
    "name", ["high_precision_fwd_mxfp8_bwd_factory", "mxfp8_fwd_high_precision_bwd_factory"]
)
def test_fast_gemms_read_the_identity_copies_as_they_are(name):
    """The fast GEMMs on gemm_operand(): on a CPU the same fp32 GEMMs, so the same bits where no
    operand carries a post-GEMM scale (identity and MXFP8 copies carry none)."""
    x, w, dy = _tensor(32, 64, 0), _tensor(32, 64, 1) * 0.1, _tensor(32, 32, 2)
    ref = _run(_linear(name, "linear"), x, w, dy)
    fast = _run(_linear(name, "linear"), x, w, dy, _FastQuantizedLinearFn)
    for r, f, what in zip(ref, fast, ("y", "dx", "dW"), strict=True):
        assert torch.equal(r, f), what
    q = H.IdentityQuantizer().quantize(x)
    assert q.gemm_operand() == (q.values, None) and q.values.dtype == BF16
