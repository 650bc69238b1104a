"""Nothing of a stack listens where it was not told to: with every service on 127.0.0.1 (the
default), NIXL/UCX included, /proc/net/tcp{,6} shows no listening socket of any of its
processes on another address."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest

from splitserve.client import collect, connect, stream
from splitserve.engine import SamplingParams
from splitserve.kv_transfer.nixl_ucx import bind_ucx_to, device_of
from tests.e2e.harness import running_stack
from tests.security.test_tls_and_up import _descendants

LISTEN = "0A"


def _address(local: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The address of /proc/net/tcp's "HEXADDR:PORT" (32-bit words in host byte order)."""
    raw = bytes.fromhex(local.split(":")[0])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def _loopback(local: str) -> bool:
    address = _address(local)
    mapped = getattr(address, "ipv4_mapped", None)  # NOTE: ::ffff:127.0.0.1 (a v6 socket)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def _listening(pids: list[int]) -> dict[int, list[str]]:
    """Per process: the local addresses ("HEXADDR:PORT") of its listening TCP sockets."""
    table: dict[int, str] = {}  # socket inode -> local address
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN:
                table[int(fields[9])] = fields[1]
    found: dict[int, list[str]] = {}
    for pid in pids:
        try:
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue  # NOTE: gone meanwhile
        inodes = [int(link[8:-1]) for link in links if link.startswith("socket:[")]
        found[pid] = [table[i] for i in inodes if i in table]
    return found


def test_proc_net_addresses_are_read_as_the_kernel_writes_them():
    assert str(_address("0100007F:1F90")) == "127.0.0.1"
    assert str(_address("00000000000000000000000001000000:1F90")) == "::1"
    assert _loopback("0000000000000000FFFF00000100007F:1F90")  # ::ffff:127.0.0.1
    assert not _loopback("00000000:1F90") and not _loopback("020200C0:1F90")  # 0.0.0.0, 192.0.2.2


def test_ucx_is_bound_to_the_hosts_device_unless_the_operator_chose():
    assert device_of("127.0.0.1") == device_of("localhost") == device_of("::1") == "lo"
    assert device_of("0.0.0.0") is None and device_of("gateway.example") is None
    env: dict[str, str] = {}
    assert bind_ucx_to("127.0.0.1", env) == "lo" and env == {"UCX_NET_DEVICES": "lo"}
    env = {"UCX_NET_DEVICES": "eth1"}
    assert bind_ucx_to("127.0.0.1", env) is None and env == {"UCX_NET_DEVICES": "eth1"}
    assert bind_ucx_to("0.0.0.0", env := {}) is None and env == {}


@pytest.mark.slow
def test_a_loopback_stack_listens_on_loopback_only_nixl_included(tiny_models):
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with running_stack(
        tiny_models["llama"], prefill=1, decode=1, kv_transport="nixl", http_port=0, metrics=True
    ) as stack:
        channel, gateway = connect(stack.address)
        with channel:  # NOTE: KV moved over NIXL first: UCX has opened what it opens
            done = collect(stream(gateway, list(range(20, 60)), params, timeout_s=60))
        assert len(done.token_ids[0]) == 4
        sockets = _listening(_descendants(os.getpid()))
        assert sum(len(s) for s in sockets.values()) >= 6  # gateway, workers, Redis, ...
        elsewhere = {
            pid: [str(_address(a)) for a in local if not _loopback(a)]
            for pid, local in sockets.items()
        }
        assert not any(elsewhere.values()), elsewhere
