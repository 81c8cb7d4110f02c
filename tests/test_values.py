"""Values that cannot round-trip as they are (issue 24, items 16 and 17): numpy 0-d arrays keep
their shape, masked arrays, matrices and nested tensors are refused at save, and views a load
cannot write into are refused before any tensor of the state is written."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import ckpt
from ckpt.errors import StateMismatchError, UnsupportedValueError


def _save(path, step: int, state: dict, **kw) -> None:
    with ckpt.Checkpointer(str(path), **kw) as c:
        c.save(step, state).wait()


def zero_d() -> dict:
    return {"f": np.array(3.5), "i": np.array(7, dtype=np.int64), "s": np.array("hi"),
            "be": np.array(5, dtype=">i4"), "nc": np.arange(4.0)[::2]}


def test_numpy_0d_arrays_round_trip_as_0d(tmp_path):
    _save(tmp_path, 0, {"np": zero_d()})
    fresh: dict = {"np": {}}
    ckpt.Checkpointer(str(tmp_path)).load(0, fresh)
    template = {"np": {"f": np.array(0.0), "i": np.array(0), "s": np.array("xx"),
                       "be": np.array(0, dtype=">i4"), "nc": np.zeros(2)}}
    ckpt.Checkpointer(str(tmp_path)).load(0, template)
    for got in (fresh["np"], template["np"]):
        for k, want in zero_d().items():
            assert got[k].shape == want.shape and got[k].dtype == want.dtype, k
            np.testing.assert_array_equal(got[k], want)
    tensors = ckpt.open(str(tmp_path)).tensors(0)
    assert tensors["np/f"].shape == () and tensors["np/i"].shape == ()



def test_numpy_text_scalars_keep_their_type(tmp_path):
    """Issue 32.17: np.str_ and np.bytes_ came back as plain str and bytes, unlike other numpy scalars."""
    saved = {"s": np.str_("héllo"), "e": np.str_(""), "b": np.bytes_(b"x\x00y"), "eb": np.bytes_(b""),
             "f": np.float32(1.5), "plain": "text", "raw": b"\x01", "keyed": {np.str_("k"): np.str_("v")}}
    _save(tmp_path, 0, {"v": saved})
    got: dict = {"v": {}}
    ckpt.Checkpointer(str(tmp_path)).load(0, got)
    for k in ("s", "e", "b", "eb", "f"):
        assert type(got["v"][k]) is type(saved[k]) and got["v"][k] == saved[k], k
    assert got["v"]["s"] == np.str_("héllo") and got["v"]["b"].dtype == np.dtype("S3")
    assert type(got["v"]["plain"]) is str and type(got["v"]["raw"]) is bytes
    assert got["v"]["keyed"] == {"k": np.str_("v")} and type(got["v"]["keyed"]["k"]) is np.str_
    assert ckpt.open(str(tmp_path)).values(0)["v/s"] == np.str_("héllo")


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("make,hint", [
    (lambda: np.ma.masked_array([1.0, 2.0], mask=[False, True]), "getmaskarray(m)"),
    (lambda: np.matrix([[1, 2], [3, 4]]), "np.asarray(m)"),
])
def test_masked_arrays_and_matrices_are_refused_at_save(tmp_path, make, hint):
    with ckpt.Checkpointer(str(tmp_path)) as c:
        with pytest.raises(UnsupportedValueError, match=re.escape(hint)) as e:
            c.save(0, {"x": {"v": make()}})
        assert "x/v" in str(e.value)
        assert c.steps() == []


def test_masked_array_round_trips_with_pickle(tmp_path):
    m = np.ma.masked_array([1.0, 2.0], mask=[False, True])
    _save(tmp_path, 0, {"x": m}, allow_pickle=True)
    got: dict = {"x": None}
    ckpt.Checkpointer(str(tmp_path), allow_pickle=True).load(0, got)
    assert isinstance(got["x"], np.ma.MaskedArray) and list(got["x"].mask) == [False, True]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_tensor_is_refused_at_save(tmp_path, layout):
    nt = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=layout)
    with ckpt.Checkpointer(str(tmp_path)) as c:
        with pytest.raises(UnsupportedValueError, match="nested tensors.*unbind"):
            c.save(0, {"n": nt})
        assert c.steps() == []


def test_views_save_as_their_values(tmp_path):
    state = {"e": torch.ones(2, 1).expand(2, 3), "n": torch._neg_view(torch.ones(2)),
             "c": (torch.ones(2, dtype=torch.complex64) * 1j).conj()}
    _save(tmp_path, 0, state)
    got = ckpt.open(str(tmp_path)).tensors(0)
    for k, v in state.items():
        assert torch.equal(got[k], v.resolve_conj().resolve_neg()), k


def _unwritable_targets() -> list:
    return [
        ("expanded view (stride 0)", lambda: torch.zeros(1, 4).expand(2, 4)),
        ("negative view", lambda: torch._neg_view(torch.zeros(2, 4))),
    ]


@pytest.mark.parametrize("what,make", _unwritable_targets())
def test_load_into_an_unwritable_view_changes_nothing(tmp_path, what, make):
    _save(tmp_path, 0, {"a": torch.ones(3), "p": torch.arange(8.0).view(2, 4)})
    a, p = torch.zeros(3), make()
    c = ckpt.Checkpointer(str(tmp_path))
    with pytest.raises(StateMismatchError, match=r"'p'.*" + re.escape(what)):
        c.load(0, {"a": a, "p": p})
    assert torch.equal(a, torch.zeros(3)) and not p.any()
    c.load(0, {"a": a, "p": p.clone()})  # the fix the message names works
    assert torch.equal(a, torch.ones(3))


def test_load_into_a_conjugate_view_changes_nothing(tmp_path):
    _save(tmp_path, 0, {"a": torch.ones(3), "z": torch.ones(4, dtype=torch.complex64)})
    a, z = torch.zeros(3), torch.zeros(4, dtype=torch.complex64).conj()
    with pytest.raises(StateMismatchError, match=r"'z'.*conjugate view.*resolve_conj"):
        ckpt.Checkpointer(str(tmp_path)).load(0, {"a": a, "z": z})
    assert torch.equal(a, torch.zeros(3))


def test_module_with_an_expanded_buffer_is_refused_before_any_write(tmp_path):
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("position_ids", torch.arange(4).expand(1, -1).expand(2, -1))

    src = M()
    src.position_ids = src.position_ids.clone()
    _save(tmp_path, 0, {"model": src})
    dst = M()
    before = dst.lin.weight.detach().clone()
    with pytest.raises(StateMismatchError, match="model/position_ids.*stride 0"):
        ckpt.Checkpointer(str(tmp_path)).load(0, {"model": dst})
    assert torch.equal(dst.lin.weight, before)
