"""The `redis-server` of `splitserve up`, kept in a session of its own.

A Ctrl-C at a terminal signals the whole foreground process group. The stack's services already
run in sessions of their own so that `up` can stop them in order (gateway, then workers, both
draining); Redis must outlive their drains too, so it is started by this small keeper process,
itself in a new session, which stops it on SIGTERM, or when `up` goes away (its stdin closes).

    splitserve up ──(stdin pipe)──▶ python -m splitserve.runtime.redis_keeper ──▶ redis-server
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

from splitserve.kv_transfer.redis_server import RedisServer

PASSWORD_ENV = "REDIS_PASSWORD"


class RedisKeeper:
    """A `RedisServer` in a keeper process; `url` once started, `stop()` to end both. With a
    `password`, Redis requires it (handed over in the keeper's environment, never argv); `url`
    does not hold it."""

    def __init__(self, startup_timeout_s: float = 30.0, password: str = "") -> None:
        env = {k: v for k, v in os.environ.items() if k != PASSWORD_ENV}
        if password:
            env[PASSWORD_ENV] = password
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.runtime.redis_keeper"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            env=env,
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if not line.startswith("redis://"):
            self.stop()
            raise RuntimeError(f"the Redis keeper did not start: {line!r}")
        self.url = line

    def terminate(self) -> None:
        """Ask the keeper to stop Redis and exit, without waiting (`stop` waits)."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the keeper; after `timeout_s`, SIGKILL its whole session (the keeper and its
        `redis-server`: a killed keeper cannot stop Redis itself)."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)  # NOTE: its own session: pgid = pid
                self._proc.wait()


def main() -> int:
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())

    def watch_parent() -> None:
        sys.stdin.read()  # NOTE: EOF when `up` exits for any reason, SIGKILL included
        done.set()

    threading.Thread(target=watch_parent, daemon=True).start()
    with RedisServer(password=os.environ.get(PASSWORD_ENV, "")) as server:
        print(server.url, flush=True)
        done.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
