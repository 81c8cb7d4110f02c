"""S3 (and S3-compatible servers) through s3fs, hardened for what object stores do.

On top of the generic fsspec backend this adds:

* **Retries we control.** Throttling (503 SlowDown, 429), 5xx, connection resets, timeouts and
  truncated bodies are retried with full-jitter exponential backoff, bounded both in attempts and in
  total time (``retry_deadline``). botocore's and s3fs's own retry loops are turned off so the bound
  holds: a server that went away turns into :class:`~ckpt.errors.StorageError` in bounded time.
  Every try ends: bodies go out without ``Expect: 100-continue`` (whose wait no timeout covered),
  and a try still under way when the deadline runs out is cancelled.
* **Parallel multipart uploads** for objects of at least ``multipart_threshold`` bytes that make
  two parts or more, parts sent by ``upload_concurrency`` threads; a failed upload is aborted, so no
  orphan parts stay billed. Smaller objects are one PUT.
* **Create-only commit and chunks.** One PUT of the whole manifest with ``If-None-Match: *`` after a
  HEAD: on a server that honours the header (AWS S3, moto) two committers cannot both win; on one that
  ignores it (rclone's ``serve s3`` at the time of writing) it degrades to check-then-put. New chunk
  objects are created the same way (``create``; a HEAD first only where the server ignores the header).
  :meth:`S3Storage.conditional_writes` probes which one a server is.
* **No listing on the commit path**: ``exists``/``size`` are HEAD requests, never fsspec's
  listing cache (which is also disabled).

ckpt-specific options are taken out of ``storage_options`` before the rest goes to s3fs:
``multipart_threshold`` (default 8 MiB), ``multipart_chunksize`` (default 8 MiB, at least 5 MiB),
``upload_concurrency`` (default 8), ``retry_deadline`` (seconds, default 60), ``max_attempts``
(default 10), ``connect_timeout`` / ``read_timeout`` (seconds, default 10 / 30).
"""

from __future__ import annotations

import builtins
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..errors import ConfigError, StorageError
from .base import RootState
from .remote import FsspecStorage

T = TypeVar("T")

log = logging.getLogger("ckpt")

MiB = 1 << 20
CKPT_OPTIONS = ("multipart_threshold", "multipart_chunksize", "upload_concurrency", "retry_deadline",
                "max_attempts", "connect_timeout", "read_timeout")
_RETRY_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests",
                "XAmzContentSHA256Mismatch", "BadDigest", "IncompleteBody"}


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        yield x
        x = x.__cause__ or x.__context__


def _client_error(e: BaseException):
    for x in _chain(e):
        if hasattr(x, "response") and isinstance(x.response, dict) and "Error" in x.response:
            return x
    return None


def is_retryable(e: BaseException) -> bool:
    """Throttling, 5xx, resets, timeouts: worth another try. 4xx (denied, missing, precondition) are not."""
    if _client_error(e) is not None:
        code, status = _status(e)
        return code in _RETRY_CODES or status >= 500 or status == 429 or code in ("500", "503", "429")
    for x in _chain(e):
        if isinstance(x, (FileNotFoundError, PermissionError, FileExistsError)):
            return False
        name = type(x).__name__
        if isinstance(x, (ConnectionError, TimeoutError)) or any(
                s in name for s in ("Connection", "Timeout", "Disconnected", "IncompleteRead", "ResponseParser",
                                    "PayloadError", "ServerDisconnected", "EndpointConnection", "HTTPClientError")):
            return True
    return False


def _lost_race(e: BaseException) -> bool:
    """A conditional write refused because another writer's object is there (or being written)."""
    code, status = _status(e)
    return status == 412 or code in ("PreconditionFailed", "ConditionalRequestConflict")


def _status(e: BaseException) -> tuple[str, int]:
    ce = _client_error(e)
    if ce is None:
        return "", 0
    return (str(ce.response.get("Error", {}).get("Code", "")),
            int(ce.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0))


