"""The checks themselves, on real gRPC servers on loopback (no model): API keys at a gateway-like
server, the cluster secret at a worker-like one and at a synchronous (KV receiver) one, request
ownership in the gateway's request table, secret files and URLs, and the refusal to serve a
non-loopback address unprotected."""

from __future__ import annotations

import asyncio
import os
import stat
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.engine.errors import Overloaded
from splitserve.gateway.key_limits import PerKeyInflight
from splitserve.gateway.requests import RequestTable
from splitserve.kv_transfer.cluster import CLUSTER_SECRET_KEY, MemberOnlyInterceptor
from splitserve.launch.up import StackSettings
from splitserve.protos.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from splitserve.runtime.auth import (
    ApiKeys,
    AuthInterceptor,
    Unauthenticated,
    authorize,
    caller,
    member_check,
    principal_of,
)
from splitserve.runtime.grpc_server import start_server
from splitserve.runtime.secrets import (
    read_lines_file,
    read_secret_file,
    redacted_url,
    with_redis_password,
)
from splitserve.runtime.security import Security, is_loopback
from splitserve.runtime.stack_secrets import StackSecrets

KEYS = ApiKeys(("alpha-key", "beta-key"))


def test_authorize_takes_only_a_configured_bearer_key():
    assert authorize({"authorization": "Bearer alpha-key"}, KEYS) == principal_of("alpha-key")
    assert authorize([("Authorization", "bearer beta-key")], KEYS) == principal_of("beta-key")
    for bad in ({}, {"authorization": "alpha-key"}, {"authorization": "Bearer alpha"},
                {"authorization": "Basic alpha-key"}, {"authorization": "Bearer "}):  # fmt: skip
        with pytest.raises(Unauthenticated):
            authorize(bad, KEYS)
    assert authorize({}, ApiKeys()) == ""  # no keys configured: everyone is anonymous
    assert "alpha-key" not in repr(KEYS) and "alpha-key" not in principal_of("alpha-key")


class _Worker(worker_pb2_grpc.DecodeWorkerServicer):
    async def GetStats(self, request, context):
        return worker_pb2.WorkerStats(num_requests=len(caller()))

    async def Abort(self, request, context):
        return common_pb2.AbortResponse(aborted=caller() == principal_of("alpha-key"))


@pytest.fixture
def keyed_server():
    server = start_server(
        lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_Worker(), s),
        ["splitserve.v1.DecodeWorker"],
        interceptors=[AuthInterceptor(KEYS.authorize)],
    )
    server.set_serving(True)
    yield server
    server.stop(0)


