"""The DSpark drafter: DFlash backbone + Markov logit-bias head + confidence head.

Context: the target's hidden states at `aux_layer_ids`, concatenated per token and projected
`fc: L·H → H` + RMSNorm, are injected as extra keys/values into every draft layer. A block
starts at anchor p: slot 0 holds x_p, the other slots the mask token's embedding. Block
queries see context tokens of their sample at positions < p (the target has not run on the
anchor yet) and their own block. With `sample_from_anchor` (DSpark), slot k predicts x_{p+k+1}.

Frozen, loaded from the target: token embedding, final norm and LM head (`verifier_*`). For a
reduced draft vocabulary the draft LM head is the target head's rows for the draft tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.profiler import record_function

from .anchors import sample_anchors
from .config import DSparkConfig
from .heads import ConfidenceHead, MarkovHead
from .layers import DraftDecoderLayer, RMSNorm, rope_cos_sin
from .samples import PackedBatch

# Names left out of checkpoints: vLLM and speculators take these from the target.
FROZEN_TARGET_KEYS = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")


@dataclass
class BlockOutputs:
    logits: torch.Tensor  # [N, γ, V_draft], Markov bias included
    confidence_logits: torch.Tensor | None  # [N, γ]
    # [U, V_target]: the frozen target's logits at U distinct positions; with `target_log_norm`,
    # only the draft vocabulary's columns [U, V_draft] (the normaliser stands for the rest).
    target_logits: torch.Tensor
    target_ids: torch.Tensor  # [N, γ] ground-truth next tokens (target vocab)
    valid: torch.Tensor  # [N, γ] bool: slot predicts a loss-masked token
    hidden: torch.Tensor  # [N, γ, H]
    target_index: torch.Tensor | None = None  # [N, γ] row of `target_logits` for each slot
    target_log_norm: torch.Tensor | None = None  # [U] logsumexp of the target's full-vocabulary logits
    target_positions: torch.Tensor | None = None  # [U] packed positions of the rows

    def slot_target_logits(self) -> torch.Tensor:
        """[N, γ, V_target]; materialises the per-slot copy (tests and small batches only)."""
        if self.target_log_norm is not None:
            raise ValueError("only the draft vocabulary's target logits were computed")
        return self.target_logits if self.target_index is None else self.target_logits[self.target_index]


@dataclass
class Proposal:
    tokens: torch.Tensor  # [k] target-vocab ids
    probs: torch.Tensor | None  # [k, V_target] draft distribution each token was sampled from
    confidence: torch.Tensor | None  # [k] calibrated acceptance estimates


def find_target_tensors(target_dir: str | Path) -> dict[str, torch.Tensor]:
    """Embedding, final norm and LM head from a HF checkpoint (single file or sharded)."""
    target_dir = Path(target_dir)
    index = target_dir / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else [p.name for p in sorted(target_dir.glob("*.safetensors"))]
    )
    if not files:
        raise FileNotFoundError(f"no safetensors weights in target dir {target_dir}")
    found: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(target_dir / name), framework="pt") as f:
            for key in f.keys():
                if "layers." in key or "mtp" in key or "vision" in key:
                    continue
                for want, suffix in (
                    ("embed", "embed_tokens.weight"),
                    ("norm", "model.norm.weight"),
                    ("head", "lm_head.weight"),
                ):
                    if key.endswith(suffix) and want not in found:
                        found[want] = f.get_tensor(key)
    if "embed" not in found or "norm" not in found:
        raise ValueError(f"{target_dir}: could not find embed_tokens / final norm weights")
    found.setdefault("head", found["embed"])  # tied embeddings
    return found


def find_layer_tensors(target_dir: str | Path) -> dict[int, dict[str, torch.Tensor]]:
    """Per decoder layer index, its weights by name relative to the layer (`self_attn.q_proj.weight`)."""
    target_dir = Path(target_dir)
    out: dict[int, dict[str, torch.Tensor]] = {}
    for path in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                head, sep, rest = key.partition("layers.")
                if not sep or "mtp" in head or "vision" in head:
                    continue
                idx, _, name = rest.partition(".")
                if idx.isdigit():
                    out.setdefault(int(idx), {})[name] = f.get_tensor(key)
    return out


class ContextCache:
    """Per-layer context keys/values of one sequence, grown as the target accepts tokens."""

    def __init__(self, model: DSparkDrafter) -> None:
        self.model, self.length, self.kv = model, 0, None

    @torch.no_grad()
    def extend(self, aux_hidden: torch.Tensor) -> None:
        m = self.model
        feats = m.context_features(aux_hidden.to(m.fc.weight.dtype))
        pos = torch.arange(self.length, self.length + feats.shape[0], device=feats.device)
        cos, sin = rope_cos_sin(pos, m.config.head_dim, m.config.rope_theta, feats.dtype)
        new = [layer.self_attn.project_context(feats, cos, sin) for layer in m.layers]
        if self.kv is None:
            self.kv = new
        else:
            self.kv = [(torch.cat([k, nk], 1), torch.cat([v, nv], 1)) for (k, v), (nk, nv) in zip(self.kv, new)]
        self.length += feats.shape[0]


class DSparkDrafter(nn.Module):
    # Vocabulary rows per block of the target head when a step computes its normalisers
    # (`verifier_draft_logits_and_norm`): 1,024-2,048 were fastest of 1,024-8,192 on a 2-core
    # AMD EPYC (Zen 4) at 300 and 600 rows; 0 runs the head as one product.
    norm_chunk_columns = 2048

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__()
        self.config = cfg = config
        h, v, vd = cfg.hidden_size, cfg.target_vocab_size, cfg.draft_vocab_size
        self.embed_tokens = nn.Embedding(v, h)
        self.verifier_norm = RMSNorm(h, cfg.rms_norm_eps, unit_offset=cfg.target_norm_unit_offset)
        self.verifier_lm_head = nn.Linear(h, v, bias=False)
        self.use_draft_vocab = vd != v
        self.lm_head = nn.Linear(h, vd, bias=False) if self.use_draft_vocab else None
        if self.use_draft_vocab:
            self.register_buffer("t2d", torch.zeros(v, dtype=torch.bool))
            self.register_buffer("d2t", torch.zeros(vd, dtype=torch.long))
        else:
            self.t2d = self.d2t = None
        self.layers = nn.ModuleList([DraftDecoderLayer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.markov_head = MarkovHead(v, vd, cfg.markov_rank, h, cfg.markov_head_type) if cfg.uses_markov_head else None
        self.confidence_head = None
        if cfg.enable_confidence_head:
            self.confidence_head = ConfidenceHead(h + (cfg.markov_rank if cfg.confidence_head_with_markov else 0))
        self._init_trainable()
        for p in self.frozen_parameters():
            p.requires_grad_(False)

    # ---- parameters ----------------------------------------------------------------------
    def _init_trainable(self) -> None:
        for name, mod in self.named_modules():
            if isinstance(mod, nn.Linear) and not name.startswith(("verifier_", "lm_head")):
                nn.init.normal_(mod.weight, std=0.02)
                if mod.bias is not None:
                    nn.init.zeros_(mod.bias)

    def frozen_parameters(self):
        yield self.embed_tokens.weight
        yield self.verifier_norm.weight
        yield self.verifier_lm_head.weight
        if self.lm_head is not None:
            yield self.lm_head.weight

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """What a checkpoint holds: trained weights, plus the vocab mapping and reduced head."""
        sd = self.state_dict()
        return {k: v for k, v in sd.items() if k not in FROZEN_TARGET_KEYS and v is not None}

    @property
    def draft_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight if self.lm_head is not None else self.verifier_lm_head.weight

    @torch.no_grad()
    def load_target_weights(self, target_dir: str | Path) -> None:
        t = find_target_tensors(target_dir)
        if t["embed"].shape != self.embed_tokens.weight.shape:
            raise ValueError(
                f"target embedding {tuple(t['embed'].shape)} != drafter {tuple(self.embed_tokens.weight.shape)}"
            )
        self.embed_tokens.weight.copy_(t["embed"])
        self.verifier_norm.weight.copy_(t["norm"])
        self.verifier_lm_head.weight.copy_(t["head"])
        self.refresh_draft_head()

    @torch.no_grad()
    def init_from_target_layers(self, target_dir: str | Path) -> dict:
        """Warm start: draft layer j takes the weights of target layer L-n+j (the last n), the
        context projection starts as the identity on the deepest aux layer, and the final norm
        is the target's. Useful when data is scarce (small local runs).

        Only what the target's layers hold in the drafter's own form is copied, by the names the
        families use: attention q/k/v/o and Qwen3's q/k norms, a dense gated MLP, the two norms
        (Gemma's pre-MLP norm is `pre_feedforward_layernorm`; its `post_attention_layernorm`
        normalises the attention output instead). Gemma-style norms scale by (1 + w) and are
        converted to the drafter's w. What a family has in another form — multi-head latent
        attention, expert MLPs — keeps its initialisation and is listed under `skipped`.
        """
        t = find_layer_tensors(target_dir)
        n, big_l = len(self.layers), self.config.target_num_layers
        src = list(range(big_l - n, big_l))
        offset = 1.0 if self.config.target_norm_unit_offset else 0.0
        copied, skipped = [], []

        def take(dst: torch.Tensor, w: dict, names: tuple[str, ...], label: str, norm: bool = False) -> None:
            found = next((w[k] for k in names if k in w and w[k].shape == dst.shape), None)
            if found is None:
                skipped.append(label)
                return
            dst.copy_(found + offset if norm else found)
            copied.append(label)

        for j, (layer, i) in enumerate(zip(self.layers, src)):
            w = t[i]
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                take(getattr(attn, name).weight, w, (f"self_attn.{name}.weight",), f"{j}.self_attn.{name}")
            for name in ("q_norm", "k_norm"):
                if hasattr(attn, name):
                    take(
                        getattr(attn, name).weight, w, (f"self_attn.{name}.weight",), f"{j}.self_attn.{name}", norm=True
                    )
            for name in ("gate_proj", "up_proj", "down_proj"):
                take(getattr(layer.mlp, name).weight, w, (f"mlp.{name}.weight",), f"{j}.mlp.{name}")
            take(layer.input_layernorm.weight, w, ("input_layernorm.weight",), f"{j}.input_layernorm", norm=True)
            pre_mlp = (
                ("pre_feedforward_layernorm.weight",)
                if "pre_feedforward_layernorm.weight" in w
                else ("post_attention_layernorm.weight",)
            )
            take(layer.post_attention_layernorm.weight, w, pre_mlp, f"{j}.post_attention_layernorm", norm=True)
        h = self.config.hidden_size
        deepest = max(range(len(self.config.aux_layer_ids)), key=lambda k: self.config.aux_layer_ids[k])
        self.fc.weight.zero_()
        self.fc.weight[:, deepest * h : (deepest + 1) * h].copy_(torch.eye(h))
        take(self.hidden_norm.weight, t[src[0]], ("input_layernorm.weight",), "hidden_norm", norm=True)
        return {"source_layers": src, "copied": copied, "skipped": skipped}

    @torch.no_grad()
    def set_vocab_mapping(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if not self.use_draft_vocab:
            raise ValueError("set_vocab_mapping needs draft_vocab_size < target vocab")
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape or int(t2d.sum()) != d2t.numel():
            raise ValueError("vocab mapping shapes do not match the drafter config")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)
        self.refresh_draft_head()

    @torch.no_grad()
    def refresh_draft_head(self) -> None:
        if self.lm_head is not None and bool(self.t2d.any()):
            self.lm_head.weight.copy_(self.verifier_lm_head.weight[self.draft_to_target_ids()])

    def draft_to_target_ids(self) -> torch.Tensor:
        vd = self.config.draft_vocab_size
        base = torch.arange(vd, device=self.fc.weight.device)
        return base if self.d2t is None else base + self.d2t

    # ---- computation ---------------------------------------------------------------------
    def context_features(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        return self.hidden_norm(self.fc(aux_hidden.to(self.fc.weight.dtype)))

    def verifier_logits(self, last_hidden: torch.Tensor, draft_columns: bool = False) -> torch.Tensor:
        """The frozen target's logits, in float32 even under autocast: they are the label.
        `draft_columns`: only the draft vocabulary's (the draft head holds the target head's rows)."""
        w = self.lm_head.weight if draft_columns else self.verifier_lm_head.weight
        with torch.autocast(last_hidden.device.type, enabled=False):
            return self._target_head(self.verifier_norm(last_hidden.float()), w)

    def _target_head(self, normed: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """float32 logits of the target head's vocabulary rows `w` for final-normed states,
        soft-capped where the target caps them (callers disable autocast)."""
        logits = normed @ w.float().t()
        cap = self.config.target_logit_softcap
        return cap * torch.tanh(logits / cap) if cap else logits

    def verifier_draft_logits_and_norm(self, last_hidden: torch.Tensor):
        """The target's logits on the draft vocabulary's columns `[rows, V_draft]` and each row's
        full-vocabulary log-normaliser `[rows]`, in float32, without the `[rows, V_target]`
        product in memory: the head runs over blocks of `norm_chunk_columns` vocabulary rows
        with a running maximum and sum (an online logsumexp); each block's draft columns are
        kept as it passes. Why: at the local job's shapes (a few hundred rows, 49,152 columns,
        576 wide) the one product writes ~60-120 MB, fresh pages each step, that the logsumexp
        then reads twice. On a 2-core AMD EPYC (Zen 4, bf16 weights, this head in fp32;
        `benchmarks/trainer_step.py`) a first-epoch step's target head took 0.24-0.26 s instead
        of 0.32-0.37 s on 2 threads and 0.37-0.43 s instead of 0.60-0.65 s on one; the step
        0.61-0.70 s instead of 0.68-0.77 s and 0.96-1.10 s instead of 1.19-1.31 s. The same sums
        in another order: equal to rounding.
        `norm_chunk_columns` 0: the one product (the baseline the benchmark compares with)."""
        cols = self.norm_chunk_columns or self.config.target_vocab_size
        w = self.verifier_lm_head.weight
        ids = self.draft_to_target_ids()
        # Draft ids in target order with their draft columns, so each block finds its own by
        # bisection (d2t maps to increasing ids in every format we write; this does not rely on it).
        sorted_ids, draft_cols = torch.sort(ids)
        starts = range(0, w.shape[0], cols)
        bounds = torch.searchsorted(sorted_ids, torch.arange(0, w.shape[0] + cols, cols, device=ids.device)).tolist()
        rows = last_hidden.shape[0]
        out = last_hidden.new_empty((rows, ids.numel()), dtype=torch.float32)
        run_max = last_hidden.new_full((rows,), float("-inf"), dtype=torch.float32)
        run_sum = last_hidden.new_zeros((rows,), dtype=torch.float32)
        with torch.autocast(last_hidden.device.type, enabled=False):
            x = self.verifier_norm(last_hidden.float())
            for i, start in enumerate(starts):
                block = self._target_head(x, w[start : start + cols])
                new_max = torch.maximum(run_max, block.amax(-1))
                run_sum = run_sum * torch.exp(run_max - new_max) + torch.exp(block - new_max[:, None]).sum(-1)
                run_max = new_max
                lo, hi = bounds[i], bounds[i + 1]
                if hi > lo:
                    out[:, draft_cols[lo:hi]] = block[:, sorted_ids[lo:hi] - start]
        return out, run_max + torch.log(run_sum)

    def target_logits_at(self, last_hidden: torch.Tensor, known_log_norm: torch.Tensor | None):
        """The target's logits at these rows, and their log-normalisers. Without `known_log_norm`
        (or with the full vocabulary as draft vocabulary): all logits, no normaliser. With it
        (NaN where unknown): the draft vocabulary's columns and every row's normaliser; the
        full-vocabulary product, the most expensive one in a step, runs only for unknown rows."""
        if known_log_norm is None or not self.use_draft_vocab:
            return self.verifier_logits(last_hidden), None
        unknown = torch.isnan(known_log_norm)
        norm = known_log_norm.clone()
        out = last_hidden.new_empty((last_hidden.shape[0], self.config.draft_vocab_size), dtype=torch.float32)
        if bool(unknown.any()):
            out[unknown], norm[unknown] = self.verifier_draft_logits_and_norm(last_hidden[unknown])
        if not bool(unknown.all()):
            out[~unknown] = self.verifier_logits(last_hidden[~unknown], draft_columns=True)
        return out, norm

    def backbone(self, block_ids, block_pos, anchor_pos, ctx_kv, ctx_pos, ctx_mask) -> torch.Tensor:
        """Normed hidden states `[N, γ, H]` of blocks over precomputed context K/V per layer."""
        x = self.embed_tokens(block_ids).to(self.fc.weight.dtype)
        cos, sin = rope_cos_sin(block_pos, self.config.head_dim, self.config.rope_theta, x.dtype)
        for layer, kv in zip(self.layers, ctx_kv):
            mask = ctx_mask
            if layer.window is not None:
                mask = mask & (ctx_pos[None, :] >= anchor_pos[:, None] - layer.window)
            x = layer(x, kv, mask, cos, sin)
        return self.norm(x)

    def project_context(self, ctx: torch.Tensor, ctx_pos: torch.Tensor):
        cos, sin = rope_cos_sin(ctx_pos, self.config.head_dim, self.config.rope_theta, ctx.dtype)
        return [layer.self_attn.project_context(ctx, cos, sin) for layer in self.layers]

    def confidence_logits(self, hidden: torch.Tensor, prev_emb: torch.Tensor | None) -> torch.Tensor:
        assert self.confidence_head is not None
        return self.confidence_head(hidden, prev_emb if self.config.confidence_head_with_markov else None)

    def forward(self, batch: PackedBatch, anchors: torch.Tensor) -> BlockOutputs:
        """Teacher-forced blocks at `anchors` (packed positions), all in one pass."""
        cfg, g, s = self.config, self.config.block_size, self.config.slot_shift
        t = batch.num_tokens
        dev = batch.input_ids.device
        offs = torch.arange(g, device=dev)
        block_ids = torch.full((anchors.numel(), g), cfg.mask_token_id, dtype=torch.long, device=dev)
        block_ids[:, 0] = batch.input_ids[anchors]
        anchor_pos = batch.position_ids[anchors]
        anchor_doc = batch.doc_ids[anchors]
        ctx_mask = (batch.doc_ids[None, :] == anchor_doc[:, None]) & (
            torch.arange(t, device=dev)[None, :] < anchors[:, None]
        )
        ctx = self.context_features(batch.aux_hidden)
        ctx_kv = self.project_context(ctx, batch.position_ids)
        hidden = self.backbone(block_ids, anchor_pos[:, None] + offs, anchor_pos, ctx_kv, batch.position_ids, ctx_mask)
        logits = hidden @ self.draft_head_weight.t().to(hidden.dtype)

        tgt = anchors[:, None] + offs + s
        tgt_c = tgt.clamp(max=t - 1)
        valid = (tgt < t) & (batch.doc_ids[tgt_c] == anchor_doc[:, None]) & batch.loss_mask[tgt_c].bool()
        if s == 0:
            valid[:, 0] = False
        prev_idx = torch.maximum(tgt_c - 1, anchors[:, None])
        prev_ids = batch.input_ids[prev_idx]
        with torch.no_grad(), record_function("dspark.target_logits"):
            # Overlapping blocks share target positions: the full-vocab target head (the most
            # expensive product here) runs once per distinct position, not once per slot.
            positions, target_index = torch.unique(prev_idx, return_inverse=True)
            known = None if batch.target_log_norm is None else batch.target_log_norm[positions]
            target_logits, log_norm = self.target_logits_at(batch.last_hidden[positions], known)

        prev_emb = None
        if self.markov_head is not None:
            prev_emb = self.markov_head.embed(prev_ids)
            logits = logits + self.markov_head.block_bias(prev_emb, hidden).to(logits.dtype)
        conf = self.confidence_logits(hidden, prev_emb) if self.confidence_head is not None else None
        return BlockOutputs(
            logits, conf, target_logits, batch.input_ids[tgt_c], valid, hidden, target_index, log_norm, positions
        )

    def sample_anchors(self, batch: PackedBatch, num_anchors: int, generator=None) -> torch.Tensor:
        return sample_anchors(
            batch.loss_mask, batch.doc_ids, self.config.block_size, num_anchors, self.config.slot_shift, generator
        )

    # ---- inference -----------------------------------------------------------------------
    @torch.no_grad()
    def propose(
        self,
        cache: ContextCache,
        anchor_token: int,
        num_tokens: int | None = None,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        """Draft up to `num_tokens` tokens after `anchor_token` (at position `cache.length`)."""
        return self.propose_batch([cache], [anchor_token], [num_tokens], temperature, generator)[0]

    @torch.no_grad()
    def propose_batch(
        self,
        caches: list[ContextCache],
        anchor_tokens: list[int],
        num_tokens: list[int | None],
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> list[Proposal]:
        """Draft a block for each of several sequences in one backbone pass.

        The sequences' contexts are laid side by side and each block attends to its own
        sequence's only (the document mask of training), so a row drafts what it would alone.
        One backbone pass gives every slot's base logits; the Markov head then samples left to
        right, each slot conditioned on the token just drafted in its row. `temperature == 0`
        drafts greedily (no distribution is returned); otherwise `probs` is the exact
        distribution each token was drawn from, which lossless verification needs.
        """
        cfg, dev = self.config, self.fc.weight.device
        n, g, s = len(caches), cfg.block_size, cfg.slot_shift
        budgets = [cfg.num_speculative_tokens if k is None else min(k, cfg.num_speculative_tokens) for k in num_tokens]
        lengths = torch.tensor([c.length for c in caches], device=dev)
        block_ids = torch.full((n, g), cfg.mask_token_id, dtype=torch.long, device=dev)
        block_ids[:, 0] = torch.tensor(anchor_tokens, device=dev)
        pos = lengths[:, None] + torch.arange(g, device=dev)
        ctx_pos = torch.cat([torch.arange(c.length, device=dev) for c in caches])
        ctx_row = torch.repeat_interleave(torch.arange(n, device=dev), lengths)
        ctx_mask = ctx_row[None, :] == torch.arange(n, device=dev)[:, None]
        if any(c.kv is None for c in caches):
            empty = self.project_context(
                torch.zeros(0, cfg.hidden_size, device=dev, dtype=self.fc.weight.dtype),
                torch.zeros(0, dtype=torch.long, device=dev),
            )
        per_layer = zip(*[c.kv if c.kv is not None else empty for c in caches])
        kv = [(torch.cat([k for k, _ in layer], 1), torch.cat([v for _, v in layer], 1)) for layer in per_layer]
        hidden = self.backbone(block_ids, pos, lengths, kv, ctx_pos, ctx_mask)  # [n, γ, H]
        base = hidden @ self.draft_head_weight.t().to(hidden.dtype)  # [n, γ, Vd]
        to_target = self.draft_to_target_ids()
        temps = cfg.confidence_temperatures
        prev = block_ids[:, 0]
        drafted, probs, confs = [], [], []
        state = self.markov_head.init_state((n,), hidden[:, 0]) if self.markov_head is not None else None
        for k in range(min(g, max(budgets, default=0) + 1 - s)):
            logit, emb = base[:, k].float(), None
            if self.markov_head is not None:
                emb = self.markov_head.embed(prev)
                bias, state = self.markov_head.step(emb, hidden[:, k], state)
                logit = logit + bias.float()
            if k < 1 - s:  # DFlash: slot 0 is the anchor itself, nothing to draft
                continue
            if self.confidence_head is not None:
                z = self.confidence_logits(hidden[:, k], emb).float()
                j = len(drafted)
                if temps is not None and j < len(temps):
                    z = z / temps[j]
                confs.append(torch.sigmoid(z))
            if temperature <= 0:
                d = torch.argmax(logit, -1)
            else:
                q = torch.softmax(logit / temperature, dim=-1)
                d = torch.multinomial(q, 1, generator=generator).squeeze(-1)
                full = torch.zeros(n, cfg.target_vocab_size, device=dev)
                full[:, to_target] = q
                probs.append(full)
            prev = to_target[d]
            drafted.append(prev)
        out = []
        for r, budget in enumerate(budgets):
            m = min(budget, len(drafted))
            out.append(
                Proposal(
                    torch.stack([t[r] for t in drafted[:m]]) if m else torch.zeros(0, dtype=torch.long, device=dev),
                    torch.stack([p[r] for p in probs[:m]]) if probs and m else None,
                    torch.stack([c[r] for c in confs[:m]]) if confs and m else None,
                )
            )
        return out
