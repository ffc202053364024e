"""Start, resume and recover the trainer world and the producers.

Before anything starts, a resume is checked against the config's plan; at start the ledger and
the record are set back to the checkpoint; the world begins from it (or fresh, its draft
vocabulary counted on the first stored answers). While training, dead replicas and a restarted
master are handled (`supervise`), a failed world restarts from the last checkpoint (bounded)
and a resize places a new world at a checkpoint boundary.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from cluster.control import ResizeTrainer
from cluster.job.checkpointing import checkpoint
from cluster.training import TrainerFailure
from cluster.waiting import wait_until

log = logging.getLogger("dspark.job")
VOCAB_SAMPLES = 64  # stored answers the draft vocabulary is counted on, at a fresh start


def check_resume_plan(job) -> None:
    """Refuse, before any actor starts, a resume whose checkpoint trained samples this config
    no longer plans: changed prompt files, `data.max_prompts(_per_category)`, held-out split
    or fewer epochs. The ledger would drop them and train another set under the old record
    (or, with a changed split, may have trained on prompts now evaluated). A plan that only
    adds samples (more epochs, another prompt file) resumes. `trainer.resume=always` with no
    whole checkpoint is refused here too."""
    from cluster.config import ConfigError
    from cluster.data import trained_outside

    t = job.cfg.trainer
    ckpt = job.resume_candidate = job.checkpoints.latest() if t.resume != "never" else None
    if t.resume == "always" and ckpt is None:
        raise ConfigError(f"config error at `trainer.resume`: always, but no whole checkpoint under {job.checkpoints.root}")
    if ckpt is None:
        return
    outside = trained_outside(json.loads((ckpt / "ledger.json").read_text()),
                              {c.id for c in job.train_prompts}, job.cfg.data.epochs)
    if not outside:
        return
    heldout = {c.id for c in job.heldout} & {u.rsplit("@", 1)[0] for u in outside}
    raise ConfigError(
        f"{ckpt} trained {len(outside)} samples this config does not plan to train (e.g. {', '.join(outside[:3])})"
        + (f"; {len(heldout)} of their prompts are now held out for evaluation" if heldout else "")
        + ": the prompt files, data.max_prompts, data.max_prompts_per_category, data.heldout_fraction, "
        "data.split_seed or data.epochs differ from the run that wrote it. Restore them to resume, or start "
        "afresh with trainer.resume=never (earlier checkpoints are moved aside).")


def restore_data_state(job) -> Path | None:
    """The checkpoint to resume from, with the ledger and the training record already set back
    to it (samples it did not commit leave the store); or a fresh start (earlier checkpoints of
    this run name moved aside, no record)."""
    resume = job.resume_candidate  # found, and checked against the plan, by check_resume_plan
    if resume is None:
        moved = job.checkpoints.archive()  # a fresh run must not rotate into an old run's steps
        if moved:
            job.events.append(f"fresh start: earlier checkpoints moved to {moved}")
        job.record.reset()
        return None
    stale = job.ledger.load_state_dict(json.loads((resume / "ledger.json").read_text()), job.master_generation)
    job.gang.remove_keys(stale)
    job.record.rollback_to(job.checkpoints.meta(resume)["record_rows"])
    job.events.append(f"resumed from {resume}")
    log.info("resuming from %s", resume)
    return resume


def restart_trainer(job, cause: Exception) -> None:
    """The world failed (a rank died, hung or raised): a new world from the last checkpoint.
    The ledger gives back what was leased after it (re-read, or regenerated if released),
    the training record drops the rows it did not commit. A restart that fails itself counts
    as the next one."""
    from cluster.scaling import place_all, trainer_specs

    layout = job.gang.layout()
    while True:
        if job.trainer_restarts >= job.cfg.trainer.max_restarts:
            raise RuntimeError(f"the trainer world failed {job.trainer_restarts + 1} times "
                               f"(trainer.max_restarts={job.cfg.trainer.max_restarts}); last: {cause}")
        job.trainer_restarts += 1
        stop_world(job)
        try:
            job.services.check(force=True)  # a dead store daemon (what may have killed the ranks) first
            job.trainer_generation += 1
            start_world(job, place_all(job.cfg, trainer_specs(job.cfg, layout, job.trainer_generation)))
            ckpt = job.checkpoints.latest()
            returned = job.ledger.trainer_restarted(job.checkpoints.meta(ckpt)["step"] if ckpt else 0)
            job.record.rollback_to(job.checkpoints.meta(ckpt)["record_rows"] if ckpt else 0)
            job.uncommitted = []
            job.events.append(f"trainer world restarted from {ckpt.name if ckpt else 'scratch'} "
                               f"({returned} leased samples given back): {cause}")
            log.warning("%s", job.events[-1])
            job.resume_from = ckpt
            job.stats.step = begin(job)
            return
        except TrainerFailure as e:
            cause = e


def resize(job, request: ResizeTrainer) -> None:
    """A new world with `request`'s ranks per group, at a checkpoint boundary: commit, stop
    the ranks, place and start the new ones, reload. If the new layout cannot be placed, the
    old one is placed again (its resources were just freed)."""
    from cluster.scaling import PlacementError, place, release, trainer_specs

    old = job.gang.layout()
    want = {**old, **request.ranks}
    if want == old:
        job.stats.resize_seq_handled = request.seq
        return
    ckpt = checkpoint(job)
    stop_world(job)
    timeout = job.cfg.autoscaler.placement_timeout_s
    for layout in (want, old):
        job.trainer_generation += 1
        placed = []
        try:
            for spec in trainer_specs(job.cfg, layout, job.trainer_generation):
                placed.append(place(spec, timeout))
            break
        except PlacementError as e:
            release(placed)
            if layout == old:
                raise
            job.events.append(f"trainer resize {old}->{want} not placed ({e}); staying at {old}")
            log.warning("%s", job.events[-1])
    start_world(job, placed)
    resized = job.gang.size != sum(old.values())  # the old layout placed again keeps its optimizer state
    job.gang.setup(job.gang.read_drafter(str(ckpt / "drafter")), ckpt, resized)
    job.stats.ranks, job.stats.layout = job.gang.size, job.gang.layout()
    job.stats.resize_seq_handled = request.seq
    job.planner.remeasure()  # another world, another pace (and the resize's own minutes are not one step)
    if job.gang.layout() != old:
        job.events.append(f"trainer resized {old}->{job.gang.layout()} at step {job.stats.step}")
        log.info("%s", job.events[-1])


def stop_world(job) -> None:
    """The trainer world's ranks stop and its placement groups are freed."""
    from cluster.scaling import release

    job.gang.stop()
    release(job.trainer_pgs)
    job.trainer_pgs = []


