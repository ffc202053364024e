"""DSpark's two light heads on top of the parallel backbone.

Markov logit-bias head: slot k's draft logits get `B(x_{k-1}) = W2 · W1[x_{k-1}]`, a low-rank
first-order transition bias from the previous token. It restores the left-to-right dependency
a one-pass block drafter lacks, at the cost of one r-dim lookup and one r×V product per slot.
`gated` scales W1[x] by a gate computed from the slot's hidden state; `rnn` carries a small
recurrent state through the block (both as speculators defines them; vLLM serves `vanilla`).

Confidence head: `c_k = σ(wᵀ[h_k ; W1[x_{k-1}]] + b)`, the predicted probability that draft
token k is accepted, used by the prefix scheduler to decide how many tokens to verify.
"""

from __future__ import annotations

import torch
from torch import nn


class MarkovHead(nn.Module):
    def __init__(self, target_vocab: int, draft_vocab: int, rank: int, hidden: int, head_type: str = "vanilla"):
        super().__init__()
        if rank <= 0:
            raise ValueError(f"markov rank must be > 0, got {rank}")
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(target_vocab, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)
        elif head_type != "vanilla":
            raise ValueError(f"unknown markov head type {head_type!r}")

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        return self.markov_w1(prev_ids.long())

    def init_state(self, batch_shape, like: torch.Tensor) -> torch.Tensor | None:
        return like.new_zeros(*batch_shape, self.rank) if self.head_type == "rnn" else None

    def step(self, prev_emb: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """Bias for one slot given the previous token's embedding; returns (bias, new_state)."""
        prev_emb = prev_emb.to(self.markov_w2.weight.dtype)
        if self.head_type == "vanilla":
            return self.markov_w2(prev_emb), state
        hidden = hidden.to(prev_emb.dtype)
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1)))
            return self.markov_w2(gate * prev_emb), state
        gate_raw, cand_raw, out_raw = self.joint_proj(torch.cat([state, prev_emb, hidden], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return self.markov_w2(torch.tanh(out_raw)), state

    def block_bias(self, prev_emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced bias for whole blocks: prev_emb `[N, γ, r]`, hidden `[N, γ, H]`."""
        if self.head_type != "rnn":
            return self.step(prev_emb, hidden, None)[0]
        state = self.init_state(prev_emb.shape[:1], prev_emb.to(self.markov_w2.weight.dtype))
        out = []
        for k in range(prev_emb.shape[1]):
            bias, state = self.step(prev_emb[:, k], hidden[:, k], state)
            out.append(bias)
        return torch.stack(out, dim=1)


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def forward(self, hidden: torch.Tensor, prev_emb: torch.Tensor | None) -> torch.Tensor:
        feats = hidden if prev_emb is None else torch.cat([hidden, prev_emb.to(hidden.dtype)], dim=-1)
        return self.proj(feats.to(self.proj.weight.dtype)).squeeze(-1)
