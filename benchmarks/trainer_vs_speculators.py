"""Our trainer against the reference trainer (`speculators`), same drafter, data and minutes:

    python benchmarks/trainer_vs_speculators.py [--minutes 2] [--threads 1,2] [--train-prompts 96]

Data, built once and cached under `--work`: the project's own prompts (`configs/local.yaml`'s
prompt files and train / held-out split), answered by other prompts' text (`--answers stand-in`,
the default, as `benchmarks/trainer_step.py`: seconds) or by the target's greedy answers
(`--answers greedy`: minutes on 2 cores); one hidden-state sample per training conversation from
the target's forward pass (SmolLM2-135M-Instruct, `dspark.hf_dataset.build_samples`).

Both trainers start from the same drafter (`configs/local.yaml`'s shape and `drafter.init`, the
draft vocabulary of the training samples' token counts), saved once in the speculators format:
- ours: `DSparkDrafter` + `DrafterObjective` (anchors, loss, the normaliser cache the job's ranks
  use) + `build_optimizer` (AdamW, warmup + cosine) + grad clipping 1.0, bf16 autocast where the
  job would use it; a plain torch loop (world of one) or, with `--ours-engine deepspeed`, the job's
  DeepSpeed engine (ZeRO stage from the config, gloo);
- speculators: `DSparkDraftModel.from_pretrained` of that checkpoint (its CLI's
  `--from-pretrained` path, `draft_attn_impl="sdpa"`: flex attention is for GPUs), its `Trainer`
  with a `TrainerConfig` (AdamW, cosine schedule with the same warmup and horizon rule, the same
  LR), `get_trainer_kwargs` for the loss (eager implementation: the fused one is Triton, GPU only)
  with our loss weights in its terms (`{"ce": w_ce, "tv": 2·w_l1}`: ‖p−q‖₁ = 2·TV; γ = our decay;
  confidence α = our weight), and a DataLoader of its own `CollateFn` over a `BaseDataset` of the
  same samples, in the same groups (`trainer.batch_tokens`) and the same order each epoch.
  `max_anchors` (blocks per packed batch) is our anchors per sample times the mean samples per batch.

Each trainer runs `--minutes` (after one untimed step). The LR horizon is each trainer's own steps
in its budget, from a short pace probe on a throw-away copy. At the end, both drafters are judged by
our evaluator (greedy speculative decoding of the held-out prompts with the target, τ = tokens per
verification) after `dspark.checkpoint.load_drafter` of each one's saved checkpoint (speculators':
its `save_pretrained`), and with `--answers greedy` by speculators' own validation metrics (its
model's forward in eval mode, as `Trainer.val_epoch` runs it: the expected acceptance length
`accept_len` and the greedy one `eal`) on the held-out samples, both checkpoints loaded back into
`DSparkDraftModel`. `--profile N` profiles N steps of each trainer
(torch.profiler, top operators by self CPU time).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class OutOfTime(Exception):
    pass


# ---- data ------------------------------------------------------------------------------------
def greedy_answers(target_dir, convs, max_new_tokens: int, cache: Path, dtype) -> dict[str, str]:
    """The target's greedy answer to each conversation's prompt (cached by id)."""
    import torch

    from dspark.chat import render_prompt
    from dspark.targets import load_target

    done = json.loads(cache.read_text()) if cache.exists() else {}
    todo = [c for c in convs if c.id not in done]
    if todo:
        model, tok = load_target(target_dir, dtype)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        for i in range(0, len(todo), 16):
            chunk = todo[i : i + 16]
            ids = [render_prompt(tok, c.prompt_messages) for c in chunk]
            width = max(map(len, ids))
            x = torch.tensor([[pad] * (width - len(r)) + r for r in ids])
            att = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids])
            with torch.no_grad():
                out = model.generate(
                    input_ids=x,
                    attention_mask=att,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                    eos_token_id=tok.eos_token_id,
                )
            for c, row in zip(chunk, out[:, width:].tolist()):
                row = row[: row.index(tok.eos_token_id)] if tok.eos_token_id in row else row
                done[c.id] = tok.decode(row, skip_special_tokens=True)
            cache.write_text(json.dumps(done))  # kept chunk by chunk: a slow machine resumes
            print(f"  answers: {len(done)} of {len(convs) + len(done) - len(todo)}", flush=True)
    return done


def build_data(args):
    import torch

    from cluster.config_load import load_config
    from cluster.data import load_prompts
    from dspark.config import DSparkConfig
    from dspark.hf_dataset import build_samples
    from dspark.prompts import Conversation
    from dspark.samples import read_sample
    from dspark.targets import prepare_smollm2

    cfg = load_config(ROOT / "configs" / "local.yaml")
    target = prepare_smollm2()
    train, held = load_prompts(cfg)
    train = train[: args.train_prompts]
    held = held[: args.heldout_prompts]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, cfg.target.dtype)
    if args.answers == "greedy":
        answers = greedy_answers(
            target, train + held, args.answer_tokens, work / f"answers-{args.answer_tokens}.json", dtype
        )
    else:  # as benchmarks/trainer_step.py: other prompts' text stands in for the target's answer
        texts = [m["content"] for c in train for m in c.prompt_messages]
        answers = {c.id: " ".join(texts[i + 1 : i + 6]) for i, c in enumerate(train)}

    def with_answer(c):
        return Conversation(c.id, c.prompt_messages + [{"role": "assistant", "content": answers[c.id]}])

    layer_ids = DSparkConfig.from_target(target, num_aux_layers=cfg.target.num_aux_layers).extract_layer_ids
    sample_dir = work / f"samples-{cfg.target.dtype}-{args.answers}-{args.answer_tokens}"
    train_s = [
        read_sample(p) for p in build_samples(target, [with_answer(c) for c in train], sample_dir, layer_ids, dtype)
    ]
    # held-out samples (speculators' validation metrics): the target's greedy answers only
    held_s = (
        [read_sample(p) for p in build_samples(target, [with_answer(c) for c in held], sample_dir, layer_ids, dtype)]
        if args.answers == "greedy"
        else []
    )
    return cfg, target, train, held, train_s, held_s


def initial_drafter(cfg, target, samples, out: Path):
    """The drafter both trainers start from, saved in the speculators format."""
    import torch
    from transformers import AutoTokenizer

    from cluster.training import vocab_mapping_from
    from dspark.checkpoint import save_drafter
    from dspark.config import DSparkConfig
    from dspark.model import DSparkDrafter

    d = cfg.drafter
    dcfg = DSparkConfig.from_target(
        target,
        mode=d.mode,
        num_layers=d.num_layers,
        block_size=d.block_size,
        markov_rank=d.markov_rank,
        draft_vocab_size=d.draft_vocab_size,
        num_aux_layers=cfg.target.num_aux_layers,
    )
    torch.manual_seed(cfg.trainer.seed)
    model = DSparkDrafter(dcfg)
    model.load_target_weights(target)
    if d.init == "target_layers":
        model.init_from_target_layers(target)
    eos = AutoTokenizer.from_pretrained(target).eos_token_id
    vocab = vocab_mapping_from(
        [(s.token_ids, s.loss_mask) for s in samples], dcfg.target_vocab_size, dcfg.draft_vocab_size, [eos]
    )
    model.set_vocab_mapping(torch.tensor(vocab["d2t"]), torch.tensor(vocab["t2d"]))
    return save_drafter(model, out)


def epoch_groups(groups: list, epoch: int, seed: int) -> list:
    order = list(groups)
    random.Random(seed + epoch).shuffle(order)
    return order


# ---- ours ------------------------------------------------------------------------------------
class Ours:
    name = "ours"

    def __init__(self, cfg, target, init_dir, samples, groups, horizon: int, engine: str) -> None:
        import torch

        from dspark.checkpoint import load_drafter
        from dspark.losses import LossWeights
        from dspark.training import DrafterObjective, OptimConfig, build_optimizer

        d, t = cfg.drafter, cfg.trainer
        self.model = load_drafter(init_dir, target).train()
        self.optim = OptimConfig(
            lr=t.lr,
            weight_decay=t.weight_decay,
            warmup_steps=t.warmup_steps,
            total_steps=horizon,
            min_lr_ratio=t.min_lr_ratio,
            grad_clip=t.grad_clip,
        )
        self.opt, self.sched = build_optimizer(self.model, self.optim)
        self.engine = None
        if engine == "deepspeed":
            import deepspeed

            from cluster.training import deepspeed_config

            self.engine, _, _, _ = deepspeed.initialize(
                model=self.model, optimizer=self.opt, lr_scheduler=self.sched, config=deepspeed_config(t, 1)
            )
        self.objective = DrafterObjective(
            self.model,
            LossWeights(d.ce_weight, d.l1_weight, d.confidence_weight, d.decay),
            d.num_anchors,
            seed=t.seed,
            autocast_dtype=torch.bfloat16 if t.precision == "bf16-mixed" else None,
            cache_normalizers=True,  # as the job's ranks: a sample's later epochs skip the full target head
        )
        self.dtype = torch.float32 if t.precision == "fp32" else torch.bfloat16
        self.samples, self.groups, self.seed = samples, groups, t.seed
        self.keys = {id(s): f"s{i}" for i, s in enumerate(samples)}
        self.steps = self.tokens = 0

    def batches(self):
        epoch = 0
        while True:
            for g in epoch_groups(self.groups, epoch, self.seed):
                yield [self.samples[i] for i in g]
            epoch += 1

    def run(self, budget_s: float, max_steps: int | None = None, on_step=None) -> None:
        """Steps until `budget_s` (wall) or `max_steps` have passed."""
        import torch

        t0 = time.perf_counter()
        for group in self.batches():
            batch = self.objective.pack(group, dtype=self.dtype, keys=[self.keys[id(s)] for s in group])
            if self.engine is not None:
                loss, _ = self.objective(batch, module=self.engine)
                self.engine.backward(loss)
                self.engine.step()
            else:
                loss, _ = self.objective(batch)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(
                    [p for p in self.model.parameters() if p.requires_grad], self.optim.grad_clip
                )
                self.opt.step()
                self.sched.step()
            self.steps += 1
            self.tokens += batch.num_tokens
            if on_step is not None:
                on_step()
            if time.perf_counter() - t0 >= budget_s or (max_steps and self.steps >= max_steps):
                return

    def save(self, out: Path) -> Path:
        from dspark.checkpoint import save_drafter

        return save_drafter(self.model, out)


# ---- speculators -----------------------------------------------------------------------------
def spec_model(ckpt_dir: Path, target):
    """A speculators DSpark drafter from a checkpoint, as its CLI's `--from-pretrained` builds it."""
    from speculators.models.dspark import DSparkDraftModel

    config = DSparkDraftModel.config_class.from_pretrained(str(ckpt_dir))
    config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001
    model = DSparkDraftModel.from_pretrained(str(ckpt_dir), config=config, verifier=str(target))
    return model.float()


