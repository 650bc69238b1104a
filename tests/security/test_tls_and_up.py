"""TLS with real certificates made here (a CA, a server certificate for 127.0.0.1 and
localhost), API keys end to end, `splitserve up` keeping its secrets out of argv and logs, and
the refusal to serve a non-loopback address unprotected."""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from splitserve.client import collect, connect, stream
from splitserve.engine import LLM, SamplingParams
from tests.e2e.harness import running_stack

pytestmark = pytest.mark.slow

KEY = "tls-test-key-5f1c2a9e"
PROMPT = list(range(20, 50))
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate it signed for 127.0.0.1 and localhost: (CA file, the
    server's chain file, the server's key file)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("splitserve test CA"))
        .issuer_name(_name("splitserve test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(_name("localhost"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    ca_file, chain_file, key_file = directory / "ca.pem", directory / "chain.pem", directory / "k"
    ca_file.write_bytes(ca.public_bytes(pem))
    chain_file.write_bytes(server.public_bytes(pem) + ca.public_bytes(pem))
    key_file.write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    key_file.chmod(0o600)
    return ca_file, chain_file, key_file


def test_tls_and_an_api_key_end_to_end(tiny_models, tmp_path):
    model = tiny_models["llama"]
    expected = LLM(model).generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    ca_file, chain_file, key_file = make_certificates(tmp_path)
    ca = ca_file.read_bytes()
    with running_stack(
        model, prefill=1, decode=1, kv_transport="grpc", api_keys=(KEY,),
        tls_cert_file=str(chain_file), tls_key_file=str(key_file),
    ) as stack:  # fmt: skip
        channel, stub = connect(stack.address, KEY, ca)
        with channel:
            done = collect(stream(stub, PROMPT, GREEDY, timeout_s=60))
        assert done.token_ids[0] == expected
        # TLS alone is not a key; a key without TLS does not reach a TLS port
        channel, stub = connect(stack.address, None, ca)
        with channel, pytest.raises(grpc.RpcError) as err:
            collect(stream(stub, PROMPT, GREEDY, timeout_s=30))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        channel, stub = connect(stack.address, KEY)
        with channel, pytest.raises(grpc.RpcError) as err:
            collect(stream(stub, PROMPT, GREEDY, timeout_s=10))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        # the command line client: the key from the environment, the CA from a file
        cli = subprocess.run(
            [sys.executable, "-m", "splitserve.cli", "generate", "hello", "--address",
             stack.address, "--tls-ca-file", str(ca_file), "--max-tokens", "4"],
            env={**os.environ, "SPLITSERVE_API_KEY": KEY},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert cli.returncode == 0, cli.stderr
        assert "4 generated" in cli.stderr


def _descendants(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid]
        found += children
        frontier += children
    return found


def _environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(p.split("=", 1) for p in pairs if "=" in p)


def _argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_up_keeps_every_secret_out_of_argv_and_logs(tiny_models, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"# the gateway's keys\n{KEY}\n")
    log = tmp_path / "up.log"
    env = {**os.environ, "SPLITSERVE_LOG_LEVEL": "INFO"}
    with open(log, "w") as out:
        up = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "up", "--model", str(tiny_models["llama"]),
             "--prefill", "0", "--api-key-file", str(keys)],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while "press Ctrl-C" not in log.read_text():
            assert up.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        banner = log.read_text()
        address = banner.split("serving on ", 1)[1].split()[0]
        pids = _descendants(up.pid)
        argvs = {pid: _argv(pid) for pid in pids}
        gateway = next(p for p, a in argvs.items() if a[3:4] == ["gateway"])
        cluster_secret = Path(_environ(gateway)["SPLITSERVE_CLUSTER_SECRET_FILE"]).read_text()
        keeper = next(p for p, a in argvs.items() if "splitserve.runtime.redis_keeper" in a)
        secrets = [KEY, cluster_secret.strip(), _environ(keeper)["REDIS_PASSWORD"]]
        assert all(len(s) >= 16 for s in secrets)
        assert len(pids) >= 4  # a decode worker, the gateway, the keeper, redis-server
        for pid, argv in argvs.items():
            assert not [s for s in secrets if s in " ".join(argv)], (pid, argv)

        channel, stub = connect(address, KEY)
        with channel:
            collect(stream(stub, PROMPT, GREEDY, timeout_s=60))
        assert "no API key" not in banner and "redis://:***@" in banner
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(60)
    text = log.read_text()
    assert "stopped" in text
    assert not [s for s in secrets if s in text]


def test_loopback_up_says_it_serves_without_a_key_and_other_hosts_refuse(tmp_path):
    cli = [sys.executable, "-m", "splitserve.cli"]
    refused = subprocess.run(
        [*cli, "up", "--host", "0.0.0.0"], capture_output=True, text=True, timeout=120
    )
    assert refused.returncode == 2 and "--insecure" in refused.stderr, refused.stderr
    for service in ("gateway", "decode"):
        refused = subprocess.run(
            [*cli, service, "--host", "0.0.0.0", "--redis-url", "redis://127.0.0.1:1/0",
             "--model", str(tmp_path)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert refused.returncode == 2, refused.stderr
        assert "--insecure" in refused.stderr, refused.stderr
