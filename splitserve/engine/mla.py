"""DeepSeek's Multi-head Latent Attention (MLA), DeepSeek-V2 and -V3, in plain torch.

Each token's keys and values come from one latent: `kv_a_proj_with_mqa` gives `kv_lora_rank`
values (normed by `kv_a_layernorm`) and one RoPE key of `qk_rope_head_dim` shared by every head.
The paged KV cache holds only that latent, the normed part and the roped key side by side
(engine/kv_cache.py `kv_page`: one plane, one row of `kv_lora_rank + qk_rope_head_dim` per
token and layer). Attention decompresses a sequence's cached latents each step, as transformers
does: `kv_b_proj` gives every head's key without position (`qk_nope_head_dim`) and its value
(`v_head_dim`); the key is that and the shared RoPE key, the query its own two parts, and SDPA
runs with a causal mask shifted by the cached prefix (engine/torch_attention.py), scaled by
`MLAConfig.softmax_scale`.

RoPE turns only the `qk_rope_head_dim` dims, laid out as each HF class does (`rope_layout`):
DeepSeek-V2 multiplies complex pairs (x0, x1), (x2, x3)… and keeps them interleaved; V3 with
`rope_interleave` turns the same pairs but writes them out as halves; without it, the usual halves.

A decode-only step (every sequence's query_len == 1) absorbs the weights instead
(`MLAttention.absorb_decode`, on by default): `kv_b_proj` splits into W_UK [heads,
qk_nope_head_dim, kv_lora_rank] and W_UV [heads, v_head_dim, kv_lora_rank]; each head's query
becomes [q_nope @ W_UK | q_pe], attends over the cached rows themselves (the value is a row's
first kv_lora_rank entries) and its latent output goes out through W_UV^T. No latent is
decompressed: on CUDA kernels/mla_decode.py `mla_decode` runs it, elsewhere its torch reference.
Prefill and mixed steps decompress as above.

The layer attends itself, whatever the engine's attention backend: the backend decides only the
rest of the step (the Triton ops and CUDA graphs on a GPU with the default "triton", neither with
"torch"). The decode path reads nothing back on the host (kernels/latent_write.py writes the
latents), so it is captured in the decode graphs like any other family's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.attention import AttentionMetadata
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.ops import NO_SCALES, Scales, TorchOps
from splitserve.engine.rotary import RotaryEmbedding
from splitserve.engine.torch_attention import sdpa
from splitserve.kernels.latent_write import write_latents as write_latents_gpu
from splitserve.kernels.latent_write import write_latents_normed, write_latents_ref
from splitserve.kernels.mla_decode import mla_decode, mla_decode_ref
from splitserve.kernels.mla_query import rope_query

if TYPE_CHECKING:
    from splitserve.engine.config import EngineConfig

# HF's q_a_layernorm and kv_a_layernorm are built without the config's eps: their default.
LATENT_NORM_EPS = 1e-6


def check_engine(model: ModelConfig, config: EngineConfig) -> None:
    """Refuse, naming the family, what would run an MLA model wrong or not at all yet."""
    if model.mla is None:
        return
    refused = [
        (config.tensor_parallel_size > 1, "tensor parallelism"),
        (config.speculative is not None, "speculative decoding"),
        (config.kv_cache_dtype != "auto", f"kv_cache_dtype {config.kv_cache_dtype!r}"),
        (config.lora_enabled, "LoRA adapters"),
        (config.quantization not in (None, "none"), f"quantization {config.quantization!r}"),
        (model.sliding_window is not None, "a sliding window"),
    ]
    for refuse, what in refused:
        if refuse:
            raise ValueError(
                f"{model.architecture} (DeepSeek MLA) is not supported with {what} yet"
            )


class _Norm(nn.Module):
    def __init__(self, dim: int, ops: TorchOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, LATENT_NORM_EPS)


class MLAttention(nn.Module):
    """One layer's latent attention; parameter names follow HF checkpoints."""

    # Decode-only steps attend over the latents with W_UK and W_UV absorbed (module docstring).
    absorb_decode = True

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, ops: TorchOps) -> None:
        super().__init__()
        assert cfg.mla is not None
        self.mla = mla = cfg.mla
        self.num_heads = heads = cfg.num_heads
        self.ops = ops
        hidden, qk = cfg.hidden_size, mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, mla.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_layernorm = _Norm(mla.q_lora_rank, ops)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, mla.latent_dim, bias=cfg.qkv_bias)
        self.kv_a_layernorm = _Norm(mla.kv_lora_rank, ops)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * mla.v_head_dim, hidden, bias=cfg.o_bias)
        self._rotary = (rotary,)  # shared across layers: kept out of the module tree
        self.qkv_scales: Scales = NO_SCALES  # what the input norm feeds (no FP8 here)
        self.lora = None  # LoRA hooks look for it; MLA takes no adapters
        # (kv_b_proj's weight when split, W_UK, W_UV): views of it, so an in-place reload
        # reaches them; a new weight tensor is split again.
        self._absorbed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def merge_projections(self) -> None:
        """Nothing to merge: the projections have different inputs."""

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        mla, ops = self.mla, self.ops
        if mla.q_lora_rank is None:
            q = ops.linear(x, self.q_proj.weight)
        else:
            q_a = ops.linear(x, self.q_a_proj.weight, self.q_a_proj.bias)
            q = ops.linear(self.q_a_layernorm(q_a), self.q_b_proj.weight)
        q = q.reshape(-1, self.num_heads, mla.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        kv_a = ops.linear(x, self.kv_a_proj_with_mqa.weight, self.kv_a_proj_with_mqa.bias)
        rotary = self._rotary[0]
        fused = ops.triton and kv_a.dtype == kv_cache.dtype
        decode_only = meta.max_query_len == 1 and q.shape[0] == meta.num_seqs
        if fused:
            # One launch: the latent normed, the RoPE key turned, both written (latent_write.py)
            write_latents_normed(
                kv_a, self.kv_a_layernorm.weight, LATENT_NORM_EPS, positions, rotary.cos,
                rotary.sin, mla.rope_layout, kv_cache, meta.slot_mapping,
            )  # fmt: skip
            if self.absorb_decode and decode_only:
                out = self._attend_absorbed_fused(q_nope, q_pe, positions, kv_cache, meta)
                return self._project_out(out)
            q_pe = rotate(positions, q_pe, None, rotary, mla.rope_layout)[0]
        else:
            kv_c, k_pe = kv_a.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
            kv_c = self.kv_a_layernorm(kv_c.contiguous())
            q_pe, k_rot = rotate(positions, q_pe, k_pe[:, None], rotary, mla.rope_layout)
            assert k_rot is not None
            write_latents(torch.cat([kv_c, k_rot[:, 0]], dim=-1), kv_cache, meta.slot_mapping)
        if self.absorb_decode and decode_only:
            out = self._attend_absorbed(q_nope, q_pe, kv_cache, meta)
        else:
            out = self._attend(torch.cat([q_nope, q_pe], dim=-1), kv_cache, meta)
        return self._project_out(out)

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        """o_proj over the heads' outputs [T, heads, v_head_dim]."""
        flat = out.reshape(-1, self.num_heads * self.mla.v_head_dim)
        return self.ops.linear(flat, self.o_proj.weight, self.o_proj.bias)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, qk_nope_head_dim, kv_lora_rank] and W_UV [heads, v_head_dim,
        kv_lora_rank]: views of `kv_b_proj`'s weight, split once per weight tensor."""
        param, cached = self.kv_b_proj.weight, self._absorbed
        # A new parameter, or new storage under it (`.to()`, `.data = ...`): split again.
        if cached is None or cached[0] is not param or cached[1].data_ptr() != param.data_ptr():
            mla = self.mla
            per_head = param.detach().reshape(
                self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank
            )
            w_uk, w_uv = per_head.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
            cached = self._absorbed = (param, w_uk, w_uv)
        return cached[1], cached[2]

    def _attend_absorbed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One query per sequence ([T, heads, *] parts) over its cached latents, W_UK folded
        into the query and W_UV into the output: [T, heads, v_head_dim]."""
        mla = self.mla
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)
        q = torch.cat([q_latent, q_pe.to(q_latent.dtype)], dim=-1).to(kv_cache.dtype)
        attend = mla_decode if kv_cache.is_cuda else mla_decode_ref
        latent_out = attend(
            q, kv_cache, meta.block_tables, meta.seq_lens, mla.kv_lora_rank,
            mla.softmax_scale, max_seq_len=meta.max_seq_len,
        )  # fmt: skip
        out = torch.bmm(latent_out.transpose(0, 1).to(w_uv.dtype), w_uv.transpose(1, 2))
        return out.transpose(0, 1).to(q_nope.dtype)

    def _attend_absorbed_fused(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """`_attend_absorbed` with q_pe still to turn, in four launches and no copies: the
        buffers are head-major [heads, T, *] seen token-major, so each bmm writes its heads'
        rows in place (strided), RoPE lands beside W_UK's product (kernels/mla_query.py), the
        attention reads and writes through strides, and the output reaches o_proj as [T, heads
        * v_head_dim] without a transpose."""
        mla, rank = self.mla, self.mla.kv_lora_rank
        rotary = self._rotary[0]
        w_uk, w_uv = self.absorbed_weights()
        heads, tokens = self.num_heads, q_nope.shape[0]
        q = q_nope.new_empty(heads, tokens, mla.latent_dim)
        torch.bmm(q_nope.transpose(0, 1), w_uk, out=q[..., :rank])
        q = q.transpose(0, 1)
        rope_query(q_pe, positions, rotary.cos, rotary.sin, mla.rope_layout, q[..., rank:])
        latent = q.new_empty(heads, tokens, rank)
        attend = mla_decode if kv_cache.is_cuda else mla_decode_ref
        attend(
            q, kv_cache, meta.block_tables, meta.seq_lens, rank, mla.softmax_scale,
            latent.transpose(0, 1), max_seq_len=meta.max_seq_len,
        )  # fmt: skip
        out = q.new_empty(tokens, heads, mla.v_head_dim)
        torch.bmm(latent, w_uv.transpose(1, 2), out=out.transpose(0, 1))
        return out

    def _attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, heads, qk_head_dim] over each sequence's cached latents, decompressed."""
        mla = self.mla
        out = q.new_zeros(q.shape[0], self.num_heads, mla.v_head_dim)
        start = 0
        for i, (query_len, seq_len) in enumerate(
            zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)
        ):
            end = start + query_len
            latents = gather_latents(kv_cache, meta.block_tables[i], seq_len, meta.block_size)
            latents = latents.to(q.dtype)
            kv_c, k_pe = latents.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
            kv = self.ops.linear(kv_c, self.kv_b_proj.weight)
            kv = kv.reshape(seq_len, self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim)
            k_nope, values = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
            k_rot = k_pe[:, None].expand(seq_len, self.num_heads, mla.qk_rope_head_dim)
            keys = torch.cat([k_nope, k_rot], dim=-1)
            # NOTE: a fresh prompt (nothing cached before it) needs no mask tensor: SDPA's own
            # causal mode picks a fused kernel and never builds [L, L] (256 MiB at 16k tokens).
            fresh = query_len == seq_len
            attn = attention(
                q[start:end].transpose(0, 1),
                keys.transpose(0, 1),
                values.transpose(0, 1),
                None if fresh else causal_mask(query_len, seq_len, q.device),
                fresh and query_len > 1,
                mla.softmax_scale,
            )
            out[start:end] = attn.transpose(0, 1)
            start = end
        return out


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    pad_values: bool | None = None,
) -> torch.Tensor:
    """SDPA over per-head [heads, L, *] q, k (qk_head_dim) and v (v_head_dim), 4-D
    (`torch_attention.sdpa`: 3-D inputs take SDPA's math path). On a GPU (or with
    `pad_values`), values narrower than the keys are zero-padded to their width and the output
    cut back: the flash kernel takes one head width for all three (DeepSeek: 192 against 128).
    The padded columns' outputs are zeros; the rest are the same sums."""
    width = v.shape[-1]
    if (q.is_cuda if pad_values is None else pad_values) and q.shape[-1] > width:
        v = F.pad(v, (0, q.shape[-1] - width))
    return sdpa(q, k, v, mask, scale, is_causal)[..., :width]


