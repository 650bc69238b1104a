"""What one request may ask for, checked at the gateway before any worker is involved.

Two kinds of bound: the gateway's own (a request id's length and characters, how many stop
strings and how long, how many stop token ids, a ceiling on `n`), and what the live workers
advertise in the registry (`WorkerInfo.max_num_seqs`, `.max_model_len`): a request must fit the
smallest of them, since any worker may be picked. A request outside them is refused with
INVALID_ARGUMENT and a short message that quotes only the start of what it got; workers check
again (their engine refuses `n > max_num_seqs`), so the advertised bounds speed refusals up but
nothing depends on them being fresh.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass

from splitserve.engine.errors import InvalidRequest, NotFound, quoted
from splitserve.gateway.validation import Job
from splitserve.kv_transfer.registry import WORKER_KINDS, Registry
from splitserve.protos.v1 import gateway_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestLimits:
    max_request_id_len: int = 256
    max_n: int = 1024  # whatever the workers advertise
    max_stop: int = 16  # stop strings per request
    max_stop_len: int = 256  # characters per stop string
    max_stop_token_ids: int = 256
    # The smallest any live worker advertises (None: none advertises one).
    worker_max_num_seqs: int | None = None
    worker_max_model_len: int | None = None
    # The LoRA adapters some live worker serves.
    adapters: frozenset[str] = frozenset()


def check_request(request: gateway_pb2.GenerateRequest, limits: RequestLimits) -> None:
    """The bounds that need no tokenizing: run first, so that hostile input costs little."""
    rid = request.request_id
    if len(rid) > limits.max_request_id_len:
        raise InvalidRequest(
            f"request_id has {len(rid)} characters; at most {limits.max_request_id_len} are "
            f"allowed (it starts {quoted(rid, 32)})"
        )
    if not all(" " <= c <= "~" for c in rid):
        raise InvalidRequest(
            f"request_id may hold printable ASCII characters only, got {quoted(rid, 32)}"
        )
    sampling = request.sampling
    if len(sampling.stop) > limits.max_stop:
        raise InvalidRequest(
            f"stop has {len(sampling.stop)} strings; at most {limits.max_stop} are allowed"
        )
    for i, stop in enumerate(sampling.stop):
        if len(stop) > limits.max_stop_len:
            raise InvalidRequest(
                f"stop[{i}] has {len(stop)} characters; at most {limits.max_stop_len} are "
                f"allowed (it starts {quoted(stop, 32)})"
            )
    if len(sampling.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequest(
            f"stop_token_ids has {len(sampling.stop_token_ids)} ids; at most "
            f"{limits.max_stop_token_ids} are allowed"
        )
    n_cap = min(limits.max_n, limits.worker_max_num_seqs or limits.max_n)
    if sampling.HasField("n") and sampling.n > n_cap:
        raise InvalidRequest(
            f"n is {sampling.n}; at most {n_cap} samples per request are allowed (no more than "
            "the workers run at once)"
        )
    max_model_len = limits.worker_max_model_len
    if (
        max_model_len is not None
        and request.WhichOneof("prompt") == "token_ids"
        and len(request.token_ids.ids) >= max_model_len
    ):
        raise InvalidRequest(
            f"prompt has {len(request.token_ids.ids)} tokens but the workers' context is "
            f"{max_model_len}, which leaves no room to generate"
        )


def check_adapter(adapter: str | None, limits: RequestLimits) -> None:
    """NotFound, naming it, for an adapter no live worker serves."""
    if adapter is not None and adapter not in limits.adapters:
        raise NotFound(f"LoRA adapter {quoted(adapter)} is not served by any live worker")


def check_job(job: Job, limits: RequestLimits) -> None:
    """The bounds on the validated request (its prompt tokenized) that the workers set."""
    max_model_len = limits.worker_max_model_len
    need = len(job.prompt_token_ids) + job.params.max_tokens
    if max_model_len is not None and need > max_model_len:
        raise InvalidRequest(
            f"prompt ({len(job.prompt_token_ids)} tokens) plus max_tokens "
            f"({job.params.max_tokens}) exceeds the workers' context of {max_model_len} tokens"
        )


class AdvertisedLimits:
    """`RequestLimits` with the live workers' bounds, re-read from the registry at most every
    `refresh_s` (blocking: call it in a thread). A registry that can't be read leaves the last
    bounds in place: workers check again."""

    def __init__(
        self, registry: Registry, base: RequestLimits | None = None, refresh_s: float = 1.0
    ) -> None:
        self.registry = registry
        self.refresh_s = refresh_s
        self._limits = base or RequestLimits()
        self._read_at = float("-inf")
        self._lock = threading.Lock()

    def current(self, fresh: bool = False) -> RequestLimits:
        """The bounds, read again if older than `refresh_s` (or if `fresh`: say, an adapter
        not seen yet, perhaps just loaded)."""
        if not fresh and time.monotonic() - self._read_at < self.refresh_s:
            return self._limits
        # NOTE: one reader at a time; the others go on with the bounds they have (unless they
        # asked for fresh ones: they wait for the reader).
        if not self._lock.acquire(blocking=fresh):
            return self._limits
        try:
            self._read_at = time.monotonic()
            workers = [w for kind in WORKER_KINDS for w in self.registry.live_workers(kind)]
        except Exception as exc:  # noqa: BLE001 - keep serving on the last bounds
            # NOTE: the registry client warns once per outage; not once per poll here too
            log.debug("could not read the workers' limits (%s); keeping the last ones", exc)
            return self._limits
        finally:
            self._lock.release()
        seqs = [w.max_num_seqs for w in workers if w.max_num_seqs]
        lens = [w.max_model_len for w in workers if w.max_model_len]
        self._limits = dataclasses.replace(
            self._limits,
            worker_max_num_seqs=min(seqs) if seqs else None,
            worker_max_model_len=min(lens) if lens else None,
            adapters=frozenset(a for w in workers for a in w.adapters),
        )
        return self._limits
