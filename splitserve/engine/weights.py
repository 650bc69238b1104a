"""Building the model and loading its weights from safetensors checkpoints (one file, or shards
listed in an index)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from splitserve.engine import moe, quantization
from splitserve.engine.config import EngineConfig
from splitserve.engine.gguf_cache import resolve_checkpoint
from splitserve.engine.model import CausalLM
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.parallel import sharding
from splitserve.engine.parallel.group import ParallelGroup
from splitserve.engine.platform import Platform

Select = Callable[[str, Any], torch.Tensor]
"""(name, safetensors slice) -> the part of that tensor to load (a tensor-parallel rank's)."""

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files that make up the checkpoint, checked to exist."""
    root = Path(model_dir)
    index = root / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index}: no weight_map")
        files = [root / name for name in sorted(set(weight_map.values()))]
    elif (root / SINGLE_FILE).is_file():
        files = [root / SINGLE_FILE]
    else:
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise ValueError(
                f"{str(root)!r} has no weights: expected {SINGLE_FILE} or {INDEX_FILE} "
                "(pickled .bin checkpoints are not loaded)"
            )
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise ValueError(f"{str(root)!r}: shard(s) listed in {INDEX_FILE} are missing: {absent}")
    return files


def iter_tensors(
    model_dir: str | Path, select: Select | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor in the checkpoint, one shard at a time; with
    `select`, only the part of each tensor it picks is read from the file."""
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if select is None:
                    yield name, f.get_tensor(name)
                else:
                    yield name, select(name, f.get_slice(name))


def load_weights(
    model: torch.nn.Module,
    model_dir: str | Path,
    *,
    tied_lm_head: bool,
    select: Select | None = None,
    model_cfg: ModelConfig | None = None,
) -> None:
    """Copy checkpoint tensors into `model`'s parameters; raise ValueError on any mismatch.

    Every parameter must be filled exactly once (except a tied `lm_head`, which shares the
    embedding), and every checkpoint tensor must land somewhere, so a wrong architecture or a
    truncated checkpoint fails here with the names that are wrong. With `model_cfg`, what the
    family stores differently is put right: Mixture-of-Experts tensors into the stacked expert
    parameters (engine/moe.py), Gemma's norm weights plus their offset.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: dict[str, int] = {}  # parameter -> elements filled so far
    parts: set[tuple[str, str]] = set()
    unexpected: list[str] = []
    experts = None
    if model_cfg is not None and model_cfg.moe is not None:
        experts = moe.CheckpointReader(model_cfg, next(iter(params.values())).dtype)
    for name, tensor in iter_tensors(model_dir, select):
        # Tied checkpoints sometimes still store a copy of the embedding as lm_head.
        if name.endswith("rotary_emb.inv_freq") or (tied_lm_head and name == "lm_head.weight"):
            continue
        for target, index, part in _targets(name, tensor, model_cfg, experts):
            param = params.get(target)
            if param is None:
                unexpected.append(name)
                continue
            if target.endswith(("weight_scale", "input_scale")):  # FP8: engine/quantization.py
                part = quantization.checkpoint_scale(target, part, param.shape[0])
            dest = param.data[index] if index else param.data
            if (target, repr(index)) in parts:
                raise ValueError(f"checkpoint in {str(model_dir)!r}: {name!r} is stored twice")
            if tuple(dest.shape) != tuple(part.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(part.shape)} in the checkpoint but the "
                    f"config implies {tuple(dest.shape)}"
                )
            with torch.no_grad():
                dest.copy_(part.to(param.dtype))
            parts.add((target, repr(index)))
            filled[target] = filled.get(target, 0) + dest.numel()
    if experts is not None:
        unexpected += [
            f"{name}_blocks/_scales (one without the other)" for name in experts.unpaired()
        ]
    loaded = {name for name, n in filled.items() if n == params[name].numel()}
    missing = sorted(set(params) - loaded - ({"lm_head.weight"} if tied_lm_head else set()))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint in {str(model_dir)!r} does not match the config: "
            f"missing {missing[:8]}{'…' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'…' if len(unexpected) > 8 else ''}"
        )


def _targets(
    name: str, tensor: torch.Tensor, cfg: ModelConfig | None, experts: moe.CheckpointReader | None
) -> list[moe.Target]:
    """(parameter, index within it, tensor) for the checkpoint tensor `name`; none for a
    DeepSeek multi-token-prediction layer (an index past the decoder's layers)."""
    if cfg is not None and cfg.mla is not None and _layer_index(name) >= cfg.num_layers:
        return []
    if experts is not None:
        found = experts.targets(name, tensor)
        if found is not None:
            return found
    if cfg is not None and cfg.norm_offset and name.endswith("norm.weight"):
        tensor = tensor.float() + cfg.norm_offset  # Gemma stores norm weights as w - 1
    return [(name, (), tensor)]


def _layer_index(name: str) -> int:
    """The decoder layer `name` belongs to; -1 if none."""
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return -1


@torch.no_grad()
def fill_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights of the right shapes (norm weights 1): for benchmarks of large shapes.

    Drawn in float32 and then cast, so models of one shape and seed in different dtypes hold
    the same weights (rounded): accuracy comparisons across dtypes need that."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            drawn = torch.empty(param.shape, device=param.device, dtype=torch.float32)
            param.copy_(drawn.normal_(0.0, 0.02, generator=gen))


def load_model(
    model_dir: str | Path,
    model_cfg: ModelConfig,
    config: EngineConfig,
    platform: Platform,
    group: ParallelGroup | None = None,
) -> CausalLM:
    """Build the transformer for `model_cfg` and fill it from the checkpoint's safetensors.

    With a tensor-parallel `group`, this rank's shard of it: each rank reads only its slices
    of the checkpoint (engine/parallel/sharding.py)."""
    model_dir = resolve_checkpoint(model_dir)  # a GGUF: its HF-format copy (gguf_cache)
    shard = group.shard if group is not None else sharding.SINGLE
    # NOTE: built on the meta device and materialised once in the target dtype, so a large
    # model never holds a float32 copy or random initial weights.
    with torch.device("meta"):
        model = CausalLM(
            sharding.local_config(model_cfg, shard),
            config.max_model_len or model_cfg.max_model_len,
            platform.attention_backend,
            platform.ops(),
            group,
        )
        model = model.to(dtype=config.dtype)
        quant = quantization.resolve(model_dir, config.quantization)
        if quant is not None and model_cfg.mla is not None:
            raise ValueError(
                f"{model_cfg.architecture} (DeepSeek MLA) is not supported with FP8 weights yet"
            )
        if quant is not None and shard.size > 1:
            raise ValueError("FP8 weights are not supported with tensor parallelism yet")
        if shard.size > 1 and (model_cfg.moe is not None or model_cfg.attn_sinks):
            raise ValueError(
                f"{model_cfg.architecture} is not supported with tensor parallelism yet"
            )
        if quant is not None and quant.prequantized and config.load_format != "dummy":
            quantization.prepare(model, quant)  # filled from the checkpoint as stored
    model = model.to_empty(device=config.device)
    model.tie_weights()
    model.model.reset_rotary(config.device)
    if config.load_format == "dummy":
        fill_dummy_weights(model, config.seed)
    else:
        select: Select | None = None
        if shard.size > 1:

            def select(name: str, source: Any) -> torch.Tensor:
                return sharding.read_slice(name, source, model_cfg, shard)

        load_weights(
            model,
            model_dir,
            tied_lm_head=model_cfg.tie_word_embeddings,
            select=select,
            model_cfg=model_cfg,
        )
    if quant is not None and not any(p.dtype == quantization.FP8 for p in model.parameters()):
        quantization.quantize_model(model)  # at load (or dummy weights)
    if platform.merge_projections:
        model.merge_projections()
    return model.eval()
