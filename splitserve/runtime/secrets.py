"""Secrets come from files or the environment, never from the command line (anyone on the host
can read a process's argv in /proc), and are never printed.

    --api-key-file, --cluster-secret-file, --redis-password-file, --tls-key-file: a file each
    SPLITSERVE_API_KEYS, SPLITSERVE_CLUSTER_SECRET, REDIS_PASSWORD: or the environment

`splitserve up` makes fresh ones (`new_secret`) and hands them to its services in files of a
private directory (`write_secret_file`, mode 0600) or in their environment.
"""

from __future__ import annotations

import os
import secrets
import urllib.parse
from collections.abc import Iterable
from pathlib import Path

MASK = "***"


def new_secret(num_bytes: int = 32) -> str:
    """An unguessable secret, printable (URL-safe base64)."""
    return secrets.token_urlsafe(num_bytes)


def read_secret_file(path: str | os.PathLike[str], what: str = "secret") -> str:
    """The file's content without surrounding whitespace; an error that names the file, never
    its content, when it is missing or empty."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} file {path}: {exc.strerror or exc}") from None
    if not text:
        raise ValueError(f"the {what} file {path} is empty")
    return text


def read_lines_file(path: str | os.PathLike[str], what: str = "key") -> tuple[str, ...]:
    """One value per line (blank lines and `#` comments skipped), e.g. an API key file."""
    lines = read_secret_file(path, what).splitlines()
    return tuple(s for line in lines if (s := line.strip()) and not s.startswith("#"))


def split_list(text: str | None) -> tuple[str, ...]:
    """A comma- or newline-separated list from one environment variable."""
    if not text:
        return ()
    return tuple(s for part in text.replace("\n", ",").split(",") if (s := part.strip()))


def write_secret_file(directory: str | os.PathLike[str], name: str, value: str) -> Path:
    """Write `value` to `directory/name`, readable by this user only."""
    path = Path(directory) / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(value + "\n")
    return path


def mask(text: str, hidden: Iterable[str]) -> str:
    """`text` with every non-empty secret in `hidden` replaced by `***`."""
    for secret in hidden:
        if secret:
            text = text.replace(secret, MASK)
    return text


def with_redis_password(url: str, password: str) -> str:
    """`url` with `password` (and, when the URL names none, the default user) put in, for
    redis-py; the URL stays in memory only. `rediss://` (TLS) URLs keep their scheme."""
    if not password:
        return url
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"a Redis password needs a redis:// or rediss:// URL, got {parts.scheme}")
    host = parts.hostname or "127.0.0.1"
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port else host
    user = urllib.parse.quote(parts.username or "", safe="")
    secret = urllib.parse.quote(password, safe="")
    return urllib.parse.urlunsplit(
        (parts.scheme, f"{user}:{secret}@{netloc}", parts.path, parts.query, parts.fragment)
    )


def redacted_url(url: str) -> str:
    """A Redis URL fit to print: any password in it replaced by `***`."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urllib.parse.urlunsplit(
        (parts.scheme, f"{user}:{MASK}@{netloc}", parts.path, parts.query, parts.fragment)
    )