def spec_loader(samples, groups, cfg, seed: int, shuffle: bool = True):
    import torch
    from speculators.train.data import BaseDataset, CollateFn
    from torch.utils.data import DataLoader

    from dspark.samples import pack

    aux_ids, last_id = None, None

    class Samples(BaseDataset):
        def __init__(self, items, max_len: int) -> None:
            self.items = items
            super().__init__(max_len, torch.bfloat16)

        def _compute_approx_lengths(self):
            return [s.num_tokens for s in self.items]

        def __len__(self) -> int:
            return len(self.items)

        def _get_raw_data(self, index: int):
            b = pack([self.items[index]], aux_ids, last_id)
            return {
                "hidden_states": b.aux_hidden,
                "input_ids": b.input_ids,
                "verifier_last_hidden_states": b.last_hidden,
                "loss_mask": b.loss_mask.long(),
            }

    class Groups:  # a batch sampler: our token-budget groups, reshuffled per epoch like ours
        def __init__(self) -> None:
            self.epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self):
            yield from (epoch_groups(groups, self.epoch, seed) if shuffle else groups)

        def __len__(self) -> int:
            return len(groups)

    from dspark.config import DSparkConfig

    dcfg = DSparkConfig.from_target(samples_target[0], num_aux_layers=cfg.target.num_aux_layers)
    aux_ids, last_id = dcfg.aux_layer_ids, dcfg.target_num_layers
    data = Samples(samples, cfg.trainer.batch_tokens)
    return DataLoader(
        data,
        batch_sampler=Groups(),
        num_workers=0,
        collate_fn=CollateFn(
            cfg.trainer.batch_tokens, dcfg.hidden_size, num_target_layers=len(aux_ids), dtype=torch.bfloat16
        ),
    )


