"""ckpt.testing.FaultyStorage over real backends (a local directory and memory://): each rule fails
exactly the calls it names, every call is counted, and everything else is the wrapped storage's."""

from __future__ import annotations

import threading
import uuid

import pytest

import ckpt
from ckpt.format.chunk import verify_object
from ckpt.storage import LocalStorage, Storage, durable_of, open_storage, open_tiered
from ckpt.testing import FaultyStorage, run_ranks


@pytest.fixture(params=["local", "memory"])
def inner(request, tmp_path):
    st: Storage = (LocalStorage(str(tmp_path / "root")) if request.param == "local"
                   else open_storage(f"memory://faulty-{uuid.uuid4().hex}"))
    yield st
    st.close()


def test_without_rules_it_is_the_wrapped_storage_and_counts_every_call(inner):
    st = FaultyStorage(inner)
    assert st.url == inner.url and st.describe() == inner.describe()
    assert st.root_state() == inner.root_state()
    assert st.write("chunks/ab/abc", [b"hello ", memoryview(b"world")]) == 11
    st.commit("steps/1/MANIFEST.json", b"{}")
    with pytest.raises(FileExistsError):  # the backend's own errors pass through untouched
        st.commit("steps/1/MANIFEST.json", b"{}")
    assert bytes(st.read("chunks/ab/abc")) == b"hello world"
    assert bytes(st.read("chunks/ab/abc", 6, 11)) == b"world"
    assert bytes(st.head("chunks/ab/abc", 5)) == b"hello"
    assert bytes(st.read_object("chunks/ab/abc", 100)) == b"hello world"
    buf = bytearray(5)
    assert st.readv("chunks/ab/abc", [buf], 6) == 5 and buf == b"world"
    assert st.exists("chunks/ab/abc") and not st.exists("chunks/ab/nope")
    assert st.size("chunks/ab/abc") == 11
    assert sorted(st.list("chunks/ab")) == sorted(inner.list("chunks/ab")) == ["abc"]
    with pytest.raises(FileNotFoundError):
        st.read("chunks/ab/nope")
    st.delete("chunks/ab/abc")
    assert not inner.exists("chunks/ab/abc")
    st.flush()
    assert st.calls == {"root_state": 1, "write": 1, "commit": 2, "read": 3, "head": 1, "read_object": 1, "readv": 1,
                        "exists": 2, "size": 1, "list": 1, "delete": 1, "flush": 1}
    assert not st.failed
    assert st.log[:3] == [("root_state", ""), ("write", "chunks/ab/abc"), ("commit", "steps/1/MANIFEST.json")]
    assert durable_of(st) is st  # a single tier: leases see the faults too
    st.reset_counts()
    assert not st.calls and not st.log


def test_nth_fails_only_that_matching_call_with_a_translated_error(inner):
    st = FaultyStorage(inner)
    rule = st.fail("write", key=r"^chunks/", nth=2)
    st.write("chunks/00/a", [b"a"])
    st.write("steps/1/rank-00000.json", [b"{}"])  # not a chunk: the rule does not count it
    with pytest.raises(ckpt.StorageError, match="injected") as e:
        st.write("chunks/00/b", [b"b"])
    assert isinstance(e.value.__cause__, OSError)  # like a backend's translation of a disk error
    st.write("chunks/00/c", [b"c"])
    assert not inner.exists("chunks/00/b") and inner.exists("chunks/00/c")  # the failed call never reached it
    assert (rule.matched, rule.fired) == (3, 1)
    assert st.calls["write"] == 4 and st.failed == {"write": 1}


def test_after_fails_every_matching_call_past_the_first_n(inner):
    st = FaultyStorage(inner)
    for k in "abcde":
        inner.write(f"chunks/00/{k}", [b"x"])

    class Killed(BaseException):
        pass

    st.fail("delete", after=2, exc=Killed)
    st.delete("chunks/00/a")
    st.delete("chunks/00/b")
    for k in "cde":
        with pytest.raises(Killed, match="delete 'chunks/00/"):
            st.delete(f"chunks/00/{k}")
    assert sorted(inner.list("chunks/00")) == ["c", "d", "e"]
    assert st.calls["delete"] == 5 and st.failed["delete"] == 3


