"""Node loss without object storage: every rank's local tier is protected by its peers.

:class:`Peers` is made with the Checkpointer, on every rank. It learns each rank's failure domain
through the store (the host name unless ``failure_domain=`` says otherwise), makes a gloo process
group of its own for the bytes (never the training group, never from two threads at once: saves use
it on the commit thread, loads on the caller's thread after every save has finished), and places:

* ``Replicas(r)``: rank i's chunks also go to r-1 ranks, one in each of the r-1 domains after its own;
* ``Parity(k, m)``: ranks are dealt round-robin over the domains into groups of k+m, each in distinct
  domains; :mod:`ckpt.peers.erasure` lays out the stripes.

(:mod:`ckpt.peers.placement` places; this module moves the bytes.)

Save (:meth:`Peers.protect`, after this rank's chunks are durable locally, before it reports ``ok``):
one gather of every rank's chunk table, then the bytes. Replica targets say which chunks they lack
(steady state: the new ones) and receive exactly those; parity holders receive the segments of their
stripes and store the parity blocks in the step's directory, with the group's layout. Every object
received is checked (hash or frame check) before it is written.

Load: :mod:`ckpt.peers.recovery` (survey, fetch, rebuild) over the same group and :meth:`Peers.exchange`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError, DistributedSaveError
from ..format import manifest as mf
from ..format import paths
from ..format.chunk import verify_object
from ..ranks import Comm, Gathered
from ..redundancy_config import Parity, Replicas
from ..storage import LocalStorage
from . import erasure
from .placement import parity_groups, replica_targets

log = logging.getLogger("ckpt")

WAVE_BYTES = 256 << 20  # bytes in flight between two ranks at once (the rest waits for the next wave)
# What one transfer carries: ("chunk", hash) | ("seg", group, member, q) (a member's segment; at save time
# with the receiving parity holder's number appended) | ("par", group, parity file name)
Item = tuple


@dataclass(frozen=True)
class Transfer:
    src: int
    dst: int
    item: Item
    size: int
    room: int = 0  # the receiver's buffer is this long (zeros after ``size``): a stripe block arrives padded
    round: int = 0  # exchange() moves every transfer of round r (and calls after_round(r)) before round r+1's


@dataclass
class PeerStats:
    """What the peer exchange of one save or load moved."""

    sent_bytes: int = 0
    received_bytes: int = 0
    stored_bytes: int = 0  # replicas and parity blocks this rank stored for its peers
    peer_chunks: int = 0  # chunks this rank got from peers (load)
    rebuilt_chunks: int = 0  # chunks this rank rebuilt from parity (load)


Waves = dict[tuple[int, int], list[list[tuple[int, Transfer]]]]  # (src, dst) -> waves of (tag, transfer)
# Reads a transfer's item from this rank's tier into the buffer given (its size long); returns the
# item's length (a different one: the tier is damaged).
Read = Callable[[Item, memoryview], int]
SEND_BUFFERS = 4  # reused buffers a rank reads what it sends into


class _SendBuffers:
    """The buffers a rank reads what it sends into, reused once their send is done: reading each
    object into new memory cost more (zeroing it, faulting it in, unmapping it) than the read."""

    def __init__(self) -> None:
        self._slots: list[list[Any]] = []  # [tensor, its send's work or None]
        self._next = 0

    def take(self, n: int) -> Any:
        import torch

        if len(self._slots) < SEND_BUFFERS:
            self._slots.append([torch.empty(n, dtype=torch.uint8), None])
            self._next = len(self._slots) - 1
        else:
            self._next = (self._next + 1) % SEND_BUFFERS
        slot = self._slots[self._next]
        if slot[1] is not None:
            slot[1].wait()
            slot[1] = None
        if slot[0].numel() < n:
            slot[0] = torch.empty(n, dtype=torch.uint8)
        return slot[0][:n]

    def sent(self, work: Any) -> None:
        self._slots[self._next][1] = work

    def drain(self) -> None:
        for slot in self._slots:
            if slot[1] is not None:
                slot[1].wait()
                slot[1] = None


def _waves(mine: list[Transfer]) -> list[Waves]:
    """Per round, each pair's transfers cut into waves of at most WAVE_BYTES. Both ends of a pair
    cut the same list the same way; a transfer's tag is its place in the pair's whole list, so tags
    never repeat between rounds."""
    pairs: dict[tuple[int, int], list[Transfer]] = defaultdict(list)
    for t in mine:
        pairs[(t.src, t.dst)].append(t)
    out: list[Waves] = [{} for _ in range(1 + max((t.round for t in mine), default=-1))]
    for key, ts in pairs.items():
        used: dict[int, int] = {}
        for tag, t in enumerate(ts):
            cut = out[t.round].setdefault(key, [[]])
            if cut[-1] and used.get(t.round, 0) + t.size > WAVE_BYTES:
                cut.append([])
                used[t.round] = 0
            cut[-1].append((tag, t))
            used[t.round] = used.get(t.round, 0) + t.size
    return out


class Peers:
    """The ranks of one Checkpointer protecting each other's local tiers (see the module docstring)."""

    def __init__(self, comm: Comm, redundancy: Replicas | Parity | None, failure_domain: str | None,
                 local: LocalStorage, process_group: Any, timeout: float, lease_id: str = ""):
        self.rank, self.world = comm.rank, comm.world
        self.redundancy = redundancy
        self.local = local
        self.group: Any = None
        self._global: list[int] = [0]
        if self.world > 1:
            import torch.distributed as dist

            self._global = (dist.get_process_group_ranks(process_group) if process_group is not None
                            else list(range(dist.get_world_size())))
            # The bytes travel on a group of their own: the commit thread may use it while the
            # training thread runs collectives on its group.
            self.group = dist.new_group(self._global, backend="gloo", timeout=timedelta(seconds=timeout),
                                        use_local_synchronization=True)
        host = socket.gethostname()
        # who is where: a coordination round through the store (the gloo group moves the bytes)
        def every(got: Gathered) -> list[dict]:
            got.raise_for("the peers' setup")
            return got.ordered()

        docs = comm.round("peers", 0).run({"domain": failure_domain or host, "lease": lease_id,
                                           "tier": f"{host}:{os.path.realpath(local.root)}"},
                                          every, what="the peers' setup")
        self.domains = [str(d["domain"]) for d in docs]
        # Ranks on one node usually share its local_dir: one of them (the lowest) applies the tier's
        # retention, and takes the others' writer leases for its own (they are not in its way).
        sharing = [r for r, d in enumerate(docs) if d["tier"] == docs[self.rank]["tier"]]
        self.tier_leader = sharing[0] == self.rank
        self.tier_leases = {str(docs[r]["lease"]) for r in sharing}
        self.targets: list[list[int]] = []
        self.groups: list[list[int]] = []
        if isinstance(redundancy, Replicas):
            self.targets = replica_targets(self.domains, redundancy.copies)
        elif isinstance(redundancy, Parity):
            self.groups = parity_groups(self.domains, redundancy.data, redundancy.parity)

    def describe(self) -> str:
        r = self.redundancy
        what = (f"{r.copies} replicas" if isinstance(r, Replicas) else
                f"parity {r.data}+{r.parity}" if isinstance(r, Parity) else "no redundancy")
        return f"{what} over {len(set(self.domains))} failure domain(s)"

    # -- talking -------------------------------------------------------------------------------------
    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order (all ranks call it in the same order)."""
        if self.group is None:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as e:
            raise self._broken(e, []) from e
        return out

    def broadcast(self, obj: Any, src: int) -> Any:
        if self.group is None:
            return obj
        import torch.distributed as dist

        box = [obj]
        try:
            dist.broadcast_object_list(box, src=self._global[src], group=self.group)
        except Exception as e:
            raise self._broken(e, [src]) from e
        return box[0]

    def _broken(self, e: Exception, ranks: list[int]) -> DistributedSaveError:
        return DistributedSaveError(
            f"rank {self.rank}: the exchange with peers over the local tiers' process group failed "
            f"({type(e).__name__}: {e}); a peer may have died. Committed steps are untouched; restart the job "
            "(it resumes from the newest step the tiers or the checkpoint path can give back)", ranks=ranks)

    def exchange(self, plan: list[Transfer], read: Read, received: Callable[[int, Item, memoryview], None],
                 stats: PeerStats, rounds: int = 1, after_round: Callable[[int], None] | None = None) -> None:
        """Collective: move every transfer of ``plan`` (the same list on every rank) from its source to
        its destination, round by round (``Transfer.round``, 0..``rounds``-1), each round in waves of at
        most WAVE_BYTES per pair of ranks; after round r, ``after_round(r)``, so a receiver can use
        and drop what round r brought before round r+1's bytes arrive (a parity holder codes one
        stripe at a time). A rank whose read or check fails still finishes every wave (sending zeros
        instead), so no peer waits for bytes that never come; then every rank raises the first failure."""
        mine = [t for t in plan if (t.src == self.rank) != (t.dst == self.rank) and t.size > 0]
        waves = _waves(mine)
        failure: CheckpointError | None = None
        pool = _SendBuffers()
        try:
            for r in range(max(rounds, len(waves))):
                cut = waves[r] if r < len(waves) else {}
                for w in range(max((len(v) for v in cut.values()), default=0)):
                    failure = self._wave(w, cut, read, received, stats, pool) or failure
                if after_round is not None:
                    try:
                        after_round(r)
                    except CheckpointError as e:
                        failure = failure or e
        except Exception as e:
            raise self._broken(e, []) from e
        views = self.gather(None if failure is None else
                            {"message": str(failure), "corrupt": isinstance(failure, CorruptCheckpointError)})
        bad = [(r, v) for r, v in enumerate(views) if v is not None]
        if failure is not None:
            raise failure
        if bad:
            r, v = bad[0]
            why = f"rank {r} could not take its part in the exchange with peers: {v['message']}"
            if v["corrupt"]:  # damaged bytes in a tier, not a broken job: an older step may still load
                raise CorruptCheckpointError(why)
            raise DistributedSaveError(why, ranks=[r for r, _ in bad])

    def _wave(self, w: int, waves: Waves, read: Read, received: Callable[[int, Item, memoryview], None],
              stats: PeerStats, pool: _SendBuffers) -> CheckpointError | None:
        """Wave ``w`` of :meth:`exchange`: every receive posted, then the sends (each read into one of
        a few reused buffers), then each receive handed over as it completes; the first failure of
        this rank's own reads or checks. Receives go first so a send waiting for its buffer never
        waits for a peer still posting sends of its own."""
        import torch
        import torch.distributed as dist

        failure: CheckpointError | None = None
        mine = [(src, dst, tag, t) for (src, dst), cut in sorted(waves.items()) if w < len(cut) for tag, t in cut[w]]
        inbox = []
        for src, _, tag, t in mine:
            if src != self.rank:
                buf = torch.empty(max(t.size, t.room), dtype=torch.uint8)
                buf[t.size:].zero_()
                inbox.append((t, buf, dist.irecv(buf[: t.size], src=self._global[src], group=self.group, tag=tag)))
        for src, dst, tag, t in mine:
            if src != self.rank:
                continue
            buf = pool.take(t.size)
            try:
                n = read(t.item, buf.numpy().data)
                if n != t.size:
                    raise CorruptCheckpointError(
                        f"{t.item[0]} {t.item[1:]} in this rank's local tier {self.local.root} is "
                        f"{'more than ' if n > t.size else ''}{n} bytes, {t.size} expected: the tier is damaged "
                        "(delete that step there, or the whole tier: peers rebuild it on the next load)")
            except (CheckpointError, OSError) as e:
                failure = failure or (e if isinstance(e, CheckpointError) else
                                      CorruptCheckpointError(f"reading {t.item} for a peer failed: {e}"))
                buf.zero_()  # the peer still gets its bytes (and will not use them)
            pool.sent(dist.isend(buf, dst=self._global[dst], group=self.group, tag=tag))
            stats.sent_bytes += t.size
        # Each transfer is used as soon as it is in, while later ones still arrive: a load reads a
        # peer's chunk the moment it is checked, not after the whole wave.
        for t, buf, work in inbox:
            if work is not None:
                work.wait()
            try:
                received(t.src, t.item, buf.numpy().data)
            except CheckpointError as e:
                failure = failure or e
            stats.received_bytes += t.size
        pool.drain()
        return failure

    # -- this rank's tier ----------------------------------------------------------------------------
    def store_chunk(self, h: str, data: memoryview, keep: Callable[[str, memoryview], None] | None = None) -> None:
        """Verify chunk ``h`` (a copy that arrived damaged, or was rebuilt wrong, is never used), then
        write it to this rank's tier, or hand it to ``keep(storage key, bytes)``."""
        key = paths.chunk_key(h)
        verify_object(key, [data])
        if keep is None:
            self.local.write(key, [data])
        else:
            keep(key, data)

    def read_range(self, member: erasure.Member, start: int, end: int, out: memoryview) -> int:
        """Bytes [start, end) of ``member``'s data (its chunks end to end) into ``out``; how many."""
        view, pos = memoryview(out).cast("B"), 0
        for h, off, n in member.pieces(start, end):
            got = self.local.readv(paths.chunk_key(h), [view[pos: pos + n]], off)
            if got != n:
                raise CorruptCheckpointError(f"chunk {h} in this rank's local tier {self.local.root} is shorter than "
                                             "its manifest says: the tier is damaged (delete the step there, or the "
                                             "whole tier: peers rebuild it on the next load)", chunk=h)
            pos += n
        return pos

    def read_whole(self, key: str, out: memoryview) -> int:
        """Object ``key`` of this rank's tier into ``out``: its length (more than ``len(out)`` when it
        is longer: one byte past is read to tell)."""
        return self.local.readv(key, [out, bytearray(1)])

    # -- saving --------------------------------------------------------------------------------------
    def protect(self, step: int, part: mf.Manifest | None) -> PeerStats | None:
        """Every rank, every save, after its chunks are durable locally: give peers what protects this
        rank's chunks (``part``, its report) and store what protects theirs. A rank without a part
        (it failed, or skipped the save) still takes part: then nobody moves anything, and it is None."""
        table = sorted((h, info.stored) for h, info in part.chunks.items()) if part is not None else []
        docs = self.gather({"ok": part is not None, "chunks": table})
        if not all(d["ok"] for d in docs):
            return None
        stats = PeerStats()
        if isinstance(self.redundancy, Replicas):
            self._replicate(docs, stats)
        elif isinstance(self.redundancy, Parity):
            self._parity(step, docs, stats)
        self.local.flush()
        return stats

    def _replicate(self, docs: list[dict], stats: PeerStats) -> None:
        sources = [s for s in range(self.world) if self.rank in self.targets[s]]
        wants = {s: [h for h, _ in docs[s]["chunks"] if not self.local.exists(paths.chunk_key(h))] for s in sources}
        every = self.gather(wants)
        plan = []
        for dst in range(self.world):
            for src, hashes in sorted(every[dst].items()):
                if self.rank in (src, dst):  # exchange() moves only this rank's transfers
                    sizes = dict(docs[src]["chunks"])
                    plan += [Transfer(src, dst, ("chunk", h), sizes[h]) for h in hashes]

        def received(src: int, item: Item, data: memoryview) -> None:
            self.store_chunk(item[1], data)
            stats.stored_bytes += len(data)

        self.exchange(plan, lambda item, out: self.read_whole(paths.chunk_key(item[1]), out), received, stats)

    def _parity(self, step: int, docs: list[dict], stats: PeerStats) -> None:
        assert isinstance(self.redundancy, Parity)
        g, ranks = next((g, ranks) for g, ranks in enumerate(self.groups) if self.rank in ranks)
        mine = erasure.GroupLayout.build(g, self.redundancy.data, self.redundancy.parity,
                                         [erasure.Member(r, [(h, n) for h, n in docs[r]["chunks"]]) for r in ranks])
        me = ranks.index(self.rank)
        # Round j brings every stripe's segments to its parity holder j: each member holds parity j of
        # exactly one stripe, so a holder has one stripe's k segments in memory at a time, never m.
        plan = []  # transfers stay within a group: this group's are all this rank takes part in
        for st in mine.stripes:
            for pos, q in st.data:
                mem = mine.members[pos]
                a, b = mem.segment(q, mine.k)
                for j, holder in enumerate(st.parity):
                    plan.append(Transfer(mem.rank, mine.members[holder].rank, ("seg", g, pos, q, j), b - a,
                                         st.length, round=j))
        got: dict[tuple[int, int], memoryview] = {}
        d = paths.step_dir(step)

        def read(item: Item, out: memoryview) -> int:
            _, _, pos, q, _ = item
            mem = mine.members[pos]
            a, b = mem.segment(q, mine.k)
            return self.read_range(mem, a, b, out)

        def received(src: int, item: Item, data: memoryview) -> None:
            got[(item[2], item[3])] = data  # the received buffer, padded to the stripe's length

        def code(j: int) -> None:
            """Parity block j of the stripe this rank holds it for, from the segments round j brought."""
            st = next(st for st in mine.stripes if st.parity[j] == me)
            try:
                if st.length:
                    blocks = [got.get((pos, q), b"") for pos, q in st.data]
                    block = erasure.encode(mine.k, mine.m, blocks, st.length, j)
                    del blocks
                    self.local.write(f"{d}/{mine.parity_name(st.index, j)}", [block])
                    stats.stored_bytes += len(block)
            finally:
                got.clear()

        self.exchange(plan, read, received, stats, rounds=mine.m, after_round=code)
        self.local.write(f"{d}/{mine.name}", [json.dumps(mine.to_json()).encode()])
