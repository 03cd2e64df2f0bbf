"""How configuration sections fail: one error type, raised with the field named."""

from __future__ import annotations

import math


class ConfigError(ValueError):
    """A configuration value is missing, malformed or inconsistent; the message names the field."""


class ConfigMismatch(ConfigError):
    """Another peer of the same run uses other settings where all must agree (see `agreed`)."""


def require(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {message}")


def is_power_of_two(x: float) -> bool:
    """(Powers of two below 1 too: 0.5, 0.25, ...)"""
    return x > 0 and math.frexp(x)[0] == 0.5
