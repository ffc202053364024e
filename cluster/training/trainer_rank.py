"""Trainer ranks: one DeepSpeed engine per data-parallel rank (gloo on CPU, NCCL on GPU).

The driver leases one step's samples for all ranks from the ledger, then runs two phases:
`fetch` (every rank reads its share from the Mooncake store; any key that is gone is reported
and the lease released, so a step never trains on partial data) and `train_step` (forward,
backward, optimizer step in lockstep). Checkpoints are collective: every rank writes its
DeepSpeed shard into one temporary directory, rank 0 adds the speculators-format drafter and
the ledger state and renames it into place.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cluster.data import write_ledger_state
from cluster.training.checkpoints import file_digests, make_universal, publish
from cluster.training.rank_setup import (
    TrainerSettings,
    deepspeed_config,
    drafter_config,
    join_world,
    leave_rendezvous,
    load_checkpoints_without_code,
    rendezvous,
    vocab_mapping_from,
)
from cluster.training.step_result import StepResult

if TYPE_CHECKING:
    from cluster.data import LeasedSample

# A key the store would not remove is tried again this many times, after 0.5, 1, 1.5 s: a daemon
# being replaced answers again within seconds; past that the key is named, not fatal.
REMOVE_TRIES, REMOVE_PAUSE_S = 4, 0.5


class TrainerRank:
    def __init__(self, rank: int, world_size: int, group: str, settings: TrainerSettings) -> None:
        self.rank, self.world_size, self.group, self.s = rank, world_size, group, settings
        if settings.trainer.torch_threads:
            torch.set_num_threads(settings.trainer.torch_threads)
        if settings.extensions_dir:
            os.environ.setdefault("TORCH_EXTENSIONS_DIR", settings.extensions_dir)
        self.engine = None
        self.batch = None
        self.batch_rows: list[LeasedSample] = []
        self.store = None
        self.fetched_step = None
        self.faults_fired: Counter = Counter()
        self.init_method: str | None = None  # rank 0: the world's rendezvous

    def set_threads(self, threads: int) -> int:
        torch.set_num_threads(threads)
        return torch.get_num_threads()

    def connect_store(self) -> None:
        """Join the store as a pure user: the node's daemon (or the master's actor) lends the
        memory, so samples outlive this rank."""
        from cluster.store import HiddenStateStore

        self.store = HiddenStateStore(self.s.store).connect()

    def remove_keys(self, keys: list[str], abandoned: list[str] = ()) -> int:
        """Drop committed (or stale) samples from the store; Mooncake will not evict them.
        `abandoned`: objects of attempts given up on (their producer died mid-put). A removal
        that fails does not stop the others: each failed key is tried again (`REMOVE_TRIES`, with
        a pause), and one the store still refuses (a put that never ended, a daemon gone) is
        named on stderr with the store's error, not fatal: the commit must not fail over a
        sample nobody will read."""
        from cluster.store import StoreError

        removed, failed = 0, {}
        pending = [*keys, *abandoned]
        for attempt in range(REMOVE_TRIES):
            failed = {}
            for k in pending:
                try:
                    removed += self.store.remove(k)
                except StoreError as e:
                    failed[k] = e
            pending = list(failed)
            if not pending:
                break
            time.sleep(REMOVE_PAUSE_S * (attempt + 1))
        for k, e in failed.items():
            print(
                f"[dspark] sample {k} stays in the store after {REMOVE_TRIES} tries: {e}", file=sys.stderr, flush=True
            )
        return removed

    def vocab_mapping(self, rows: list[LeasedSample], prompt_texts: list[str] = ()) -> dict:
        """Draft vocabulary before any training: the answers' tokens in the first stored samples
        (weighted up: they are what the drafter predicts) plus the tokens of every training
        prompt (cheap, and they cover the vocabulary the answers will draw on)."""
        from transformers import AutoTokenizer

        samples = self.store.get_samples([r.ref for r in rows])
        cfg = drafter_config(self.s, {})
        tok = AutoTokenizer.from_pretrained(self.s.target_path, trust_remote_code=self.s.trust_remote_code)
        pairs = [(s.token_ids, s.loss_mask) for s in samples] * 4
        for text in prompt_texts:
            ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
            pairs.append((ids, torch.ones_like(ids, dtype=torch.bool)))
        return vocab_mapping_from(pairs, cfg.target_vocab_size, cfg.draft_vocab_size, [tok.eos_token_id])

    def read_drafter(self, drafter_dir: str) -> dict:
        """What `setup` needs to rebuild a checkpointed drafter: its config and vocab mapping."""
        from safetensors.torch import load_file

        d = Path(drafter_dir)
        out = {"config": json.loads((d / "config.json").read_text())}
        tensors = load_file(str(d / "model.safetensors"))
        if "d2t" in tensors:
            out.update(d2t=tensors["d2t"].tolist(), t2d=tensors["t2d"].tolist())
        return out

    def rendezvous(self, one_node: bool, stale: str | None) -> str:
        """Rank 0: the new world's rendezvous (`rank_setup.rendezvous`); removed in `leave`."""
        self.init_method = rendezvous(one_node, stale)
        return self.init_method

    def leave(self) -> None:
        """Rank 0, before the world is stopped: remove its rendezvous directory."""
        leave_rendezvous(self.init_method)

    def setup(self, init_method: str, model_init: dict, resume: str | None = None, resized: bool = False) -> dict:
        """Create the process group (at `init_method`), the drafter and the engine; optionally resume.

        `resized`: the checkpoint was written by a different data-parallel size. DeepSpeed's ZeRO
        shards hold each rank's slice of the flattened optimizer state, which another world size
        cannot read as is: rank 0 first converts the checkpoint into DeepSpeed's universal format
        (one file per parameter: fp32 weights, Adam's moments and step; `universal_checkpoint`),
        which every rank then loads into its own partition. The world goes on as the old one would
        have (weights, moments, LR schedule, anchor generators)."""
        import deepspeed

        from dspark.losses import LossWeights
        from dspark.model import DSparkDrafter
        from dspark.training import DrafterObjective, OptimConfig, build_optimizer

        # DeepSpeed builds its shared-memory allreduce op here (torch's JIT, which runs whichever
        # `ninja` PATH names). The venv has pip's ninja, hosts often another (apt's 1.11); their
        # build logs do not read each other's command hashes, so a job after a test run (or the
        # other way round) rebuilt the op from scratch, ~80 s on 2 cores. The venv's is the one
        # scripts/bootstrap.sh builds it with.
        venv_bin, path = os.path.dirname(sys.executable), os.environ.get("PATH", "")
        if path.split(os.pathsep, 1)[0] != venv_bin:  # (once per process: set-up runs again at every world restart)
            os.environ["PATH"] = venv_bin + os.pathsep + path
        join_world(init_method, self.rank, self.world_size, "nccl" if self.s.device == "cuda" else "gloo")
        d, t = self.s.drafter, self.s.trainer
        if resume:
            load_checkpoints_without_code()
        # ZeRO 0 keeps the whole optimizer state on every rank: any world size reads it as is.
        universal = bool(resume and resized and t.zero_stage > 0)
        if universal:
            resume = self.universal_checkpoint(resume)
        cfg = drafter_config(self.s, model_init)
        torch.manual_seed(t.seed)  # identical initial weights on every rank
        model = DSparkDrafter(cfg)
        model.load_target_weights(self.s.target_path)
        if d.init == "target_layers" and not resume:  # (a resumed world loads its weights below)
            model.init_from_target_layers(self.s.target_path)
        if model.use_draft_vocab:
            model.set_vocab_mapping(torch.tensor(model_init["d2t"]), torch.tensor(model_init["t2d"]))
        optim = OptimConfig(
            lr=t.lr,
            weight_decay=t.weight_decay,
            warmup_steps=t.warmup_steps,
            total_steps=self.s.total_steps,
            min_lr_ratio=t.min_lr_ratio,
            grad_clip=t.grad_clip,
        )
        opt, sched = build_optimizer(model, optim)
        if t.zero_stage == 3:
            # ZeRO-3 gathers a module's own weights around its forward only. The drafter's forward
            # reads two weights of its submodules directly (the draft head's product and the
            # target head's, the label): registered, they are gathered around the drafter's forward.
            for weight in {id(w): w for w in (model.draft_head_weight, model.verifier_lm_head.weight)}.values():
                deepspeed.zero.register_external_parameter(model, weight)
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=opt,
            lr_scheduler=sched,
            config=deepspeed_config(t, self.world_size, universal),
        )
        self.model = model
        self.full_copy = None  # ZeRO-3, rank 0: the drafter with full weights (`gather_full_weights`)
        self.objective = DrafterObjective(
            model,
            LossWeights(d.ce_weight, d.l1_weight, d.confidence_weight, d.decay),
            d.num_anchors,
            seed=t.seed + 1000 * self.rank,
            autocast_dtype=torch.bfloat16 if t.precision == "bf16-mixed" else None,
            cache_normalizers=True,  # a sample's later epochs then skip the full-vocabulary target head
        )
        if self.store is None:
            self.connect_store()
        step = 0
        if resume:
            decay = [group["weight_decay"] for group in opt.param_groups]
            _, client = self.engine.load_checkpoint(resume, tag="ds", load_module_strict=False)
            if client is None:
                raise RuntimeError(f"no DeepSpeed checkpoint (tag ds) under {resume}")
            # DeepSpeed 0.19.8's ZeRO-3 universal load gives every param group the first group's
            # hyperparameters: the norms' and biases' group (no weight decay) would be decayed.
            # The LR comes from the schedule; the weight decay is this config's, group by group.
            for group, weight_decay in zip(opt.param_groups, decay):
                group["weight_decay"] = weight_decay
            # It also hands every group one and the same `step` tensor, which AdamW increments in
            # place: each group's step would then advance once per group per update, and Adam's
            # bias correction be wrong from the first step on (measured: 1.4e-3 off after two).
            for state in opt.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
            step = int(client["step"])
            self.set_lr_horizon(self.s.total_steps)  # the driver's, not the one saved with the scheduler
            saved = client["anchor_rng"]
            if self.rank < len(saved):  # a rank added by a resize keeps its fresh seed
                self.objective.generator.set_state(saved[self.rank])
        return {
            "step": step,
            "rank": self.rank,
            "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        }

    def universal_checkpoint(self, trainer_dir: str) -> str:
        """Collective: the universal form of the DeepSpeed checkpoint in `trainer_dir` (written by
        another world size), made once by rank 0 beside it (`universal/`, atomically renamed into
        place, reused by a later resize from the same checkpoint); the other ranks wait for it at a
        barrier (the gang's call deadline bounds the wait if rank 0 dies converting)."""
        import torch.distributed as dist

        if self.rank == 0:
            make_universal(Path(trainer_dir))
        dist.barrier()
        return str(Path(trainer_dir).parent / "universal")

    def set_lr_horizon(self, total_steps: int) -> None:
        """The step the LR schedule ends at, from the next step on (the plan was measured or shortened)."""
        for schedule in self.scheduler.lr_lambdas:
            schedule.total_steps = total_steps

    def reconnect_store(self) -> None:
        self.store.reconnect()

    def fetch(self, step: int, rows: list[LeasedSample]) -> dict[str, str]:
        """Read this rank's samples for `step`; returns {uid: why} for those that cannot be
        trained: gone from the store, corrupt (Mooncake's error or the sample's own check names
        it), or with token ids outside the target's vocabulary. The ledger counts the last two
        against the prompt by these words (`cluster.data.ledger_rows.read_failure_blamed`)."""
        from cluster.store import SampleMissing, StoreError, StoreUnavailable
        from dspark.samples import CorruptSampleError

        self.batch, self.batch_rows, self.fetched_step = None, [], step
        failures = (SampleMissing, CorruptSampleError, StoreError, StoreUnavailable)
        refs = [row.ref for row in rows]
        bad: dict[str, str] = {}
        try:
            # One transfer for the whole step; views into the read buffer, which `pack` copies
            # before anything reads again.
            samples = self.store.get_samples(refs, copy=False)
        except failures:
            samples = []
            for row, ref in zip(rows, refs):  # which ones? (copies: the buffer is reused)
                try:
                    samples.extend(self.store.get_samples([ref]))
                except failures as e:
                    bad[row.uid] = f"{type(e).__name__}: {e}"
        vocab = self.model.config.target_vocab_size
        if not bad:
            for row, sample in zip(rows, samples):
                top = int(sample.token_ids.max()) if sample.num_tokens else 0
                if top >= vocab:
                    bad[row.uid] = f"token id {top} >= the target's vocabulary ({vocab})"
        if samples and not bad:
            # bf16-mixed too: the stored states are bf16 already, autocast takes them as they are
            dtype = torch.float32 if self.s.trainer.precision == "fp32" else torch.bfloat16
            self.batch = self.objective.pack(
                samples, device=self.engine.device, dtype=dtype, keys=[r.key for r in refs]
            )
            self.batch_rows = rows
        return bad

    def train_step(self, step: int) -> StepResult:
        """One optimizer step in lockstep with the other ranks. Returns its figures and the
        samples this rank trained on (for the exactly-once record).

        The update is that of one batch made of every rank's samples, whatever their split:
        each loss term is a sum over this rank's slots divided by the world's count of slots over
        the world size (one all-reduce of two numbers), so DeepSpeed's mean of the ranks'
        gradients is the gradient of the mean over all the world's slots. (Each rank dividing by
        its own count, as before, weighted a slot by 1 / its rank's slots: the ranks' samples
        differ in number and length, so the two-rank world trained on another mixture than one
        rank did on the same samples.) A rank without data takes part with zero slots and a zero
        gradient.

        A non-finite loss on any rank skips the update on every rank (they agree through an
        all-reduce, so the engines stay in lockstep): `skipped` is set, `nonfinite` on the ranks
        whose loss it was, and nothing is trained."""
        import torch.distributed as dist

        if self.fetched_step != step:
            raise RuntimeError(f"rank {self.rank}: train_step({step}) without fetch({step})")
        poison = [row.uid for row in self.batch_rows if row.prompt_id in self.s.testing.trainer_crash_on]
        if poison:  # fault injection (tests): a sample that kills the rank training it, every time
            print(
                f"[dspark] rank {self.rank}: dying on {poison[0]} (testing.trainer_crash_on)",
                file=sys.stderr,
                flush=True,
            )
            os._exit(1)
        t0 = time.perf_counter()

        def share_counts(local: torch.Tensor) -> torch.Tensor:  # collective: once per step on every rank
            counts = local.detach().to(device=self.engine.device, dtype=torch.float64).clone()
            dist.all_reduce(counts)
            return counts / self.world_size

        loss, metrics = (None, {})
        if self.batch is not None:
            loss, metrics = self.objective(self.batch, module=self.engine, share_counts=share_counts)
        if loss is None:  # no data, or none with room for a block
            loss = self.idle_loss(share_counts)
        if self.rank == 0 and self.faults_fired[step] < self.s.testing.nonfinite_steps.count(step):
            self.faults_fired[step] += 1  # fault injection (tests): as many NaN losses at `step` as it is listed
            loss = loss * float("nan")
        nonfinite = not bool(torch.isfinite(loss.detach()).all())
        flag = torch.tensor([float(nonfinite)], device=loss.device)
        dist.all_reduce(flag)
        skipped = bool(flag.item() > 0)
        if not skipped:
            self.engine.backward(loss)
            self.engine.step()
        if self.s.testing.trainer_throttle_s:  # (tests: a slower trainer)
            time.sleep(self.s.testing.trainer_throttle_s)
        result = StepResult(
            step=step,
            rank=self.rank,
            skipped=skipped,
            nonfinite=nonfinite,
            tokens=self.batch.num_tokens if self.batch is not None and not skipped else 0,
            step_s=time.perf_counter() - t0,
            lr=self.scheduler.get_last_lr()[0] if self.scheduler else None,
            batch=[r.uid for r in self.batch_rows],
            trained=[] if skipped else list(self.batch_rows),
            figures=metrics,
        )
        self.batch, self.batch_rows = None, []
        return result

    def idle_loss(self, share_counts) -> torch.Tensor:
        """A zero loss for a rank with nothing to train this step that still takes part in every
        collective of the step, in the others' order: a forward of the real model on a placeholder
        block, the world's slot count (`share_counts`, with zero slots) where the others count
        theirs, and a backward of the loss zeroed. Under ZeRO-3 the others' forward and backward
        gather weights and reduce gradients module by module, so a rank that skipped them (or
        counted before its forward) would leave the world waiting; under ZeRO 0-2 its gradients
        are zeros of every shape the reduction expects."""
        from dspark.samples import Sample

        def count_nothing(local: torch.Tensor) -> torch.Tensor:
            share_counts(torch.zeros_like(local))
            return torch.ones_like(local)  # any divisor: the loss is zeroed

        cfg = self.model.config
        length = cfg.block_size + 2  # room for one anchor whose block is whole
        layers = self.model.config.extract_layer_ids
        dtype = torch.float32 if self.s.trainer.precision == "fp32" else torch.bfloat16
        placeholder = Sample(
            torch.zeros(length, dtype=torch.long),
            torch.ones(length, dtype=torch.bool),
            torch.zeros(length, len(layers), cfg.hidden_size, dtype=torch.bfloat16),
            list(layers),
        )
        batch = self.objective.pack([placeholder], device=self.engine.device, dtype=dtype)
        loss, _ = self.objective(batch, module=self.engine, share_counts=count_nothing)
        return loss * 0.0

    def parameters_finite(self) -> bool:
        """Checked before every checkpoint: a model that went non-finite is never saved."""
        from dspark.samples import all_finite

        # ZeRO-3: a rank holds a partition of each weight (`ds_tensor`; the parameter itself is
        # empty outside a forward); every rank is asked, so the partitions cover every weight.
        held = (getattr(p, "ds_tensor", p) for p in self.model.parameters() if p.requires_grad)
        return all(all_finite(w.detach()) for w in held if w.numel())

    def gather_full_weights(self) -> None:
        """Collective: makes `full_drafter()` current on rank 0. Under ZeRO-3 each rank holds a
        partition of every weight; they gather them together and rank 0 keeps a plain copy of the
        drafter (without DeepSpeed's hooks: a forward that rank 0 runs alone, as calibration does,
        must not wait for the others). Under ZeRO 0-2 every rank holds the full weights already."""
        if self.s.trainer.zero_stage != 3:
            return
        import deepspeed

        from dspark.model import FROZEN_TARGET_KEYS, DSparkDrafter

        trainable = [p for p in self.model.parameters() if p.requires_grad]
        with deepspeed.zero.GatheredParameters(trainable, modifier_rank=None):
            state = (
                {k: v.detach().clone() for k, v in self.model.trainable_state_dict().items()}
                if self.rank == 0
                else None
            )
        if self.rank == 0:
            if self.full_copy is None:
                # The frozen target weights are read from the target, as loading a checkpoint does;
                # the config object is the world's own, so what calibration writes into it stays.
                self.full_copy = DSparkDrafter(self.model.config)
                self.full_copy.load_target_weights(self.s.target_path)
            missing, unexpected = self.full_copy.load_state_dict(state, strict=False)
            if unexpected or set(missing) - set(FROZEN_TARGET_KEYS):
                raise RuntimeError(f"gathered drafter: missing {missing}, unexpected {unexpected}")

    def full_drafter(self):
        """Rank 0: the drafter with its full, current weights (under ZeRO-3 after `gather_full_weights`)."""
        if self.s.trainer.zero_stage != 3:
            return self.model
        if self.full_copy is None:
            raise RuntimeError("ZeRO-3: gather_full_weights must run on every rank before rank 0 reads the drafter")
        return self.full_copy

    def save(self, tmp_dir: str, step: int, anchor_rngs: list) -> None:
        """Collective: every rank writes its DeepSpeed shard under `tmp_dir/trainer`."""
        self.engine.save_checkpoint(
            str(Path(tmp_dir) / "trainer"),
            tag="ds",
            client_state={"step": step, "anchor_rng": anchor_rngs},
            exclude_frozen_parameters=True,
        )
        self.gather_full_weights()  # for the drafter that rank 0 adds (`finalize_checkpoint`)

    def anchor_rng(self):
        return self.objective.generator.get_state()

    def finalize_checkpoint(self, tmp_dir: str, dest: str, ledger_state: dict, meta: dict) -> str:
        """Rank 0: add the drafter and the ledger, then move the checkpoint into place."""
        from dspark.checkpoint import save_drafter

        tmp, dest = Path(tmp_dir), Path(dest)
        save_drafter(self.full_drafter(), tmp / "drafter")
        write_ledger_state(tmp, ledger_state)  # (a base or a delta and the chain's earlier files)
        meta = {**meta, "files": file_digests(tmp)}  # what `CheckpointDir.problem` checks a resume against
        (tmp / "meta.json").write_text(json.dumps(meta))  # written last: a checkpoint without it is incomplete
        publish(tmp, dest)
        return str(dest)

    def export(self, dest: str, confidence_temperatures: list[float] | None = None, verifier: str | None = None) -> str:
        from dspark.checkpoint import save_drafter

        model = self.full_drafter()
        if verifier:
            model.config.verifier_name_or_path = verifier
        if confidence_temperatures is not None:
            model.config.confidence_temperatures = confidence_temperatures
        save_drafter(model, dest)
        return dest

    def calibrate(self, rows: list[LeasedSample], measure_on: list[LeasedSample] = ()) -> dict:
        """Fit confidence temperatures on held-out samples and measure them on others (rank 0)."""
        from dspark.training import calibrate_confidence

        def batches(of):
            return [
                self.objective.pack([s]).to(dtype=torch.float32) for s in self.store.get_samples([r.ref for r in of])
            ]

        model = self.full_drafter()
        model.float()
        return calibrate_confidence(model, batches(rows), self.objective.num_anchors, measure_on=batches(measure_on))
