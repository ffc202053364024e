"""`plan_box`: on one CPU box, choose what the job trains in its time budget before anything is
placed, and apply it to the config (`box_plan.enabled`).

Reads what the plan needs (the training prompts per category before any cap, their mean length
in the target's chat template, the cores this process may use: affinity and quota), probes the
paces (`machine_paces`; or takes those a probe of this machine measured for the same shapes
within `box_plan.keep_paces_s`: `kept_paces`), asks the pure `plan.choose_plan`, then
sets `data.max_prompts_per_category`, `sampling.max_tokens`, `inference.cpu_threads` and
`trainer.torch_threads`. Returns what result.json records as `plan`.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import Counter

from cluster.box.plan import Choices, EvaluationFit, Workload, choose_plan, fit_evaluation, startup_seconds
from cluster.config import JobConfig

log = logging.getLogger("dspark.job")


def prompt_tokens(target, conversations, limit: int = 200) -> float:
    """Mean tokens of the prompts (up to `limit`) as the replica renders them (the job's chat
    format, the generation prompt included)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target.path, trust_remote_code=target.trust_remote_code)
    lengths = [
        len(
            tok(
                target.chat.render(tok, c.prompt_messages, add_generation_prompt=True), add_special_tokens=False
            ).input_ids
        )
        for c in conversations[:limit]
    ]
    return sum(lengths) / max(len(lengths), 1)


def box_unfit(cfg: JobConfig) -> str | None:
    """Why the box plan does not apply to this config (None: it does). It plans one CPU box's
    generation and training within a time budget."""
    if cfg.device != "cpu":
        return f"device {cfg.device}"
    if len(cfg.topology.groups) != 1:
        return f"{len(cfg.topology.groups)} groups"
    if cfg.inference.backend != "vllm":
        return f"the {cfg.inference.backend} backend generates nothing"
    if not cfg.trainer.time_budget_s:
        return "no trainer.time_budget_s"
    if cfg.trainer.max_steps:
        return f"trainer.max_steps={cfg.trainer.max_steps} ends training first"
    return None


def probe_or_kept(cfg: JobConfig, cpu, target_dir, prompt_tokens: int, answer_tokens: int, quota_binds: bool):
    """(paces, the probe's seconds, when it probed: None for a probe now): kept ones where this
    machine was probed within `box_plan.keep_paces_s` for the same shapes, else a probe (kept)."""
    from cluster.box.kept_paces import keep_paces, kept_paces, paces_key
    from cluster.box.machine_paces import probe_paces
    from dspark.targets import cache_root

    path, key = cache_root() / "box_paces.json", paces_key(cfg, cpu, target_dir, prompt_tokens, answer_tokens)
    kept = kept_paces(path, key, cfg.box_plan.keep_paces_s, time.time())
    if kept:
        paces, _, probed_at = kept
        log.info(
            "box_plan: the paces probed on this machine %.0f min ago (%s; box_plan.keep_paces_s=%g): no probe",
            (time.time() - probed_at) / 60,
            path,
            cfg.box_plan.keep_paces_s,
        )
        return paces, 0.0, probed_at
    paces, probe_s = probe_paces(cfg, target_dir, cpu.usable_cores, prompt_tokens, answer_tokens, quota_binds)
    if cfg.box_plan.keep_paces_s:
        keep_paces(path, key, paces, probe_s, time.time())
    return paces, probe_s, None


def planned_values(cfg: JobConfig) -> dict:
    """What the plan may set, by the keys the user writes (the end's evaluation fit aside)."""
    return {
        "data.max_prompts_per_category": cfg.data.max_prompts_per_category,
        "sampling.max_tokens": cfg.sampling.max_tokens,
        "inference.cpu_threads": cfg.inference.cpu_threads,
        "trainer.torch_threads": cfg.trainer.torch_threads,
        "trainer.torch_threads_when_idle": cfg.trainer.torch_threads_when_idle,
    }


