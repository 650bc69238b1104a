"""UCX (NIXL's backend) bound to the worker's `--host`: by default UCX listens on every network
device, whatever address the worker was told to serve. Before NIXL starts (in the worker's
process, so that its engine core inherits it), `UCX_NET_DEVICES` is set to the device that holds
`--host`: `lo` for a loopback host, the device with that address for another one. A wildcard
host (0.0.0.0, ::), a name, or an operator's own UCX_NET_DEVICES leaves UCX as it is."""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import MutableMapping

log = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915  # NOTE: Linux: the IPv4 address of a device


def device_of(host: str) -> str | None:
    """The network device that holds `host` (an IP address), or None (a wildcard, a name, an
    address no device holds, a platform without the ioctl)."""
    try:
        address = ipaddress.ip_address("127.0.0.1" if host == "localhost" else host.strip("[]"))
    except ValueError:
        return None
    if address.is_unspecified:
        return None
    for _, name in socket.if_nameindex():
        if address.is_loopback and name == "lo":
            return name
        if address.version == 4 and _ipv4_of(name) == address:
            return name
    return None


def _ipv4_of(device: str) -> ipaddress.IPv4Address | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            raw = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", device.encode()))
        except OSError:
            return None
    return ipaddress.IPv4Address(raw[20:24])


def bind_ucx_to(host: str, env: MutableMapping[str, str] = os.environ) -> str | None:
    """Set UCX_NET_DEVICES in `env` to `host`'s device (returned); None when left as it is."""
    if env.get("UCX_NET_DEVICES"):
        return None  # NOTE: the operator chose
    device = device_of(host)
    if device is None:
        log.info("UCX (NIXL) listens on every device: --host %s names none of them", host)
        return None
    env["UCX_NET_DEVICES"] = device
    return device
