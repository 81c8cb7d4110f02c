"""Helpers to test code that uses ckpt with real parts instead of mocks.

* :func:`run_ranks` runs a function on real ``torch.distributed`` ranks (gloo on 127.0.0.1), one
  process each, and returns what every rank returned.
* :class:`RcloneS3` and :class:`MotoS3` start real S3-compatible servers on loopback;
  :class:`FaultProxy` sits in front of one and breaks connections (503 SlowDown, resets, stalls)
  or holds them to a bandwidth (``rate=``, a :class:`TokenBucket` each way);
  :func:`storage_options` gives the options that reach them.
* :class:`FaultyStorage` wraps any :class:`~ckpt.storage.base.Storage` and makes chosen calls fail,
  counting every call, so a test can show what ckpt does when the disk or the store says no.

ckpt's own tests and benchmarks use these; so can the tests of a training script. Everything optional
is imported only by the function that needs it (moto and boto3 when a moto server starts, the rclone
binary when an rclone server starts), so ``import ckpt.testing`` works on a plain install::

    from ckpt.testing import FaultyStorage
    from ckpt.storage import LocalStorage

    disk = FaultyStorage(LocalStorage(tmp_path))
    disk.fail("write", key=r"^chunks/", nth=2)   # the second chunk write raises StorageError
"""

from __future__ import annotations

from .faults import FaultyStorage, Gate, Rule
from .ranks import run_ranks
from .s3 import FaultProxy, MotoS3, RcloneS3, TokenBucket, free_port, storage_options, wait_port

__all__ = ["FaultyStorage", "Gate", "Rule", "run_ranks", "RcloneS3", "MotoS3", "FaultProxy", "TokenBucket",
           "free_port", "wait_port", "storage_options"]
