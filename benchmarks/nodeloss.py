"""Node loss: frequent local commits protected by peers (replicas, parity) against none, on 4 gloo ranks.

    python benchmarks/nodeloss.py                      # 4 ranks × 256 MiB, 10 measured saves, 5 restores
    python benchmarks/nodeloss.py --quick              # 8 MiB per rank, 1 MiB chunks: a smoke test
    python benchmarks/nodeloss.py --s3-fraction 0.25   # S3 limited to a quarter of the disk's read speed

Four ranks (processes on this machine, gloo over 127.0.0.1, OMP_NUM_THREADS=1), each its own failure
domain (``failure_domain=f"node{rank}"``) with its own ``local_dir``, each holding ``--mib-per-rank``
MiB of float32 as four ``LocalShard`` row blocks of global tensors. The checkpoint path is
``s3://…`` on ``rclone serve s3`` over a temporary directory (ckpt.testing.RcloneS3). Three
Checkpointers per rank, taking turns within each round so drift on the shared machine hits all alike:

* **none**: ``local_dir`` and ``persist_every=1000``, no redundancy;
* **Replicas(2)**: every chunk also on the next node;
* **Parity(3+1)**: ``Parity(data=3, parity=1)``, one group of the four nodes.

All use ``codec="raw"``, so the comparison is about redundancy, not compression. Every save gets
fresh values in every element (mantissa bits flipped: nothing deduplicates, like dense training);
before each save the ranks meet and ``os.sync()`` runs; each save is waited for (committed, and its
local retention done) before the next. Round 1 is the first save (uploaded: the first save always
is) and is not in the medians; rounds 2..``--saves``+1 are local-only saves (committed to every
rank's local tier, not uploaded): reported as medians of the maximum over ranks (times) or the sum
over ranks (bytes); the last round is saved with ``persist=True`` (uploaded and committed locally):
the step every restore loads.

Restore, in the same run, each ``--restores`` times (median reported; the order rotates): first a
load with every tier intact (the floor), then node 2's tier is wiped (``shutil.rmtree`` of all of
node 2's local directories) before each of:

* **peers (replicas)** and **peers (parity)**: ``load("latest")`` gets node 2's chunks from a peer's
  copy, or rebuilds them from parity; not one chunk comes from S3;
* **S3 (node 2 only)**: the *none* Checkpointer: nodes 0, 1, 3 read their tiers, node 2 reads S3;
* **S3 (every node fresh)**: fresh empty ``local_dir`` on every rank: all four read S3 at once;
* both again with **S3 limited to a node's bandwidth**: each rank reaches rclone through a proxy of
  its own (``ckpt.testing.FaultProxy(rate=...)``: a token bucket each way, shared by the rank's
  connections) that holds it to ``--s3-fraction`` (default 1/10) of this disk's read speed,
  measured first (a file written and read back past the page cache: ``O_DIRECT``, 16 MiB reads,
  4 at once), while peers still talk over loopback. The first two rows and the peer rows reach S3
  (only to list its steps) through the limited proxies too: the cluster a restore is meant for.

Each restore is timed from ``load()`` to its return (the Checkpointer is made outside the timing, a
restarted job makes one anyway), reported for node 2 and for the slowest rank, and for node 2 also
until its tier is healed (``wait()``: the chunks it took from peers or S3 written back behind the
load); every load is checked bit for bit (sha256 of every rank's tensors against the saved ones)
and by where its chunks came from.
The tiers and rclone's directory share this machine's disk, and "S3" is loopback: unlimited, this
compares the paths (gloo exchange, parity decoding, S3 requests); limited, it models S3 at a node's
share of a network against peers on a faster one, not real S3.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import mmap
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
HERE = os.path.dirname(os.path.abspath(__file__))

from distributed import synced  # noqa: E402  (benchmarks/, the script's own folder)
from harness import banner, fmt, median, pyplot, save_figure, write_results  # noqa: E402

import ckpt  # noqa: E402
from ckpt.testing import FaultProxy, RcloneS3, run_ranks, storage_options  # noqa: E402

WORLD = 4
WIPED = 2  # the node that is lost
N_TENSORS = 4
COLS = 1024
BUCKET = "ckpt-nodeloss"
CONFIGS = ("none", "replicas", "parity")
LABELS = {"none": "none", "replicas": "Replicas(2)", "parity": "Parity(3+1)"}
K, M = 3, 1
PERSIST_EVERY = 1000
RESTORES = ("intact", "replicas", "parity", "s3", "s3_fresh", "s3_limited", "s3_fresh_limited")
RESTORE_LABELS = {"intact": "every tier intact (floor)", "replicas": "peers: Replicas(2)",
                  "parity": "peers: Parity(3+1), rebuilt", "s3": "S3 at disk speed, node 2 only (none)",
                  "s3_fresh": "S3 at disk speed, every node fresh",
                  "s3_limited": "S3 limited, node 2 only (none)", "s3_fresh_limited": "S3 limited, every node fresh"}
FROM_S3 = ("s3", "s3_fresh", "s3_limited", "s3_fresh_limited")  # the none Checkpointer: node 2 reads S3
FRESH = ("s3_fresh", "s3_fresh_limited")
UNLIMITED = ("s3", "s3_fresh")  # restores that reach S3 straight, at loopback speed
TARGET_BLOCKED = 1.05
TARGET_RESTORE = 2.0
TARGET_PARITY = (K + M) / K + 0.05
METRICS = ("stall_s", "local_s", "duration_s", "peer_s", "persisted", "peer_sent_bytes", "peer_stored_bytes",
           "written_bytes", "raw_bytes")


# ---------------------------------------------------------------------------------------------
# one rank's state: 4 row blocks of global tensors, new bits in every element per save

def version_mask(v: int) -> int:
    """Mantissa bits flipped in version v (the exponent is left alone: values stay finite)."""
    return ((v * 0x9E3779B1 + 0x5BD1E995) & 0x7FFFFF) | 0x10101


class State:
    def __init__(self, rank: int, mib: float):
        rows = max(1, round(mib * 2**20 / (4 * COLS * N_TENSORS)))
        g = torch.Generator().manual_seed(1000 + rank)
        self.rank = rank
        self.base = [torch.randn(rows, COLS, generator=g).view(torch.int32) for _ in range(N_TENSORS)]
        self.local = [torch.empty(rows, COLS) for _ in range(N_TENSORS)]
        self.shards = [ckpt.LocalShard(t, (rank * rows, 0), (WORLD * rows, COLS)) for t in self.local]
        self.nbytes = sum(t.numel() * 4 for t in self.local)

    def state(self, step: int) -> dict:
        return {**{f"layers.{i}.weight": s for i, s in enumerate(self.shards)}, "step": step}

    def set_version(self, v: int) -> None:
        for b, t in zip(self.base, self.local):
            torch.bitwise_xor(b, version_mask(v), out=t.view(torch.int32))

    def zero(self) -> None:
        for t in self.local:
            t.zero_()

    def digest(self) -> str:
        h = hashlib.sha256()
        for t in self.local:
            h.update(t.numpy().data)
        return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# the ranks

def redundancy(cfg: str):
    return {"none": None, "replicas": ckpt.Replicas(2), "parity": ckpt.Parity(data=K, parity=M)}[cfg]


def open_ckptr(cfg: str, rank: int, a: dict, local_dir: str | None = None, endpoint: str | None = None
               ) -> ckpt.Checkpointer:
    return ckpt.Checkpointer(
        f"s3://{BUCKET}/{a['run']}/{cfg}", storage_options=storage_options(endpoint or a["endpoint"]),
        local_dir=local_dir or os.path.join(a["root"], f"node{rank}", cfg), redundancy=redundancy(cfg),
        persist_every=PERSIST_EVERY, failure_domain=f"node{rank}", keep_local=2, keep_last=1, codec="raw",
        chunk_size=a["chunk_size"], timeout=300)


def gathered(x) -> list:
    import torch.distributed as dist
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def say(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def wipe(rank: int, root: str) -> None:
    """Node 2 is lost: every local directory it had (all three configurations') is gone."""
    import torch.distributed as dist
    dist.barrier()
    if rank == WIPED:
        shutil.rmtree(os.path.join(root, f"node{WIPED}"), ignore_errors=True)
    dist.barrier()


def rank_body(rank: int, world: int, a: dict) -> dict:
    """One rank's whole run (on a gloo group of WORLD processes made by ckpt.testing.run_ranks)."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    torch.set_num_threads(1)

    st = State(rank, a["mib"])
    ckptrs = {cfg: open_ckptr(cfg, rank, a) for cfg in CONFIGS}
    saves: dict[str, list] = {cfg: [] for cfg in CONFIGS}
    digests: dict[str, str] = {}
    rounds = a["saves"] + 2
    v = 0
    try:
        for rnd in range(rounds):
            step = rnd + 1
            last = rnd == rounds - 1
            order = CONFIGS[rnd % 3:] + CONFIGS[: rnd % 3]
            for cfg in order:
                v += 1
                st.set_version(v)  # untimed: new values in every element
                if last:
                    digests[cfg] = st.digest()
                synced()
                h = ckptrs[cfg].save(step, st.state(step), persist=True if last else None)
                m = h.wait()
                ckptrs[cfg].wait()  # the local tier's retention, outside the next save's timing
                rec = {k: getattr(m, k) for k in METRICS}
                per_rank = gathered(rec)
                saves[cfg].append({"step": step, "kind": "first" if rnd == 0 else "persisted" if last else "local",
                                   "ranks": per_rank})
                if rank == 0:
                    mx = lambda k, rs=per_rank: max(r[k] or 0.0 for r in rs)  # noqa: E731
                    print(f"  save  round {rnd + 1}/{rounds}  {LABELS[cfg]:12s} blocked {mx('stall_s'):6.3f}s  "
                          f"committed {mx('duration_s'):6.2f}s  peers {mx('peer_s'):5.2f}s  "
                          f"sent {sum(r['peer_sent_bytes'] for r in per_rank) / 2**20:7.1f} MiB  "
                          f"{'uploaded' if per_rank[0]['persisted'] else 'local only'}", flush=True)
    finally:
        for c in ckptrs.values():
            c.close()
        ckptrs.clear()  # their host buffers go: the restores run with the memory a restarted job has
        gc.collect()
    final = rounds

    def restore(what: str, rep: int) -> dict:
        cfg = "none" if what == "intact" or what in FROM_S3 else what
        fresh = os.path.join(a["root"], f"fresh{rep}", f"node{rank}") if what in FRESH else None
        c = open_ckptr(cfg, rank, a, local_dir=fresh, endpoint=None if what in UNLIMITED else a["limited"][rank])
        try:
            st.zero()
            state = st.state(-1)
            synced()
            t0 = time.perf_counter()
            got = c.load("latest", state)
            dt = time.perf_counter() - t0
            c.wait()  # the tier healed behind the load (the chunks it took from peers or S3 written back)
            healed = time.perf_counter() - t0
            ls = c.last_load
            assert ls is not None
        finally:
            c.close()
        ok = got == final and state["step"] == final and st.digest() == digests[cfg]
        out = {"s": dt, "healed_s": healed, "step": got, "exact": ok, "source": ls.source,
               "peer_chunks": ls.peer_chunks, "rebuilt_chunks": ls.rebuilt_chunks, "local_chunks": ls.local_chunks,
               "remote_chunks": ls.remote_chunks, "chunks_read": ls.chunks_read, "bytes_read": ls.bytes_read}
        per_rank = gathered(out)
        if fresh is not None:
            shutil.rmtree(fresh, ignore_errors=True)
        bad = [r for r, o in enumerate(per_rank) if not o["exact"]]
        if bad:
            raise AssertionError(f"restore {what}: rank(s) {bad} did not load step {final} bit for bit: {per_rank}")
        check_sources(what, per_rank)
        n2 = per_rank[WIPED]
        say(rank, f"  restore {rep + 1}/{a['restores']}  {RESTORE_LABELS[what]:37s} node 2 {n2['s']:6.2f}s  "
                  f"slowest {max(o['s'] for o in per_rank):6.2f}s  (node 2: {n2['peer_chunks']} from peers, "
                  f"{n2['rebuilt_chunks']} rebuilt, {n2['remote_chunks']} from S3, {n2['local_chunks']} local)")
        return {"ranks": per_rank}

    restores: dict[str, list] = {w: [] for w in RESTORES}
    for rep in range(a["restores"]):  # the floor first: later loads heal node 2's tiers only partly
        restores["intact"].append(restore("intact", rep))
    lost = [w for w in RESTORES if w != "intact"]
    for rep in range(a["restores"]):
        for what in lost[rep % len(lost):] + lost[: rep % len(lost)]:
            wipe(rank, a["root"])
            restores[what].append(restore(what, rep))
    dist.barrier()
    return {"saves": saves, "restores": restores, "state_bytes": st.nbytes, "final_step": final}


def disk_read_speed(directory: str, nbytes: int, block: int = 16 << 20, threads: int = 4, reads: int = 5
                    ) -> tuple[list[float], str]:
    """This disk's sequential read speed (bytes/s, each of ``reads`` reads) past the page cache, and
    how it was measured: a file of ``nbytes`` written and fsynced in ``directory``, read with O_DIRECT
    in ``block``-sized reads, ``threads`` at once (the device with a queue, as the loader's threads
    read). Where O_DIRECT is refused (tmpfs), read after posix_fadvise(DONTNEED) instead. (A virtual
    disk's speed moves with its host: 1.1 to 2.6 GB/s on the machine of the recorded results.)"""
    path = os.path.join(directory, "disk-speed.bin")
    n = max(block, nbytes // block * block)
    piece = os.urandom(block)
    try:
        with open(path, "wb") as f:
            for _ in range(n // block):
                f.write(piece)
            f.flush()
            os.fsync(f.fileno())
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            how = f"O_DIRECT, {block >> 20} MiB reads, {threads} at once"
        except OSError:
            fd = os.open(path, os.O_RDONLY)
            how = f"after posix_fadvise(DONTNEED), {block >> 20} MiB reads, {threads} at once"
        bufs = [mmap.mmap(-1, block) for _ in range(threads)]  # page-aligned, as O_DIRECT wants
        speeds = []
        try:
            for _ in range(reads):
                if "fadvise" in how:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                with ThreadPoolExecutor(threads) as pool:
                    t0 = time.perf_counter()
                    got = sum(pool.map(lambda i: os.preadv(fd, [bufs[i % threads]], i * block), range(n // block)))
                    speeds.append(got / (time.perf_counter() - t0))
        finally:
            os.close(fd)
        return speeds, how
    finally:
        try:
            os.remove(path)
        except OSError:
            pass


def check_sources(what: str, ranks: list[dict]) -> None:
    """Where each rank's chunks came from is what the scenario says."""
    n2 = ranks[WIPED]

    def need(cond: bool, why: str) -> None:
        if not cond:
            raise AssertionError(f"restore {what}: {why}: {ranks}")

    if what in FRESH:
        need(all(r["source"] == "checkpoint" and r["remote_chunks"] > 0 for r in ranks), "not every rank read S3")
        return
    need(all(r["source"] == "local tiers" for r in ranks), "not loaded from the local tiers")
    others = [r for i, r in enumerate(ranks) if i != WIPED]
    need(all(r["remote_chunks"] == 0 for r in others), "an intact node read S3")
    if what == "intact":
        need(n2["remote_chunks"] == 0, "node 2 read S3 with its tier intact")
    elif what in FROM_S3:
        need(n2["remote_chunks"] > 0 and not n2["peer_chunks"] and not n2["rebuilt_chunks"],
             "node 2 did not read S3 alone")
    elif what == "replicas":
        need(n2["remote_chunks"] == 0 and n2["peer_chunks"] > 0, "node 2 did not get its chunks from peers")
    elif what == "parity":
        need(n2["remote_chunks"] == 0 and n2["rebuilt_chunks"] > 0, "node 2 did not rebuild its chunks")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib-per-rank", type=float, default=256.0, help="state per rank, MiB (4 ranks)")
    p.add_argument("--saves", type=int, default=10, help="measured local-only saves per configuration")
    p.add_argument("--restores", type=int, default=5, help="restores per scenario (median reported)")
    p.add_argument("--chunk-mib", type=float, default=16.0, help="chunk_size in MiB (ckpt's default: 16)")
    p.add_argument("--s3-fraction", type=float, default=0.1, help="the limited S3 rows: each node's bandwidth to "
                   "S3 as a fraction of this disk's read speed (measured first)")
    p.add_argument("--s3-mibps", type=float, default=None, help="the limited S3 rows: each node's bandwidth to S3 "
                   "in MiB/s (instead of --s3-fraction)")
    p.add_argument("--out", default=None, help="where the .md/.json/.png go (default: benchmarks/results; with "
                   "--quick: a temp dir, so a smoke run never overwrites the recorded results)")
    p.add_argument("--name", default="nodeloss", help="results file name (without extension)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds the whole run may take")
    p.add_argument("--quick", action="store_true", help="8 MiB per rank, 1 MiB chunks, 2 saves, 1 restore")
    args = p.parse_args()
    print(banner(), flush=True)
    if args.quick:
        args.mib_per_rank, args.saves, args.restores, args.chunk_mib = 8.0, 2, 1, 1.0
    if args.saves < 1 or args.restores < 1 or args.mib_per_rank <= 0:
        p.error("--saves and --restores must be at least 1, --mib-per-rank positive")
    if not 0 < args.s3_fraction <= 1 or (args.s3_mibps is not None and args.s3_mibps <= 0):
        p.error("--s3-fraction must be in (0, 1], --s3-mibps positive")
    chunk = int(args.chunk_mib * 2**20)
    if args.out is None:
        args.out = (os.path.join(tempfile.gettempdir(), "ckpt-bench-results") if args.quick else
                    os.path.join(HERE, "results"))
    cmd = " ".join(["python benchmarks/nodeloss.py", *sys.argv[1:]])
    os.environ["OMP_NUM_THREADS"] = "1"  # every rank, as torchrun does on a full machine

    root = tempfile.mkdtemp(prefix="ckpt-nodeloss-bench-")
    print(f"{WORLD} ranks × {args.mib_per_rank:g} MiB float32 ({N_TENSORS} LocalShards of {COLS} columns), "
          f"chunks {args.chunk_mib:g} MiB, codec raw; {os.cpu_count()} CPUs; torch {torch.__version__}; "
          f"scratch {root}")
    print(f"command: {cmd}", flush=True)
    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    server = None
    proxies: list[FaultProxy] = []
    try:
        speeds, how = disk_read_speed(root, max(64 << 20, int(args.mib_per_rank * 2**20)))
        disk = median(speeds)
        how += f", median of {len(speeds)}"
        rate = args.s3_mibps * 2**20 if args.s3_mibps is not None else args.s3_fraction * disk
        limit = {"disk_read_mibps": disk / 2**20, "disk_read_how": how, "s3_mibps": rate / 2**20,
                 "disk_read_runs_mibps": [x / 2**20 for x in speeds],
                 "fraction": None if args.s3_mibps is not None else args.s3_fraction}
        print(f"this disk reads {disk / 2**20:.0f} MiB/s ({how}); S3 limited to {rate / 2**20:.0f} MiB/s per node "
              "in the limited rows", flush=True)
        server = RcloneS3(os.path.join(root, "s3")).start()
        server.make_bucket(BUCKET)
        proxies = [FaultProxy(server.port, rate=rate) for _ in range(WORLD)]  # one link per node
        a = {"mib": args.mib_per_rank, "saves": args.saves, "restores": args.restores, "chunk_size": chunk,
             "root": os.path.join(root, "nodes"), "endpoint": server.endpoint, "run": "bench",
             "limited": [x.endpoint for x in proxies], "timeout": min(args.timeout, 600.0)}
        res = run_ranks(WORLD, rank_body, a, timeout=args.timeout, pg_timeout=a["timeout"])[0]
        limit["through_node_links_mib"] = [{d: b.taken / 2**20 for d, b in x.limits.items()} for x in proxies]
    finally:
        for x in proxies:
            x.close()
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    elapsed = time.perf_counter() - t_start
    report(args, cmd, res, chunk, elapsed, (load_before, os.getloadavg()[0]), limit)


def summarize(res: dict) -> dict:
    state = res["state_bytes"] * WORLD
    out: dict = {"configs": {}, "restore": {}, "targets": {}}
    for cfg, rows in res["saves"].items():
        local = [r["ranks"] for r in rows if r["kind"] == "local"]
        mx = lambda rs, k: max((x[k] or 0.0) for x in rs)  # noqa: E731
        tot = lambda rs, k: sum(x[k] for x in rs)  # noqa: E731
        first = next(r["ranks"] for r in rows if r["kind"] == "first")
        last = next(r["ranks"] for r in rows if r["kind"] == "persisted")
        out["configs"][cfg] = {
            "label": LABELS[cfg],
            "blocked_s": median(mx(rs, "stall_s") for rs in local),
            "blocked_pooled_s": median(x["stall_s"] for rs in local for x in rs),
            "committed_local_s": median(mx(rs, "duration_s") for rs in local),
            "durable_local_s": median(mx(rs, "local_s") for rs in local),
            "peer_s": median(mx(rs, "peer_s") for rs in local) if cfg != "none" else None,
            "sent_bytes": median(tot(rs, "peer_sent_bytes") for rs in local),
            "written_bytes": median(tot(rs, "written_bytes") for rs in local),
            "peer_stored_bytes": median(tot(rs, "peer_stored_bytes") for rs in local),
            "stored_bytes": median(tot(rs, "written_bytes") + tot(rs, "peer_stored_bytes") for rs in local),
            "raw_bytes": median(tot(rs, "raw_bytes") for rs in local),
            "first_save_committed_s": mx(first, "duration_s"),
            "persisted_save_committed_s": mx(last, "duration_s"),
            "local_saves": len(local),
        }
        c = out["configs"][cfg]
        c["overhead"] = c["stored_bytes"] / state
    none_blocked = out["configs"]["none"]["blocked_s"]
    none_pooled = out["configs"]["none"]["blocked_pooled_s"]
    for c in out["configs"].values():
        c["blocked_vs_none"] = c["blocked_s"] / none_blocked if none_blocked else float("nan")
        c["blocked_pooled_vs_none"] = c["blocked_pooled_s"] / none_pooled if none_pooled else float("nan")
    for what, reps in res["restores"].items():
        n2 = [r["ranks"][WIPED]["s"] for r in reps]
        slow = [max(x["s"] for x in r["ranks"]) for r in reps]
        last = reps[-1]["ranks"][WIPED]
        out["restore"][what] = {
            "label": RESTORE_LABELS[what], "node2_s": median(n2), "slowest_s": median(slow), "node2_runs_s": n2,
            "node2_healed_s": median([r["ranks"][WIPED]["healed_s"] for r in reps]),
            "slowest_runs_s": slow, "exact": all(x["exact"] for r in reps for x in r["ranks"]),
            "node2": {k: last[k] for k in ("source", "peer_chunks", "rebuilt_chunks", "local_chunks",
                                           "remote_chunks", "chunks_read", "bytes_read")},
            "remote_chunks_other_ranks": sum(x["remote_chunks"] or 0 for r in reps[-1:]
                                             for i, x in enumerate(r["ranks"]) if i != WIPED),
        }
    s3, limited = out["restore"]["s3"]["node2_s"], out["restore"]["s3_limited"]["node2_s"]
    floor = out["restore"]["intact"]["node2_s"]
    for r in out["restore"].values():
        r["over_floor_s"] = r["node2_s"] - floor  # what losing the tier costs beyond a restart with it
        r["s3_over_this"] = s3 / r["node2_s"] if r["node2_s"] else float("nan")
        r["s3_limited_over_this"] = limited / r["node2_s"] if r["node2_s"] else float("nan")
    t = out["targets"]
    for cfg in ("replicas", "parity"):
        x = out["configs"][cfg]["blocked_vs_none"]
        t[f"blocked_{cfg}"] = {"what": f"blocked time {LABELS[cfg]} ÷ none", "target": f"≤ {TARGET_BLOCKED:.2f}",
                               "value": x, "met": x <= TARGET_BLOCKED}
    for suffix, key, what in (("_limited", "s3_limited_over_this", "S3 limited"),
                              ("", "s3_over_this", "S3 at disk speed")):
        for cfg in ("replicas", "parity"):
            x = out["restore"][cfg][key]
            t[f"restore_{cfg}{suffix}"] = {"what": f"restore of node 2: {what} ÷ {RESTORE_LABELS[cfg]}",
                                           "target": f"≥ {TARGET_RESTORE:.1f}", "value": x, "met": x >= TARGET_RESTORE}
    x = out["configs"]["parity"]["overhead"]
    t["parity_overhead"] = {"what": f"storage of {LABELS['parity']} ÷ state", "target": f"≤ {TARGET_PARITY:.3f} "
                            f"((k+m)/k + 0.05)", "value": x, "met": x <= TARGET_PARITY}
    return out


def limit_line(limit: dict) -> str:
    """The limited rows' S3, said as the issue asks: a node's bandwidth against this disk's."""
    share = (f" = 1/{1 / limit['fraction']:g} of local disk read {limit['disk_read_mibps']:.0f} MiB/s"
             if limit["fraction"] else f" (local disk read {limit['disk_read_mibps']:.0f} MiB/s)")
    return f"S3 limited to {limit['s3_mibps']:.0f} MiB/s per node{share} ({limit['disk_read_how']})"


def report(args, cmd: str, res: dict, chunk: int, elapsed: float, loadavg: tuple[float, float], limit: dict) -> None:
    s = summarize(res)
    s["s3_limit"] = limit
    mib = 2**20
    state = res["state_bytes"] * WORLD
    lines = [
        f"Command: `{cmd}`",
        "",
        (f"Machine: {os.cpu_count()} CPUs ({platform.machine()}, {platform.system()}), torch {torch.__version__}, "
         f"python {platform.python_version()}. {WORLD} ranks (processes, gloo over 127.0.0.1, OMP_NUM_THREADS=1), "
         f"each its own failure domain with its own local_dir on the same disk; the checkpoint path is "
         f"`rclone serve s3` on 127.0.0.1. State: {res['state_bytes'] / mib:.0f} MiB float32 per rank "
         f"({state / mib:.0f} MiB in all) in {N_TENSORS} LocalShards, new bits in every element per save; "
         f"`codec=\"raw\"` (the comparison is about redundancy, not compression), chunk_size {chunk / mib:g} MiB, "
         f"persist_every={PERSIST_EVERY}, keep_local=2, keep_last=1. Saves: median of {args.saves} local-only saves "
         f"(after the first save, which uploads), each the maximum over ranks (times) or the sum over ranks (bytes); "
         f"the configurations take turns within each round, and every save is waited for before the next. "
         f"Restores: median of {args.restores}, every load checked bit for bit. The tiers and rclone's directory "
         f"share one disk and S3 is on loopback; in the limited rows each node reaches it through a proxy of its "
         f"own holding it to a node's bandwidth, while peers talk over loopback: a model of S3 at a node's share "
         f"of the network against peers on a faster one, not real S3. "
         f"Wall time of the whole run: {elapsed:.0f}s; 1-minute load average {loadavg[0]:.1f} before and "
         f"{loadavg[1]:.1f} after."),
        "",
        "### Saves",
        "",
        "| redundancy | blocked (s) | blocked ÷ none | blocked ÷ none, every rank | committed locally (s) | "
        "peer exchange (s) | sent to peers / save (MiB) | stored / save (MiB) | stored ÷ state | "
        "first save, uploaded (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in s["configs"].values():
        lines.append(f"| {c['label']} | {fmt(c['blocked_s'])} | {fmt(c['blocked_vs_none'], 2)} | "
                     f"{fmt(c['blocked_pooled_vs_none'], 2)} | {fmt(c['committed_local_s'], 2)} | "
                     f"{fmt(c['peer_s'], 2)} | "
                     f"{c['sent_bytes'] / mib:.1f} | {c['stored_bytes'] / mib:.1f} | {c['overhead']:.3f} | "
                     f"{fmt(c['first_save_committed_s'], 2)} |")
    lines += ["", "Blocked: time inside `save()` (the slowest rank's, median over saves; \"every rank\": the "
              "median over every rank's saves, a steadier ratio: four ranks copying at once on "
              f"{os.cpu_count()} cores make the slowest rank's time noisy); committed locally: `save()` to "
              "committed on every rank's local tier (`duration_s` of a local-only save), peers included; stored: "
              "the chunks each rank wrote to its own tier plus what it stored for peers (replicas, parity blocks), "
              "all ranks.",
              "", f"### Restore of node 2 (its local tier wiped), {res['state_bytes'] / mib:.0f} MiB", "",
              f"{limit_line(limit)}; peers on loopback.", "",
              "| restored from | node 2 (s) | node 2 − floor (s) | slowest rank (s) | "
              "S3 limited (node 2 only) ÷ this | S3 at disk speed (node 2 only) ÷ this | node 2's tier healed (s) | "
              "node 2's chunks: peers / rebuilt / S3 / local |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in s["restore"].values():
        n = r["node2"]
        lines.append(f"| {r['label']} | {fmt(r['node2_s'], 2)} | {fmt(r['over_floor_s'], 2)} | "
                     f"{fmt(r['slowest_s'], 2)} | "
                     f"{fmt(r['s3_limited_over_this'], 2)} | {fmt(r['s3_over_this'], 2)} | "
                     f"{fmt(r['node2_healed_s'], 2)} | "
                     f"{n['peer_chunks']} / {n['rebuilt_chunks']} / "
                     f"{n['remote_chunks']} / {n['local_chunks']} |")
    lines += ["", "Node 2 (s): `load()` to its return, when training can go on (every rank's load ends together); "
              "node 2 − floor: that less the floor's median, what losing the tier cost; node 2's tier healed: until "
              "the chunks it took from peers or S3 are written back into its tier (in the background, behind the "
              "load; `wait()` returns then). The other nodes read nothing from S3 but in the \"every node "
              "fresh\" rows (checked), and every load was bit-exact. Through node 2's limited link, all runs: "
              f"{limit['through_node_links_mib'][WIPED]['down']:.0f} MiB from S3 "
              f"({limit['through_node_links_mib'][WIPED]['up']:.1f} MiB of requests; the heal writes back what "
              "the load downloaded, so that is its state once per limited row and restore).",
              "", "### Targets", "", "| target | measured | goal | met |", "|---|---:|---:|---|"]
    for t in s["targets"].values():
        lines.append(f"| {t['what']} | {fmt(t['value'], 3)} | {t['target']} | {'yes' if t['met'] else 'no'} |")
    text = "\n".join(lines)
    print("\n" + text)
    doc = {"command": cmd, "world": WORLD, "mib_per_rank": args.mib_per_rank, "state_bytes_per_rank":
           res["state_bytes"], "saves": args.saves, "restores": args.restores, "codec": "raw",
           "chunk_size": chunk, "persist_every": PERSIST_EVERY, "cpus": os.cpu_count(),
           "torch": torch.__version__, "elapsed_s": elapsed, "loadavg_before_after": loadavg,
           **s, "raw": res}
    write_results(args.out, args.name, text + "\n", doc, indent=1, json_default=str,
                  plot=lambda path: plot(s, path, res["state_bytes"]))

def plot(s: dict, path: str, per_rank: int) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax0, ax1, ax2, ax3) = plt.subplots(1, 4, figsize=(18, 4.8), gridspec_kw={"width_ratios": [1, 1, 1, 1.5]})
    cfgs = list(s["configs"].values())
    x = list(range(len(cfgs)))
    names = [c["label"] for c in cfgs]
    bars = ax0.bar(x, [c["blocked_s"] for c in cfgs], 0.6)
    ax0.bar_label(bars, [f"{c['blocked_vs_none']:.2f}×" for c in cfgs])
    ax0.axhline(TARGET_BLOCKED * cfgs[0]["blocked_s"], color="gray", ls="--", lw=1,
                label=f"target: {TARGET_BLOCKED:.2f}× none")
    ax0.set_ylim(0, 1.25 * max(TARGET_BLOCKED * cfgs[0]["blocked_s"], *(c["blocked_s"] for c in cfgs)))
    ax0.set_xticks(x, names)
    ax0.set_ylabel("seconds (median, max over ranks)")
    ax0.set_title("blocked in save()")
    ax0.legend(loc="lower right")
    bars = ax1.bar(x, [c["committed_local_s"] for c in cfgs], 0.6, color="tab:orange")
    ax1.bar_label(bars, [f"{c['committed_local_s']:.2f}s" for c in cfgs])
    ax1.set_ylim(0, 1.15 * max(c["committed_local_s"] for c in cfgs))
    ax1.set_xticks(x, names)
    ax1.set_ylabel("seconds (median, max over ranks)")
    ax1.set_title("local-only save: save() to committed")
    bars = ax2.bar(x, [c["overhead"] for c in cfgs], 0.6, color="tab:green")
    ax2.bar_label(bars, [f"{c['overhead']:.3f}" for c in cfgs])
    ax2.axhline(TARGET_PARITY, color="gray", ls="--", lw=1, label=f"parity target {TARGET_PARITY:.3f}")
    ax2.set_ylim(0, 1.2 * max(2.0, *(c["overhead"] for c in cfgs)))
    ax2.set_xticks(x, names)
    ax2.set_ylabel("bytes stored per save ÷ state")
    ax2.set_title("storage on all tiers")
    ax2.legend(loc="upper right")
    rs = list(s["restore"].values())
    y = list(range(len(rs)))
    bars = ax3.barh([i - 0.2 for i in y], [r["node2_s"] for r in rs], 0.4, label="node 2")
    ax3.bar_label(bars, [f"{r['node2_s']:.2f}s" for r in rs], fontsize=8)
    ax3.barh([i + 0.2 for i in y], [r["slowest_s"] for r in rs], 0.4, label="slowest rank")
    ax3.set_yticks(y, [r["label"] for r in rs], fontsize=8)
    ax3.invert_yaxis()
    ax3.set_xlim(0, 1.3 * max(max(r["node2_s"], r["slowest_s"]) for r in rs))
    ax3.set_xlabel("seconds (median)")
    ax3.set_title(f"restore of node 2 ({per_rank / 2**20:.0f} MiB), its tier wiped\n"
                  f"S3 limited: {s['s3_limit']['s3_mibps']:.0f} MiB/s per node, peers on loopback", fontsize=10)
    ax3.legend(loc="upper right")
    fig.suptitle(f"node loss: {WORLD} gloo ranks × {per_rank / 2**20:.0f} MiB on {os.cpu_count()} CPUs, codec raw, "
                 "remote: rclone serve s3 on 127.0.0.1 (limited: through a rate-limited proxy per node)")
    save_figure(fig, path)


if __name__ == "__main__":
    main()