samples_target: list = []  # the target dir, for `spec_loader` (set in main)


def spec_call_kwargs(cfg, max_anchors: int) -> dict:
    from speculators.models.dspark import DSparkDraftModel

    d = cfg.drafter
    train_kw, _ = DSparkDraftModel.get_trainer_kwargs(
        loss_fn=json.dumps({"ce": d.ce_weight, "tv": 2 * d.l1_weight}),
        loss_implementation="eager",
        dflash_decay_gamma=d.decay,
        max_anchors=max_anchors,
        confidence_head_alpha=d.confidence_weight,
    )
    return train_kw


class Spec:
    name = "speculators"

    def __init__(self, cfg, target, init_dir, samples, groups, horizon: int, max_anchors: int, save: Path) -> None:
        import torch
        from speculators.train import distributed as spec_dist
        from speculators.train.trainer import Trainer, TrainerConfig

        # A world of one on the CPU: the trainer moves the model and batches `.to(local_rank)`,
        # an index meaning cuda:N; "cpu" is where they are.
        spec_dist._local_rank = "cpu"  # noqa: SLF001
        t = cfg.trainer
        kw = spec_call_kwargs(cfg, max_anchors)
        self.loader = spec_loader(samples, groups, cfg, t.seed)
        config = TrainerConfig(
            lr=t.lr,
            num_epochs=10**6,
            save_path=str(save),
            resume_from_checkpoint=False,
            train_call_kwargs=kw,
            val_call_kwargs=kw,
            optimizer="adamw",
            weight_decay=t.weight_decay,
            scheduler_type="cosine",
            scheduler_warmup_steps=t.warmup_steps,
            scheduler_total_steps=horizon,
            hidden_states_dtype=torch.bfloat16 if t.precision != "fp32" else torch.float32,
            log_freq=10**9,
        )
        torch.manual_seed(t.seed)
        self.trainer = Trainer(spec_model(init_dir, target), config, self.loader)
        # Its autocast is on `torch.accelerator`'s device type, "cuda" where there is none
        # (disabled on a CPU tensor): the CPU's own, as our bf16-mixed trainer does.
        self.trainer.device_type = "cpu"
        # Its step timer (on at steps that are multiples of `log_freq`) synchronises
        # `torch.accelerator`, which raises without one: counted from 1, no step is a multiple.
        self.trainer.global_step = 1
        self.steps = self.tokens = 0
        self.epoch = 0

    def run(self, budget_s: float, max_steps: int | None = None, on_step=None) -> None:
        t0 = time.perf_counter()
        tr = self.trainer

        def step() -> None:
            self.steps += 1
            if on_step is not None:
                on_step()
            if time.perf_counter() - t0 >= budget_s or (max_steps and self.steps >= max_steps):
                raise OutOfTime

        try:
            while True:
                tr.train_epoch(self.epoch, step_callback=step)
                self.epoch += 1
        except OutOfTime:
            pass

    def save(self, out: Path) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        self.trainer.model.save_pretrained(str(out))
        return out


