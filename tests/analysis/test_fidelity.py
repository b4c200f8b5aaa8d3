"""analysis.fidelity: the curve criterion against BF16 seeds, its band-free form, and rel."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch

from analysis.fidelity import criterion, criterion_free, rel


def curve(*v: float) -> dict:
    return {"train": [[s, x] for s, x in zip((1, 10, 20), v, strict=True)]}


def test_criterion_compares_each_logged_step_with_the_seed_spread():
    seeds = [curve(5.0, 4.0, 3.0), curve(5.1, 4.1, 3.1)]
    ok = criterion(curve(5.0, 4.0, 3.0), curve(5.0, 4.01, 3.02), seeds, "train")
    assert ok["holds"] and ok["violating_steps"] == [] and ok["holds_vs_mean_pairwise"]
    bad = criterion(curve(5.0, 4.0, 3.0), curve(5.2, 4.0, 3.0), seeds, "train")
    assert not bad["holds"] and bad["violating_steps"] == [1]
    # seeds 0 and 1 cross at step 20; the mean over three seeds' pairs is (0 + .3 + .3) / 3 = .2
    crossing = [curve(5.0, 4.0, 3.0), curve(5.1, 4.1, 3.0), curve(5.2, 4.2, 3.3)]
    c = criterion(curve(5.0, 4.0, 3.0), curve(5.0, 4.0, 3.1), crossing, "train")
    assert c["violating_steps"] == [20] and c["holds_vs_mean_pairwise"]
    assert c["rows"][2] == [20, pytest.approx(0.1), 0.0, pytest.approx(0.2)]


def test_criterion_needs_two_seeds():
    with pytest.raises(ValueError, match="at least 2 BF16 seed"):
        criterion(curve(1, 1, 1), curve(1, 1, 1), [curve(1, 1, 1)], "train")


def test_criterion_free_keeps_the_sign():
    c = criterion_free(curve(5.0, 4.0, 3.0), curve(4.9, 4.1, 2.9), "train")
    assert c["max_pair_diff"] == pytest.approx(0.1)
    assert c["mean_signed"] == pytest.approx(0.1 / 3)
    assert [r[0] for r in c["rows"]] == [1, 10, 20] and c["rows"][1][1] == pytest.approx(-0.1)


def test_rel_is_relative_to_the_second_and_safe_at_zero():
    b = torch.tensor([3.0, 4.0])
    assert rel(b + torch.tensor([0.0, 0.5]), b) == pytest.approx(0.1)
    assert rel(torch.zeros(2), torch.zeros(2)) == 0.0
