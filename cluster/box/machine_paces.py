"""`probe_paces`: what this machine does, measured in the driver before anything is placed, for
the box's plan (`plan`).

- **Trainer**: the job's drafter (its config, the target's weights) on synthetic samples of the
  job's shapes (prompt + answer tokens; random hidden states of the target's layers, in its
  dtype): a first-epoch step (the target's full-vocabulary normaliser, forward, loss, backward,
  AdamW) at each thread count, and a later-epoch step (the normaliser cached) at the last; each
  after one untimed step, the least disturbed of up to three readings, then scaled to the job's
  own steps (`JOB_STEP_OVER_PROBE`: store reads, DeepSpeed's engine, checkpoints).
- **Generation**: the target's decode step in transformers (KV cache, the replica's batch),
  at each replica thread count, scaled by how much faster vLLM's CPU engine decodes than that
  (`VLLM_OVER_TRANSFORMERS`, measured). A probe of vLLM itself would start an engine (tens of
  seconds) only to start another.

A CPU quota (a cgroup's `cpu.max`, `systemd-run -p CPUQuota=`) slows both as it slows the job:
the probe runs under it. The paces are a projection, not a promise: the job measures its own
as it goes, and the time budget's `EpochPlanner` keeps the epochs the real pace trains.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

from cluster.box.plan import Paces

# vLLM's CPU engine tokens/s over this probe's at the same batch (64) and threads, the local
# target, greedy: on a 2-core Xeon (Ice Lake, family 6 model 106, fp32) `benchmarks/generation.py`'s
# plain vLLM (iomp, tcmalloc) made 147 tok/s on one thread and 259 on two, the probe 198-212 and
# 303-324, and the local job's replica generated its answers at about 185 tok/s on one thread and
# 260 on two (the engine also prefills real prompts and schedules): 0.83-0.9.
VLLM_OVER_TRANSFORMERS = 0.85
# A trainer rank's step in the job over the probe's on the same shapes: the job's also reads its
# samples from the store, runs DeepSpeed's engine and checkpoints. On that Xeon the local job's
# later-epoch steps took 0.49 s of wall clock each against the probe's 0.38.
JOB_STEP_OVER_PROBE = 1.3
# Under a CPU quota that binds (fewer cores' worth than the affinity gives) every process of the
# job spends it, Ray's own and the idle engine's too, where on free cores they take the spare
# ones: under a quota of 0.66 cores the later-epoch steps took 1.87 s against the 1.46 s
# projected.
QUOTA_STEP_OVER_FREE = 1.3


@contextmanager
def torch_threads(n: int):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def probe_trainer(
    cfg, target_dir, prompt_tokens: int, answer_tokens: int, threads: list[int], repeats: int = 3
) -> tuple[dict[int, float], dict[int, float]]:
    """Seconds per step at each thread count on samples of prompt + answer tokens: in their first
    epoch (the target's full-vocabulary normaliser computed), and at the last thread count in a
    later one (the normaliser cached, as a trainer rank keeps it). The optimizer's learning rate
    is 0 at its first steps: the weights the steps see stay put."""
    import itertools

    import torch

    from dspark.config import DSparkConfig
    from dspark.losses import LossWeights
    from dspark.model import DSparkDrafter
    from dspark.samples import Sample
    from dspark.training import DrafterObjective, OptimConfig, build_optimizer, token_budget_batches

    d, t = cfg.drafter, cfg.trainer
    dcfg = DSparkConfig.from_target(
        target_dir,
        mode=d.mode,
        num_layers=d.num_layers,
        block_size=d.block_size,
        markov_rank=d.markov_rank,
        draft_vocab_size=d.draft_vocab_size,
        num_aux_layers=cfg.target.num_aux_layers,
    )
    gen = torch.Generator().manual_seed(0)
    model = DSparkDrafter(dcfg)
    model.load_target_weights(target_dir)
    if model.use_draft_vocab:
        # the draft vocabulary: the first ids (which ones does not change a step's cost); d2t
        # holds offsets (draft id + d2t = target id), as in speculators
        t2d = torch.zeros(dcfg.target_vocab_size, dtype=torch.bool)
        t2d[: dcfg.draft_vocab_size] = True
        model.set_vocab_mapping(torch.zeros(dcfg.draft_vocab_size, dtype=torch.long), t2d)
    opt, _ = build_optimizer(model, OptimConfig(lr=t.lr, warmup_steps=1, total_steps=100))
    objective = DrafterObjective(
        model,
        LossWeights(d.ce_weight, d.l1_weight, d.confidence_weight, d.decay),
        d.num_anchors,
        autocast_dtype=torch.bfloat16 if t.precision == "bf16-mixed" else None,
        cache_normalizers=True,
    )
    hidden_dtype = torch.float32 if cfg.target.dtype == "float32" else torch.bfloat16
    tokens = prompt_tokens + answer_tokens
    layer_ids = dcfg.extract_layer_ids

    def sample() -> Sample:
        ids = torch.randint(0, dcfg.draft_vocab_size, (tokens,), generator=gen)
        mask = torch.zeros(tokens, dtype=torch.bool)
        mask[prompt_tokens:] = True
        hidden = torch.randn(tokens, len(layer_ids), dcfg.hidden_size, generator=gen).to(hidden_dtype)
        return Sample(ids, mask, hidden, list(layer_ids))

    batch = next(
        iter(token_budget_batches([sample() for _ in range(max(1, t.batch_tokens // tokens))], t.batch_tokens))
    )
    dtype = torch.float32 if t.precision == "fp32" else torch.bfloat16
    fresh = itertools.count()

    def step(keys: list[str]) -> None:
        loss, _ = objective(objective.pack(batch, dtype=dtype, keys=keys), module=model)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def first_epoch() -> None:  # keys never seen: the normaliser is computed
        step([f"s{next(fresh)}" for _ in batch])

    def reading(fn) -> float:
        fn()  # untimed: first-touch allocations, oneDNN's kernel choice for this thread count
        times = [timed(fn)]
        while len(times) < repeats and sum(times) < 3.0:  # a slow box's step: fewer readings
            times.append(timed(fn))
        return min(times)  # the least disturbed (measured: a reading beside a job's teardown took 2x)

    first, later = {}, {}
    for n in threads:
        with torch_threads(n):
            first[n] = reading(first_epoch)
    seen = [f"later{i}" for i in range(len(batch))]
    with torch_threads(threads[-1]):
        later[threads[-1]] = reading(lambda: step(seen))  # the first call caches, the rest read it
    return first, later


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def probe_generation(
    target_dir, dtype: str, batch: int, threads: list[int], context: int = 8, steps: int = 6
) -> dict[int, float]:
    """Tokens/s of the target's batched decode at each thread count, scaled to vLLM's engine.
    A short context: a 135M target's decode step is its weights' matmuls at any context of a few
    hundred tokens, and the prefill of a long one cost 20 s of the probe's 30 on one thread."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=getattr(torch, dtype))
    model.eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.config.vocab_size, (batch, context), generator=gen)
    paces = {}
    for n in threads:
        with torch_threads(n), torch.inference_mode():
            past = model(ids, use_cache=True).past_key_values
            token = ids[:, -1:]
            model(token, past_key_values=past, use_cache=True)  # untimed
            best = float("inf")
            for _ in range(2):  # the less disturbed of two readings
                t0 = time.perf_counter()
                for _ in range(steps):
                    past = model(token, past_key_values=past, use_cache=True).past_key_values
                best = min(best, time.perf_counter() - t0)
            paces[n] = batch * steps / best * VLLM_OVER_TRANSFORMERS
            past = None
    return paces


def probe_paces(
    cfg, target_dir, cores: int, prompt_tokens: int, answer_tokens: int, quota_binds: bool = False
) -> tuple[Paces, float]:
    """The paces at every thread count the plan may choose (replica and trainer 1..cores), and
    the probe's own seconds. `quota_binds`: a CPU quota below the cores the affinity gives."""
    t0 = time.perf_counter()
    replica_threads = list(range(1, cores + 1))
    generation = probe_generation(
        target_dir, cfg.target.dtype, min(cfg.inference.prompt_batch, cfg.target.max_num_seqs), replica_threads
    )
    first, later = probe_trainer(cfg, target_dir, prompt_tokens, answer_tokens, list(range(1, cores + 1)))
    scale = JOB_STEP_OVER_PROBE * (QUOTA_STEP_OVER_FREE if quota_binds else 1.0)
    first = {n: s * scale for n, s in first.items()}
    later = {n: s * scale for n, s in later.items()}
    return Paces(generation, first, later, source="probe"), time.perf_counter() - t0
