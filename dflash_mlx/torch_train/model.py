"""The DFlash drafter in PyTorch, with the checkpoint's own parameter names, and its training forward.

Parameter names are those of a z-lab DFlash checkpoint (`fc`, `hidden_norm`, `layers.{i}.self_attn.{q,k,v,o}_proj`,
`q_norm`, `k_norm`, `mlp.{gate,up,down}_proj`, `norm`), plus `lm_head` and the `d2t` id map when the drafter has a
reduced draft vocabulary (dflash-mlx's extension). So `state_dict()` saved as safetensors next to the config is a
checkpoint that `dflash-mlx convert` and `dflash_mlx.load` read unchanged.

The forward is the MLX drafter's (`dflash_mlx/drafter.py`, `train/forward.py`): fused context
`hidden_norm(fc(features))`, pre-norm Qwen3 layers whose queries come from the block and whose keys and values come
from the context (this layer's projections) and the block itself, NeoX RoPE at absolute positions, no mask inside a
block, each block seeing only the context before its anchor. Full-attention layers only (the recipe's drafters).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..drafters.config import DFlashConfig
from ..errors import DFlashError


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX-style rotary embedding (halves rotated), x: [..., T, hd], positions broadcastable to [..., T]."""
    hd = x.shape[-1]
    inv = theta ** (-torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    angles = positions.to(torch.float32)[..., None] * inv  # [..., T, hd/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float()[..., : hd // 2], x.float()[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.n_heads, self.n_kv = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = c.head_dim or c.hidden_size // c.num_attention_heads
        H, hd = c.hidden_size, self.head_dim
        bias = bool(c.attention_bias)
        self.q_proj = nn.Linear(H, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(H, self.n_kv * hd, bias=bias)
        self.v_proj = nn.Linear(H, self.n_kv * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(hd, c.rms_norm_eps)
        self.theta = c.rope_theta

    def context_kv(self, ctx: torch.Tensor):
        """ctx [R, S, H] -> keys, values [R, nKV, S, hd], keys rotated at positions 0..S-1."""
        R, S, _ = ctx.shape
        k = self.k_norm(self.k_proj(ctx).view(R, S, self.n_kv, -1)).transpose(1, 2)
        v = self.v_proj(ctx).view(R, S, self.n_kv, -1).transpose(1, 2)
        return rope(k, torch.arange(S, device=ctx.device), self.theta), v

    def forward(self, x: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """x [R, A, B, H] normed block inputs (block j at positions anchors[:, j] + 0..B-1); each block attends to
        the context keys before its anchor and to its own B slots, one softmax over both."""
        R, A, B, _ = x.shape
        G, hd = self.n_heads // self.n_kv, self.head_dim
        q = self.q_norm(self.q_proj(x).view(R, A, B, self.n_heads, hd)).permute(0, 3, 1, 2, 4)  # [R, nH, A, B, hd]
        k = self.k_norm(self.k_proj(x).view(R, A, B, self.n_kv, hd)).permute(0, 3, 1, 2, 4)  # [R, nKV, A, B, hd]
        v = self.v_proj(x).view(R, A, B, self.n_kv, hd).permute(0, 3, 1, 2, 4)
        pos = anchors[:, None, :, None] + torch.arange(B, device=x.device)  # [R, 1, A, B]
        q, k = rope(q, pos, self.theta), rope(k, pos, self.theta)
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)  # GQA: head h reads kv head h // G
        ck, cv = ctx_k.repeat_interleave(G, dim=1), ctx_v.repeat_interleave(G, dim=1)  # [R, nH, S, hd]
        scale = 1.0 / math.sqrt(hd)
        S = ck.shape[2]
        s_ctx = torch.einsum("rhabd,rhsd->rhabs", q, ck) * scale
        sees = torch.arange(S, device=x.device)[None, None, None, None, :] < anchors[:, None, :, None, None]
        s_ctx = s_ctx.masked_fill(~sees, float("-inf"))
        s_own = torch.einsum("rhabd,rhacd->rhabc", q, k) * scale
        w = torch.softmax(torch.cat([s_ctx, s_own], dim=-1).float(), dim=-1).to(q.dtype)
        out = torch.einsum("rhabs,rhsd->rhabd", w[..., :S], cv) + torch.einsum("rhabc,rhacd->rhabd", w[..., S:], v)
        return self.o_proj(out.permute(0, 2, 3, 1, 4).reshape(R, A, B, self.n_heads * hd))


class MLP(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


def check_supported(c: DFlashConfig) -> None:
    """The PyTorch trainer covers the recipe's drafters: full attention, plain RoPE, no output scaling."""
    unsupported = [name for name, bad in (
        ("sliding layers (layer_types)", any(t != "full_attention" for t in (c.layer_types or []))),
        ("rope_scaling", bool(c.rope_scaling)),
        ("input_embedding_scale", c.input_embedding_scale is not None),
        ("output_multiplier", c.output_multiplier is not None),
        ("final_logit_softcapping", c.final_logit_softcapping is not None),
    ) if bad]
    if unsupported:
        raise DFlashError(f"the PyTorch trainer does not support {', '.join(unsupported)}; train this drafter with "
                          "`dflash-mlx train`")


class DraftModel(nn.Module):
    """A DFlash drafter; the target's embedding and head are passed in, not owned (frozen, shared)."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        check_supported(config)
        c = self.config = config
        H = c.hidden_size
        self.fc = nn.Linear(c.num_taps * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(H, c.rms_norm_eps)
        if c.draft_vocab_size:
            # Draft id i stands for target id i + d2t[i]; the reduced head keeps the target's rows (frozen).
            self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
            self.lm_head.weight.requires_grad_(False)
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int32))

    def block_hidden(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                     embed: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Final-normed hidden states [R, A, B-1, H] of block slots 1..B-1.

        features [R, S, n*H]: the target's tapped features of the row's tokens [R, S]; anchors [R, A] with
        1 <= a <= S - B. The block at anchor a is [tokens[a], MASK x (B-1)] at positions a..a+B-1 and sees the
        context features of positions < a: what the drafter sees at inference after committing tokens 0..a.
        """
        c = self.config
        B = c.block_size
        ctx = self.hidden_norm(self.fc(features))
        first = torch.gather(tokens, 1, anchors.long())
        mask = torch.full((*first.shape, B - 1), c.mask_token_id, dtype=tokens.dtype, device=tokens.device)
        x = embed(torch.cat([first[..., None], mask], dim=-1)).to(ctx.dtype)  # [R, A, B, H]
        for layer in self.layers:
            attn = layer.self_attn
            ctx_k, ctx_v = attn.context_kv(ctx)
            h = x + attn(layer.input_layernorm(x), ctx_k, ctx_v, anchors)
            x = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(x[:, :, 1:])

    def logits(self, h: torch.Tensor, target_head: Optional[Callable[[torch.Tensor], torch.Tensor]] = None):
        """Logits over the drafter's vocabulary: its reduced head, or the target's head (`target_head`)."""
        if self.config.draft_vocab_size:
            return self.lm_head(h)
        if target_head is None:
            raise ValueError("a drafter without its own head needs the target's head")
        return target_head(h)
