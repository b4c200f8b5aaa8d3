"""Shared fixtures (helpers live in tests/helpers.py so test modules can import them)."""

from __future__ import annotations

import pytest

from tests.helpers import TINY, compose_cfg


@pytest.fixture
def cfg_of():
    return compose_cfg


@pytest.fixture
def tiny_overrides():
    return list(TINY)
