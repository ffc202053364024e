"""The job's last lines: what a finished or stopped run's result.json says, for a person reading
the job's log (the held-out and other sets' τ, what was trained exactly once, the drafter, the
quality flag, the machine)."""

from __future__ import annotations

from cluster.config import JobConfig
from dspark.tau_report import fmt, format_length_table, format_table


def left_out(evaluation: dict, budget_key: str) -> str:
    """What an evaluation set's time budget left out."""
    left = evaluation.get("left_out_for_time") or []
    return f" ({len(left)} more left out by {budget_key}: {', '.join(left[:4])})" if left else ""


def summary(result: dict, cfg: JobConfig) -> str:
    if result["status"] == "stopped":
        return (
            f"\nstopped at step {result['steps']} ({result['reason']}); {result['resume']}\n"
            f"results: {result['run_dir']}/result.json"
        )
    ev = result["evaluation"]
    lines = [
        f"\nheld-out tau = {fmt(ev['tau'])} over {ev['num_prompts']} prompts (greedy, block {cfg.drafter.block_size}); "
        f"lossless={ev['lossless']}; per-position acceptance "
        + " ".join(f"{a:.2f}" for a in ev["per_position_acceptance"]),
        format_table(ev),
    ]
    for name, other in result["evaluation_sets"].items():
        lines += [
            f"\n{name} tau = {fmt(other['tau'])} over {other['num_prompts']} prompts of {cfg.data.eval_sets[name]} "
            f"(never trained on); lossless={other['lossless']}",
            format_table(other),
        ]
    sampled = result.get("evaluation_sampled")
    if sampled:
        s = sampled["settings"]
        lines += [
            f"\nheld-out tau at temperature {s['temperature']} = {fmt(sampled['tau'])} over {sampled['num_prompts']} "
            f"prompts (the served recipe: {s['draft_sample_method']} drafting, {s['rejection_sample_method']} "
            f"rejection){left_out(sampled, 'data.eval_sampled_budget_s')}",
            format_table(sampled),
        ]
    long_context = result.get("long_context")
    if long_context:
        lines += [
            f"\nlong-context tau = {fmt(long_context['tau'])} over {long_context['num_prompts']} prompts of "
            f"{cfg.data.long_context_prompts}{left_out(long_context, 'data.long_context_budget_s')}, by context "
            f"length:",
            format_length_table(long_context["by_prompt_length"]),
        ]
    lines += [f"\n{name}: not measured ({why})" for name, why in result.get("evaluation_skipped", {}).items()]
    proof, epochs = result["exactly_once"], result["epochs"]
    # what was trained, as passes over the prompts: "20 of 20 planned epochs" said nothing of a run
    # that the time budget ended 3.5% into its plan
    lines.append(
        f"trained {proof['trained']} samples exactly once over groups {sorted(result['groups'])} "
        f"({proof['crossed']} by another group's rank): {epochs['trained']:.1f} epochs of {epochs['prompts']} "
        f"prompts ({result['trained_fraction']:.0%} of the {epochs['kept']} epochs kept of {epochs['planned']} "
        f"planned) in {result['trained_until_s'] / 60:.1f} min, ended by {result['ended_by']}; record: "
        f"{proof['record']}"
    )
    if result.get("plan"):
        p = result["plan"]
        lines.append(
            f"plan for this box: {p['prompts_per_category']} prompts per category, answers of up to "
            f"{p['answer_tokens']} tokens, expected {p['epochs']:.1f} epochs ({p['reasons'][0]})"
        )
    lines.append(f"drafter: {result['drafter']}  (vLLM: method=dspark)")
    quality = result["quality"]
    if not quality["worth_serving"]:
        lines.append(f"NOT WORTH SERVING: {'; '.join(quality['reasons'])}\n  to change: {'; '.join(quality['advice'])}")
    cpu = result["machine"]["cpu"]
    lines.append(
        f"wall clock {result['wall_clock_s'] / 60:.1f} min on {cpu['model']} ({cpu['cores']} cores, native bf16: "
        f"{cpu['native_bf16']}); target {result['machine']['target_dtype']}, trainer "
        f"{result['machine']['trainer_precision']}"
    )
    lines.append(f"results: {result['run_dir']}/result.json")
    return "\n".join(lines)
