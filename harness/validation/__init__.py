"""The rules and `load()`, above what they check: the guide's, TE's and Megatron-LM's rules
(rules.py, megatron_rules.py, reference_sweep.py) and the one way to a ready Config (load.py)."""

from __future__ import annotations

from harness.config.errors import ConfigError, ConfigWarning  # noqa: F401
from harness.validation.load import compose, compose_config, load, prepare  # noqa: F401
