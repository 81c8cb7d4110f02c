"""The simulated job of benchmarks/scale.py: N ranks in one process, running ckpt's own per-rank code.

What is simulated, and what is ckpt's code as a real job runs it:

* the state: a model's ``state_dict`` and AdamW's (``exp_avg``, ``exp_avg_sq``, a 0-d ``step`` per
  parameter, ``param_groups``) as rank ``r`` of ``N`` holds it under FSDP2 (dim-0 shards) or FSDP2 x
  TP8; every shard is a :class:`ckpt.LocalShard` over a zero-stride tensor (one element of memory
  viewed at the shard's shape), so shapes, boxes and byte counts are the 70B/405B ones and the
  values are not there;
* the plan: :meth:`Inventory.of` -> :func:`ckpt.save.planning.exchange_plan` (rank 0 runs
  :func:`ckpt.save.planning.plan_posted`: ranks alike planned from what is distinct among them), N threads
  over one in-process store that counts every request, then the same round again for rank 0's peak
  memory; each rank's flattened state is rank 0's (:func:`ckpt.flatten.flatten` run once) with the
  rank's own boxes (:class:`Ranks`);
* the rank report: :func:`ckpt.save.buffer_layout.make_layout` of the tensors the plan gave the rank, cut into
  16 MiB chunks, and :meth:`Writer._report` with a chunk table of made-up hashes (no bytes are hashed,
  encoded or written: every chunk is "raw", without span digests);
* the commit, :func:`ckpt.save.commit_index.commit_summarized` as the commit protocol runs it: every rank's
  summary of its report (:func:`ckpt.save.commit_index.summarize`, what its commit report carries), then on
  rank 0 :meth:`ckpt.save.commit_index.IndexBuilder.build` (the first save of a plan reads every report
  once to learn the layout; the next save, measured apart, reads none), the index checked as every
  reader checks it (:func:`ckpt.format.index.committable`) and the create-only write;
* the load (of the second save): on one rank, :func:`ckpt.format.manifest.read_committed` (the index) and
  :func:`ckpt.load.index_reads.step_for_load` (the reports of the saved ranks whose boxes it needs,
  each checked against the index), then :func:`ckpt.load.match.match`,
  :func:`~ckpt.load.checks.check_fit` and :func:`ckpt.load.plan.plan_boxes` (which chunks feed which
  bytes), the destinations given one-element stand-ins (a load refuses zero-stride targets);
* the rounds: :meth:`Comm.agree` three times (what ``load("latest")`` runs) and the commit round's
  ``report`` / ``gather`` / ``publish`` / ``decision``, N threads, every request counted.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from scale_counting import CountingStorage, comms, on_threads, totals

import ckpt
from ckpt.errors import StepExistsError
from ckpt.flatten import Flat, Leaf, flatten
from ckpt.format import manifest as mf
from ckpt.format.chunk import HEADER_SIZE
from ckpt.handle import SaveMetrics
from ckpt.save.buffer_layout import make_layout
from ckpt.save.encode import CodecSpec
from ckpt.save.planning import Inventory, WriteAssignment, exchange_plan
from ckpt.save.writer import Writer, _Put
from ckpt.storage.base import Storage

MiB = 1 << 20


# -- the models ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Model:
    """A Llama-3-shaped decoder: its parameters' shapes and how tensor parallelism splits each."""

    name: str
    layers: int
    hidden: int
    kv: int  # key/value projection rows (kv heads x head dim)
    ffn: int
    vocab: int

    def params(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, tp split): "col" splits rows, "row" splits columns, "rep" is replicated over TP."""
        h, out = self.hidden, [("embed_tokens.weight", (self.vocab, self.hidden), "col")]
        for i in range(self.layers):
            p = f"layers.{i}."
            out += [(p + "self_attn.q_proj.weight", (h, h), "col"),
                    (p + "self_attn.k_proj.weight", (self.kv, h), "col"),
                    (p + "self_attn.v_proj.weight", (self.kv, h), "col"),
                    (p + "self_attn.o_proj.weight", (h, h), "row"),
                    (p + "mlp.gate_proj.weight", (self.ffn, h), "col"),
                    (p + "mlp.up_proj.weight", (self.ffn, h), "col"),
                    (p + "mlp.down_proj.weight", (h, self.ffn), "row"), (p + "input_layernorm.weight", (h,), "rep"),
                    (p + "post_attention_layernorm.weight", (h,), "rep")]
        return out + [("norm.weight", (h,), "rep"), ("lm_head.weight", (self.vocab, h), "col")]

    @property
    def tensors(self) -> int:
        return 4 * len(self.params())  # weight, exp_avg, exp_avg_sq, step

    @property
    def numel(self) -> int:
        total = 0
        for _, shape, _ in self.params():
            n = 1
            for d in shape:
                n *= d
            total += n
        return total


MODELS = {
    "llama3-70b": Model("llama3-70b", 80, 8192, 1024, 28672, 128256),
    "llama3-405b": Model("llama3-405b", 126, 16384, 1024, 53248, 128256),
    "tiny": Model("tiny", 2, 256, 64, 512, 1024),  # the test's
}
LAYOUTS = {"fsdp": 1, "fsdp-tp8": 8}  # layout -> TP degree (FSDP2 over the rest)


def _rows(total: int, parts: int, i: int) -> tuple[int, int]:
    """FSDP2's dim-0 chunking: part ``i`` of ``parts`` of ``total`` rows (ceil-sized: the last short or empty)."""
    size = -(-total // parts)
    start = min(i * size, total)
    return start, max(0, min(size, total - start))


def box(shape: tuple[int, ...], split: str, rank: int, world: int, tp: int
        ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Rank ``rank``'s box (offsets, lengths) of a parameter under FSDP2 (dim 0, over world/tp) x TP (``tp``)."""
    dp, d, t = world // tp, rank // tp, rank % tp
    rows = shape[0]
    if tp == 1 or split == "rep" or len(shape) == 1:
        start, n = _rows(rows, dp, d)
        return (start, *([0] * (len(shape) - 1))), (n, *shape[1:])
    if split == "col":  # TP's block of rows, then FSDP's rows within it
        block = rows // tp
        start, n = _rows(block, dp, d)
        return (t * block + start, 0), (n, shape[1])
    cols = shape[1] // tp  # "row": TP splits the columns, FSDP the rows
    start, n = _rows(rows, dp, d)
    return (start, t * cols), (n, cols)


def _stand_in(lengths: tuple[int, ...]) -> torch.Tensor:
    """A tensor of the shard's shape that holds one float: shapes and byte counts without the bytes."""
    return torch.zeros((), dtype=torch.float32).expand(*lengths)


def state_of(model: Model, layout: str, rank: int, world: int, step: int = 100) -> dict[str, Any]:
    """Rank ``rank``'s state as the training loop hands it to ``save``: ``{"model": ..., "optim": ...}``."""
    tp = LAYOUTS[layout]
    weights: dict[str, Any] = {}
    opt: dict[int, dict[str, Any]] = {}
    for i, (name, shape, split) in enumerate(model.params()):
        offs, lens = box(shape, split, rank, world, tp)
        weights[name], exp_avg, exp_avg_sq = (ckpt.LocalShard(_stand_in(lens), offsets=offs, global_shape=shape)
                                              for _ in range(3))
        opt[i] = {"step": torch.tensor(float(step)), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
               "params": list(range(len(weights)))}]
    return {"model": weights, "optim": {"state": opt, "param_groups": groups}}


# -- one rank's part of a save ----------------------------------------------------------------------------------
def fake_hash(rank: int, i: int) -> str:
    """A chunk name no other chunk of the job has (what hashing distinct bytes gives)."""
    return f"{rank:012x}{i:020x}"


def rank_report(writer: Writer, flat: Flat, answer: WriteAssignment, rank: int, step: int,
                chunk_size: int) -> mf.Manifest:
    """Rank ``rank``'s report of a save, as :meth:`Writer.write_part` makes it from the snapshot's
    layout (:func:`make_layout` over the tensors the plan gave it) and the chunks it wrote."""
    keys = list(flat.tensors)
    write = [keys[i] for i in answer.write]
    layout = make_layout({k: flat.tensors[k] for k in write}, chunk_size, frozenset(keys[i] for i in answer.fresh))
    puts = [_Put(fake_hash(rank, i), mf.ChunkInfo(c.length, c.length + HEADER_SIZE, "raw/1"), "created")
            for i, c in enumerate(layout.chunks)]
    snapshot = SimpleNamespace(buffer=SimpleNamespace(layout=layout), leaves={k: flat.leaves[k] for k in write})
    job = SimpleNamespace(step=step, metrics=SaveMetrics(step=step), snapshot=snapshot, structure=flat.structure)
    return writer._report(job, rank, puts)  # type: ignore[arg-type]  # the fields _report reads


def make_writer(storage: Storage) -> Writer:
    return Writer(storage, CodecSpec.parse("raw"), io=None)  # type: ignore[arg-type]  # a report, no chunk: no pool


class Ranks:
    """Every rank's flattened state, from one real :func:`flatten` (rank 0's): the structure is the
    same on every rank, only the boxes differ, so rank ``r``'s :class:`Flat` is rank 0's with its own
    boxes and stand-ins (flattening N full states in one process would cost N times what one rank pays)."""

    def __init__(self, model: Model, layout: str, world: int):
        self.model, self.layout, self.world = model, layout, world
        self.template = flatten(state_of(model, layout, 0, world))
        params = model.params()
        by_name = {f"model/{name}": (shape, split) for name, shape, split in params}
        self.params: dict[str, tuple[tuple[int, ...], str] | None] = {}
        for key in self.template.tensors:
            parts = key.split("/")
            if parts[0] == "model":
                self.params[key] = by_name[key]
            else:  # optim/state/<i>/<exp_avg|exp_avg_sq|step>
                self.params[key] = None if parts[3] == "step" else params[int(parts[2])][1:]

    def flat(self, rank: int) -> Flat:
        if rank == 0:
            return self.template
        t = self.template
        tensors, leaves = {}, {}
        for key, leaf in t.leaves.items():
            p = self.params[key]
            if p is None:  # a replicated 0-d tensor
                tensors[key], leaves[key] = t.tensors[key], leaf
                continue
            offs, lens = box(p[0], p[1], rank, self.world, LAYOUTS[self.layout])
            tensors[key] = _stand_in(lens)
            leaves[key] = Leaf((offs, lens), leaf.global_shape, leaf.kind)
        return Flat(t.structure, tensors, leaves, t.pieces, t.targets, t.statefuls, t.paths, t.per_rank)


# -- measuring ---------------------------------------------------------------------------------------------------
class Traced:
    """Python's heap above where it was on entry (``tracemalloc``): at most, and still held on exit.
    Resident memory would not do: what the earlier steps of a case freed is reused without growing it."""

    def __enter__(self) -> Traced:
        import gc
        import tracemalloc

        gc.collect()
        tracemalloc.start()
        self._base = tracemalloc.get_traced_memory()[0]
        return self

    def __exit__(self, *exc: object) -> None:
        import tracemalloc

        current, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        self.held, self.peak = current - self._base, peak - self._base


def save_and_load(model: Model, layout: str, world: int, root: str, chunk_size: int = 16 * MiB,
                  step: int = 100) -> dict[str, Any]:
    """One save (plan round, every rank's report, rank 0's commit) and one rank's load of the
    manifest, of ``model`` under ``layout`` on ``world`` simulated ranks; what each part cost.
    Times are CPU seconds of the thread doing the part (``time.thread_time``: the other simulated
    ranks and other processes on the machine do not count; all of it is single-threaded Python)."""
    import dataclasses
    import json

    from ckpt.format import paths
    from ckpt.save.commit_index import IndexBuilder, commit_summarized, summarize
    from ckpt.save.commit_plan import lazily
    from ckpt.storage.local import LocalStorage

    inner = LocalStorage(root)
    disks = [CountingStorage(inner) for _ in range(world)]
    cs = comms(world)
    ranks = Ranks(model, layout, world)
    plan_s: list[float] = []
    plan_peak: list[int] = []
    first: list[Any] = [None] * world  # each rank's store requests and bytes in the first round
    parts: dict[int, mf.Manifest] = {}
    summaries: dict[int, list[dict]] = {step: [{}] * world, step + 1: [{}] * world}
    one_at_a_time = threading.Semaphore(1)  # every rank's report after the plan: one flattened state alive at once
    kept: list = []  # rank 0: the plan, whose layout its first commit takes

    def rank(r: int) -> int:
        comm = cs[r]
        inv = Inventory.of(ranks.flat(r))
        if r == 0:  # the coordinator's part of the round, once every inventory is posted
            for q in range(1, world):
                comm.shared.get(f"plan/0/{q}", time.monotonic() + comm.timeout)
            t = time.thread_time()
            answer = exchange_plan(comm, 0, inv, chunk_size, kept)
            plan_s.append(time.thread_time() - t)
            first[0] = SimpleNamespace(requests=Counter(comm.requests), bytes=Counter(comm.bytes))
            for q in range(1, world):  # the same round again, for its memory (the others wait for answers)
                comm.shared.get(f"plan/1/{q}", time.monotonic() + comm.timeout)
            with Traced() as mem:
                exchange_plan(comm, 1, inv, chunk_size)
            plan_peak.append(mem.peak)
        else:
            answer = exchange_plan(comm, 0, inv, chunk_size)
            first[r] = SimpleNamespace(requests=Counter(comm.requests), bytes=Counter(comm.bytes))
            exchange_plan(comm, 1, inv, chunk_size)
        del inv
        with one_at_a_time:
            part = rank_report(make_writer(disks[r]), ranks.flat(r), answer, r, step, chunk_size)
            for s in (step, step + 1):  # the first save of the plan, and the next (the same layout)
                p = part if s == step else dataclasses.replace(part, step=s)
                data = p.to_json()
                disks[r].write(paths.rank_key(s, r), [data])
                summaries[s][r] = summarize(p, data, frozenset())
                if r == 0:
                    parts[s] = p
        return answer.bytes

    written = on_threads(world, rank)
    out: dict[str, Any] = {"plan_s": plan_s[0], "plan_peak": plan_peak[0], "plan_store": totals(first),  # type: ignore[arg-type]
                           "report_bytes_max": max(d.written_bytes for d in disks),
                           "assigned_bytes_max": max(written), "assigned_bytes_min": min(written)}
    coord = disks[0]
    coord.reset_counts()
    coord.read_bytes = 0
    builders = [IndexBuilder()]

    def commit(s: int) -> None:  # CommitProtocol's commit, on rank 0
        built = commit_summarized(coord, builders[0], s, parts[s], summaries[s], frozenset(), plan=lazily(kept))
        assert built is not None  # no chunk listed differently by two ranks

    for s, tag in ((step, "commit_first_"), (step + 1, "commit_")):
        coord.reset_counts()
        coord.read_bytes = 0
        t = time.thread_time()
        commit(s)
        out[tag + "s"] = time.thread_time() - t
        out.update({tag + "read_bytes": coord.read_bytes, tag + "requests": sum(coord.calls.values()),
                    tag + "report_reads": coord.calls["read_object"]})
        if s == step:
            assert (builders[0].planned, builders[0].learned) == (1, 0)  # the layout from the plan, no report read
            learned = builders[0]
            builders[0] = IndexBuilder()  # learning again, for its memory
        with Traced() as mem:  # the same work again, for its memory: up to the create-only write, which refuses
            try:
                commit(s)
            except StepExistsError:
                pass
        out[tag + "peak_rss"] = mem.peak
        builders[0] = learned
    assert learned.planned == 1 and learned.learned == 0  # the second save read no report either
    out["report_bytes_total"] = sum(x["size"] for x in summaries[step + 1])
    out["commit_summary_bytes"] = sum(len(json.dumps(x)) for x in summaries[step + 1])
    out["manifest_bytes"] = inner.size(paths.manifest_key(step + 1))
    out.update(load_one_rank(model, layout, world, disks[world // 2], world // 2, step + 1))
    return out


def load_one_rank(model: Model, layout: str, world: int, disk: CountingStorage, r: int, step: int) -> dict[str, Any]:
    """Rank ``r``'s load up to its first chunk read: the manifest read and checked, its state matched,
    which chunk feeds which bytes (fill's own steps); the reads themselves are not made."""
    from ckpt.load.checks import check_fit
    from ckpt.load.index_reads import step_for_load
    from ckpt.load.match import match as match_state
    from ckpt.load.plan import Request, plan_boxes

    state = state_of(model, layout, r, world, step)

    def metadata() -> mf.Manifest:  # what StepChooser._load_step reads before its plan
        got = mf.read_committed(disk, step)
        return got if isinstance(got, mf.Manifest) else step_for_load(disk, got, state, r, world)

    with Traced() as mem:  # its memory (the parse traced is slower: timed again below)
        m = metadata()
    del m
    disk.reset_counts()
    disk.read_bytes = 0
    t = time.thread_time()
    m = metadata()
    parse_s = time.thread_time() - t
    t = time.thread_time()
    target = flatten(state, for_target=True)
    found = match_state(m, state, target, r, world, None)
    check_fit(m, found, state, target, strict=True)
    requests = []
    for key, owner, tkey in found.wanted:  # the boxes alone: plan_load's destinations refuse zero-stride targets
        assert tkey is not None
        requests.append(Request(key, owner, target.leaves[tkey].box))
    plan = plan_boxes(m, requests, found.entries)
    feeds = plan.reads
    match_s = time.thread_time() - t
    assert not plan.stages  # loading on the world size that saved: every box is a saved shard
    sources = {int(h[:12], 16) for h in feeds}
    got_bytes, requests, reports = disk.read_bytes, sum(disk.calls.values()), disk.calls["read_object"] - 1
    whole = mf.read_step(disk, step)  # the step's totals, for the table (not part of the load)
    return {"load_parse_s": parse_s, "load_match_s": match_s, "load_get_bytes": got_bytes,
            "load_get_requests": requests, "load_reports": reports, "load_manifest_rss": mem.held,
            "load_parse_peak_rss": mem.peak, "load_chunks": len(feeds), "load_source_ranks": len(sources),
            "load_other_chunks": sum(1 for h in feeds if int(h[:12], 16) != r),
            "tensors": len(whole.tensors), "shards": sum(len(t.shards) for t in whole.tensors),
            "chunks": len(whole.chunks), "step_writers": len({t.shards[0].rank for t in whole.tensors if not t.shape})}


def rounds(world: int) -> dict[str, dict[str, int]]:
    """Store requests of the rounds every save and load runs, on ``world`` threads: a save's ``go``
    and ``commit`` rounds (as :class:`ckpt.save.commit.CommitProtocol` runs them) and the three ``agree``
    rounds of ``load("latest")`` (:class:`ckpt.load.step_choice.StepChooser`), with the documents they post
    and the reductions they run."""
    from ckpt.load.step_choice import _coordinators, _failures, _outcome, _ready
    from ckpt.save.commit import Decision, Report, Status

    cs = comms(world)

    def save(r: int) -> None:
        comm = cs[r]
        comm.round("go", 0).run({"lease": "job"} if r == 0 else None, what="the start of save 0")

        def decide(got) -> dict:
            assert len(got.ordered()) == world and not got.missing
            return Decision(Status.OK).to_json()

        answer = comm.round("commit", 0).run(Report(Status.OK, 100).to_json(), decide, what="the commit of save 0")
        if Decision.from_json(answer).status is not Status.OK:
            raise RuntimeError("no decision")

    on_threads(world, save)
    out = {"save": totals(cs)}
    for c in cs:
        c.reset()

    def load(r: int) -> None:
        comm = cs[r]
        # rank 0 listed; every rank posts its host (the run journal's), as the loader does
        comm.agree({"steps": [100], "root": None, "host": "node-00000"} if r == 0 else {"host": f"node-{r:05d}"},
                   _coordinators)
        comm.agree(_outcome(None), _ready)  # a rank that took every entry sends no bitmap
        comm.agree(_outcome(None), _failures)

    on_threads(world, load)
    out["load"] = totals(cs)
    return out


def steady_commit(model: Model, layout: str, world: int, root: str, chunk_size: int = 16 * MiB,
                  step: int = 101) -> dict[str, Any]:
    """Rank 0's commit of a save after the first of a plan, at ``world`` ranks, run directly (what
    :func:`save_and_load` cannot reach on this machine): the coordinator holds the layout it learned
    (every rank's boxes as :func:`box` gives them; each 0-d ``step`` written by rank 0, as the plan
    packs them), every rank's summary is what :func:`ckpt.save.commit_index.summarize` makes of a report
    of its bytes in ``chunk_size`` chunks (made-up names), then :meth:`IndexBuilder.build`, the index
    checked as every reader checks it, and the create-only write. The summaries' JSON decoding in
    the commit round is not counted."""
    import math

    from ckpt.format import paths
    from ckpt.save.commit_index import IndexBuilder, commit_summarized
    from ckpt.storage.local import LocalStorage
    from ckpt.tree import digest, top_items

    tp = LAYOUTS[layout]
    template = flatten(state_of(model, layout, 0, min(world, 8 * tp)))
    plist = model.params()
    params = {f"model/{name}": (shape, split) for name, shape, split in plist}
    groups: dict[tuple, int] = {}  # (shape, split) -> layout id
    layouts: list[tuple] = []
    per_rank = [0] * world  # bytes each rank saves
    tensors = []
    steps = [k for k in template.tensors if k.endswith("/step")]
    for key in template.tensors:
        parts = key.split("/")
        spec = params[key] if parts[0] == "model" else None if parts[3] == "step" else plist[int(parts[2])][1:]
        if spec is None:  # a 0-d step: one shard, on rank 0
            lay = groups.setdefault(("step",), len(layouts))
            if lay == len(layouts):
                layouts.append(((0, ((), ())),))
            tensors.append((key, "float32", (), None, lay))
            continue
        shape, split = spec
        lay = groups.setdefault((shape, split), len(layouts))
        if lay == len(layouts):
            boxes: dict[tuple, int] = {}  # a box replicated over TP: written once, by its first rank
            for r in range(world):
                b = box(shape, split, r, world, tp)
                if math.prod(b[1]):
                    boxes.setdefault(b, r)
            layouts.append(tuple((r, b) for b, r in boxes.items()))
        for r, (_, lens) in layouts[lay]:
            per_rank[r] += 4 * math.prod(lens)
        tensors.append((key, "float32", tuple(shape), None, lay))
    builder = IndexBuilder()
    builder.tensors, builder.layouts = tensors, layouts
    builder.digests = [f"{r:032x}" for r in range(world)]
    tops = {k: digest(v) for k, v in top_items(template.structure)}
    own = mf.Manifest(step=step, kind="rank", rank=0, structure=template.structure, tensors=[], chunks={})
    step_chunk = fake_hash(0, 1 << 40)
    summaries = []
    for r in range(world):
        chunks = {fake_hash(r, i): [min(chunk_size, per_rank[r] - i * chunk_size),
                                    min(chunk_size, per_rank[r] - i * chunk_size) + HEADER_SIZE, "raw/1"]
                  for i in range(-(-per_rank[r] // chunk_size))}
        inline = {}
        if r == 0:
            chunks[step_chunk] = [64 * len(steps), 64 * len(steps) + HEADER_SIZE, "raw/1"]
            inline = {k: [[[step_chunk, 64 * i, 4]]] for i, k in enumerate(steps)}
        summaries.append({"size": 1000, "digest": f"{r:032x}", "layout": builder.digests[r], "tops": tops,
                          "values": {}, "stats": {"raw_bytes": per_rank[r], "chunks": len(chunks)},
                          "chunks": chunks, "spans": {}, "inline": inline})
    disk = CountingStorage(LocalStorage(root))

    def commit() -> None:
        assert commit_summarized(disk, builder, step, own, summaries, frozenset()) is not None  # reads no report

    t = time.thread_time()
    commit()
    cpu = time.thread_time() - t
    with Traced() as mem:
        try:
            commit()
        except StepExistsError:
            pass
    assert builder.learned == 0 and disk.calls["read_object"] == 0
    return {"n": world, "commit_s": cpu, "commit_peak_rss": mem.peak, "commit_read_bytes": disk.read_bytes,
            "manifest_bytes": disk.inner.size(paths.manifest_key(step)),
            "chunks": sum(len(s["chunks"]) for s in summaries),
            "summary_bytes": sum(len(json.dumps(s)) for s in summaries)}


def plan_layout(model: Model, layout: str, world: int, chunk_size: int = 16 * MiB) -> dict[str, Any]:
    """What the first save of a plan adds to rank 0's commit, run directly at ``world`` ranks: the
    step's layout from the plan of ranks alike (:func:`ckpt.save.commit_plan.from_plan`, with each rank's
    expected digest of its report's boxes). Every rank's plan post is what
    :func:`ckpt.save.planning.split` makes of its inventory (rank 0's top-level digests and layouts, the
    same on every rank here, with each rank's own rows: checked equal to :meth:`Inventory.of` on a
    few ranks); :func:`ckpt.save.planning_alike.assign_alike` plans them; then ``from_plan`` is timed."""
    import math

    from ckpt.flatten import tensor_of
    from ckpt.save.commit_plan import from_plan
    from ckpt.save.planning import InventoryRow, _digest, pack, split
    from ckpt.save.planning_alike import assign_alike

    ranks = Ranks(model, layout, world)
    inv0 = Inventory.of(ranks.template)
    posted: dict[int, dict] = {}
    known: dict[str, dict] = {}
    t0 = ranks.template
    fixed = {key: (tensor_of(key, leaf), leaf.kind, str(t0.tensors[key].dtype).removeprefix("torch."),
                   list(leaf.global_shape), t0.tensors[key].element_size()) for key, leaf in t0.leaves.items()}
    for r in range(world):
        rows = []
        for key, leaf in t0.leaves.items():
            name, kind, dtype, shape, size = fixed[key]
            p = ranks.params[key]
            offs, lens = leaf.box if p is None else box(p[0], p[1], r, world, LAYOUTS[layout])
            rows.append(InventoryRow(name, kind, dtype, shape, list(offs), list(lens), size * math.prod(lens)))
        inv = Inventory(inv0.tops, inv0.per_rank, rows, layouts=inv0.layouts)
        if r in (1, world - 1):
            assert inv == Inventory.of(ranks.flat(r)), r
        parts, own = split(inv)
        digests = {top: _digest(part) for top, part in parts.items()}
        if r == 0:
            known = {digests[top]: part for top, part in parts.items()}
        posted[r] = {"d": digests, "p": pack(own)}
    kept: list = []
    assert assign_alike(posted, known, world, chunk_size, kept) is not None
    del posted
    t = time.thread_time()
    got = from_plan(kept[0])
    cpu = time.thread_time() - t
    with Traced() as mem:
        from_plan(kept[0])
    assert got is not None and len(got.digests) == world
    return {"first_layout_s": cpu, "first_layout_peak": mem.peak, "layouts": len(got.layouts)}
