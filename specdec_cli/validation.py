"""Checks of request fields shared by the gateway and the scorer (each
validates at its own boundary). Errors name the field."""
from __future__ import annotations

import math


class InvalidArgument(ValueError):
    """A request field is bad; str(self) starts with the field's name."""


def sampling_fields(temperature: float, top_k: int, top_p: float, field: str) -> tuple[float, int, float]:
    """Validated (temperature, top_k, top_p) of a SamplingParams message at
    `field`; top_p 0 means disabled and comes back as 1.0."""
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise InvalidArgument(f"{field}.temperature: must be a finite number >= 0, got {temperature}")
    if top_k < 0:
        raise InvalidArgument(f"{field}.top_k: must be >= 0, got {top_k}")
    if not 0 <= top_p <= 1:
        raise InvalidArgument(f"{field}.top_p: must be in [0, 1], got {top_p}")
    return float(temperature), int(top_k), float(top_p) if top_p > 0 else 1.0
