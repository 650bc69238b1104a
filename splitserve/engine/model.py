"""The decoder every family shares (Llama 2/3, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, gpt-oss,
Gemma 3, DeepSeek-V2/V3) over a paged KV cache; what differs between them is read from config.json
(engine/families.py): a layer's MLP is dense or Mixture-of-Experts (engine/moe.py,
engine/deepseek_moe.py), its attention full or sliding-window with its own RoPE, or DeepSeek's
latent attention (engine/mla.py), and Gemma wraps both sub-layers in norms.

Module and parameter names follow HF checkpoints so weights load by name. Tokens arrive
flattened ([num_tokens]) across all scheduled sequences; the attention backend uses
`AttentionMetadata` to find each sequence's pages.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    get_attention_backend,
    window_view,
)
from splitserve.engine.deepseek_moe import DeepseekMoE
from splitserve.engine.families import DEEPSEEK_ROUTERS
from splitserve.engine.lora.batch import LoRALayer
from splitserve.engine.mla import MLAttention
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.moe import MoE
from splitserve.engine.ops import NO_SCALES, Activation, Scales, TorchOps
from splitserve.engine.parallel.group import ParallelGroup
from splitserve.engine.parallel.layers import VocabParallelEmbedding
from splitserve.engine.rotary import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops: TorchOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): one fused kernel with Triton ops."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)

    def norm_for(
        self, x: torch.Tensor, residual: torch.Tensor | None, feeds: Scales
    ) -> tuple[Activation, torch.Tensor]:
        """`add_and_norm` (or the plain norm, and x as the residual, without one) as the input
        of the projection whose scales are `feeds` (ops may quantize it for an FP8 one)."""
        if residual is None:
            return self.ops.rms_norm_for(x, self.weight, self.eps, feeds), x
        return self.ops.add_rms_norm_for(x, residual, self.weight, self.eps, feeds)


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, ops: TorchOps
    ):
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_size, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        # gpt-oss: one learned logit per head that joins every softmax's denominator.
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads)) if cfg.attn_sinks else None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ops)
        # Shared across layers; kept out of the module tree so it is not registered per layer.
        self._rotary = (rotary,)
        self.backend = backend
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None
        self.qkv_scales: Scales = NO_SCALES
        # This layer's LoRA views (engine/lora), set when the engine serves adapters.
        self.lora: LoRALayer | None = None

    def merge_projections(self) -> None:
        """Put q/k/v weights into one tensor (the three Linear weights become views of it)."""
        self.qkv_weight = _merge(self.q_proj, self.k_proj, self.v_proj, "weight")
        if self.cfg.qkv_bias:
            self.qkv_bias = _merge(self.q_proj, self.k_proj, self.v_proj, "bias")
        self.qkv_scales = _merge_scales(self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self,
        positions: torch.Tensor,
        x: Activation,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cfg = self.cfg
        if self.qkv_weight is not None:  # merged projection on a GPU: one GEMM, not three
            qkv = self.ops.linear(x, self.qkv_weight, self.qkv_bias, *self.qkv_scales)
            if self.lora is not None:
                qkv = self.lora.apply("qkv", x, qkv)  # type: ignore[arg-type]
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        else:
            q, k, v = (
                _lora_linear(self.ops, x, m, self.lora, name)
                for m, name in ((self.q_proj, "q_proj"), (self.k_proj, "k_proj"),
                                (self.v_proj, "v_proj"))
            )  # fmt: skip
        q = q.reshape(-1, cfg.num_heads, cfg.head_dim)
        k = k.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            # The GPU norm kernel wants whole rows; q and k are strided views of the qkv GEMM.
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        sinks = None if self.sinks is None else self.sinks.float()
        out = self.backend.rotate_and_forward(
            positions, q, k, v, self._rotary[0], kv_cache, meta, sinks=sinks
        )
        out = out.reshape(-1, cfg.q_size)
        return _lora_linear(self.ops, out, self.o_proj, self.lora, "o_proj")


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: TorchOps, gelu: bool = False) -> None:
        super().__init__()
        self.ops = ops
        self.gelu = gelu  # GeGLU (Gemma) rather than SwiGLU
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

        self.gate_up_weight: torch.Tensor | None = None
        self.gate_up_scales: Scales = NO_SCALES
        self.lora: LoRALayer | None = None

    def merge_projections(self) -> None:
        self.gate_up_weight = _merge(self.gate_proj, self.up_proj, None, "weight")
        self.gate_up_scales = _merge_scales(self.gate_proj, self.up_proj, None)

    def forward(self, x: Activation) -> torch.Tensor:
        ops = self.ops
        lora = self.lora if self.lora is not None and self.lora.active else None
        if self.gelu:
            return self._geglu(x, lora)
        if self.gate_up_weight is not None:
            down = self.down_proj
            if lora is not None:  # LoRA goes between the GEMM and SwiGLU: no fused SwiGLU
                gate_up = ops.linear(x, self.gate_up_weight, None, *self.gate_up_scales)
                act = ops.silu_and_mul(lora.apply("gate_up", x, gate_up))  # type: ignore[arg-type]
                return _lora_linear(ops, act, down, lora, "down_proj")
            h = ops.gate_up_silu(x, self.gate_up_weight, self.gate_up_scales, _scales(down))
            return _linear(ops, h, down)
        gate = _lora_linear(ops, x, self.gate_proj, lora, "gate_proj")
        up = _lora_linear(ops, x, self.up_proj, lora, "up_proj")
        return _lora_linear(ops, F.silu(gate) * up, self.down_proj, lora, "down_proj")

    def _geglu(self, x: Activation, lora: LoRALayer | None) -> torch.Tensor:
        """down(gelu_tanh(gate(x)) * up(x)), as HF's Gemma MLP computes it."""
        ops = self.ops
        if self.gate_up_weight is not None:
            gate_up = ops.linear(x, self.gate_up_weight, None, *self.gate_up_scales)
            if lora is not None:
                gate_up = lora.apply("gate_up", x, gate_up)  # type: ignore[arg-type]
            gate, up = gate_up.chunk(2, dim=-1)
        else:
            gate = _lora_linear(ops, x, self.gate_proj, lora, "gate_proj")
            up = _lora_linear(ops, x, self.up_proj, lora, "up_proj")
        act = F.gelu(gate, approximate="tanh") * up
        return _lora_linear(ops, act, self.down_proj, lora, "down_proj")


