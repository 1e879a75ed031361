"""Settings read from the environment for measurements (a pause, a wait, a kernel switched off),
refused by name when they are not what is allowed."""

from __future__ import annotations

import os


def env_number(name: str, default: float, low: float, high: float, unit: str) -> float:
    """The number in environment variable `name`, `default` when it is unset. Anything that is
    not a number from `low` to `high` (an empty value too) raises ValueError naming the
    variable, the value, the unit and the range."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")  # refused below, with the range
    if not low <= value <= high:
        raise ValueError(f"{name}={raw!r}: give {unit}, a number from {low:g} to {high:g}")
    return value


def env_switch(name: str) -> bool:
    """Whether the switch in environment variable `name` is on: unset, empty or 1 (on) and 0
    (off); anything else raises ValueError naming the variable and the value."""
    text = os.environ.get(name, "").strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"{name}={text!r}: 0 or 1")
    return text != "0"