class S3Storage(FsspecStorage):
    """Checkpoint storage on S3 or an S3-compatible server (``s3://bucket/prefix``)."""

    def __init__(self, url: str, storage_options: dict):
        opts = dict(storage_options)
        mine = {k: opts.pop(k) for k in CKPT_OPTIONS if k in opts}
        self.multipart_threshold = int(mine.get("multipart_threshold", 8 * MiB))
        self.part_size = int(mine.get("multipart_chunksize", 8 * MiB))
        self.upload_concurrency = int(mine.get("upload_concurrency", 8))
        self.retry_deadline = float(mine.get("retry_deadline", 60.0))
        self.max_attempts = int(mine.get("max_attempts", 10))
        if self.part_size < 5 * MiB:
            raise ConfigError(f"multipart_chunksize must be at least 5 MiB (S3's smallest part), got {self.part_size}")
        if self.upload_concurrency < 1 or self.max_attempts < 1 or not self.retry_deadline > 0:
            raise ConfigError(
                f"storage_options: upload_concurrency ({self.upload_concurrency}) and max_attempts "
                f"({self.max_attempts}) must be at least 1 and retry_deadline ({self.retry_deadline}) above 0 seconds")
        # Our retry loop is the only one, so its time bound is real.
        opts.setdefault("use_listings_cache", False)
        config = dict(opts.get("config_kwargs") or {})
        config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
        config.setdefault("connect_timeout", float(mine.get("connect_timeout", 10)))
        config.setdefault("read_timeout", float(mine.get("read_timeout", 30)))
        config.setdefault("max_pool_connections", max(32, 2 * self.upload_concurrency))
        # Plain checksums in headers, not aws-chunked bodies: every S3-compatible server accepts them.
        config.setdefault("request_checksum_calculation", "when_required")
        config.setdefault("response_checksum_validation", "when_required")
        opts["config_kwargs"] = config
        # A try that stalls where no socket timeout applies (a body the server never reads) is cut
        # when the deadline runs out, yet always gets this long: a connection and one read.
        self._read_timeout = float(config["read_timeout"] or 0) or 1.0
        self._try_floor = float(config["connect_timeout"] or 0) + self._read_timeout
        super().__init__(url, opts)
        self.fs.retries = 1  # s3fs's own retry loop (a class attribute): one try, ours retries
        _without_expect_continue(self.fs)
        bucket, _, prefix = self.root.partition("/")
        if not bucket:
            raise ConfigError(f"{url!r} names no bucket; use s3://bucket/prefix")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self._parts = ThreadPoolExecutor(self.upload_concurrency, thread_name_prefix="ckpt-s3-part")
        self._conditional: bool | None = None
        self._probing = threading.Lock()  # the first creates, from many threads, wait for one probe
        self._lock = threading.Lock()
        self._gave_up_at: float | None = None  # when a request last gave up on the server (monotonic)
        self.counters = {"retries": 0, "multipart": 0, "aborted": 0}

    def _s3key(self, key: str) -> str:
        self._path(key)  # the '..' guard
        return f"{self.prefix}/{key}" if self.prefix else key

    # -- the retry loop -------------------------------------------------------------------------
    def _call(self, what: str, key: str, method: str, _attempts: int | None = None, **kw: Any) -> Any:
        """One S3 call with jittered exponential backoff on retryable errors, bounded in time."""
        return self._retrying(what, key, lambda limit: self.fs.call_s3(method, timeout=limit, **kw), _attempts)

    def _retrying(self, what: str, key: str, once: Callable[[float], T], attempts: int | None = None) -> T:
        """``once(limit)`` until it succeeds, with full-jitter backoff on retryable errors: at most
        ``max_attempts`` tries, never sleeping past ``retry_deadline``, each try cancelled after
        ``limit`` seconds (what is left of the deadline, at least a connect and a read timeout). When
        one request gives up on the server, the others already retrying give up at their next try
        instead of each waiting out a deadline of its own: a save's failure time is bounded as a whole."""
        from fsspec.exceptions import FSTimeoutError

        max_attempts = attempts or self.max_attempts
        start = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            limit = max(self._try_floor, self.retry_deadline - (time.monotonic() - start))
            try:
                try:
                    return once(limit)
                except FSTimeoutError as e:  # says nothing by itself
                    raise TimeoutError(f"no complete answer within {limit:.1f}s (what was left of "
                                       "retry_deadline)") from e
            except Exception as e:  # classified below
                if not is_retryable(e):
                    raise
                now = time.monotonic()
                elapsed = now - start
                exhausted = attempt >= max_attempts or elapsed >= self.retry_deadline
                gave_up = self._gave_up_at
                if exhausted or (gave_up is not None and gave_up >= start):
                    with self._lock:
                        self._gave_up_at = now
                    why = (f"after {attempt} attempt(s) in {elapsed:.1f}s" if exhausted
                           else "another request to it just gave up")
                    raise StorageError(
                        f"{what} {self.url}/{key} failed ({why}): {type(e).__name__}: {e}. The server is "
                        "throttling, failing or unreachable; check it (and retry_deadline/max_attempts in "
                        "storage_options).") from e
                # full jitter: uniform in [0, min(cap, base·2^n)], never past the deadline
                delay = random.uniform(0, min(5.0, 0.05 * 2 ** attempt))
                delay = min(delay, max(0.0, self.retry_deadline - elapsed))
                with self._lock:
                    self.counters["retries"] += 1
                log.debug("%s %s: retry %d in %.2fs after %s", what, key, attempt, delay, e)
                time.sleep(delay)

    def _wrap(self, what: str, key: str, e: Exception) -> Exception:
        if isinstance(e, StorageError):
            return e
        code, status = _status(e)
        if status == 404 or code in ("NoSuchKey", "404", "NotFound") or isinstance(e, FileNotFoundError):
            return FileNotFoundError(f"{self.url}/{key}")
        return self._fail(what, key, e)

    # -- the surface ----------------------------------------------------------------------------
    def write(self, key: str, buffers: Sequence) -> int:
        return self._put(key, buffers, {})

    def create(self, key: str, buffers: Sequence) -> int:
        """One PUT (or the completion of a multipart upload) with ``If-None-Match: *``: on a server
        that honours it the first writer's object stays and the others get ``FileExistsError``. On
        one that ignores it (:meth:`conditional_writes`, asked once) a HEAD comes first, and two
        writers between the HEAD and the PUT both write, the last one's object staying."""
        views = [memoryview(b).cast("B") for b in buffers]
        multipart = self._multipart_for(sum(len(v) for v in views))
        # The probe is a single PUT: whether a server honours the condition on completing a
        # multipart upload is not known, so those ask first as well (the HEAD costs little beside parts).
        if (multipart or not self.conditional_writes()) and self.exists(key):
            raise FileExistsError(f"{self.url}/{key}")
        buffers = views
        try:
            return self._put(key, buffers, {"IfNoneMatch": "*"})
        except StorageError as e:
            if _lost_race(e):
                raise FileExistsError(f"{self.url}/{key}") from None
            raise

    def _put(self, key: str, buffers: Sequence, cond: dict) -> int:
        views = [memoryview(b).cast("B") for b in buffers]
        total = sum(len(v) for v in views)
        try:
            # A multipart upload of one part is a PUT with two more round trips (and, on some servers,
            # the object assembled again from its part): multipart only where parts go in parallel.
            if self._multipart_for(total):
                self._multipart(key, views, total, cond)
            else:
                self._call("writing", key, "put_object", Bucket=self.bucket, Key=self._s3key(key),
                           Body=_body(views, 0, total), **cond)
        except Exception as e:
            err = self._wrap("writing", key, e)
            raise err from e
        return total

    def _multipart_for(self, total: int) -> bool:
        return total >= self.multipart_threshold and total >= 2 * self.part_size

    def _multipart(self, key: str, views: list[memoryview], total: int, cond: dict) -> None:
        n = total // self.part_size
        size = -(-total // n)  # even parts of part_size to 2 × part_size: every one above S3's 5 MiB minimum
        s3key = self._s3key(key)
        up = self._call("starting multipart upload of", key, "create_multipart_upload", Bucket=self.bucket, Key=s3key)
        upload_id = up["UploadId"]
        with self._lock:
            self.counters["multipart"] += 1

        def part(i: int) -> dict:
            body = _body(views, i * size, min(total, (i + 1) * size))
            r = self._call(f"uploading part {i + 1}/{n} of", key, "upload_part", Bucket=self.bucket, Key=s3key,
                           UploadId=upload_id, PartNumber=i + 1, Body=body)
            return {"PartNumber": i + 1, "ETag": r["ETag"]}

        futures = [self._parts.submit(part, i) for i in range(n)]
        parts, first = [], None
        for f in futures:  # wait for all, so nothing is still uploading when we abort
            try:
                parts.append(f.result())
            except Exception as e:  # re-raised after the abort
                first = first or e
        try:
            if first is not None:
                raise first
            self._call("completing multipart upload of", key, "complete_multipart_upload", Bucket=self.bucket,
                       Key=s3key, UploadId=upload_id, MultipartUpload={"Parts": parts}, **cond)
        except Exception:
            self._abort(key, s3key, upload_id)
            raise

    def _abort(self, key: str, s3key: str, upload_id: str) -> None:
        try:  # an abort deserves a few tries even on a strict budget
            self._call("aborting multipart upload of", key, "abort_multipart_upload", Bucket=self.bucket,
                       Key=s3key, UploadId=upload_id, _attempts=max(self.max_attempts, 6))
            with self._lock:
                self.counters["aborted"] += 1
        except Exception as e:  # the upload error matters more; say what is left
            log.error("could not abort multipart upload %s of %s/%s (%s); its parts stay on the server "
                      "until aborted (e.g. by a bucket lifecycle rule for incomplete uploads)", upload_id,
                      self.url, key, e)

    def commit(self, key: str, data: bytes) -> None:
        if self.exists(key):  # check-then-put for servers that ignore If-None-Match
            raise FileExistsError(f"{self.url}/{key}")
        try:
            self._call("committing", key, "put_object", Bucket=self.bucket, Key=self._s3key(key), Body=bytes(data),
                       IfNoneMatch="*")
        except Exception as e:
            if _lost_race(e):
                raise FileExistsError(f"{self.url}/{key}") from None
            raise self._wrap("committing", key, e) from e

    def _head(self, key: str) -> dict:
        try:
            return self._call("stat of", key, "head_object", Bucket=self.bucket, Key=self._s3key(key))
        except Exception as e:
            raise self._wrap("stat of", key, e) from e

    def exists(self, key: str) -> bool:
        try:
            self._head(key)
            return True
        except FileNotFoundError:
            return False

    def size(self, key: str) -> int:
        return int(self._head(key)["ContentLength"])

    def mtime(self, key: str) -> float | None:
        t = self._head(key).get("LastModified")
        return t.timestamp() if t is not None else None

    def read(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        kw = {"Bucket": self.bucket, "Key": self._s3key(key)}
        if start or end is not None:
            kw["Range"] = f"bytes={start or 0}-{'' if end is None else end - 1}"
        try:
            if "Range" not in kw:
                return self._read_parallel(key, kw)
            return self._get(key, kw)
        except Exception as e:
            raise self._wrap("reading", key, e) from e

    def _get(self, key: str, kw: dict) -> bytes:
        # The body is read inside the retried call: a reset mid-body is retried like any other.
        def once(limit: float) -> bytes:
            t0 = time.monotonic()
            r = self.fs.call_s3("get_object", timeout=limit, **kw)
            # the body gets what is left of the try, and at least one read timeout
            return _read_body(self.fs, r, max(self._read_timeout, limit - (time.monotonic() - t0)))
        return self._retrying("reading", key, once)

    def _read_parallel(self, key: str, kw: dict) -> bytes:
        """Whole object: one GET when small, else ranged GETs in parallel (part-size ranges)."""
        size = int(self._call("stat of", key, "head_object", **kw)["ContentLength"])
        if size < 2 * self.part_size:
            return self._get(key, kw)
        ranges = [(a, min(size, a + self.part_size)) for a in range(0, size, self.part_size)]
        out = bytearray(size)
        def fetch(r):
            out[r[0]:r[1]] = self._get(key, {**kw, "Range": f"bytes={r[0]}-{r[1] - 1}"})
        list(self._parts.map(fetch, ranges))
        return bytes(out)

    def list(self, prefix: str) -> list[str]:
        """The names under ``prefix``, retried as every other request is: a listing meets the same resets,
        stalls and throttling (the first save's lease check lists, and its failure failed the save)."""
        return self._retrying("listing", prefix, lambda limit: super(S3Storage, self).list(prefix))

    def delete(self, key: str) -> None:
        try:
            self._call("deleting", key, "delete_object", Bucket=self.bucket, Key=self._s3key(key))
        except Exception as e:
            err = self._wrap("deleting", key, e)
            if isinstance(err, FileNotFoundError):
                return
            raise err from e

    def delete_many(self, keys: Sequence[str]) -> None:
        """DeleteObjects (the multi-object delete s3fs's ``rm`` sends), :attr:`delete_batch` keys a
        request, each request retried like any other, one after another in the order given."""
        for i in range(0, len(keys), self.delete_batch):
            batch = keys[i:i + self.delete_batch]
            objects = [{"Key": self._s3key(k)} for k in batch]
            try:
                r = self._call("deleting", batch[0], "delete_objects", Bucket=self.bucket,
                               Delete={"Objects": objects, "Quiet": True})
            except Exception as e:
                raise self._wrap("deleting", batch[0], e) from e
            errors = [e for e in r.get("Errors") or [] if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise StorageError(f"deleting {self.url}/{first.get('Key', '')} failed: {first.get('Code', '')} "
                                   f"{first.get('Message', '')} ({len(errors)} of {len(batch)} keys not deleted)")

    def multipart_uploads(self) -> builtins.list[dict]:
        """Multipart uploads started under this prefix and neither completed nor aborted."""
        r = self._call("listing multipart uploads of", "", "list_multipart_uploads", Bucket=self.bucket,
                       Prefix=self.prefix)
        return list(r.get("Uploads") or [])

    def conditional_writes(self) -> bool:
        """Does the server honour ``If-None-Match: *`` (true create-only)? Probed once, with a
        throwaway object under the prefix."""
        with self._probing:
            if self._conditional is None:
                self._conditional = self._probe_conditional()
            return self._conditional

    def _probe_conditional(self) -> bool:
        key = f".ckpt-probe-{uuid.uuid4().hex[:12]}"
        kw = {"Bucket": self.bucket, "Key": self._s3key(key), "Body": b"probe", "IfNoneMatch": "*"}
        try:
            for second in (False, True):
                try:
                    self._call("probing", key, "put_object", **kw)
                except Exception as e:
                    if second and _lost_race(e):
                        return True
                    raise self._wrap("probing", key, e) from e
            return False  # the second PUT replaced the first
        finally:
            try:
                self.delete(key)
            except StorageError as e:  # a bucket that lets us write but not delete: the answer stands
                log.warning("could not delete the probe object %s/%s (%s); delete it by hand", self.url, key, e)

    def root_state(self) -> RootState:
        """As for any fsspec URL, but a bucket that does not exist is an error, not a new run."""
        try:
            self._call("checking bucket", "", "head_bucket", Bucket=self.bucket)
        except Exception as e:
            code, status = _status(e)
            if status == 404 or code in ("NoSuchBucket", "404", "NotFound") or isinstance(e, FileNotFoundError):
                endpoint = (self.fs.client_kwargs or {}).get("endpoint_url", "AWS S3")
                raise StorageError(f"bucket {self.bucket!r} does not exist at {endpoint}: create it, or fix the "
                                   f"URL {self.url!r}") from e
            raise self._wrap("checking bucket", "", e) from e
        return super().root_state()

    def close(self) -> None:
        self._parts.shutdown(wait=False)


def _body(views: list[memoryview], start: int, end: int) -> bytes | bytearray:
    """Bytes ``start:end`` of the buffers laid end to end, copied once (botocore takes bytes, not
    views); a whole ``bytes`` or ``bytearray`` (a chunk read back from a local tier) is sent as it is."""
    pieces, pos = [], 0
    for v in views:
        a, b = max(start - pos, 0), min(end - pos, len(v))
        if a < b:
            pieces.append(v[a:b])
        pos += len(v)
        if pos >= end:
            break
    if len(pieces) == 1 and isinstance(pieces[0].obj, (bytes, bytearray)) and len(pieces[0]) == len(pieces[0].obj):
        return pieces[0].obj
    return b"".join(pieces)


def _drop_expect(params: dict, **_: Any) -> None:
    params.get("headers", {}).pop("Expect", None)


def _without_expect_continue(fs: Any) -> None:
    """Send PUT bodies straight away instead of asking ``Expect: 100-continue`` first.

    botocore asks it of every PutObject and UploadPart; aiohttp then holds the body until the server
    answers "100 Continue", and starts the read timeout only once the body is sent. A server that
    accepts the connection and never answers held a save forever, past read_timeout and
    retry_deadline. The hook goes on the session s3fs makes its clients from (a client copies the
    session's handlers when made), so every client it makes, now or after a reconnect, has it: s3fs
    keeps a session it did not make instead of making a new one. Registered last, after botocore's
    own handler has added the header."""
    from aiobotocore.session import AioSession

    session = fs.session if fs.session is not None else AioSession(**fs.kwargs)
    session.get_component("event_emitter").register_last("before-call.s3", _drop_expect,
                                                         unique_id="ckpt-no-expect-continue")
    fs.session = session
    fs._session_is_owned = False


def _read_body(fs, response, limit: float) -> bytes:
    from fsspec.asyn import sync

    async def read():
        async with response["Body"] as body:
            return await body.read()
    return sync(fs.loop, read, timeout=limit)
