"""Small builders shared by tests (not fixtures, so tests can call them with parameters)."""

from __future__ import annotations

import torch

from cluster.config import TargetConfig
from dspark.config import DSparkConfig
from dspark.model import DSparkDrafter
from dspark.samples import PackedBatch
from dspark.vocab import build_vocab_mapping

# ChatML with an optional system line chosen by an option, as thinking switches are.
PERSONA_TEMPLATE = (
    "{% if persona is defined and persona %}<|im_start|>system\n{{ persona }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Pinned in the replay-backend job tests (faults, autoscaler): what they judge does not depend on
# the local default's warm start, its split of threads, its extra evaluation sets or its
# calibration split (generated after epoch 0 and awaited at the end: tests/integration/test_job.py
# checks it).
NO_CALIBRATION = "data.calibration_prompts=0"
# The end evaluation's sampled and long-context sets (tests/integration/test_job.py judges them):
# the long prompts alone cost a job test ~25 s on 2 cores.
QUICK_EVAL = ["data.long_context_prompts=null", "data.eval_temperature=0"]
# The data and threads as the test writes them, not as the box's plan would choose them for the
# local job's time budget (tests/integration/test_box.py judges the plan).
FIXED_PLAN = "box_plan.enabled=false"
REPLAY_JOB_PINS = [
    "data.eval_sets={}",
    "drafter.init=random",
    "trainer.torch_threads=2",
    NO_CALIBRATION,
    *QUICK_EVAL,
    FIXED_PLAN,
]


def eager_target(path, **fields) -> TargetConfig:
    """The target section of an engine a test starts: eager, for a start in seconds (no graph
    compilation; ../shared/ENVIRONMENT.md), the config's defaults otherwise."""
    return TargetConfig(path=str(path), enforce_eager=True, **fields)


def make_drafter(target_dir, seed: int = 0, **settings) -> DSparkDrafter:
    settings.setdefault("num_layers", 2)
    settings.setdefault("block_size", 4)
    settings.setdefault("markov_rank", 16)
    cfg = DSparkConfig.from_target(target_dir, **settings)
    torch.manual_seed(seed)
    model = DSparkDrafter(cfg)
    model.load_target_weights(target_dir)
    if model.use_draft_vocab:
        counts = torch.randint(0, 1000, (cfg.target_vocab_size,), generator=torch.Generator().manual_seed(seed))
        model.set_vocab_mapping(*build_vocab_mapping(counts, cfg.draft_vocab_size))
    with torch.no_grad():  # non-trivial heads so the oracle comparisons are not of zeros
        for name, p in model.named_parameters():
            if p.requires_grad and "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def random_batch(cfg: DSparkConfig, lengths=(40, 27), prompt_len: int = 8, seed: int = 0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    ids = torch.randint(20, 5000, (t,), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    mask = pos >= prompt_len
    h = cfg.hidden_size
    aux = torch.randn(t, len(cfg.aux_layer_ids) * h, generator=g)
    last = torch.randn(t, h, generator=g)
    return PackedBatch(ids, pos, doc, mask, aux, last)


def reference_outputs(sm, batch, anchors, monkeypatch):
    """speculators' own forward pieces (backbone, Markov head, confidence head) at our anchors."""
    import speculators.models.dflash.core as spec_core
    from speculators.models.attention import create_float_mask

    monkeypatch.setattr(spec_core, "select_anchors", lambda lm, n, g: (anchors, torch.ones(n, dtype=torch.bool)))
    sm.config.transformer_layer_config._attn_implementation = "eager"
    sm._create_mask_fn = create_float_mask
    n, g = anchors.numel(), sm.block_size
    with torch.no_grad():
        hidden, logits, targets, _, idx = sm._backbone_forward(
            batch.aux_hidden[None],
            batch.input_ids[None],
            batch.loss_mask[None].long(),
            batch.last_hidden[None],
            batch.doc_ids[None],
            batch.position_ids[None],
            max_anchors=n,
        )
        hidden, logits = hidden.view(n, g, -1), logits.view(n, g, -1)
        conf = None
        if getattr(sm, "markov_head", None) is not None:
            block = batch.input_ids[idx].view(n, g)
            prev = block if sm.config.sample_from_anchor else torch.cat([block[:, :1], block[:, :-1]], 1)
            emb = sm.markov_head.prev_embeddings(prev)
            logits = logits + sm.markov_head.block_bias(prev_token_ids=prev, hidden_states=hidden, prev_emb=emb)
            if sm.confidence_head is not None:
                conf = sm.confidence_head(torch.cat([hidden, emb], -1))
    return hidden, logits, targets.view(n, g, -1), conf


def kill_and_resubmit(
    cmd: list[str],
    run_dir,
    log_path,
    first_timeout_s: float = 600.0,
    second_timeout_s: float = 900.0,
    sig=None,
    stop_wait_s: float = 120.0,
    between=None,
):
    """Run the job's entry script `cmd` against the test session's Ray, send its process group
    `sig` (SIGKILL by default; SIGTERM is what `ray job stop` sends, then the first run must end
    by itself within `stop_wait_s`) once `run_dir` holds a finished checkpoint, run the same
    command again to the end. Returns (the newest checkpoint step after the first run, the second
    run's CompletedProcess). `between()` is called after the first run ends."""
    import os
    import signal
    import subprocess
    import time

    import ray

    # Not this process's wandb service (an earlier test may have started one): it would still
    # hold the killed run's id when the second run asks for it ("run ID resume is in use").
    env = {
        **{k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"},
        "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
    }
    ckpts = run_dir / "checkpoints"
    with open(log_path, "w") as log:
        first = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + first_timeout_s
        while not list(ckpts.glob("step-*/meta.json")) and first.poll() is None:
            assert time.monotonic() < deadline, f"no checkpoint within {first_timeout_s:.0f}s"
            time.sleep(0.5)
        assert first.poll() is None, "the first run finished before it could be killed"
        sig = signal.SIGKILL if sig is None else sig
        os.killpg(first.pid, sig)
        try:
            code = first.wait(timeout=None if sig == signal.SIGKILL else stop_wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(first.pid, signal.SIGKILL)
            raise AssertionError(
                f"the first run did not end within {stop_wait_s:.0f}s of {sig.name} (log: {log_path})"
            ) from None
        assert sig == signal.SIGKILL or code == 0, f"the stopped run exited with {code} (log: {log_path})"
    if between is not None:
        between()
    killed_at = max(int(p.name.split("-")[1]) for p in ckpts.glob("step-*") if (p / "meta.json").exists())
    second = subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=second_timeout_s
    )
    return killed_at, second


def untrained_copy(drafter_dir, target_dir, out, init: str = "random") -> None:
    """The drafter a job started from: the trained one's config and vocabulary, fresh weights
    (`init` as `drafter.init`), saved to `out`."""
    from dspark.checkpoint import load_drafter, save_drafter

    trained = load_drafter(drafter_dir, target_dir)
    fresh = DSparkDrafter(trained.config)
    fresh.load_target_weights(target_dir)
    if fresh.use_draft_vocab:
        fresh.set_vocab_mapping(trained.d2t, trained.t2d)
    if init == "target_layers":
        fresh.init_from_target_layers(target_dir)
    save_drafter(fresh, out)
