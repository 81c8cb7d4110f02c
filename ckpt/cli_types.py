"""Argument types of the ``ckpt`` command line: each parses one word and says what it expected."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from .format.manifest import MAX_STEP

UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(s: str) -> float:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", s)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a duration like 90s, 30m, 1h or 2d, got {s!r}")
    return float(m.group(1)) * UNITS[m.group(2)]


def key_value(s: str) -> tuple[str, Any]:
    if "=" not in s:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {s!r}")
    k, v = s.split("=", 1)
    try:
        return k, json.loads(v)
    except json.JSONDecodeError:
        return k, v


def step(s: str) -> int | str:
    if s == "latest":
        return s
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a step is a non-negative integer or 'latest', got {s!r}") from None
    if not 0 <= n <= MAX_STEP:
        raise argparse.ArgumentTypeError(f"a step is an integer from 0 to 2**63 - 1, got {s!r}")
    return n


def new_step(s: str) -> int:
    n = step(s)
    if not isinstance(n, int):
        raise argparse.ArgumentTypeError("a step number is needed here, not 'latest'")
    return n


def positive(s: str) -> int:
    try:
        n = int(s)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}")
    return n
