"""The expert-MLP benchmark's routing counts and spec checks (its timings run on a GPU only)."""

from __future__ import annotations

import pytest

from benchmarks import moe_experts, specs


@pytest.mark.parametrize("routing", moe_experts.ROUTINGS)
def test_counts_cover_the_rows_in_aligned_groups(routing):
    counts = moe_experts.counts_for(routing, 128, 16384 * 8)
    assert sum(counts) == 16384 * 8 and len(counts) == 128
    assert all(c % moe_experts.ALIGN == 0 for c in counts)
    if routing == "balanced":
        assert set(counts) == {1024}
    if routing == "zipf":
        assert counts[0] > 50 * counts[-1] > 0 and counts == sorted(counts, reverse=True)
    if routing == "empty":
        assert counts.count(0) == 16 and len(set(counts) - {0}) <= 2


def test_unknown_shape_is_named_before_anything_runs():
    spec = specs.load_spec("moe_experts")
    opts = moe_experts.Options(shapes=("qwen3",))
    with pytest.raises(specs.SpecError, match=r"unknown shapes \['qwen3'\]"):
        specs.check(spec, opts)
