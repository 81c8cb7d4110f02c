"""Run a function on real ``torch.distributed`` ranks (gloo, 127.0.0.1) from a test.

    def body(rank, world, path):           # module-level, so spawned processes can import it
        ckptr = ckpt.Checkpointer(path)
        ...
        return {"digest": ...}             # anything picklable

    results = run_ranks(3, body, str(tmp_path))   # one result per rank, in rank order

A rank that raises makes ``run_ranks`` fail with that rank's traceback, and a rank that exits
without a result makes it fail at once (not after ``timeout``), unless it is listed in ``may_die``
(tests that kill a rank: its entry is None). ckpt's tests and benchmarks use it.
"""

from __future__ import annotations

import atexit
import os
import queue
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing import util as mp_util

import torch.distributed as dist
import torch.multiprocessing as mp

from .s3 import free_port

# Ranks are forked from one server process that imported these once (multiprocessing's forkserver),
# not spawned: a spawned rank imported torch afresh, 2-3 CPU-s each, in every test on real ranks (a
# two-rank group took 3 s to start, 6 s on the loaded machine; 0.2 s forked). The server only imports
# modules, so no thread runs in it to be lost by a fork; it keeps the environment it started with, so
# each rank is handed the caller's (tests/test_testing.py checks that).
_PRELOAD = ["torch", "torch.distributed", "ckpt", "ckpt.testing"]


def _context():
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _entry(fn, rank: int, world: int, port: int, results, args, hard_exit: bool, pg_timeout: float,
           hosted: bool, env: dict[str, str]) -> None:
    os.environ.clear()  # the caller's now, not the server's (started with an earlier test's)
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    status, payload = "ok", None
    try:
        timeout = timedelta(seconds=pg_timeout)
        if hosted:  # the caller holds the store: its port was never free for another process to take
            store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        else:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                    timeout=timeout)
        payload = fn(rank, world, *args)
    except BaseException:  # sent to the test
        status, payload = "error", traceback.format_exc()
    results.put((rank, status, payload))
    if hard_exit:  # a peer may be dead: leave without the shutdown handshakes
        results.close()
        results.join_thread()
        os._exit(0)
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        pass
    _leave()


def _leave() -> None:
    """End this rank as its interpreter would, less the finalization: multiprocessing's exit (the
    result's queue flushed), the hooks of ``threading._register_atexit`` (ckpt's: saves in flight
    finished), non-daemon threads joined, ``atexit``'s functions; then ``os._exit``. Finalizing a
    process that imported torch took 0.7 s (3 s on a loaded machine) per rank, after the test had its
    results; and gloo's threads meeting finalization can abort a process (tests/test_shutdown.py), as
    the examples' ``shutdown`` says."""
    try:
        mp_util._exit_function()  # type: ignore[attr-defined]
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_ranks(world: int, fn, *args, timeout: float = 180.0, may_die: tuple[int, ...] = (),
              pg_timeout: float = 120.0, daemon: bool = True) -> list:
    ctx = _context()
    results = ctx.Queue()
    # The store is held here, on a port it binds itself, unless a test kills ranks (rank 0 then hosts
    # it, so its death is what the others see, as in a real job). A free_port() number handed to rank 0
    # could be taken by another process before rank 0 bound it: the other ranks then connected to that
    # process and hung (seen with several test runs on one machine).
    host = None if may_die else dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                                               timeout=timedelta(seconds=pg_timeout))
    port = host.port if host is not None else free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, results, args, bool(may_die), pg_timeout,
                                              host is not None, dict(os.environ)),
                         daemon=daemon) for r in range(world)]  # daemon=False: ranks may start processes
    for p in procs:
        p.start()
    out: dict[int, tuple[str, object]] = {}
    gone: set[int] = set()  # exited without a result at the last look (its result may still be in the pipe)
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world:
            try:
                rank, status, payload = results.get(timeout=1.0)
                out[rank] = (status, payload)
                continue
            except queue.Empty:
                pass
            dead = {r for r in range(world) if r not in out and not procs[r].is_alive()}
            for r in dead & set(may_die):
                out[r] = ("died", None)
            lost = sorted((dead & gone) - set(may_die))  # dead at two looks a second apart, nothing came
            if lost:
                raise AssertionError(f"rank(s) {lost} exited without a result (exit codes "
                                     f"{[procs[r].exitcode for r in lost]}); results so far: {out}")
            gone = dead
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(out))
                exited = {r: procs[r].exitcode for r in missing if not procs[r].is_alive()}
                raise TimeoutError(f"ranks {missing} gave no result within {timeout}s (exited: {exited})")
    finally:
        finished = len(out) == world and all(status != "error" for status, _ in out.values())
        for p in procs:
            p.join(timeout=30 if finished else 1)  # after a failure the others may wait in a collective
            if p.is_alive():
                p.kill()
    errors = [(r, payload) for r, (status, payload) in sorted(out.items()) if status == "error"]
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} failed:\n{tb}" for r, tb in errors))
    return [out[r][1] for r in range(world)]
