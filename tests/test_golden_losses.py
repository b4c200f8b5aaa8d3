"""The stored golden loss curves are reproduced bit for bit (tests/golden_losses.py says the rule)."""

from __future__ import annotations

import pytest

from tests.golden_losses import CASES, STEPS, baseline, curve, path_of, read_curve


@pytest.mark.parametrize("name", list(CASES))
def test_golden_loss_curve(name):
    assert path_of(name).is_file(), f"{path_of(name)} missing: python -m tests.golden_losses {name}"
    stored = read_curve(name)
    assert [s for s, _ in stored] == list(range(1, STEPS + 1))
    assert curve(name) == stored  # exact: float equality of every step's loss


def test_curves_differ_between_recipes():
    """A recipe that silently fell back to BF16 would reproduce the BF16 curve: none does."""
    for where in ("", "amx", "avx2"):
        for name in CASES:
            if (base := baseline(name)) is not None:
                assert read_curve(name, where) != read_curve(base, where), (name, where)


def test_every_platform_has_every_case():
    for where in ("", "amx", "avx2"):
        for name in CASES:
            assert path_of(name, where).is_file(), path_of(name, where)
