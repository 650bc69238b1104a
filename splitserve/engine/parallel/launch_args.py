"""What a follower rank is started with, as JSON on its command line (no pickle).

Only the engine's plain settings travel: what rank 0 alone uses (speculation: its proposer runs
on rank 0, and the target's verification step reaches followers as any step does) is left at
its default.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch

from splitserve.engine.config import EngineConfig, parse_dtype
from splitserve.engine.parallel.group import Rendezvous


@dataclass(frozen=True)
class FollowerArgs:
    model_dir: str
    config: EngineConfig
    rank: int
    rendezvous: Rendezvous

    def to_json(self) -> str:
        config = {
            f.name: getattr(self.config, f.name)
            for f in dataclasses.fields(self.config)
            if not dataclasses.is_dataclass(getattr(self.config, f.name))
        }
        config["dtype"] = str(self.config.dtype).removeprefix("torch.")
        return json.dumps(
            {
                "model_dir": self.model_dir,
                "config": config,
                "rank": self.rank,
                "rendezvous": dataclasses.asdict(self.rendezvous),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> FollowerArgs:
        raw = json.loads(text)
        config = dict(raw["config"])
        dtype: torch.dtype = parse_dtype(config.pop("dtype"))
        config = {k: _tuples(v) for k, v in config.items()}
        return cls(
            raw["model_dir"],
            EngineConfig(dtype=dtype, **config),
            int(raw["rank"]),
            Rendezvous(**raw["rendezvous"]),
        )


def _tuples(value: Any) -> Any:
    """JSON arrays back to the tuples the frozen config holds."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value
