"""The TE half of issue 13: every recipe config the reference sweep accepts builds a TE recipe object
that TE's own recipe classes accept (their __post_init__ asserts are TE's rules), with the fields lowp
set. Needs Transformer Engine; on the GPU node: `python -m pytest -q -m gpu tests/test_megatron_gpu.py`."""

from __future__ import annotations

import warnings

import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def accepted_recipes():
    pytest.importorskip("transformer_engine")
    from harness.validation.reference_sweep import cases
    from harness.validation.rules import ConfigError, validate

    seen = {}
    for label, cfg in cases():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                validate(cfg, for_export=True)
            except ConfigError:
                continue
        key = repr((cfg.recipe, cfg.stability.fp8_margin, cfg.stability.fp8_wgrad))
        seen.setdefault(key, (label, cfg.recipe, cfg.stability))
    return list(seen.values())


def test_te_accepts_every_recipe_lowp_accepts(accepted_recipes):
    from harness import recipes
    from harness.backends.te_recipe import build_te_recipe

    assert len(accepted_recipes) > 20
    refused = []
    for label, r, s in accepted_recipes:
        try:
            rec = build_te_recipe(r, s)
        except Exception as exc:  # noqa: BLE001 - TE refuses with AssertionError/ValueError
            refused.append(f"{label}: {type(exc).__name__}: {exc}")
            continue
        cls = recipes.get(r.name).te_recipe_class
        assert (rec is None) == (cls is None), label
        if rec is None:
            continue
        assert type(rec).__name__ == cls, (label, type(rec).__name__)
        if cls == "Float8BlockScaling":
            dims = (rec.x_block_scaling_dim, rec.w_block_scaling_dim, rec.grad_block_scaling_dim)
            assert dims == (r.x_block_dim, r.w_block_dim, r.grad_block_dim), label
        if cls == "DelayedScaling":
            assert (rec.amax_history_len, rec.margin) == (r.fp8_amax_history_len, s.fp8_margin), label
        if cls == "Float8CurrentScaling":
            split = (rec.fp8_gemm_fprop, rec.fp8_gemm_dgrad, rec.fp8_gemm_wgrad)
            backward = r.fp8_fast_accumulation != "all"
            assert [p.use_split_accumulator for p in split] == [False, backward, backward], label
    assert not refused, refused[:10]


def test_te_refuses_what_lowp_refuses_for_block_dims():
    """The other direction for the rule lowp took from TE: the 2D-by-2D tiling it refuses, TE refuses."""
    R = pytest.importorskip("transformer_engine.common.recipe")
    for dims in ((2, 2, 1), (1, 2, 2), (2, 1, 2)):
        # TE 2.20's recipe dataclasses are pydantic: its assert comes out as a ValidationError (a ValueError)
        with pytest.raises((AssertionError, ValueError), match="2D by 2D"):
            R.Float8BlockScaling(
                x_block_scaling_dim=dims[0], w_block_scaling_dim=dims[1], grad_block_scaling_dim=dims[2]
            )
