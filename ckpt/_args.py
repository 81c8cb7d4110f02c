"""The one check of a boolean argument, used by every public call that takes one.

``"false"``, ``"no"``, ``0`` and ``None`` are not False to ckpt: Python would take the non-empty string
``"false"`` as true (``load(..., allow_pickle="false")`` would unpickle), so anything but ``True`` or
``False`` (or None where None means "the default") is refused with a :class:`~ckpt.ConfigError` that
names the argument, before the call changes anything.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError


def flag(name: str, value: Any, *, none: bool = False) -> Any:
    """``value`` if it is True or False (or None when ``none``), else a ConfigError naming ``name``."""
    if isinstance(value, bool) or (none and value is None):
        return value
    allowed = "True, False or None (the default)" if none else "True or False"
    hint = " (a string such as 'false' is not False)" if isinstance(value, str) else ""
    raise ConfigError(f"{name} must be {allowed}, got {value!r}{hint}")


def flags(*, none: bool = False, **values: Any) -> None:
    """:func:`flag` for each keyword, in order: ``flags(strict=strict, overwrite=overwrite)``."""
    for name, value in values.items():
        flag(name, value, none=none)
