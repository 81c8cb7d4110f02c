"""Run a function on real ``torch.distributed`` ranks (gloo, 127.0.0.1) from a test.

    def body(rank, world, path):           # module-level, so spawned processes can import it
        ckptr = ckpt.Checkpointer(path)
        ...
        return {"digest": ...}             # anything picklable

    results = run_ranks(3, body, str(tmp_path))   # one result per rank, in rank order

A rank that raises makes ``run_ranks`` fail with that rank's traceback. Ranks listed in
``may_die`` may exit without a result (tests that kill a rank); their entry is None.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, results, args, hard_exit: bool) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    status, payload = "ok", None
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
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


def run_ranks(world: int, fn, *args, timeout: float = 180.0, may_die: tuple[int, ...] = ()) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, results, args, bool(may_die)), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world:
            try:
                rank, status, payload = results.get(timeout=1.0)
                out[rank] = (status, payload)
                continue
            except queue.Empty:
                pass
            for r in may_die:
                if r not in out and not procs[r].is_alive():
                    out[r] = ("died", None)
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(out))
                exited = {r: procs[r].exitcode for r in missing if not procs[r].is_alive()}
                raise TimeoutError(f"ranks {missing} gave no result within {timeout}s (exited: {exited})")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [(r, payload) for r, (status, payload) in sorted(out.items()) if status == "error"]
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} failed:\n{tb}" for r, tb in errors))
    return [out[r][1] for r in range(world)]