def causal_mask(query_len: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[query_len, seq_len] bool: query j (at seq_len - query_len + j) sees keys up to itself."""
    q_pos = torch.arange(seq_len - query_len, seq_len, device=device).unsqueeze(1)
    return torch.arange(seq_len, device=device).unsqueeze(0) <= q_pos


def write_latents(latents: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Store each token's latent [T, latent_dim] at its flat slot of the layer's view
    kv_cache [1, blocks, block_size, 1, latent_dim]; slot -1 (padding) is skipped. On a GPU one
    Triton launch that reads nothing back (a decode graph captures it), else torch."""
    latents = latents.to(kv_cache.dtype)
    if kv_cache.is_cuda:
        write_latents_gpu(latents.contiguous(), kv_cache, slots)
    else:
        write_latents_ref(latents, kv_cache, slots)


def gather_latents(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, block_size: int
) -> torch.Tensor:
    """The latents of one sequence's first `seq_len` tokens: [seq_len, latent_dim]."""
    blocks = block_table[: -(-seq_len // block_size)].long()
    return kv_cache[0][blocks].reshape(-1, kv_cache.shape[-1])[:seq_len]


def rotate(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    rotary: RotaryEmbedding,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RoPE on q [T, heads, rope_dim] and k [T, 1, rope_dim] (None: q only) in the HF class's
    `layout`."""
    if layout == "half":
        if k is None:
            return rotary.rotate_one(positions, q), None
        return rotary(positions, q, k)
    half = q.shape[-1] // 2
    # The tables are cat(freqs, freqs) (times YaRN's attention factor): the first half is
    # each pair's angle.
    cos = rotary.cos[positions, :half].unsqueeze(1)
    sin = rotary.sin[positions, :half].unsqueeze(1)
    if layout == "interleave":  # transformers' apply_rotary_pos_emb_interleave
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)

        def turn(x: torch.Tensor) -> torch.Tensor:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

        return turn(q), None if k is None else turn(k)
    # DeepSeek-V2's apply_rotary_emb: complex products in float32, pairs kept interleaved.
    freqs = torch.complex(cos.float(), sin.float())

    def turn_complex(x: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(pairs * freqs).flatten(-2).to(x.dtype)

    return turn_complex(q), None if k is None else turn_complex(k)
