"""The errors of a configuration, on the ground floor: any layer may raise them, the entry points
turn them into one `error:` line and exit code 2."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that must not run; the message is one line naming the options and the fix."""


class ConfigWarning(UserWarning):
    """The guide recommends otherwise; the run goes on."""
