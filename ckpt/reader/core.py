"""Reading a checkpoint from Python, without a Checkpointer or a process group: ``ckpt.open``.

    import ckpt
    with ckpt.open("runs/exp1") as ck:            # a directory or any fsspec URL
        ck.steps()                                # [100, 200, 300]
        weights = ck.tensors(keys="model/")       # whole tensors, resharded from any world size
        ck.values()["step"]                       # plain values, as saved
        ck.load_into(state, "latest")             # in place, like Checkpointer.load, with no writer
        ck.ls().to_json()                         # what `ckpt ls --json` prints
        ck.verify(all=True).ok                    # every chunk re-read and re-hashed
        ck.export(300, "model.safetensors", keys="model/", strip_prefix=True)
        ck.export(300, "hf-model", format="hf", keys="model/", strip_prefix=True)  # shards + index
        ck.goodput().to_json()                    # starts, failures, goodput: what `ckpt goodput --json` prints

The ``ckpt`` command line is built on it: each command is one call here, formatted there. Nothing
here unpickles unless ``load_into`` is told to: a value saved with pickle comes back as a
:class:`Pickled` placeholder. Nothing here imports the writer, the commit protocol or the peers,
and neither does the load path it reads tensors through (tests/test_seams.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .._args import flag, flags
from ..errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, NotACheckpointError
from ..format import manifest as mf
from ..format import paths
from ..root_level import check_root_level
from ..storage import Storage, open_storage
from . import collect, listing
from .values import check_rank, key_prefixes, read_values, step_number
from .verify import VerifyResult, verify

if TYPE_CHECKING:  # tensors, diffs and exports import torch when first used: ls and inspect need none
    import torch

    from ..goodput import Goodput
    from .diff import Diff
    from .export import ExportResult

Step = int | str | None  # a step number, or None / "latest" for the newest committed step


class Reader:
    """A checkpoint root opened for reading. See :func:`open`.

    ``committed`` are the steps with a ``MANIFEST.json`` (ascending), ``incomplete`` the step
    directories without one (a save in progress, or one that never committed); both as of opening.
    Each manifest is read at most once.

    Args:
        url: a directory or fsspec URL, or an opened :class:`~ckpt.storage.base.Storage` used as it is.
        storage_options: passed to fsspec (and, for ``s3://``, ckpt's S3 options).
        threads: threads for reading and checking chunks.

    Raises:
        NotACheckpointError: nothing is there, or it holds no ckpt checkpoint.
        NotARootError: ``url`` is a level of a root (its ``steps/``, a step) or holds roots; it names the root
            meant.
    """

    def __init__(self, url: str | os.PathLike | Storage, storage_options: dict | None = None, *, threads: int = 8):
        if isinstance(url, Storage):  # an open storage (a node's local tier, a test's)
            self.storage = url
            self.url = url.describe()
        elif isinstance(url, (str, os.PathLike)):
            self.url = os.fspath(url)
            self.storage = open_storage(self.url, storage_options)
        else:
            raise ConfigError(f"a checkpoint URL must be a string or os.PathLike, got {url!r}")
        self.threads = threads
        storage = self.storage
        if storage.root_state() in ("missing", "file"):
            raise NotACheckpointError(f"{storage.describe()}: no such checkpoint directory")
        self.committed: list[int] = mf.committed_steps(storage)
        self.incomplete: list[int] = [s for s in mf.step_candidates(storage) if s not in set(self.committed)]
        if not self.committed and not self.incomplete and not storage.list(paths.CHUNKS) \
                and not storage.list(paths.JOURNAL):  # a run's journal alone: its first save never committed
            check_root_level(storage, self.url)  # a level of a root, or a directory of roots: name the root meant
            raise NotACheckpointError(f"{storage.describe()} holds no ckpt checkpoint (no steps, no chunks)")
        self.manifests = mf.ManifestCache(storage)

    # -- what is there -----------------------------------------------------------------------------
    def steps(self) -> list[int]:
        """The committed steps (as of opening).

        Returns:
            list[int]: ascending.
        """
        return list(self.committed)

    def latest(self) -> int | None:
        """The newest committed step (as of opening).

        Returns:
            int | None: None when nothing is committed.
        """
        return self.committed[-1] if self.committed else None

    def step(self, step: Step = None) -> int:
        """A committed step number.

        Args:
            step: a committed step number, or None / ``"latest"`` for the newest.

        Returns:
            int: the step.

        Raises:
            CheckpointNotFoundError: the step is not committed (or the root has none).
            CorruptCheckpointError: its manifest does not parse or check.
        """
        s = self._resolve(step)
        self.manifest(s)
        return s

    def manifest(self, step: Step = None) -> mf.Manifest:
        """The parsed, checked manifest of a committed step.

        Args:
            step: a committed step number, or None / ``"latest"`` for the newest.

        Returns:
            Manifest: its tensors (shards, chunks), structure and chunk table.

        Raises:
            CheckpointNotFoundError: the step is not committed.
            CorruptCheckpointError: its manifest does not parse or check.
        """
        s = self._resolve(step)
        if s not in self.committed:
            raise CheckpointNotFoundError(
                f"step {s} is not committed in {self.storage.describe()}; committed: "
                f"{', '.join(map(str, self.committed)) or 'none'}")
        m = self.find(s)
        if m is None:
            raise CorruptCheckpointError(f"step {s} is damaged: {self.errors[s]}", object=paths.manifest_key(s))
        return m

    def find(self, step: int) -> mf.Manifest | None:
        """The manifest of a committed step, or None if it is damaged (``errors`` says why).

        Args:
            step: a committed step number.

        Returns:
            Manifest | None: the manifest, None where it cannot be read.
        """
        return self.manifests.find(step)

    @property
    def errors(self) -> dict[int, str]:
        """Committed steps whose manifest cannot be read, and why (filled as manifests are read)."""
        return self.manifests.errors

    def _resolve(self, step: Step) -> int:
        if step is None or step == "latest":
            if not self.committed:
                raise CheckpointNotFoundError(f"{self.storage.describe()} has no committed step")
            return self.committed[-1]
        return step_number(step)

    def earlier_chunks(self, step: int) -> set[str]:
        """Chunks referenced by committed steps before ``step`` (damaged manifests count for nothing).
        A chunk of ``step`` is *new* if it is not in this set, *reused* otherwise.

        Args:
            step: a step number (committed or not).

        Returns:
            set[str]: the chunks' names (hex digests).
        """
        return set(self.chunk_holders(step))

    def chunk_holders(self, step: int) -> dict[str, int]:
        """For every chunk of the committed steps before ``step``, the newest of them holding it.

        Args:
            step: a step number (committed or not).

        Returns:
            dict[str, int]: chunk name -> step.
        """
        out: dict[str, int] = {}
        for s in self.committed:
            if s >= step:
                break
            m = self.find(s)
            if m is not None:
                out.update(dict.fromkeys(m.chunks, s))
        return out

    def rank_files(self, step: int) -> list[str]:
        """The rank reports in a step's directory (committed or not).

        Args:
            step: a step number.

        Returns:
            list[str]: their file names (``rank-00000.json`` …).
        """
        return [n for n in self.storage.list(paths.step_dir(step)) if n.startswith("rank-") and n.endswith(".json")]

    def chunk_count(self, steps: Sequence[int]) -> int:
        """How many distinct chunks the readable manifests of ``steps`` reference (what verify reads).

        Args:
            steps: step numbers; damaged or missing ones count for nothing.

        Returns:
            int: the number of distinct chunks.
        """
        return len({h for s in steps if (m := self.find(s)) is not None for h in m.chunks})

    # -- what `ckpt ls`, `ckpt inspect` and `ckpt gc` show --------------------------------------------
    def ls(self, *, verify: bool = False, local: Sequence[str] = (),
           progress: Callable[[int, int], None] | None = None) -> listing.Listing:
        """Every step: committed (time, world size, raw / stored / new bytes), damaged, incomplete.

        Args:
            verify: re-read and re-hash every chunk of every step.
            local: nodes' ``local_dir`` paths: also the steps committed only there, and where each step is held.
            progress: called as ``progress(chunks_done, bytes_done)`` while verifying.

        Returns:
            Listing: the steps; ``.to_json()`` is what ``ckpt ls --json`` prints.
        """
        flag("verify", verify)
        return listing.ls(self, verify=verify, local=local, progress=progress)

    def inspect(self, step: Step = None, *, keys: str | Sequence[str] | None = None) -> listing.Inspection:
        """One step in depth: tensors (group, shards, codecs, new and reused chunks, delta bases, and for
        optimizer state its parameter's key where the step recorded it), values, bytes per group.

        Args:
            step: a committed step number, or None / ``"latest"`` for the newest.
            keys: only tensors and values matching one (a glob with ``*?[``, else a prefix; optimizer state
                also by its parameter's key).

        Returns:
            Inspection: ``.to_json()`` is what ``ckpt inspect --json`` prints.

        Raises:
            CheckpointNotFoundError: the step is not committed.
        """
        return listing.inspect(self, self.step(step), [keys] if isinstance(keys, str) else keys)

    def gc(self, *, grace_s: float = 3600.0, keep_last: int | None = None, dry_run: bool = True,
           drop_after: int | None = None) -> collect.GcReport:
        """Garbage: orphan chunks, temporary files and incomplete steps older than ``grace_s``, and the
        steps ``keep_last`` or ``drop_after`` remove.

        Args:
            grace_s: only what is older than this many seconds counts as garbage (a save may be under way).
            keep_last: also the committed steps retention would remove, keeping the newest N.
            drop_after: also every committed step above this one (a rollback's abandoned steps).
            dry_run: only report (the default); ``False`` deletes.

        Returns:
            GcReport: what was (or would be) removed; ``.to_json()`` is what ``ckpt gc --json`` prints.
        """
        flag("dry_run", dry_run)
        plan = collect.plan(self, grace_s=grace_s, keep_last=keep_last, drop_after=drop_after)
        removed = plan.remove if dry_run else collect.run(self, plan)
        return collect.GcReport(self.url, plan, removed, dry_run)

    def goodput(self) -> Goodput:
        """What failures cost the run, from its journal (:mod:`ckpt.goodput` defines each figure).

        Returns:
            Goodput: the starts, the failures (mean time between them, per failure the work lost, the restart
            and the load), goodput and badput; ``.to_json()`` is what ``ckpt goodput --json`` prints.
        """
        from .. import journal
        from ..goodput import analyse

        return analyse(journal.read(self.storage))

    # -- contents ----------------------------------------------------------------------------------
    def tensors(self, step: Step = None, keys: str | Sequence[str] | None = None, *, rank: int = 0
                ) -> dict[str, torch.Tensor]:
        """Whole tensors of a step by key (``"model/0.weight"``), assembled from the shards of any world
        size, every chunk verified; only the chunks the keys need are read.

        Args:
            step: a committed step number, or None / ``"latest"`` for the newest.
            keys: names or key prefixes (``"model/"``) to read; None reads every tensor.
            rank: for per-rank tensors, the saved rank whose tensors to give.

        Returns:
            dict[str, torch.Tensor]: CPU tensors by key.

        Raises:
            ConfigError: no tensor matches ``keys``, or ``rank`` is not a saved rank.
            CorruptCheckpointError: a chunk fails its check.
        """
        m = self.manifest(step)
        wanted = key_prefixes(keys)
        check_rank(m, rank)
        entries = [t for t in m.tensors if (t.rank is None or t.rank == rank)
                   and (wanted is None or any(t.key == p or t.key.startswith(p) for p in wanted))]
        if wanted is not None and not entries:
            raise ConfigError(f"step {m.step} has no tensor named or starting with {wanted}; its keys begin "
                              f"{sorted({t.key.split('/', 1)[0] + '/' for t in m.tensors})}")
        with ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-read") as io:
            from .tensors import read_tensors

            return dict(zip([e.key for e in entries], read_tensors(self.storage, m, entries, io)))

    def values(self, step: Step = None, *, rank: int | None = None) -> dict[str, Any]:
        """The plain values of a step by key path: ``values(s)["step"]``,
        ``values(s)["optim/param_groups"][0]["lr"]`` (a list is one value). Pickled values are
        :class:`Pickled` placeholders, never unpickled.

        Args:
            step: a committed step number, or None / ``"latest"`` for the newest.
            rank: only this saved rank's per-rank values; None gives every rank's, with a ``[rank r]`` suffix.

        Returns:
            dict[str, Any]: values by key path.
        """
        return read_values(self, self.manifest(step), rank)

    def load_into(self, state: dict[str, Any], step: Step = None, *, strict: bool = True,
                  allow_pickle: bool = False, rank: int = 0, world: int = 1, staged: bool = True) -> int:
        """Load a committed step into ``state`` in place, as ``Checkpointer.load`` does, every chunk
        verified, as rank ``rank`` of ``world``. No writer, no leases, no process group.

        Args:
            state: the state to fill.
            step: a committed step number, or None / ``"latest"`` for the newest.
            strict: refuse keys missing on either side.
            allow_pickle: unpickle pickled values: only for checkpoints you trust.
            rank, world: the part of a sharded state this process takes (default: one process, everything).
            staged: read and verify everything before changing the state; ``False`` reads straight into the
                tensors (no staging copy, but a damaged chunk then leaves them half-loaded).

        Returns:
            int: the step loaded.

        Raises:
            ConfigError: ``rank`` is not a rank of ``world``.
            StateMismatchError: the state does not match the step (with ``strict``).
            CorruptCheckpointError: a chunk fails its check (with ``staged``, the state is unchanged).
        """
        flags(strict=strict, allow_pickle=allow_pickle, staged=staged)
        for name, n in (("world", world), ("rank", rank)):
            if isinstance(n, bool) or not isinstance(n, int):
                raise ConfigError(f"{name} must be an int, got {n!r}")
        if not 0 <= rank < world:
            raise ConfigError(f"rank={rank} is not a rank of world={world}: load as rank 0 to {world - 1} of "
                              f"{world} (the defaults, rank=0 and world=1, load everything into one process)")
        from .tensors import load_into

        m = self.manifest(step)
        with ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-read") as io:
            load_into(self.storage, m, state, strict=strict, allow_pickle=allow_pickle, io=io, rank=rank, world=world,
                      staged=staged)
        return m.step

    # -- checks and tools --------------------------------------------------------------------------
    def verify(self, step: Step = None, *, all: bool = False,
               progress: Callable[[int, int], None] | None = None) -> VerifyResult:
        """Re-read and re-hash every chunk of a step, or of every committed step.

        Args:
            step: a committed step number, or None / ``"latest"`` for the newest.
            all: every committed step instead.
            progress: called as ``progress(chunks_done, bytes_done)`` as chunks finish (of :meth:`chunk_count`).

        Returns:
            VerifyResult: ``ok``, and ``problems`` naming each damaged or missing object.
        """
        flag("all", all)
        steps = self.steps() if all else [self.step(step)]
        return verify(self, steps, threads=self.threads, progress=progress)

    def diff(self, a: Step, b: Step, *, max_diff: bool = False) -> Diff:
        """Tensors and values that differ between two steps (by chunk hashes where they decide it, else by
        bytes).

        Args:
            a, b: the steps (numbers, or ``"latest"``).
            max_diff: read changed tensors for their largest absolute difference.

        Returns:
            Diff: per tensor added / removed / changed / same (and how it was decided), and the values that
                differ.
        """
        flag("max_diff", max_diff)
        from .diff import diff

        return diff(self, self.step(a), self.step(b), max_diff=max_diff, threads=self.threads)

    def export(self, step: Step, path: str | os.PathLike, *, keys: str | Sequence[str] | None = None,
               strip_prefix: bool = False, rank: int = 0, overwrite: bool = False, format: str | None = None,
               dtype: str | None = None, max_shard_size: int | str | None = None,
               config: str | os.PathLike | None = None) -> ExportResult:
        """Write one step whole, resharded from any world size, every chunk verified:

        * ``format=None``: one file, the format from its suffix (``.safetensors``, ``.pt``);
        * ``format="hf"``: a directory of Hugging Face shards (``model-00001-of-00002.safetensors`` …
          and ``model.safetensors.index.json``; one shard is ``model.safetensors``), at most
          ``max_shard_size`` each (``"5GB"`` default, ``"500MB"``, ``"2GiB"``), one shard in memory at a time;
        * ``format="dcp"``: a plain ``torch.distributed.checkpoint`` directory.

        With ``keys`` and ``strip_prefix``, the matched prefix is taken off each name, so that
        ``model.load_state_dict(safetensors.torch.load_file(path))`` works as it is; ``dtype``
        (``"bf16"``, ``"fp16"``, ``"fp32"``) casts the floating tensors. ``format="hf"`` without
        ``keys`` exports the model's tensors (``model/``, prefix stripped), and writes ``config.json``
        from ``config`` (a JSON file, or the key of the model's config saved in the step; by
        default a ``config`` value of the step, else a warning)::

            ck.export("latest", "hf-out", format="hf", keys="model/", strip_prefix=True, dtype="bf16")

        Args:
            step: a committed step, or ``"latest"``.
            path: the file or directory to write.
            keys: names or key prefixes of the tensors to export (default: all; the model's for ``"hf"``).
            strip_prefix: take the matched prefix off each name.
            rank: for per-rank tensors, the saved rank whose tensors to export.
            overwrite: replace ``path`` if it exists (else :class:`~ckpt.ConfigError`).
            format: None (from the suffix), ``"hf"`` or ``"dcp"``.
            dtype: cast floating tensors: ``"bf16"``, ``"fp16"`` or ``"fp32"``.
            max_shard_size: for ``"hf"``: bytes per shard file, or ``"5GB"``-style sizes.
            config: for ``"hf"``: a JSON file, or the key of the model's config saved in the step.

        Returns:
            ExportResult: where, the tensors written (dtype and shape by name), their bytes, and the values
            written or skipped.

        Raises:
            ConfigError: a bad argument, ``path`` exists, or names the target format cannot hold.
            CorruptCheckpointError: a chunk fails its check (no half-written file is left at ``path``).
        """
        flags(strip_prefix=strip_prefix, overwrite=overwrite)
        from .export import export

        return export(self, self.step(step), os.fspath(path), prefixes=key_prefixes(keys),
                      strip_prefix=strip_prefix, rank=rank, overwrite=overwrite, threads=self.threads,
                      format=format, dtype=dtype, max_shard_size=max_shard_size,
                      config=None if config is None else os.fspath(config))

    def close(self) -> None:
        self.storage.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ckpt.open({self.url!r}): {len(self.committed)} committed step(s)"


def open(url: str | os.PathLike | Storage, storage_options: dict | None = None) -> Reader:  # only as ckpt.open
    """Open a checkpoint root for reading: steps, manifests, whole tensors, values, loading into a
    state, verify, diff, export, and what ``ckpt ls`` / ``inspect`` / ``gc`` show. ``url`` is a
    directory or any fsspec URL; ``storage_options`` go to fsspec (and, for ``s3://``, ckpt's S3
    options); or ``url`` is an opened :class:`~ckpt.storage.base.Storage` (a test's faulty disk), used
    as it is.

    Args:
        url: a directory, an fsspec URL, or an opened storage.
        storage_options: passed to fsspec (and, for ``s3://``, ckpt's S3 options).

    Returns:
        Reader: the root opened for reading (also a context manager that closes it).

    Raises:
        NotACheckpointError: nothing is there, or it is not a ckpt root (:class:`~ckpt.NotARootError` names
            the root meant when ``url`` is a level of one).
    """
    return Reader(url, storage_options)