def start_world(job, placed: list) -> None:
    """A trainer world on the placement groups `placed`: the store daemons of their nodes
    first (the ranks are store clients of them), then the ranks."""
    job.trainer_pgs = placed
    job.services.ensure_node_stores(placed)
    job.gang.settings = replace(job.gang.settings, store=job.services.store_config())
    job.gang.start(placed)


def begin(job) -> int:
    """The trainer world's drafter and engines: from the checkpoint, or fresh (the draft
    vocabulary counted on the first stored answers); the step it starts from."""
    if job.resume_from is None:
        return job.gang.setup(fresh_model_init(job), None, False)
    model_init = job.gang.read_drafter(str(job.resume_from / "drafter"))
    return job.gang.setup(model_init, job.resume_from, job.checkpoints.meta(job.resume_from)["world_size"] != job.gang.size)


def fresh_model_init(job) -> dict:
    if not job.cfg.drafter.draft_vocab_size:
        return {}
    # More answers cover more of what the drafter will predict (on the default prompts, 64
    # instead of 16 draft-vocab ~94 % of held-out answer tokens instead of 92 %); waiting
    # costs little: epoch 0 can only be trained as it arrives.
    want = min(VOCAB_SAMPLES, len(job.train_prompts))
    rows, counts = [], None

    def stored_enough():
        nonlocal rows, counts
        rows = job.ledger.peek_stored(want)
        counts = job.ledger.counts()
        # A full store (producers paused) or nothing left to generate: take what there is.
        if len(rows) >= want or (rows and (counts.paused or counts.to_generate == 0)):
            return True
        if not rows and counts.to_generate == 0 and not counts.generating:
            failed = job.ledger.outcome()["failed"]
            example = next(iter(failed.items()), ("-", ["?"]))
            raise RuntimeError(f"no answer could be stored: {len(failed)} prompt x epochs FAILED, e.g. {example[0]}: "
                               f"{example[1][-1] if example[1] else '?'}")
        supervise(job)  # replicas that die before the first answers are replaced meanwhile
        return False

    timeout = job.cfg.inference.first_samples_timeout_s
    wait_until(stored_enough, timeout_s=timeout, interval_s=0.5, what="the first answers", on_timeout=lambda: TimeoutError(
        f"{len(rows)} of the first {want} answers stored after {timeout:.0f}s (inference.first_samples_timeout_s); "
        f"ledger: {({'pending': counts.pending, 'generating': counts.generating, 'stored': counts.stored, 'failed': counts.failed})}"))
    texts = [m["content"] for c in job.train_prompts for m in c.prompt_messages]
    return job.gang.vocab_mapping(rows, texts)


def supervise(job) -> None:
    """Replace dead replicas (bounded); after a master restart the stored samples are gone."""
    gen = job.services.check()
    if gen > job.master_generation:
        job.master_generation = gen
        lost = job.ledger.master_restarted(gen)
        job.events.append(f"master restarted (generation {gen}): {lost} stored samples back to pending")
        log.warning("%s", job.events[-1])
        job.gang.reconnect_store()
    for pool in job.pools.values():
        pool.supervise()
