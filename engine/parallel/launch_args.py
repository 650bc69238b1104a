"""What a follower rank is started with, as JSON on its command line (no pickle)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

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
        config = dataclasses.asdict(self.config)
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
        return cls(
            raw["model_dir"],
            EngineConfig(dtype=dtype, **config),
            int(raw["rank"]),
            Rendezvous(**raw["rendezvous"]),
        )
