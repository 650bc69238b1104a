"""Security fixtures: the end-to-end ones (a real `redis-server` for the session, flushed per
test). Tests here play a stranger on the same network: a caller without the API key, a host
without the cluster secret, a client of Redis without its password; each attack must be refused
and leave the victims' requests as they would have been."""

from __future__ import annotations

import pytest

from splitserve.engine import LLM
from tests.e2e.conftest import redis_client, redis_server, registry
from tests.e2e.harness import running_stack
from tests.security.attack_setup import (
    ALICE,
    GREEDY,
    LONG,
    MALLORY,
    PER_CALLER,
    PROMPT,
    TOKENS_PER_MINUTE,
)

__all__ = ["redis_client", "redis_server", "registry"]


# NOTE: one stack for the attack tests of both files (test_attacks*.py); a module that
# defines its own `model_dir` or `stack` uses that one
@pytest.fixture(scope="package")
def model_dir(tiny_models):
    return tiny_models["llama"]


@pytest.fixture(scope="package")
def oracle(model_dir):
    llm = LLM(model_dir)
    outs = llm.generate([PROMPT, PROMPT], [GREEDY, LONG], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="package")
def stack(model_dir):
    with running_stack(
        model_dir, prefill=1, decode=1, kv_transport="grpc", api_keys=(ALICE, MALLORY),
        extra_gateway_args=("--max-inflight-per-key", "2",
                            "--max-tokens-per-minute-per-key", str(TOKENS_PER_MINUTE)),
        http_port=0,
        worker_args=("--max-reservations-per-caller", str(PER_CALLER)),
    ) as s:  # fmt: skip
        assert s.secrets is not None and s.secrets.cluster_secret  # on: API keys are given
        yield s