def plan_choices(cfg: JobConfig, per_category: Counter, explicit: frozenset[str]) -> Choices:
    """The choices the plan weighs: the config's box_plan lists, except where the user set the
    value (`explicit`): then that value alone. The config's own prompts and answers are the
    baseline the plan departs from only where its forecast is far off (`plan.FORECAST_ERROR`)."""
    box, cap, answer = cfg.box_plan, cfg.data.max_prompts_per_category, cfg.sampling.max_tokens
    cap_set, answer_set = "data.max_prompts_per_category" in explicit, "sampling.max_tokens" in explicit
    replica_set = "inference.cpu_threads" in explicit and cfg.inference.cpu_threads
    return Choices(
        (cap or max(per_category.values()),) if cap_set else tuple(box.prompts_per_category),
        (answer,) if answer_set else tuple(box.answer_tokens),
        box.target_epochs,
        baseline=(cap or max(per_category.values()), answer),
        # the config's split (`resolve_for_machine` gave the replica every usable core if unset)
        baseline_split=(cfg.inference.cpu_threads, cfg.trainer.torch_threads)
        if cfg.inference.cpu_threads and cfg.trainer.torch_threads
        else None,
        replica_threads=(cfg.inference.cpu_threads,) if replica_set else (),
        trainer_threads=cfg.trainer.torch_threads if "trainer.torch_threads" in explicit else None,
    )


