"""The checks of :mod:`ckpt.options`: each takes the option's name and the value as given and returns
the value as kept, or raises :class:`~ckpt.errors.ConfigError` naming the option."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ._args import flag as _is_flag
from .errors import ConfigError
from .redundancy_config import Parity, Replicas
from .save.encode import CodecSpec
from .schedule import positive

Check = Callable[[str, Any], Any]  # (option name, value as given) -> value as kept, or ConfigError


def flag(name: str, v: Any) -> bool:
    return _is_flag(name, v)  # "no" and 0 are not False: say so instead of guessing


def count(name: str, v: Any) -> int | None:
    if v is not None and (type(v) is not int or v < 1):
        raise ConfigError(f"{name} must be a positive integer or None, got {v!r}")
    return v


def int_in(lo: int, hi: int, what: str) -> Check:
    def check(name: str, v: Any) -> int:
        if type(v) is not int or not lo <= v <= hi:
            raise ConfigError(f"{name} must be an integer {what}, got {v!r}")
        return v
    return check


def number_in(lo: float, hi: float, what: str) -> Check:
    def check(name: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise ConfigError(f"{name} must be a number {what}, got {v!r}")
        return float(v)
    return check


def one_of(*allowed: Any) -> Check:
    def check(name: str, v: Any) -> Any:
        if not any(v is a or (isinstance(a, str) and v == a) for a in allowed):  # True, not 1
            raise ConfigError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {v!r}")
        return v
    return check


def codec(name: str, v: Any) -> CodecSpec:
    if isinstance(v, CodecSpec):
        return v
    if not isinstance(v, str):
        raise ConfigError(f"{name} must be a string such as 'auto' or 'zstd:3', got {v!r}")
    return CodecSpec.parse(v)


def directory(name: str, v: Any) -> str | None:
    if v is not None and not isinstance(v, (str, os.PathLike)):
        raise ConfigError(f"{name} must be a local directory path, got {v!r}")
    return None if v is None else os.fspath(v)


def mapping(name: str, v: Any) -> dict[str, Any] | None:
    if v is not None and not isinstance(v, dict):
        raise ConfigError(f"{name} must be a dict, got {type(v).__name__}")
    return v


def seconds(name: str, v: Any) -> float:
    return positive(f"{name} (seconds)", v)


def share(name: str, v: Any) -> float:
    return positive(name, v, upper=1.0)


def redundancy(name: str, v: Any) -> Replicas | Parity | None:
    if v is not None and not isinstance(v, (Replicas, Parity)):
        raise ConfigError(f"{name} must be ckpt.Replicas(r) or ckpt.Parity(data=k, parity=m), got {v!r}")
    return v


def domain(name: str, v: Any) -> str | None:
    if v is not None and (not isinstance(v, str) or not v):
        raise ConfigError(f"{name} must be a non-empty string (e.g. the node's name), got {v!r}")
    return v
