"""The secrets of a stack that `splitserve up` starts: made fresh for each run, written to files
of a private directory (mode 0700, files 0600) whose paths the services get in their
environment (the same as the `--*-file` flags),
so that no secret is ever in a process's argv, and removed when the stack stops.

    up ── private dir: api-key, cluster-secret, redis-password
       ├── redis keeper (password in its environment) ── redis-server (requirepass on stdin)
       └── gateway, workers: SPLITSERVE_{API_KEY,CLUSTER_SECRET,REDIS_PASSWORD}_FILE
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field

from splitserve.runtime.secrets import new_secret, write_secret_file


@dataclass
class StackSecrets:
    """What one stack's services share; `service_env` tells each where to read it."""

    directory: str
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    cluster_secret: str = field(default="", repr=False)
    redis_password: str = field(default="", repr=False)
    _files: dict[str, str] = field(default_factory=dict, repr=False)

    @classmethod
    def create(
        cls, api_keys: tuple[str, ...] = (), cluster_secret: str = "", redis_password: str = ""
    ) -> StackSecrets:
        directory = tempfile.mkdtemp(prefix="splitserve-secrets-")  # NOTE: mode 0700
        made = cls(directory, api_keys, cluster_secret, redis_password)
        values = {
            "--api-key-file": "\n".join(api_keys),
            "--cluster-secret-file": cluster_secret,
            "--redis-password-file": redis_password,
        }
        for flag, value in values.items():
            if value:
                name = flag.strip("-").removesuffix("-file")
                made._files[flag] = str(write_secret_file(directory, name, value))
        return made

    @classmethod
    def fresh(
        cls,
        api_keys: tuple[str, ...],
        cluster_secret: bool | None,
        own_redis: bool,
        loopback: bool,
    ) -> StackSecrets:
        """New secrets for one run: a Redis password when Redis is started here, a cluster
        secret when asked for (None: beyond loopback, or with API keys)."""
        if cluster_secret is None:
            cluster_secret = bool(api_keys) or not loopback
        return cls.create(
            api_keys=api_keys,
            cluster_secret=new_secret() if cluster_secret else "",
            redis_password=new_secret() if own_redis else "",
        )

    def service_env(self, gateway: bool) -> dict[str, str]:
        """Where one service reads them: SPLITSERVE_*_FILE variables naming the files (the API
        keys go to the gateway only), so that its argv is the same with or without them."""
        env: dict[str, str] = {}
        for flag, path in self._files.items():
            if flag != "--api-key-file" or gateway:
                env["SPLITSERVE_" + flag.strip("-").replace("-", "_").upper()] = path
        return env

    def hidden(self) -> tuple[str, ...]:
        """Every secret value (to mask in anything printed)."""
        return (*self.api_keys, self.cluster_secret, self.redis_password)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
