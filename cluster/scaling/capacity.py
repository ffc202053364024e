"""The capacity plan `--plan` prints: what the topology moves and holds, per group, in figures an
operator can check by hand.

From the target's config: hidden-state bytes per token (stored layers × hidden size × dtype
size), and what a token takes in a replica's KV cache on each rank: the target's attention and the
hidden-state capture's own cache group, whole on every rank (`replica_kv_per_token`). From the
drafter settings: its parameters, trainable and frozen (counted on a model built on PyTorch's meta
device: exact, no memory), and the model state per trainer rank. From
`capacity.*` (expected rates) and the topology: per group, the tokens/s and GB/s its replicas
put into the store and its ranks can train, which side limits, the network a sample crosses
(once, from a replica node's store daemon to a trainer node's), and the store memory: what the
producers may hold before they pause, and what the samples trained between two checkpoints
take (they stay in the store until the checkpoint commits them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from cluster.config import JobConfig
from cluster.config_checks import check_against_target
from cluster.scaling.placement import node_chunks, role_specs

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}
GB, GIB = 1e9, 2**30


@dataclass
class KvPerToken:
    """What one token takes in a replica's KV cache on each of its tensor-parallel ranks, in two
    parts with their arithmetic: the target's attention layers, and the hidden-state capture's
    cache layer (`cluster.inference.capture_model`), which vLLM gives a KV-cache group of its own
    (one latent row of captured states x hidden size per token, as MLA's: no separate values) and
    does not split over the ranks: every rank holds every token's captured states whole."""

    attention: int
    attention_formula: str
    hidden_states: int
    hidden_states_formula: str

    @property
    def total(self) -> int:
        return self.attention + self.hidden_states


def attention_layers(tc) -> int:
    """The target's layers with a per-token KV cache: all, less a hybrid model's linear-attention
    layers (whose state is a fixed size per sequence): Kimi Linear's `linear_attn_config`
    names its full-attention (MLA) layers; transformers' `layer_types` marks linear ones."""
    linear = getattr(tc, "linear_attn_config", None) or {}
    if linear.get("full_attn_layers"):
        return len(linear["full_attn_layers"])
    types = getattr(tc, "layer_types", None)
    if types:
        return sum(t != "linear_attention" for t in types)
    return tc.num_hidden_layers


def replica_kv_per_token(cfg: JobConfig, tc, states: int, hidden_size: int) -> KvPerToken:
    """Bytes per token per rank of a replica's KV cache (`KvPerToken`). Attention: multi-head
    latent attention (`kv_lora_rank`) keeps one latent of `kv_lora_rank + qk_rope_head_dim` per
    layer, the same on every rank; other attention keeps keys and values of its KV heads, split
    over the ranks (a rank keeps one head at least). In `target.kv_cache_dtype` (fp8: 1 B; auto:
    the model's dtype). The capture: `states` x `hidden_size` in the model's dtype (its layer
    refuses a quantized cache), on every rank."""
    t = cfg.target
    item = DTYPE_BYTES.get(t.dtype, 2)
    kv_item = 1 if t.kv_cache_dtype.startswith("fp8") else DTYPE_BYTES.get(t.kv_cache_dtype, item)
    kv_name = t.kv_cache_dtype if t.kv_cache_dtype != "auto" else t.dtype
    layers = attention_layers(tc)
    if getattr(tc, "kv_lora_rank", None):
        latent = tc.kv_lora_rank + tc.qk_rope_head_dim
        attention = layers * latent * kv_item
        formula = (
            f"{layers} MLA layers x ({tc.kv_lora_rank} + {tc.qk_rope_head_dim}) x {kv_item} B ({kv_name}; "
            f"not split over ranks) = {attention:,} B"
        )
    else:
        heads = getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        per_rank = max(1, heads // t.tensor_parallel_size)
        attention = layers * 2 * per_rank * head_dim * kv_item
        formula = (
            f"{layers} layers x 2 x {per_rank} KV heads ({heads} over TP {t.tensor_parallel_size}) x {head_dim} "
            f"x {kv_item} B ({kv_name}) = {attention:,} B"
        )
    captured = states * hidden_size * item
    return KvPerToken(
        attention,
        formula,
        captured,
        f"{states} x {hidden_size} x {item} B ({t.dtype}; its own KV-cache group, whole on every rank) "
        f"= {captured:,} B",
    )


def group_watermarks(cfg: JobConfig, groups_on_node: dict[str, set[str]] | None = None) -> dict[str, tuple[int, int]]:
    """Per group, the stored-but-untrained bytes at which its producers pause and resume: a
    fraction of its share of store memory. A group's samples sit on the daemons of the nodes its
    replicas run on; groups whose replicas share a node (`groups_on_node`: node -> groups, from
    the placement) split that node's segment by need, in proportion to how many replicas each
    may run (`max_replicas`: what it can put in at once), a group on several nodes taking its
    smallest share; the groups split the master's memory the same way when the master lends it.
    Without a placement each group is taken to have its nodes to itself."""
    t, groups = cfg.transport, cfg.topology.groups
    need = {g.name: max(g.max_replicas, g.inference_replicas, 1) for g in groups}
    if t.segment_host == "master":
        groups_on_node = {"master": set(need)}
    share = {name: 1.0 for name in need}
    for names in (groups_on_node or {}).values():
        total = sum(need[n] for n in names if n in need)
        for n in names:
            if n in need:
                share[n] = min(share[n], need[n] / total)
    seg = t.segment_mb << 20
    return {n: (int(seg * share[n] * t.high_watermark), int(seg * share[n] * t.low_watermark)) for n in need}


def groups_on_nodes(placed) -> dict[str, set[str]]:
    """Node id -> the groups whose replicas were placed on it (`Placed` inference roles)."""
    out: dict[str, set[str]] = {}
    for p in placed:
        if p.spec.role == "inference":
            for node in set(p.bundle_nodes):
                out.setdefault(node, set()).add(p.spec.group)
    return out


def size(n: float) -> str:
    """Bytes in decimal units, readable at any scale."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:.0f} B"


def nodes_used(gpu_chunks: list[float], per_node: int) -> int:
    """Nodes of `per_node` GPUs a group's per-node shares pack into (first fit decreasing; the
    single-node split packs a replica and a trainer into one); CPU-only groups: one."""
    if not per_node:
        return 1
    free: list[float] = []
    for c in sorted(gpu_chunks, reverse=True):
        i = next((k for k, f in enumerate(free) if f >= c), None)
        if i is None:
            free.append(per_node - c)
        else:
            free[i] -= c
    return len(free)


def target_config(cfg: JobConfig):
    """The target's (text) config: from `target.path` if it is here, else `target.plan_config`."""
    from transformers import PretrainedConfig

    from cluster.config import LOCAL_TARGET, RANDOM_TARGET
    from cluster.target import read_config, resolve_target

    if cfg.target.path in (LOCAL_TARGET, RANDOM_TARGET) or (Path(cfg.target.path) / "config.json").exists():
        tc = read_config(resolve_target(cfg), cfg.target.trust_remote_code)
    elif cfg.target.plan_config:
        d = json.loads(Path(cfg.target.plan_config).read_text())
        tc = PretrainedConfig(**(d.get("text_config") or d))
        tc._name_or_path = cfg.target.path
    else:
        raise FileNotFoundError(
            f"capacity plan: target.path={cfg.target.path} has no config.json here; "
            f"set target.plan_config to a copy of it"
        )
    return getattr(tc, "text_config", None) or tc


@dataclass
class DrafterSize:
    trainable: int
    frozen: int
    config: object  # DSparkConfig

    def state_bytes_per_rank(self, precision: str, zero_stage: int, world: int) -> float:
        """Weights, gradients and Adam moments on one rank (activations not included).
        bf16-mixed / fp32: fp32 weights and gradients; bf16: bf16 weights and gradients plus an
        fp32 master copy. ZeRO-1 partitions the optimizer state, ZeRO-2 the gradients too."""
        weight, grad, master = (2, 2, 4) if precision == "bf16" else (4, 4, 0)
        optim = 8 + master  # Adam's two moments (+ the master copy), fp32
        per_param = weight + grad / (world if zero_stage >= 2 else 1) + optim / (world if zero_stage >= 1 else 1)
        return self.trainable * per_param + self.frozen * weight


def drafter_size(cfg: JobConfig, tcfg) -> DrafterSize:
    """The drafter the job would build for this target, counted on the meta device."""
    import torch

    from dspark.config import DSparkConfig, default_aux_layer_ids
    from dspark.model import DSparkDrafter

    d = cfg.drafter
    dspark = d.mode == "dspark"
    aux = cfg.target.aux_layer_ids or default_aux_layer_ids(tcfg.num_hidden_layers, cfg.target.num_aux_layers)
    dc = DSparkConfig.from_target(
        tcfg,
        mode=d.mode,
        num_layers=d.num_layers,
        block_size=d.block_size,
        markov_rank=d.markov_rank if dspark else 0,
        markov_head_type=d.markov_head_type,
        enable_confidence_head=d.enable_confidence_head if dspark else False,
        draft_vocab_size=d.draft_vocab_size,
        aux_layer_ids=list(aux),
        mask_token_id=d.mask_token_id if d.mask_token_id is not None else 0,
    )
    with torch.device("meta"):
        model = DSparkDrafter(dc)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return DrafterSize(trainable, frozen, dc)


def plan(cfg: JobConfig) -> str:
    tc = target_config(cfg)
    check_against_target(cfg, tc)
    drafter = drafter_size(cfg, tc)
    dc = drafter.config
    states = len(dc.extract_layer_ids)
    item = DTYPE_BYTES.get(cfg.target.dtype, 2)
    per_token = states * dc.hidden_size * item
    groups = cfg.topology.groups
    world = sum(g.trainer_ranks for g in groups)
    t, cap = cfg.trainer, cfg.capacity
    state = drafter.state_bytes_per_rank(t.precision, t.zero_stage, world)
    kv = replica_kv_per_token(cfg, tc, states, dc.hidden_size)
    out = [
        f"capacity plan: target {cfg.target.path} (hidden {dc.hidden_size}, {dc.target_num_layers} layers, "
        f"vocab {dc.target_vocab_size}); {states} hidden states per token "
        f"(aux layers {list(dc.aux_layer_ids)} + the last)",
        f"  hidden states: {states} x {dc.hidden_size} x {item} B ({cfg.target.dtype}) = {per_token:,} B per token "
        f"(+5 B of token id and loss mask)",
        f"  replica KV cache per token on each rank: {kv.total:,} B = attention {kv.attention_formula} "
        f"+ hidden-state capture {kv.hidden_states_formula}",
        f"  drafter: {dc.num_layers} layers, {drafter.trainable:,} trainable parameters "
        f"({drafter.trainable / 1e9:.2f} B), "
        f"{drafter.frozen:,} frozen ({drafter.frozen / 1e9:.2f} B: the target's embedding, final norm and LM head"
        f"{', the reduced draft head' if dc.draft_vocab_size != dc.target_vocab_size else ''})",
        f"  model state per trainer rank: {state / GIB:.1f} GiB "
        f"({t.precision}, ZeRO-{t.zero_stage} over {world} ranks; activations not included)",
        f"  one step: {world} ranks x {t.batch_tokens:,} tokens = {world * t.batch_tokens:,} tokens "
        f"= {size(world * t.batch_tokens * per_token)} of hidden states read",
    ]
    # before placement: CPU groups are taken to share one box (the local configs), GPU groups to
    # have their nodes to themselves
    marks = group_watermarks(cfg, {"cpu": {g.name for g in groups if not g.gpus_per_node}})
    specs = role_specs(cfg)
    for g in groups:
        nodes = nodes_used([c for sp in specs if sp.group == g.name for c, _ in node_chunks(sp)], g.gpus_per_node)
        high = marks[g.name][0]
        step_bytes = g.trainer_ranks * t.batch_tokens * per_token
        lines = [f"  group {g.name}: {g.inference_replicas} replica(s), {g.trainer_ranks} trainer rank(s)"]
        if cap.replica_tokens_per_s and cap.rank_tokens_per_s:
            made = g.inference_replicas * cap.replica_tokens_per_s
            can = g.trainer_ranks * cap.rank_tokens_per_s
            if not made:
                side = "no replicas: its ranks train what they borrow from other groups"
            elif can > made:
                side = (
                    f"inference: its ranks could train {can / made:.2f}x what its replicas make (they borrow or wait)"
                )
            else:
                side = (
                    f"training: its replicas make {made / can:.2f}x what its ranks train (the surplus is lent to "
                    f"other groups' ranks, or producers pause)"
                )
            lines += [
                f"    in:  {g.inference_replicas} x {cap.replica_tokens_per_s:,.0f} tok/s = {made:,.0f} tok/s "
                f"= {made * per_token / GB:.2f} GB/s into the store",
                f"    out: {g.trainer_ranks} x {cap.rank_tokens_per_s:,.0f} tok/s = {can:,.0f} tok/s "
                f"= {can * per_token / GB:.2f} GB/s read at full speed",
                f"    limits: {side}",
                f"    network: {min(made, can) * per_token / GB:.2f} GB/s from replica nodes to the trainer node "
                f"(each sample crosses once, daemon to daemon)"
                if nodes > 1 and made
                else "    network: none (the replica and the ranks share one node's store daemon)"
                if made
                else "    network: whatever its ranks borrow, daemon to daemon",
            ]
        held = (
            f"producers pause at {high / GIB:.1f} GiB held ({cfg.transport.high_watermark} of its share of one "
            f"node's segment)"
        )
        if cap.replica_tokens_per_s:
            held += f" = {high / per_token:,.0f} tokens"
            if g.inference_replicas:
                held += f" = {high / per_token / (g.inference_replicas * cap.replica_tokens_per_s):.0f} s of production"
        lines.append(f"    store: {nodes} node(s) x {cfg.transport.segment_mb / 1024:g} GiB lent; {held}")
        fits = high / step_bytes
        if t.release_samples == "after_step":
            lines.append(
                f"    a step of its ranks reads {size(step_bytes)}; trained samples leave the store after their "
                f"step (trainer.release_samples=after_step): what it may hold is {fits:.1f} steps of data"
                + (
                    ""
                    if fits >= 2
                    else ": WARNING steps will run part-full (lower trainer.batch_tokens or raise transport.segment_mb)"
                )
            )
        else:
            interval = t.checkpoint_interval * step_bytes
            note = (
                ""
                if fits >= t.checkpoint_interval
                else (
                    f" > what it may hold: WARNING the job will checkpoint early, "
                    f"about every {max(int(fits), 1)} step(s) "
                    f"(trainer.release_samples=after_step, lower trainer.batch_tokens or checkpoint_interval, or raise "
                    f"transport.segment_mb)"
                )
            )
            lines.append(
                f"    between checkpoints its ranks train {t.checkpoint_interval} steps x {size(step_bytes)} "
                f"= {size(interval)}, kept in the store until committed{note}"
            )
        out += lines
    return "\n".join(out)