# ---- judging ---------------------------------------------------------------------------------
def tau_ours(ckpt: Path, target, held_convs, max_new_tokens: int) -> dict:
    import torch

    from dspark.chat import ChatFormat, render_prompt
    from dspark.checkpoint import load_drafter
    from dspark.decoder import DecodeStats, SpeculativeDecoder
    from dspark.targets import load_target

    drafter = load_drafter(ckpt, target).eval()
    model, tok = load_target(target, torch.float32)
    chat = ChatFormat.from_record(drafter.config.chat_format)
    prompts = [render_prompt(tok, c.prompt_messages, chat) for c in held_convs]
    dec = SpeculativeDecoder(model, drafter, "greedy", "standard", 0.0)
    total = DecodeStats()
    for _, stats in dec.generate_many(prompts, max_new_tokens, {tok.eos_token_id}):
        total.merge(stats)
    return {"tau": total.tau, "per_position": [round(a, 3) for a in total.per_position_acceptance]}


def spec_val(ckpt: Path, target, cfg, held, held_groups, max_anchors: int) -> dict:
    """speculators' validation metrics of a checkpoint on the held-out samples."""
    import torch
    from speculators.train.utils import normalize_counted_metrics

    model = spec_model(ckpt, target).eval()
    kw = spec_call_kwargs(cfg, max_anchors)
    loader = spec_loader(held, held_groups, cfg, 0, shuffle=False)
    torch.manual_seed(0)  # its anchors: the same draw for every checkpoint
    acc: dict = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.trainer.precision != "fp32"):
        for _ in range(3):
            for batch in loader:
                batch = {k: v for k, v in batch.items() if k != "error_records"}
                _, _, m = model(**batch, **kw)
                for k, v in m.items():
                    acc[k] = acc.get(k, 0.0) + float(v)
    m = normalize_counted_metrics(acc, 1)
    return {"accept_len": m.get("accept_len"), "eal": m.get("eal")}