def _linear(ops: TorchOps, x: Activation, m: nn.Linear) -> torch.Tensor:
    """`m(x)` through `ops` (FP8 projections carry their scales: engine/quantization.py)."""
    return ops.linear(x, m.weight, m.bias, *_scales(m))


def _lora_linear(
    ops: TorchOps, x: Activation, m: nn.Linear, lora: LoRALayer | None, name: str
) -> torch.Tensor:
    """`_linear`, plus the step's LoRA products for projection `name` (LoRA never runs with
    FP8 projections, so x is a plain tensor there)."""
    y = _linear(ops, x, m)
    return y if lora is None else lora.apply(name, x, y)  # type: ignore[arg-type]


def _scales(m: nn.Module) -> Scales:
    return getattr(m, "weight_scale", None), getattr(m, "input_scale", None)


def _merge_scales(a: nn.Linear, b: nn.Linear, c: nn.Linear | None) -> Scales:
    """Merged projections' scales: weight scales concatenated like the weights, one static
    input scale (the largest: the three share their input)."""
    if _scales(a)[0] is None:
        return None, None
    weight_scale = _merge(a, b, c, "weight_scale")
    inputs = [_scales(m)[1] for m in (a, b, c) if m is not None]
    if any(s is None for s in inputs):
        return weight_scale, None
    return weight_scale, torch.stack([s.reshape(()) for s in inputs if s is not None]).amax()[None]