def plan_box(
    cfg: JobConfig,
    conversations: list | None,
    started: float,
    clock=time.monotonic,
    explicit: frozenset[str] = frozenset(),
) -> dict | None:
    """The plan for this box, applied to `cfg` (None: `box_plan` is off). `started`: the job's
    start on `clock`, from which the time budget counts; `explicit`: the keys the user set
    (`config_load.explicit_keys`), which it never changes."""
    if not cfg.box_plan.enabled:
        return None
    unfit = box_unfit(cfg)
    if unfit:
        log.info("box_plan: not applied (%s): the data and threads as configured", unfit)
        return None
    from cluster.data import load_prompts
    from cluster.hardware import busy_cores, read_cpu
    from cluster.target import read_target

    box = cfg.box_plan
    uncapped = copy.deepcopy(cfg)
    uncapped.data.max_prompts_per_category = None
    train, _ = load_prompts(uncapped, conversations)
    per_category = Counter(c.category or "" for c in train)
    target = read_target(cfg)
    target_dir = target.path
    mean_prompt = prompt_tokens(target, train)
    cpu = read_cpu()
    cores = cpu.usable_cores
    busy_before = busy_cores()
    quota_binds = cpu.quota is not None and cpu.quota < (cpu.affinity or cpu.cores)
    paces, probe_s, probed_at = probe_or_kept(
        cfg, cpu, target_dir, round(mean_prompt), max(box.answer_tokens), quota_binds
    )
    if probed_at is None and busy_before is not None and busy_before > 0.5:
        # what else runs slows the probe: measured, a probe beside the previous job's teardown
        # read half the paces and chose 12 prompts a category instead of 24
        log.warning(
            "%.1f of the machine's cores were busy as the box's probe began: its paces may be low, and "
            "the plan cautious (another job, or one's teardown, on this machine?)",
            busy_before,
        )
    startup = startup_seconds(box.startup_s, paces.gen(cores))
    window = cfg.trainer.time_budget_s - startup - (clock() - started)
    work = Workload(dict(per_category), mean_prompt, cfg.trainer.batch_tokens, window, cores, cfg.data.epochs)
    plan = choose_plan(work, paces, plan_choices(cfg, per_category, explicit))
    before = planned_values(cfg)
    user_set = {key: value for key, value in before.items() if key in explicit}
    user_set |= {
        key: value
        for key, value in (
            ("data.eval_limit", cfg.data.eval_limit),
            ("data.long_context_prompts", cfg.data.long_context_prompts),
            ("data.eval_temperature", cfg.data.eval_temperature),
        )
        if key in explicit
    }
    if "data.max_prompts_per_category" not in explicit:
        cfg.data.max_prompts_per_category = plan.prompts_per_category
    if "sampling.max_tokens" not in explicit:
        cfg.sampling.max_tokens = plan.answer_tokens
    if "inference.cpu_threads" not in explicit:
        cfg.inference.cpu_threads = plan.replica_threads
    if "trainer.torch_threads" not in explicit:
        cfg.trainer.torch_threads = plan.trainer_threads
    if "trainer.torch_threads_when_idle" not in explicit:
        cfg.trainer.torch_threads_when_idle = cores
    evaluation = None
    if box.end_s and cfg.data.eval_limit:
        sampled, long_context = cfg.data.eval_temperature > 0, bool(cfg.data.long_context_prompts)
        # the user's own evaluation settings bound the fit: a limit they set is judged whole, a
        # set they asked for is kept
        floor = cfg.data.eval_limit if "data.eval_limit" in explicit else None
        fit = fit_evaluation(
            paces.gen(cores),
            box.end_s,
            cfg.data.eval_limit,
            sampled,
            long_context,
            **({"min_limit": floor, "extras_min_limit": floor} if floor else {}),
        )
        fit = EvaluationFit(
            fit.eval_limit,
            fit.sampled or (sampled and "data.eval_temperature" in explicit),
            fit.long_context or (long_context and "data.long_context_prompts" in explicit),
            fit.expected_s,
        )
        evaluation = {
            "eval_limit": fit.eval_limit,
            "sampled": fit.sampled,
            "long_context": fit.long_context,
            "expected_s": fit.expected_s,
        }
        if (fit.eval_limit, fit.sampled, fit.long_context) != (cfg.data.eval_limit, sampled, long_context):
            left_out = [
                name
                for name, asked, kept in (
                    ("sampled", sampled, fit.sampled),
                    ("long-context", long_context, fit.long_context),
                )
                if asked and not kept
            ]
            log.info(
                "the end evaluation scaled to this box (box_plan.end_s=%g, expected %.0f s): %d prompts of each "
                "greedy set%s",
                box.end_s,
                fit.expected_s,
                fit.eval_limit,
                f", without the {' and '.join(left_out)} set{'s' if len(left_out) > 1 else ''}" if left_out else "",
            )
            before.update(
                {
                    "data.eval_limit": cfg.data.eval_limit,
                    "data.long_context_prompts": cfg.data.long_context_prompts,
                    "data.eval_temperature": cfg.data.eval_temperature,
                }
            )
            cfg.data.eval_limit = fit.eval_limit
            if not fit.long_context:
                cfg.data.long_context_prompts = None
            if not fit.sampled:
                cfg.data.eval_temperature = 0.0
    log.info(
        "the plan for this box (%s, %d usable cores%s): %d prompts per category (%d prompts), answers of up to "
        "%d tokens, the replica on %d thread(s) and the trainer on %d while it generates, all %d after; %s",
        cpu.model,
        cores,
        f", quota {cpu.quota:g} cores" if cpu.quota else "",
        plan.prompts_per_category,
        plan.prompts,
        plan.answer_tokens,
        plan.replica_threads,
        plan.trainer_threads,
        cores,
        "; ".join(plan.reasons),
    )
    if user_set:
        log.info(
            "box_plan: kept as you set them: %s", ", ".join(f"{key}={value}" for key, value in sorted(user_set.items()))
        )
    if not plan.worth_serving:
        log.warning(
            "this box cannot train a drafter worth serving in trainer.time_budget_s=%g: %s",
            cfg.trainer.time_budget_s,
            plan.reasons[-1],
        )
    if cfg.target.tensor_parallel_size > 1:  # the probe's engine is one process
        plan.reasons.append(
            f"the probe generated at tensor parallelism 1; the replica runs {cfg.target.tensor_parallel_size} "
            "ranks: its own pace is measured at the first answers, and prompts never handed out are left out "
            "then if it cannot train these often enough (cluster.box.revision)"
        )
        log.info("box_plan: %s", plan.reasons[-1])
    after = planned_values(cfg)
    return {
        **plan.to_dict(),
        "paces": {
            "generation_tok_s": paces.generation_tok_s,
            "first_step_s": paces.first_step_s,
            "later_step_s": paces.later_step_s,
            "source": paces.source,
            "probe_s": round(probe_s, 1),
            "probed_at": None if probed_at is None else round(probed_at, 1),
            "busy_cores_before": None if busy_before is None else round(busy_before, 2),
        },
        "workload": {
            "prompts_per_category": dict(per_category),
            "prompt_tokens": round(mean_prompt, 1),
            "train_window_s": round(window, 1),
            "startup_s": round(startup, 1),
            "usable_cores": cores,
            "quota_cores": cpu.quota,
        },
        "evaluation": evaluation,
        # (the evaluation's keys are there only where its fit changed them)
        "replaced": {key: value for key, value in before.items() if after.get(key, cfg) != value},
        "kept": user_set,
    }