def profile_steps(trainer, steps: int, top: int = 14) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.run(1e9, max_steps=trainer.steps + steps)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


# ---- main ------------------------------------------------------------------------------------
def run_one(kind: str, args, cfg, target, init_dir, train_s, groups, max_anchors, work: Path, threads: int):
    import torch

    torch.set_num_threads(threads)
    save = work / f"spec-trainer-{threads}"

    def make(horizon: int):
        if kind == "ours":
            return Ours(cfg, target, init_dir, train_s, groups, horizon, args.ours_engine)
        return Spec(cfg, target, init_dir, train_s, groups, horizon, max_anchors, save)

    # The LR horizon: this trainer's own steps in its budget, from a short probe on a throw-away copy.
    probe = make(10**6)
    probe.run(1e9, max_steps=2)
    t0, s0 = time.perf_counter(), probe.steps
    probe.run(1e9, max_steps=s0 + args.probe_steps)
    pace = (probe.steps - s0) / (time.perf_counter() - t0)
    horizon = max(cfg.trainer.warmup_steps + 1, int(pace * args.minutes * 60))
    del probe

    tr = make(horizon)
    tr.run(1e9, max_steps=1)  # untimed: first-call costs (allocations, lazy imports)
    s0 = tr.steps
    tok0 = tr.tokens if kind == "ours" else None
    spec_tokens = [0]
    if kind != "ours":  # real tokens of each batch its loader hands over
        orig = tr.loader.collate_fn

        def counting(items):
            out = orig(items)
            spec_tokens[0] += int((out["document_ids"] != -1).sum())
            return out

        tr.loader.collate_fn = counting
    t0 = time.perf_counter()
    tr.run(args.minutes * 60)
    dt = time.perf_counter() - t0
    steps = tr.steps - s0
    tokens = tr.tokens - tok0 if kind == "ours" else spec_tokens[0]
    prof = profile_steps(tr, args.profile) if args.profile else None
    ckpt = tr.save(work / f"final-{kind}-{threads}")
    return {
        "trainer": kind,
        "threads": threads,
        "seconds": dt,
        "steps": steps,
        "tokens_per_s": tokens / dt,
        "s_per_step": dt / max(1, steps),
        "horizon": horizon,
        "ckpt": str(ckpt),
        "profile": prof,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=2.0, help="training wall time per trainer and thread count")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--trainers", default="ours,speculators")
    ap.add_argument("--train-prompts", type=int, default=64)
    ap.add_argument("--heldout-prompts", type=int, default=8)
    ap.add_argument(
        "--answers",
        choices=["greedy", "stand-in"],
        default="stand-in",
        help="greedy: the target answers every prompt first (minutes on 2 cores); stand-in: other prompts' "
        "text, as benchmarks/trainer_step.py (held-out τ then judges drafters trained on text the target did "
        "not write, and speculators' validation metrics are left out)",
    )
    ap.add_argument("--answer-tokens", type=int, default=96)
    ap.add_argument("--eval-tokens", type=int, default=64, help="answer length of the τ evaluation")
    ap.add_argument("--probe-steps", type=int, default=4)
    ap.add_argument("--profile", type=int, default=0, help="profile this many steps of each trainer at the end")
    ap.add_argument("--ours-engine", choices=["plain", "deepspeed"], default="plain")
    ap.add_argument("--work", default=str(ROOT / "outputs" / "bench_trainer_vs_speculators"))
    args = ap.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    import logging

    logging.basicConfig(level=logging.WARNING)
    from cluster.hardware import read_cpu
    from dspark.training import token_budget_batches

    if args.ours_engine == "deepspeed":
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29534")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    work = Path(args.work)
    cfg, target, _train, held, train_s, held_s = build_data(args)
    samples_target.append(target)
    init_dir = initial_drafter(cfg, target, train_s, work / "init")
    index = {id(s): i for i, s in enumerate(train_s)}
    groups = [[index[id(s)] for s in g] for g in token_budget_batches(train_s, cfg.trainer.batch_tokens)]
    hidx = {id(s): i for i, s in enumerate(held_s)}  # (none with stand-in answers)
    held_groups = [[hidx[id(s)] for s in g] for g in token_budget_batches(held_s, cfg.trainer.batch_tokens)]
    max_anchors = round(cfg.drafter.num_anchors * len(train_s) / len(groups))
    cpu = read_cpu()
    ntok = sum(s.num_tokens for s in train_s)
    print(
        f"CPU: {cpu.model}, {cpu.cores} cores, native bf16: {cpu.native_bf16}\n"
        f"drafter: {cfg.drafter.num_layers} layer(s), block {cfg.drafter.block_size}, draft vocab "
        f"{cfg.drafter.draft_vocab_size}, markov rank {cfg.drafter.markov_rank}; precision {cfg.trainer.precision}; "
        f"{len(train_s)} training samples ({ntok} tokens, {len(groups)} batches of <= {cfg.trainer.batch_tokens} "
        f"tokens), {len(held_s)} held out; anchors: ours {cfg.drafter.num_anchors}/sample, speculators "
        f"{max_anchors}/batch",
        flush=True,
    )
    rows = []
    for n in [int(x) for x in args.threads.split(",")]:
        for kind in args.trainers.split(","):
            r = run_one(kind, args, cfg, target, init_dir, train_s, groups, max_anchors, work, n)
            print(
                f"  {kind} threads {n}: {r['steps']} steps, {r['tokens_per_s']:.0f} tok/s ({r['seconds']:.0f} s)",
                flush=True,
            )
            rows.append(r)
    import torch

    torch.set_num_threads(max(int(x) for x in args.threads.split(",")))
    init = {"trainer": "(initial)", "threads": 0, "seconds": 0, "steps": 0, "tokens_per_s": 0.0, "ckpt": str(init_dir)}
    for r in [init, *rows]:
        r.update(tau_ours(Path(r["ckpt"]), target, held, args.eval_tokens))
        if held_s:
            r.update(spec_val(Path(r["ckpt"]), target, cfg, held_s, held_groups, max_anchors))
    print(f"\nCPU: {cpu.model}; {args.minutes:g} min per trainer; held-out: {len(held)} prompts")
    print(
        f"{'trainer':12} {'threads':>7} {'steps':>6} {'s/step':>7} {'tok/s':>7} {'tau (ours)':>10} "
        f"{'accept_len':>10} {'eal':>6}"
    )
    for r in [init, *rows]:
        print(
            f"{r['trainer']:12} {r['threads']:7d} {r['steps']:6d} {r.get('s_per_step', 0):7.3f} "
            f"{r['tokens_per_s']:7.0f} {r['tau']:10.3f} {r.get('accept_len') or float('nan'):10.3f} "
            f"{r.get('eal') or float('nan'):6.3f}"
        )
    for r in rows:
        if r.get("profile"):
            print(f"\n--- profile: {r['trainer']}, {r['threads']} thread(s), {args.profile} steps\n{r['profile']}")
    (work / "results.json").write_text(
        json.dumps([{k: v for k, v in r.items() if k != "profile"} for r in [init, *rows]], indent=2)
    )


if __name__ == "__main__":
    main()
