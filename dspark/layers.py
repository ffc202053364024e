"""The drafter's decoder layer: Qwen3-style attention whose keys/values also include the
target's context features, and blocks that attend to their own slots.

Parameter names follow speculators' `Qwen3DFlashDecoderLayer` and vLLM's `qwen3_dflash`, so a
state dict moves between the three unchanged.

Attention is computed in two parts that share one softmax: queries against the context
(`[Q, T]`, masked per block by the anchor position, document and window) and queries against
their own block (`[N, γ, γ]`). A dense mask over `[Q, T + Q]` would spend most of its memory
on the `Q × Q` block-to-block part, which is all masked except the γ×γ diagonal tiles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:  # Gemma convention: x * (1 + w), computed in float32
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables `[..., head_dim]` for integer positions (default RoPE, half rotation)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DraftMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ContextBlockAttention(nn.Module):
    """Attention of block queries over [context features ; own block]."""

    def __init__(self, cfg, causal_in_block: bool) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.causal_in_block = causal_in_block
        self.scale = d**-0.5

    def project_context(self, ctx: torch.Tensor, ctx_cos: torch.Tensor, ctx_sin: torch.Tensor):
        """Context keys/values `[kv_heads, T, d]`; cacheable across decode steps."""
        t = ctx.shape[0]
        k = self.k_norm(self.k_proj(ctx).view(t, self.num_kv_heads, self.head_dim)).transpose(0, 1)
        v = self.v_proj(ctx).view(t, self.num_kv_heads, self.head_dim).transpose(0, 1)
        return apply_rope(k, ctx_cos, ctx_sin), v

    def forward(self, x: torch.Tensor, ctx_kv, ctx_mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x `[N, γ, H]`; ctx_kv from `project_context`; ctx_mask `[N, T]` bool; cos/sin `[N, γ, d]`."""
        n, g, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, g, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(n, g, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(n, g, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, cos.unsqueeze(2), sin.unsqueeze(2))
        k = apply_rope(k, cos.unsqueeze(2), sin.unsqueeze(2))
        rep = self.num_heads // self.num_kv_heads
        k_ctx, v_ctx = ctx_kv
        # [heads, N*γ, d] against [heads, T, d]: GQA by repeating each kv head `rep` times.
        qh = q.permute(2, 0, 1, 3).reshape(self.num_heads, n * g, self.head_dim)
        s_ctx = torch.matmul(qh, k_ctx.repeat_interleave(rep, 0).transpose(-1, -2)) * self.scale
        s_ctx = s_ctx.view(self.num_heads, n, g, -1)
        s_ctx = s_ctx.masked_fill(~ctx_mask.view(1, n, 1, -1), float("-inf"))
        kb = k.repeat_interleave(rep, 2).permute(2, 0, 3, 1)  # [heads, N, d, γ]
        qb = q.permute(2, 0, 1, 3)  # [heads, N, γ, d]
        s_blk = torch.matmul(qb, kb) * self.scale  # [heads, N, γ, γ]
        if self.causal_in_block:
            causal = torch.ones(g, g, dtype=torch.bool, device=x.device).tril()
            s_blk = s_blk.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1).float(), dim=-1).to(v.dtype)
        t = s_ctx.shape[-1]
        out = torch.matmul(probs[..., :t].reshape(self.num_heads, n * g, t), v_ctx.repeat_interleave(rep, 0))
        out = out.view(self.num_heads, n, g, self.head_dim)
        vb = v.repeat_interleave(rep, 2).permute(2, 0, 1, 3)  # [heads, N, γ, d]
        out = out + torch.matmul(probs[..., t:], vb)
        return self.o_proj(out.permute(1, 2, 0, 3).reshape(n, g, self.num_heads * self.head_dim))


class DraftDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__()
        sliding = cfg.is_sliding(layer_idx)
        # Full-attention layers see their whole block; sliding layers are causal inside the
        # block unless the config says otherwise (speculators' `sliding_window_non_causal`).
        self.window = cfg.sliding_window if sliding else None
        self.self_attn = ContextBlockAttention(cfg, causal_in_block=sliding and not cfg.sliding_window_non_causal)
        self.mlp = DraftMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx_kv, ctx_mask, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), ctx_kv, ctx_mask, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))
