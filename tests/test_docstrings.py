"""Public functions and classes say what they take, give and raise (``Args:``, ``Returns:``, ``Raises:``
sections, Google style), so ``help()`` and an editor's hover answer without the docs."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import ckpt
import ckpt.dcp
import ckpt.lightning

PROTOCOL = {"state_dict", "load_state_dict"}  # the Stateful protocol: its meaning is torch's


def _public() -> Iterator[tuple[str, Any]]:
    for name in ckpt.__all__:
        if not name.endswith("Error") and name != "__version__":
            yield f"ckpt.{name}", getattr(ckpt, name)
    for name in ckpt.dcp.__all__:
        yield f"ckpt.dcp.{name}", getattr(ckpt.dcp, name)
    for name in ckpt.lightning.__all__:
        obj = getattr(ckpt.lightning, name)
        if callable(obj):
            yield f"ckpt.lightning.{name}", obj


def _params(f: Any) -> list[str]:
    return [p for p in inspect.signature(f).parameters if p not in ("self", "cls")]


def _inherited(cls: type, name: str) -> bool:
    """A method the class overrides from a framework base (DCP's StorageWriter, Lightning's Callback): the
    base documents it."""
    return any(name in vars(base) for base in cls.__mro__[1:] if base is not object)


def _missing() -> list[str]:
    out = []
    for name, obj in _public():
        if inspect.isclass(obj):
            init = vars(obj).get("__init__")
            params = _params(obj)
            doc = (obj.__doc__ or "") + ((init.__doc__ or "") if init is not None else "")
            if params and "Args:" not in doc and "Attributes:" not in doc:
                out.append(f"{name}: no Args: (or Attributes:) for {params}")
            for m, v in vars(obj).items():
                if m.startswith("_") or m in PROTOCOL or _inherited(obj, m) or isinstance(v, property):
                    continue
                if inspect.isfunction(v) or isinstance(v, (classmethod, staticmethod)):
                    out.extend(_function_missing(f"{name}.{m}", getattr(obj, m)))
        elif callable(obj):
            out.extend(_function_missing(name, obj))
    return out


def _function_missing(name: str, f: Any) -> list[str]:
    doc, out = f.__doc__ or "", []
    if _params(f) and "Args:" not in doc:
        out.append(f"{name}: no Args: for {_params(f)}")
    ret = inspect.signature(f).return_annotation
    if ret not in (inspect.Signature.empty, None, "None") and "Returns:" not in doc:
        out.append(f"{name}: no Returns: for {ret}")
    return out


def test_every_public_function_and_class_documents_its_arguments_and_result():
    missing = _missing()
    assert not missing, "docstrings to complete:\n" + "\n".join(missing)


def test_the_main_entry_points_say_what_they_raise():
    for f in (ckpt.Checkpointer.save, ckpt.Checkpointer.load, ckpt.Reader.tensors, ckpt.Reader.load_into,
              ckpt.import_checkpoint, ckpt.SaveHandle.wait, ckpt.open):
        assert "Raises:" in (f.__doc__ or ""), f"{f.__qualname__} does not say what it raises"