def _merge(a: nn.Linear, b: nn.Linear, c: nn.Linear | None, name: str) -> torch.Tensor:
    """Concatenate the parameters `name` of a, b (and c) along the output dim; each module's
    parameter then views its slice, so memory is not doubled and reloading stays possible."""
    parts = [getattr(m, name) for m in (a, b, c) if m is not None]
    merged = torch.cat([p.data for p in parts])
    start = 0
    for p in parts:
        p.data = merged[start : start + p.shape[0]]
        start += p.shape[0]
    return merged


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        ops: TorchOps,
        group: ParallelGroup,
        moe: bool = False,
    ):
        super().__init__()
        # Tensor parallelism: o_proj and down_proj are row-parallel, so each rank holds a
        # partial sum of the sub-layer's output until this all-reduce (identity at TP=1).
        self.group = group
        self.self_attn: Attention | MLAttention = (
            MLAttention(cfg, rotary, ops)
            if cfg.mla is not None
            else Attention(cfg, rotary, backend, ops)
        )
        self.mlp = _mlp(cfg, ops, moe)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, ops)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:  # Gemma: post_attention_layernorm norms the attention's output
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, ops)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, ops)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it is added back).

        NOTE: the residual addition is deferred into the next norm (one fused kernel with Triton
        ops); torch ops add in HF's order, so float32 results stay identical.
        """
        attn, mlp = self.self_attn, self.mlp
        h, residual = self.input_layernorm.norm_for(x, residual, attn.qkv_scales)
        out = self.group.all_reduce(attn(positions, h, kv_cache, meta))
        if self.sandwich:
            out = self.post_attention_layernorm(out)
            h, residual = self.pre_feedforward_layernorm.add_and_norm(out, residual)
            return self.post_feedforward_layernorm(self.group.all_reduce(mlp(h))), residual
        feeds = mlp.gate_up_scales if isinstance(mlp, MLP) else NO_SCALES
        h, residual = self.post_attention_layernorm.norm_for(out, residual, feeds)
        return self.group.all_reduce(mlp(h)), residual


def _mlp(cfg: ModelConfig, ops: TorchOps, moe: bool) -> MLP | MoE | DeepseekMoE:
    if not moe:
        return MLP(cfg, ops, gelu=cfg.hidden_act == "gelu_tanh")
    assert cfg.moe is not None
    if cfg.moe.router not in DEEPSEEK_ROUTERS:
        return MoE(cfg, ops)
    width = cfg.moe.shared_intermediate_size
    shared = MLP(dataclasses.replace(cfg, intermediate_size=width), ops) if width else None
    return DeepseekMoE(cfg, ops, shared)


class DecoderModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, max_len: int, backend_name: str, ops: TorchOps, group: ParallelGroup
    ) -> None:
        super().__init__()
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group)
            if group.world_size > 1
            else nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        )
        self.embed_scale = cfg.embed_scale
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_len)
        # Gemma 3's sliding layers turn at their own base (tables, like `rotary`'s, that no
        # checkpoint holds: non-persistent buffers, rebuilt by `reset_rotary`).
        self.rotary_local = (
            RotaryEmbedding(cfg.rope_local, cfg.head_dim, max_len)
            if cfg.rope_local is not None
            else None
        )
        backend_cls = get_attention_backend(backend_name)
        scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
        backends: dict[int | None, AttentionBackend] = {}
        layers = []
        for i in range(cfg.num_layers):
            window = cfg.window(i)
            if window not in backends:  # one per window: full layers and sliding ones
                backends[window] = backend_cls(
                    cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, scale, window, ops=ops
                )
            local = window is not None and self.rotary_local is not None
            rotary = self.rotary_local if local else self.rotary
            assert rotary is not None
            layers.append(
                DecoderLayer(cfg, rotary, backends[window], ops, group, cfg.is_moe_layer(i))
            )
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is None:
            return x
        # As Gemma does: the scale rounded to the weights' dtype first.
        return x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def reset_rotary(self, device: torch.device | str) -> None:
        self.rotary.reset(device)
        if self.rotary_local is not None:
            self.rotary_local.reset(device)


class CausalLM(nn.Module):
    """Decoder + LM head. `forward` returns final hidden states; `compute_logits` the logits.

    Under tensor parallelism (`group` of more than one rank) `cfg` is this rank's shard
    (engine/parallel/sharding.py: its heads and MLP columns, the whole vocabulary), the
    embedding and LM head are vocab-parallel, and `compute_logits` gathers every rank's
    columns, so each rank returns the whole vocabulary's logits.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        max_len: int,
        backend_name: str = "torch",
        ops: TorchOps | None = None,
        group: ParallelGroup | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops or TorchOps()
        self.group = group or ParallelGroup()
        self.model = DecoderModel(cfg, max_len, backend_name, self.ops, self.group)
        vocab = -(-cfg.vocab_size // self.group.world_size)  # this rank's rows, padded
        self.lm_head = nn.Linear(cfg.hidden_size, vocab, bias=False)
        self.tie_weights()
        self._slides = [cfg.window(i) is not None for i in range(cfg.num_layers)]
        # The KV cache's window map when its sliding layers have a pool of their own.
        self.window_map: torch.Tensor | None = None

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so.

        NOTE: call again after `to_empty`, which gives each module its own new tensor.
        """
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed(input_ids)
        residual: torch.Tensor | None = None
        # Sliding layers in a window pool of their own (engine/kv_cache.py) read it through
        # the window map: translated once per step, on the device.
        local = meta if self.window_map is None else window_view(meta, self.window_map)
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
            x, residual = layer(
                positions, x, residual, kv_cache, local if self._slides[i] else meta
            )
        assert residual is not None
        return self.model.norm.add_and_norm(x, residual)[0]

    def merge_projections(self) -> None:
        """One GEMM for q/k/v and one for gate/up in every layer (the platform decides)."""
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.merge_projections()
            layer.mlp.merge_projections()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.ops.linear(hidden, self.lm_head.weight)
        if self.group.world_size == 1:
            return logits
        return self.group.all_gather_last(logits)[:, : self.cfg.vocab_size]