def test_the_interceptor_refuses_without_a_key_and_names_the_caller_with_one(keyed_server):
    with grpc.insecure_channel(f"127.0.0.1:{keyed_server.port}") as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        for metadata in (None, (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as err:
                stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5, metadata=metadata)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        alpha = (("authorization", "Bearer alpha-key"),)
        assert stub.Abort(common_pb2.AbortRequest(), timeout=5, metadata=alpha).aborted
        beta = (("authorization", "Bearer beta-key"),)
        assert not stub.Abort(common_pb2.AbortRequest(), timeout=5, metadata=beta).aborted
        # health stays open to anyone (load balancers, orchestrators)
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_worker_server_wants_the_cluster_secret():
    server = start_server(
        lambda s: worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_Worker(), s),
        ["splitserve.v1.DecodeWorker"],
        interceptors=[AuthInterceptor(member_check("s3cret"))],
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            for metadata in (None, ((CLUSTER_SECRET_KEY, "guess"),)):
                with pytest.raises(grpc.RpcError) as err:
                    stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5, metadata=metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stub.GetStats(
                worker_pb2.GetStatsRequest(), timeout=5, metadata=((CLUSTER_SECRET_KEY, "s3cret"),)
            )
    finally:
        server.stop(0)


def test_a_synchronous_server_refuses_non_members_before_the_handler():
    called = []

    class Sync(worker_pb2_grpc.DecodeWorkerServicer):
        def GetStats(self, request, context):
            called.append(1)
            return worker_pb2.WorkerStats()

    server = grpc.server(ThreadPoolExecutor(2), interceptors=[MemberOnlyInterceptor("s3cret")])
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(Sync(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = worker_pb2_grpc.DecodeWorkerStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert called == []
            good = ((CLUSTER_SECRET_KEY, "s3cret"),)
            stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5, metadata=good)
            assert called == [1]
    finally:
        server.stop(0)


def test_an_abort_reaches_only_its_owners_request():
    async def scenario() -> None:
        table = RequestTable()
        victim = table.claim("shared-id", owner="victim")
        assert not table.abort("shared-id", owner="stranger")
        assert not victim.aborted
        # a stranger's early abort of an id must not stop the victim's later request either
        table.release(victim)
        assert not table.abort("next-id", owner="stranger")
        assert not table.claim("next-id", owner="victim").aborted
        assert not table.abort("mine", owner="victim")
        assert table.claim("mine", owner="victim").aborted  # the owner's early abort holds
        assert table.abort("next-id", owner="victim")

    asyncio.run(scenario())


def test_secret_files_urls_and_masks(tmp_path):
    secrets = StackSecrets.create(("k1-zz", "k2-zz"), "cl-zz-9", "rp-zz-7")
    try:
        env = secrets.service_env(gateway=True)
        assert "SPLITSERVE_API_KEY_FILE" not in secrets.service_env(gateway=False)
        assert read_lines_file(env["SPLITSERVE_API_KEY_FILE"]) == ("k1-zz", "k2-zz")
        assert read_secret_file(env["SPLITSERVE_CLUSTER_SECRET_FILE"]) == "cl-zz-9"
        assert stat.S_IMODE(os.stat(env["SPLITSERVE_REDIS_PASSWORD_FILE"]).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(secrets.directory).st_mode) == 0o700
        assert not any(s in " ".join(env.values()) for s in secrets.hidden())
    finally:
        secrets.close()
    url = with_redis_password("redis://127.0.0.1:6379/0", "p@ss/word")
    assert url == "redis://:p%40ss%2Fword@127.0.0.1:6379/0"
    assert with_redis_password("rediss://h:1/0", "x").startswith("rediss://:x@h:1")
    assert redacted_url(url) == "redis://:***@127.0.0.1:6379/0"
    with pytest.raises(ValueError, match="empty"):
        (tmp_path / "empty").write_text("\n")
        read_secret_file(tmp_path / "empty")


def test_beyond_loopback_nothing_serves_unprotected():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")
    Security().check_exposure("127.0.0.1", gateway=True)
    with pytest.raises(ValueError, match="--api-key-file"):
        Security().check_exposure("0.0.0.0", gateway=True)
    with pytest.raises(ValueError, match="--cluster-secret-file"):
        Security().check_exposure("0.0.0.0", gateway=False)
    Security(api_keys=KEYS).check_exposure("0.0.0.0", gateway=True)
    Security(cluster_secret="s").check_exposure("0.0.0.0", gateway=False)
    Security(insecure=True).check_exposure("0.0.0.0", gateway=False)
    with pytest.raises(ValueError, match="--insecure"):
        StackSettings(host="0.0.0.0")
    StackSettings(host="0.0.0.0", insecure=True)
    StackSettings(host="0.0.0.0", api_keys=("k",))


def test_a_key_holds_at_most_its_share_of_requests():
    limit = PerKeyInflight(2)
    with limit.hold("a"), limit.hold("a"):
        with pytest.raises(Overloaded, match="--max-inflight-per-key"), limit.hold("a"):
            pass
        with limit.hold("b"):
            assert len(limit) == 3
    assert len(limit) == 0
    with limit.hold("a"):  # slots come back when requests end, failed ones included
        pass
    unlimited = PerKeyInflight(0)
    with unlimited.hold("a"), unlimited.hold("a"), unlimited.hold("a"):
        pass
