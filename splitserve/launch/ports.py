"""Free ports for the services of a stack: each gets an explicit one, so that its health can be
watched from the moment it starts."""

from __future__ import annotations

import socket


def free_port(host: str) -> int:
    """A port on `host` that was free just now (the OS's pick)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def new_port(host: str, taken: set[int]) -> int:
    """A free port not yet handed to another service of this stack."""
    while (port := free_port(host)) in taken:
        pass
    taken.add(port)
    return port


def new_ports(host: str, taken: set[int], count: int) -> int:
    """The first of `count` consecutive free ports not yet handed out."""
    while True:
        first = new_port(host, taken)
        rest = range(first + 1, first + count)
        if all(p not in taken and p <= 65535 and can_listen(host, p) for p in rest):
            taken.update(rest)
            return first


def can_listen(host: str, port: int) -> bool:
    """Whether `port` on `host` can be bound just now."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
