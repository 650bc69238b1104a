"""What the attack tests share: the stack's API keys and limits, the victims' prompts and
sampling, and small helpers (their stack and oracle are fixtures in conftest.py)."""

from __future__ import annotations

import grpc
import pytest

from splitserve.engine import SamplingParams
from splitserve.kv_transfer.registry import WorkerInfo
from tests.e2e.harness import workers

ALICE, MALLORY = "alice-key-0123456789", "mallory-key-9876543210"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = list(range(10, 74))  # 64 tokens: 4 full blocks, the prefix of the attack
LONG = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)
# NOTE: held until cancelled: on a busy host one 160-token hog could end before the other's
# first token came
HOG = SamplingParams(temperature=0, max_tokens=1800, ignore_eos=True)
PER_CALLER = 4  # --max-reservations-per-caller of the decode worker
TOKENS_PER_MINUTE = 20_000  # --max-tokens-per-minute-per-key: ample for every other test here


def worker_of(stack, kind: str) -> WorkerInfo:
    return next(w for w in workers(stack) if w.kind == kind)


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()