def test_a_key_pattern_on_any_operation_once(inner):
    st = FaultyStorage(inner)
    inner.write("steps/1/MANIFEST.json", [b"{}"])
    rule = st.fail(key=r"MANIFEST\.json$", once=True, exc=OSError("disk gone"))
    assert st.exists("chunks/00/a") is False  # another key: untouched
    with pytest.raises(OSError, match="disk gone"):
        st.read("steps/1/MANIFEST.json")
    assert bytes(st.read("steps/1/MANIFEST.json")) == b"{}"  # once: the retry goes through
    assert st.exists("steps/1/MANIFEST.json")
    assert (rule.matched, rule.fired) == (3, 1) and st.failed == {"read": 1}


def test_several_operations_times_and_an_error_factory(inner):
    st = FaultyStorage(inner)
    st.fail(["read", "readv"], times=2, exc=lambda op, key: ckpt.StorageError(f"{op} of {key} throttled"))
    inner.write("k", [b"data"])
    with pytest.raises(ckpt.StorageError, match="read of k throttled"):
        st.read("k")
    with pytest.raises(ckpt.StorageError, match="readv of k throttled"):
        st.readv("k", [bytearray(4)])
    assert bytes(st.read("k")) == b"data"  # fired its two times
    st.write("k2", [b"x"])  # writes were never in the rule
    assert st.failed == {"read": 1, "readv": 1}


def test_the_first_rule_that_fires_raises_and_the_others_only_count(inner):
    st = FaultyStorage(inner)
    first = st.fail("write", nth=1, exc=ValueError("first"))
    second = st.fail("write", nth=1, exc=KeyError("second"))
    with pytest.raises(ValueError, match="first"):
        st.write("a", [b"x"])
    st.write("b", [b"x"])
    assert (first.matched, first.fired, second.matched, second.fired) == (2, 1, 2, 0)
    st.clear()
    assert not st.rules


def test_a_gate_holds_matching_calls_until_opened(inner):
    st = FaultyStorage(inner)
    gate = st.gate("write", key=r"^chunks/")
    st.write("steps/1/rank-00000.json", [b"{}"])  # not held
    done = threading.Event()
    t = threading.Thread(target=lambda: (st.write("chunks/00/a", [b"a"]), done.set()))
    t.start()
    assert gate.entered.wait(10)
    assert not done.is_set() and not inner.exists("chunks/00/a")  # provably in flight
    gate.open()
    t.join(10)
    assert done.is_set() and inner.exists("chunks/00/a") and gate.held == 1


def test_a_gate_that_is_never_opened_fails_in_bounded_time(inner):
    st = FaultyStorage(inner)
    st.gate("read", timeout=0.05)
    with pytest.raises(TimeoutError, match="never opened"):
        st.read("anything")


def test_bad_rules_are_refused_before_any_call(inner):
    st = FaultyStorage(inner)
    with pytest.raises(ValueError, match="unknown storage operation"):
        st.fail("wirte")
    with pytest.raises(ValueError, match="counts from 1"):
        st.fail("write", nth=0)


def test_backend_attributes_and_tiers_show_through(tmp_path):
    local = FaultyStorage(LocalStorage(str(tmp_path / "root")))
    assert local.root == str(tmp_path / "root")  # a backend's own attribute
    tiered = open_tiered(f"memory://faulty-{uuid.uuid4().hex}", str(tmp_path / "nvme"), verify=verify_object)
    st = FaultyStorage(tiered)
    assert st.durable_tier() is tiered.durable_tier()  # the remote itself, not the wrapper
    assert st.tier_counters() == tiered.tier_counters()
    st.close()
    assert st.calls["close"] == 1


def _what_a_rank_sees(rank: int, world: int) -> tuple:
    import os
    return os.environ.get("CKPT_TEST_MARK"), os.environ.get("CKPT_TEST_GONE"), os.getcwd()


def test_run_ranks_hands_each_rank_the_callers_environment_and_directory_now(tmp_path, monkeypatch):
    """Ranks are forked from a server that an earlier call started, with that moment's environment:
    a rank sees the caller's environment and directory as they are at this call, as a spawned one did."""
    monkeypatch.setenv("CKPT_TEST_GONE", "1")
    run_ranks(1, _what_a_rank_sees)  # the server is up (started with CKPT_TEST_GONE, if by this call)
    monkeypatch.delenv("CKPT_TEST_GONE")
    mark = uuid.uuid4().hex
    monkeypatch.setenv("CKPT_TEST_MARK", mark)
    monkeypatch.chdir(tmp_path)
    assert run_ranks(2, _what_a_rank_sees) == [(mark, None, str(tmp_path))] * 2
