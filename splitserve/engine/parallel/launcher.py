"""Rank 0's side of a tensor-parallel engine: it starts the follower ranks, sends them each
step's plan, watches that they live, and stops them.

    LLMEngine (rank 0: schedules, samples)
      ├── follower rank 1 (process) ┐ same forward on its shard, its own KV-cache shard
      └── follower rank N-1         ┘ (engine/parallel/follower.py)

Wherever rank 0's engine lives (an offline `LLM`, a worker's engine-core process), its
followers are its child processes: one per extra GPU, or gloo processes on the CPU. They are
started as `python -m splitserve.engine.parallel.follower` with their settings as JSON on the
command line: nothing is pickled, and the caller's `__main__` is not imported again.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import subprocess
import sys
import weakref
from pathlib import Path

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.errors import Unavailable
from splitserve.engine.parallel.group import Rendezvous, TorchGroup
from splitserve.engine.parallel.launch_args import FollowerArgs
from splitserve.engine.parallel.sharding import Shard
from splitserve.engine.parallel.step_plan import StepPlan, StepPlanChannel

log = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 10.0


class RankLost(Unavailable):
    """A tensor-parallel rank died: the engine can't run another step (UNAVAILABLE)."""


def rank_device(device: str, rank: int) -> str:
    """Rank `rank`'s device: the GPU `rank` after rank 0's (cuda:1 -> cuda:1, cuda:2, …; a
    bare "cuda" is the current GPU, where rank 0 runs); every rank on the CPU shares it."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return device
    first = dev.index if dev.index is not None else torch.cuda.current_device()
    return f"cuda:{first + rank}"


def check_devices(device: str, size: int) -> None:
    """Raise ValueError unless every rank gets a GPU of its own (CUDA_VISIBLE_DEVICES counts):
    a follower on a GPU that isn't there dies at start, and two ranks on one GPU would
    share its memory and FLOPs."""
    if torch.device(device).type != "cuda":
        return
    last = rank_device(device, size - 1)
    if int(last.split(":")[1]) >= torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size {size} from {device} needs GPUs {rank_device(device, 0)}.."
            f"{last}; this process sees {torch.cuda.device_count()}"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Followers:
    """The follower processes of one engine and the group rank 0 talks to them through."""

    def __init__(self, procs: list[subprocess.Popen[bytes]]) -> None:
        self.procs = procs
        self.group: TorchGroup | None = None
        self.channel: StepPlanChannel | None = None
        self._stopped = False

    @classmethod
    def start(cls, model_dir: str | Path, config: EngineConfig) -> Followers:
        """Start ranks 1..N-1 and join them in a group (blocks until every rank joined; raises
        RankLost at once if one dies first)."""
        size = config.tensor_parallel_size
        check_devices(config.device, size)
        rendezvous = Rendezvous("127.0.0.1", _free_port())
        procs = []
        for rank in range(1, size):
            rank_config = dataclasses.replace(config, device=rank_device(config.device, rank))
            args = FollowerArgs(str(model_dir), rank_config, rank, rendezvous)
            cmd = [sys.executable, "-m", "splitserve.engine.parallel.follower", args.to_json()]
            procs.append(subprocess.Popen(cmd))
        followers = cls(procs)
        # NOTE: an engine dropped without `shutdown` (or the interpreter exiting) still takes
        # its ranks down: they hold GPUs.
        weakref.finalize(followers, _kill, list(procs))
        device = torch.device(config.device)
        log.info("tensor-parallel: %d followers started; joining the group", size - 1)
        try:
            group = TorchGroup(
                Shard(0, size),
                rendezvous,
                device,
                followers.check,
                config.tensor_parallel_peer_all_reduce_bytes,
            )
        except BaseException:
            followers.kill()
            raise
        log.info(
            "tensor-parallel: %d ranks joined (%s%s)",
            size,
            group.backend,
            ", small all-reduces over peer memory" if group.peer_all_reduce else "",
        )
        followers.group = group
        followers.channel = StepPlanChannel(group, device)
        return followers

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def check(self) -> None:
        """Raise RankLost if a follower is gone."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                raise RankLost(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}; "
                    "this engine can't run another step"
                )

    def send(self, plan: StepPlan) -> None:
        """The step plan to every follower, after checking they are alive."""
        assert self.channel is not None
        self.check()
        try:
            self.channel.send(plan)
        except RuntimeError as exc:  # the backend's error when a peer vanished mid-call
            self.check()
            raise RankLost(f"tensor-parallel group failed: {exc}") from exc

    def shutdown(self) -> None:
        """Stop every follower (idempotent): a stop plan, then a kill for one that lingers."""
        if self._stopped:
            return
        self._stopped = True
        intact = all(p.poll() is None for p in self.procs)
        try:
            if self.channel is not None and intact:
                self.channel.send_stop()
        except RuntimeError:
            intact = False
            log.warning("tensor-parallel group broken at shutdown; killing followers")
        # NOTE: released with the followers, not after they exit: NCCL's destroy waits for
        # every rank of the host, so rank 0 waiting for their exit first while they wait in
        # theirs would deadlock. A broken group is aborted (it waits on no one).
        if self.group is not None:
            self.group.close(abort=not intact)
        for proc in self.procs:
            try:
                proc.wait(_JOIN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(_JOIN_TIMEOUT_S)

    def kill(self) -> None:
        self._stopped = True
        _kill(self.procs)


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(_JOIN_TIMEOUT_S)
