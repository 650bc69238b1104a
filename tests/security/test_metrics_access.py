"""Who may read /metrics: on loopback anyone local (as before); off loopback only a scraper
that sends the cluster secret as a bearer token, on the address `--metrics-host` names (the
service's `--host` by default); and no service serves it off loopback without a cluster
secret unless told `--insecure`."""

from __future__ import annotations

import os
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import Counter

from splitserve.cli import main
from splitserve.runtime.metrics import Metrics
from splitserve.runtime.security import Security
from splitserve.runtime.settings import ServiceSettings
from tests.e2e.harness import running_stack

SECRET = "s3cret-cluster-0123456789"


def _scrape(url: str, token: str | None = None) -> int:
    """The HTTP status of GET `url` (with `Authorization: Bearer <token>` if given)."""
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert b"# HELP" in reply.read()
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_metrics_with_a_secret_answer_only_the_bearer_of_it():
    metrics = Metrics("tiny")
    Counter("splitserve:probe", "A series to read.", registry=metrics.registry).inc()
    port = _free_port()
    metrics.serve("127.0.0.1", port, secret=SECRET)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        assert _scrape(url) == 401
        assert _scrape(url, "not-the-secret") == 401
        assert _scrape(url, SECRET) == 200
    finally:
        metrics.close()


def test_metrics_ask_for_the_cluster_secret_off_loopback_only():
    member = Security(cluster_secret=SECRET)
    assert member.metrics_secret("127.0.0.1", 9100) == ""
    assert member.metrics_secret("::1", 9100) == ""
    assert member.metrics_secret("0.0.0.0", 9100) == SECRET
    assert member.metrics_secret("0.0.0.0", 0) == ""  # no /metrics at all
    with pytest.raises(ValueError, match="--metrics-host 127.0.0.1"):
        Security().metrics_secret("0.0.0.0", 9100)
    assert Security(insecure=True).metrics_secret("0.0.0.0", 9100) == ""


def test_the_metrics_host_defaults_to_the_services_host():
    service = ServiceSettings(model="m", redis_url="redis://x", host="10.0.0.5")
    assert service.metrics_bind_host == "10.0.0.5"
    other = ServiceSettings(model="m", redis_url="redis://x", metrics_host="127.0.0.1")
    assert other.metrics_bind_host == "127.0.0.1"


def _outside_address() -> str | None:
    """An address of this host that is not loopback (None if it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.123", 9))  # NOTE: UDP: nothing is sent
            address = sock.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


@pytest.mark.slow
def test_every_services_metrics_on_an_outside_metrics_host_need_the_cluster_secret(
    tiny_models,
):
    outside = _outside_address()
    if outside is None:
        pytest.skip("this host has no address but loopback")
    where = ("--metrics-host", outside)
    with running_stack(
        tiny_models["llama"], prefill=1, decode=1, metrics=True, api_keys=("key-0123456789",),
        worker_args=where, extra_gateway_args=where,
    ) as stack:  # fmt: skip
        assert stack.secrets is not None and stack.secrets.cluster_secret
        secret = stack.secrets.cluster_secret
        assert set(stack.metrics_ports) == {"gateway", "prefill-0", "decode-0"}
        for name, port in stack.metrics_ports.items():
            url = f"http://{outside}:{port}/metrics"
            assert _scrape(url) == 401, name
            assert _scrape(url, "a-guess") == 401, name
            assert _scrape(url, secret) == 200, name
            with pytest.raises(urllib.error.URLError):  # NOTE: not on --host (loopback)
                _scrape(f"http://127.0.0.1:{port}/metrics", secret)


@pytest.mark.slow  # NOTE: the command's imports take about 10 s on a loaded CPU
def test_a_service_refuses_metrics_off_loopback_without_a_cluster_secret(
    tiny_models, monkeypatch, capsys
):
    """Before it loads anything: exit code 2 and what to do, not a service open to anyone."""
    for name in [n for n in os.environ if n.startswith("SPLITSERVE_")]:
        monkeypatch.delenv(name)
    code = main(
        ["decode", "--model", str(tiny_models["llama"]), "--redis-url", "redis://127.0.0.1:1",
         "--metrics-host", "0.0.0.0", "--metrics-port", str(_free_port())]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert "/metrics would answer anyone on 0.0.0.0" in err and "--metrics-host 127.0.0.1" in err
