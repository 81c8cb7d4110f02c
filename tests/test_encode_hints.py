"""``auto`` reuses the trials of the chunk at the same place in the previous save (issue 37): a hint
stands for ``_RETRY - 1`` saves, then the trials run again; a delta the hint never tried, or tried only
up to a smaller room, is tried afresh; what a hinted encode stores decodes bit-exact; and a
``Checkpointer``'s saves of a training state run the trials on about one chunk in ``_RETRY`` per save."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import ckpt
from ckpt.format.chunk import HEADER_SIZE, Base, chunk_hash, decode, parse_header
from ckpt.save import encode as enc
from ckpt.save.encode import CodecSpec, encode_chunk


def _weights(seed: int, n: int = 1 << 19) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.02


def _view(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy().view(np.uint8)).cast("B")


@pytest.fixture
def counted(monkeypatch):
    """How many times the trials ran on a chunk longer than two samples (shorter ones are tried whole every
    time: they take no hint)."""
    calls = [0]
    lock = threading.Lock()  # the writer's threads encode at once
    real = enc._trials

    def counting(raw, base, width, rot, level, whole, room):
        if not whole:
            with lock:
                calls[0] += 1
        return real(raw, base, width, rot, level, whole, room)

    monkeypatch.setattr(enc, "_trials", counting)
    return calls


def _roundtrip(out, raw: memoryview, h: str, base: Base | None = None) -> None:
    blob = b"".join(bytes(b) for b in out.buffers)
    assert bytes(decode(blob, name="x", expect_hash=h, base=base)) == bytes(raw)


def test_a_hint_stands_for_the_trials_until_it_is_due(counted):
    first, second = _weights(0), _weights(0) + 1e-3 * _weights(1)
    raw0, raw1 = _view(first), _view(second)
    h0, h1 = chunk_hash(raw0), chunk_hash(raw1)
    out0 = encode_chunk(raw0, h0, CodecSpec("auto"), width=4, rotate=True)
    assert counted[0] == 1 and out0.choice is not None and out0.choice.age == int(h0[:8], 16) % enc._RETRY
    fresh = enc.replace(out0.choice, age=0)
    for age in range(enc._RETRY - 1):
        out = encode_chunk(raw1, h1, CodecSpec("auto"), width=4, rotate=True, hint=enc.replace(fresh, age=age))
        assert counted[0] == 1, "a hint younger than _RETRY - 1 saves must stand for the trials"
        assert out.choice is not None and out.choice.age == age + 1 and out.codec == "planes"
        _roundtrip(out, raw1, h1)
    due = encode_chunk(raw1, h1, CodecSpec("auto"), width=4, rotate=True,
                       hint=enc.replace(fresh, age=enc._RETRY - 1))
    assert counted[0] == 2 and due.choice is not None and due.choice.age == 0
    # the hinted encode stores what fresh trials would, give or take the sample's drift: here the same bytes
    assert b"".join(bytes(b) for b in due.buffers) == b"".join(bytes(b) for b in out.buffers)


def test_a_delta_the_hint_never_tried_is_tried(counted):
    prev, cur = _weights(0), _weights(0)
    cur[::97] += 0.01  # a sparse update: the delta is far smaller than the chunk
    raw_p, raw_c = _view(prev), _view(cur)
    hp, hc = chunk_hash(raw_p), chunk_hash(raw_c)
    without = encode_chunk(raw_p, hp, CodecSpec("auto"), width=4, rotate=True)
    assert without.choice is not None and not any(t.codec == "xor" for t in without.choice.trials)
    base = Base(raw_p, hp, len(raw_c))
    hint = enc.replace(without.choice, age=0)
    out = encode_chunk(raw_c, hc, CodecSpec("auto"), width=4, rotate=True, base=base, hint=hint)
    assert counted[0] == 2 and out.codec == "xor"
    _roundtrip(out, raw_c, hc, base)
    # its choice (with the delta's trials) now stands for the next save's, a delta again
    assert out.choice is not None
    again = encode_chunk(raw_c, hc, CodecSpec("auto"), width=4, rotate=True, base=base,
                         hint=enc.replace(out.choice, age=0))
    assert counted[0] == 2 and again.codec == "xor"
    _roundtrip(again, raw_c, hc, base)


def test_a_delta_trial_stopped_at_a_smaller_room_is_tried_again(counted):
    prev = _weights(0)
    cur = prev + 1e-3 * _weights(1)  # dense: a delta takes most of the chunk
    raw_p, raw_c = _view(prev), _view(cur)
    hp, hc = chunk_hash(raw_p), chunk_hash(raw_c)
    tight = Base(raw_p, hp, HEADER_SIZE + len(raw_c) // 20)
    out = encode_chunk(raw_c, hc, CodecSpec("auto"), width=4, rotate=True, base=tight)
    assert out.codec == "planes" and out.choice is not None
    stopped = [t for t in out.choice.trials if t.codec == "xor"]
    assert stopped and not any(t.complete for t in stopped)
    hint = enc.replace(out.choice, age=0)
    encode_chunk(raw_c, hc, CodecSpec("auto"), width=4, rotate=True, base=tight, hint=hint)
    assert counted[0] == 1, "the same room: the stopped trial still says the delta does not fit"
    roomy = Base(raw_p, hp, 2 * len(raw_c))
    wide = encode_chunk(raw_c, hc, CodecSpec("auto"), width=4, rotate=True, base=roomy, hint=hint)
    assert counted[0] == 2, "a room the stopped trial never measured: the delta is tried again"
    assert wide.choice is not None and all(t.complete for t in wide.choice.trials)
    _roundtrip(wide, raw_c, hc, roomy if wide.codec == "xor" else None)
    unbounded = encode_chunk(raw_c, hc, CodecSpec("auto"), width=4, rotate=True, base=Base(raw_p, hp), hint=hint)
    assert counted[0] == 3, "no budget at all: the stopped trial's size is unknown, so it is tried again"
    _roundtrip(unbounded, raw_c, hc, Base(raw_p, hp) if unbounded.codec == "xor" else None)
    # a hint with delta trials, and no base now (its chain is full): the whole-chunk trials stand
    alone = encode_chunk(raw_c, hc, CodecSpec("auto"), width=4, rotate=True, hint=hint)
    assert counted[0] == 3 and alone.codec == "planes"
    _roundtrip(alone, raw_c, hc)


def test_a_hinted_delta_that_outgrew_its_room_is_stored_whole(counted):
    """The hint's delta was small; this save's is not (the training jumped): the final encode measures it,
    finds it past the room, and stores the chunk whole from the hint's whole-chunk trials."""
    prev = _weights(0)
    small = prev.clone()
    small[::501] += 0.01
    raw_p, raw_s = _view(prev), _view(small)
    hp, hs = chunk_hash(raw_p), chunk_hash(raw_s)
    base = Base(raw_p, hp, len(raw_s) // 2)
    first = encode_chunk(raw_s, hs, CodecSpec("auto"), width=4, rotate=True, base=base)
    assert first.codec == "xor" and first.choice is not None
    jumped = prev + 0.5 * _weights(2)
    raw_j = _view(jumped)
    hj = chunk_hash(raw_j)
    out = encode_chunk(raw_j, hj, CodecSpec("auto"), width=4, rotate=True, base=base,
                       hint=enc.replace(first.choice, age=1))
    assert counted[0] == 1 and out.codec == "planes"
    _roundtrip(out, raw_j, hj)
    # the hint misled: the next save's chunk there runs its trials again rather than make a delta to drop
    assert out.choice is not None and out.choice.age == enc._RETRY - 1


def test_a_short_chunk_whose_delta_does_not_fit_is_stored_as_without_a_base(monkeypatch):
    """A chunk short enough to be its own sample: its sparse delta is kept to be measured, is past the room,
    and the chunk is stored whole from the whole trials already run, byte for byte what it is without a
    base (and those trials are not run twice)."""
    prev = _weights(0, 1 << 15)  # 128 KiB: tried whole
    cur = prev.clone()
    cur[::97] += 0.01
    raw_p, raw_c = _view(prev), _view(cur)
    hp, hc = chunk_hash(raw_p), chunk_hash(raw_c)
    roomy = encode_chunk(raw_c, hc, CodecSpec("auto"), width=4, rotate=True, base=Base(raw_p, hp))
    assert roomy.codec == "xor"
    delta = sum(len(b) if isinstance(b, bytes) else memoryview(b).nbytes for b in roomy.buffers)
    whole = encode_chunk(raw_c, hc, CodecSpec("auto"), width=4, rotate=True)
    runs = []
    real = enc._try
    monkeypatch.setattr(enc, "_try", lambda codec, *a, **k: runs.append(codec) or real(codec, *a, **k))
    out = encode_chunk(raw_c, hc, CodecSpec("auto"), width=4, rotate=True, base=Base(raw_p, hp, delta - 8))
    assert out.codec == whole.codec != "xor"
    assert b"".join(bytes(b) for b in out.buffers) == b"".join(bytes(b) for b in whole.buffers)
    assert runs.count("xor") >= 1
    assert runs.count("planes") == 2, "the whole trials (rotated and not) run once each"
    _roundtrip(out, raw_c, hc)


def _later_place_first(monkeypatch, twins: set[str]) -> threading.Event:
    """Make a chunk in ``twins`` (filled in by the caller) be stored from its later place first: its first
    place's store waits until the later one's is done. Returns the event set once it is."""
    from ckpt.save.writer import Writer

    later_done = threading.Event()
    real = Writer._put_chunk

    def later_first(self, job, data, h, base, chunk, first):
        if h in twins and chunk is first:
            assert later_done.wait(60), "the second place's store never finished"
            return real(self, job, data, h, base, chunk, first)
        try:
            return real(self, job, data, h, base, chunk, first)
        finally:
            if h in twins:
                later_done.set()

    monkeypatch.setattr(Writer, "_put_chunk", later_first)
    return later_done


def test_a_chunk_at_two_places_is_stored_as_at_its_first_whichever_is_written_first(tmp_path, monkeypatch):
    """Two places of one save hold the same bytes, each with its own delta base (and hint): the chunk is
    stored once, encoded as at its first place, even where the second place's thread gets there first
    (forced here), so what a save stores does not depend on the threads' timing."""

    n = 1 << 18  # 1 MiB of fp32: one chunk each
    x, y = _weights(1, n), _weights(2, n)
    state = {"a": x.clone(), "b": y.clone()}
    cp = ckpt.Checkpointer(tmp_path, chunk_size=1 << 20, io_threads=2)
    cp.save(1, state).wait()
    z = y.clone()
    z[::501] += 0.01  # close to b's last bytes (a small delta on them), unrelated to a's
    state["a"].copy_(z)
    state["b"].copy_(z)
    twin = chunk_hash(_view(z))
    twins = {twin}
    later_done = _later_place_first(monkeypatch, twins)
    cp.save(2, state).wait()
    assert later_done.is_set()
    (stored,) = list((tmp_path / "chunks").glob(f"*/{twin}"))
    head = parse_header(stored.read_bytes(), name=stored.name)
    assert head.base != chunk_hash(_view(y)), "encoded on the second place's base: timing chose the bytes"
    assert head.base in (None, chunk_hash(_view(x))), head.base  # the first place's base, or whole
    out = {k: torch.empty_like(v) for k, v in state.items()}
    cp.load(2, out)
    assert torch.equal(out["a"], z) and torch.equal(out["b"], z)
    cp.close()


def test_twin_places_of_two_widths_are_stored_at_the_first_ones(tmp_path, monkeypatch):
    """The same bytes at an fp32 place and a bf16 one, the bf16 place's thread first: the chunk is encoded at
    the first place's width and rotation with its hint (a hint made at one width does not fit another), and
    the saves after it, twins again, store and load exactly."""

    n = 1 << 18
    state = {"a": _weights(1, n), "b": _weights(2, 2 * n).bfloat16()}  # 1 MiB each: one chunk each
    cp = ckpt.Checkpointer(tmp_path, chunk_size=1 << 20, io_threads=2)
    cp.save(1, state).wait()  # each place's trials, at its own width
    twins: set[str] = set()
    later_done = _later_place_first(monkeypatch, twins)
    for step in (2, 3, 4):
        with torch.no_grad():
            state["a"].add_(1e-3 * _weights(step, n))
            state["b"].view(torch.uint8).copy_(state["a"].view(torch.uint8))
        twins.add(chunk_hash(_view(state["a"])))
        later_done.clear()
        cp.save(step, state).wait()
        assert later_done.is_set()
        (stored,) = list((tmp_path / "chunks").glob(f"*/{chunk_hash(_view(state['a']))}"))
        head = parse_header(stored.read_bytes(), name=stored.name)
        assert (head.width, head.rot) == (4, True), head
        out = {k: torch.empty_like(v) for k, v in state.items()}
        cp.load(step, out)
        assert all(torch.equal(out[k].view(torch.uint8), state[k].view(torch.uint8)) for k in state)  # (NaN bits)
    cp.close()


def test_saves_of_a_training_state_rerun_the_trials_on_one_chunk_in_retry(tmp_path, counted):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # 1 MiB weights: 2 chunks each
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(16, 512)

    def step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    step()
    state = {"model": model, "optim": opt}
    c = ckpt.Checkpointer(tmp_path / "ck", chunk_size=512 * 1024, keep_last=2)
    per_save = []
    for s in range(2 + enc._RETRY):
        step()
        before = counted[0]
        c.save(s, state).wait()
        per_save.append(counted[0] - before)
    large = 8 * 3 * 2  # weights and both moments, two chunks each (the biases share a short one)
    assert per_save[:2] == [large, large], per_save  # no hint yet; then a base appears: its delta is tried
    # then each chunk once in _RETRY saves (a little more where a chain's room grew past a delta trial's
    # cap), spread over the saves by digest rather than all at once every _RETRY-th save
    assert large <= sum(per_save[2:]) <= large * 5 // 4, per_save
    assert max(per_save[2:]) <= large // 2, per_save
    reader = ckpt.Checkpointer(tmp_path / "ck")
    want = {k: v.clone() for k, v in model.state_dict().items()}
    for p in model.parameters():
        p.data.zero_()
    reader.load(2 + enc._RETRY - 1, state)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
    c.close()
    reader.close()
