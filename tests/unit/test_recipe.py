"""The serving recipe shipped with a drafter: `serve.sh` run with a stand-in `vllm` that records
its arguments, and vLLM's own `SpeculativeConfig` built from the `--speculative-config` JSON it
received (CPU: vLLM parses the config for `dspark`, it executes it only on GPU). The recipe's
names are checked against the installed vLLM's own types, and the reason probabilistic drafting
is allowed with a reduced draft vocabulary (vLLM's dspark speculator maps the draft distribution
into the target vocabulary through d2t) against its source, so a vLLM upgrade that drops it
fails here instead of serving a reduced-vocabulary drafter wrongly.

A drafter directory is someone else's files: `scripts/serve.sh` builds the command from its
config.json without executing anything in it, the verifier name must be a model id or a plain
path, and `--trust-remote-code` comes only from the user."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from dspark.checkpoint import save_drafter
from dspark.recipe import RECIPES, VERIFIER_KEY, model_card, serve_argv, speculative_config, write_recipe
from tests.helpers import make_drafter

pytest.importorskip("vllm")

EVALUATION = {
    "tau": 1.7,
    "macro_tau": 1.6,
    "num_prompts": 3,
    "lossless": True,
    "per_category": {
        "math": {"tau": 2.0, "num_prompts": 1, "per_position_acceptance": [0.6, 0.4]},
        "coding": {"tau": 1.2, "num_prompts": 2, "per_position_acceptance": [0.2, 0.0]},
    },
    "percentiles": {"p10": 1.1, "p50": 1.5, "p90": 2.0, "bottom10_mean": 1.0, "top10_mean": 2.1},
    "settings": {"dtype": "float32", "temperature": 0.0, "num_speculative_tokens": 8, "max_new_tokens": 80},
}
TRAINING = {
    "target": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "prompt_files": ["data/prompts/default.jsonl"],
    "train_prompts": 600,
    "heldout_prompts": 60,
    "categories": {"math": 300, "coding": 300},
    "epochs": 2,
    "trained_samples": 1200,
    "steps": 40,
    "sampling": "temperature 0.0, up to 160 tokens",
}


ROOT = Path(__file__).resolve().parents[2]
SERVE = ROOT / "scripts" / "serve.sh"


def run_stubbed(cmd, tmp_path, env=None, cwd=None):
    """Run `cmd` with `vllm` on PATH replaced by a script that writes its argv as JSON: (argv or
    None when vllm was not run, the finished process)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    argv_file = tmp_path / "argv.json"
    argv_file.unlink(missing_ok=True)
    fake = bin_dir / "vllm"
    fake.write_text(
        f'#!/usr/bin/env python3\nimport json, sys\njson.dump(sys.argv[1:], open({str(argv_file)!r}, "w"))\n'
    )
    fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k != "TARGET"}
    env = {**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", **(env or {})}
    done = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    return (json.loads(argv_file.read_text()) if argv_file.exists() else None), done


def served_config(drafter_dir, tmp_path, target=None, script=None):
    """Run serve.sh (or `script DRAFTER`) with the stand-in `vllm`: the target and speculative config it got."""
    cmd = [script, drafter_dir] if script else [drafter_dir / "serve.sh"]
    argv, done = run_stubbed([*cmd, "--max-model-len", "512"], tmp_path, {"TARGET": str(target)} if target else {})
    assert done.returncode == 0, done.stderr
    assert argv[0] == "serve" and argv[-2:] == ["--max-model-len", "512"]
    return argv[1], json.loads(argv[argv.index("--speculative-config") + 1])


RECIPE = {
    "method": "dspark",
    "num_speculative_tokens": 8,
    "draft_sample_method": "probabilistic",
    "rejection_sample_method": "block",
}


def test_recipe_names_are_vllms():
    """Every value the recipes use is one the pinned vLLM's config accepts, and the reason a
    reduced draft vocabulary may still draft probabilistically is in its dspark speculator."""
    import inspect
    import typing

    from vllm.config.speculative import DraftSampleMethod, RejectionSampleMethod
    from vllm.v1.worker.gpu.spec_decode.dspark.speculator import DSparkSpeculator

    for draft, rejection, _ in RECIPES.values():
        assert draft in typing.get_args(DraftSampleMethod) and rejection in typing.get_args(RejectionSampleMethod)
    # The draft-vocabulary logits are scattered into target-vocabulary columns (the rest -inf)
    # before they are sampled and cached for the rejection sampler.
    src = inspect.getsource(DSparkSpeculator._sample_logits)
    assert "_d2t_scatter_index" in src and "index_copy_" in src


def test_recipe_per_method():
    cfg = {
        "speculators_model_type": "dspark",
        "block_size": 8,
        "draft_vocab_size": 4000,
        "transformer_layer_config": {"vocab_size": 49152},
        "speculators_config": {"proposal_methods": [{"speculative_tokens": 8}]},
    }
    assert speculative_config(cfg, "d") == {"model": "d", **RECIPE}
    assert speculative_config(cfg, "d", "dflash") == {  # vLLM's CPU (V1) runner: no block verification
        "model": "d",
        "method": "dflash",
        "num_speculative_tokens": 8,
        "draft_sample_method": "greedy",
        "rejection_sample_method": "standard",
    }
    with pytest.raises(ValueError, match="no serving recipe"):
        speculative_config(cfg, "d", "eagle3")
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 9
    with pytest.raises(ValueError, match="9 speculative tokens from a block of 8"):
        speculative_config(cfg, "d")


@pytest.mark.parametrize("draft_vocab", [None, 4000])
def test_serve_recipe_parses_in_vllm(tiny_target, tmp_path, draft_vocab):
    from vllm.config import ModelConfig, ParallelConfig, SpeculativeConfig

    drafter = make_drafter(tiny_target, block_size=8, draft_vocab_size=draft_vocab)
    drafter.config.verifier_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"  # target.name: a public id
    final = save_drafter(drafter, tmp_path / "final")
    write_recipe(final, TRAINING, EVALUATION)
    assert os.access(final / "serve.sh", os.X_OK)

    target, spec = served_config(final, tmp_path)
    assert target == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the recorded verifier, not a local path
    assert spec == {"model": str(final), **RECIPE}  # a reduced draft vocabulary too: vLLM maps it (d2t)

    target, spec = served_config(final, tmp_path, target=tiny_target)  # TARGET= overrides, the drafter stays
    parsed = SpeculativeConfig(
        target_model_config=ModelConfig(model=target, max_model_len=512),
        target_parallel_config=ParallelConfig(),
        **spec,
    )
    assert parsed.method == "dspark" and parsed.num_speculative_tokens == 8
    assert parsed.draft_sample_method == "probabilistic" and parsed.rejection_sample_method == "block"
    assert parsed.draft_model_config.hf_config.draft_vocab_size == (draft_vocab or 49152)


def test_model_card_states_what_was_measured(tiny_target, tmp_path):
    drafter = make_drafter(tiny_target, block_size=8, draft_vocab_size=4000)
    final = save_drafter(drafter, tmp_path / "final")
    card = model_card(json.loads((final / "config.json").read_text()), TRAINING, EVALUATION)
    assert "| math | 1 | 2.000 | 0.60 0.40 |" in card and "| coding | 2 | 1.200 | 0.20 0.00 |" in card
    assert "Macro τ over categories: 1.600" in card and "p10 1.100" in card
    assert "600 training prompts (coding 300, math 300)" in card
    assert '"draft_sample_method": "probabilistic", "rejection_sample_method": "block"' in card
    assert "probabilistic drafting + block rejection (draft vocabulary 4000 of the target's 49152)" in card
    assert "through d2t" in card  # why a reduced vocabulary still drafts probabilistically
    assert (
        "Lossless (greedy speculative output identical to the target's, token for token, against the target's own"
        " greedy output): True." in card
    )
    served = model_card(
        json.loads((final / "config.json").read_text()),
        TRAINING,
        {**EVALUATION, "backend": "vllm", "lossless": None, "settings": {**EVALUATION["settings"], "method": "dspark"}},
    )
    assert "Lossless" not in served  # not checked: not claimed
    assert "Not worth serving" not in card  # no quality verdict given: none claimed


def test_model_card_says_when_a_drafter_is_not_worth_serving(tiny_target, tmp_path):
    from cluster.job.quality import assess

    final = save_drafter(make_drafter(tiny_target, block_size=8), tmp_path / "final")
    verdict = assess(192, 276, 1.055, "time_budget", 480)
    card = model_card(
        json.loads((final / "config.json").read_text()),
        {**TRAINING, "quality": {"worth_serving": False, "reasons": verdict.reasons, "advice": verdict.advice}},
        EVALUATION,
    )
    head = card.split("## Training data")[0]
    assert "**Not worth serving as trained:** it trained 192 samples, 70% of one epoch" in head
    assert "raise trainer.time_budget_s (was 480)" in head


def test_scripts_serve_builds_the_command_from_config_json(tiny_target, tmp_path):
    """scripts/serve.sh on a checkpoint exported without its recipe: the command comes from the
    checkpoint's config.json, and nothing is written in its place to be run."""
    drafter = make_drafter(tiny_target, block_size=8, draft_vocab_size=4000)
    drafter.config.verifier_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    final = save_drafter(drafter, tmp_path / "step")
    assert not (final / "serve.sh").exists()
    target, spec = served_config(final, tmp_path, script=SERVE)
    assert target == "HuggingFaceTB/SmolLM2-135M-Instruct" and spec == {"model": str(final.resolve()), **RECIPE}
    target, _ = served_config(final, tmp_path, target="/models/local copy", script=SERVE)  # TARGET= overrides
    assert target == "/models/local copy"
    assert not (final / "serve.sh").exists()


@pytest.fixture(scope="module")
def exported(tiny_target, tmp_path_factory):
    """One saved drafter checkpoint, copied by each test that edits its config.json."""
    return save_drafter(make_drafter(tiny_target, block_size=8), tmp_path_factory.mktemp("exported") / "final")


def drafter_copy(exported, where: Path, **edits) -> tuple[Path, dict]:
    """A copy of the exported drafter at `where` with config.json edited: `verifier` (the
    verifier's name), `dspark_cluster` (merged into that section)."""
    shutil.copytree(exported, where)
    cfg = json.loads((where / "config.json").read_text())
    if "verifier" in edits:
        cfg["speculators_config"]["verifier"]["name_or_path"] = edits["verifier"]
    cfg["dspark_cluster"] = {**cfg.get("dspark_cluster", {}), **edits.get("dspark_cluster", {})}
    (where / "config.json").write_text(json.dumps(cfg))
    return where.resolve(), cfg


BAD_NAMES = [
    "Qwen/Qwen3-32B\ntouch {marker}",
    "$(touch {marker})",
    "`touch {marker}`",
    "org/name; touch {marker}",
    "--trust-remote-code",
    "a\x1bname",
]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_verifier_name_that_is_not_a_model_name_is_refused(exported, tmp_path, name):
    """Written into serve.sh, the model card, or served: refused, the key and the value named, and
    vllm never started."""
    marker = tmp_path / "marker"
    name = name.format(marker=marker)
    final, cfg = drafter_copy(exported, tmp_path / "d", verifier=name)
    with pytest.raises(ValueError) as e:
        write_recipe(final, TRAINING, EVALUATION)
    assert f"`{VERIFIER_KEY}` in config.json is {name!r}" in str(e.value)
    assert not (final / "serve.sh").exists() and not (final / "README.md").exists()
    argv, done = run_stubbed([SERVE, final], tmp_path, {"TARGET": ""}, cwd=tmp_path)
    assert done.returncode != 0 and argv is None
    assert VERIFIER_KEY in done.stderr and repr(name) in done.stderr
    assert not marker.exists()
    # TARGET= names the target instead: the config's name is then not used, and nothing is refused.
    argv, done = run_stubbed([SERVE, final], tmp_path, {"TARGET": "org/model"})
    assert done.returncode == 0, done.stderr
    assert argv[:2] == ["serve", "org/model"]


CHAT = {"template": "{{ messages }}", "kwargs": {"persona": 'it\'s "$(touch x)" `id`', "n": 1}, "source": "config"}


@pytest.mark.parametrize("name", ["Qwen/Qwen3-32B", "/models/my target v2", "models/Qwen3 copy"])
def test_written_serve_sh_is_quoted_and_round_trips(exported, tmp_path, name):
    """The serve.sh written beside a drafter (in a directory whose name needs quoting, a chat
    option full of shell syntax) parses in bash and hands vllm exactly `serve_argv`'s words."""
    final, cfg = drafter_copy(
        exported, tmp_path / 'my "drafter" $dir', verifier=name, dspark_cluster={"chat_format": CHAT}
    )
    write_recipe(final, TRAINING, EVALUATION)
    script = final / "serve.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    extra = ["--max-model-len", "512", "--served-model-name", "a b"]
    argv, done = run_stubbed([script, *extra], tmp_path)
    assert done.returncode == 0, done.stderr
    assert argv == serve_argv(cfg, final, extra=extra)[1:]
    assert argv[1] == name and json.loads(argv[3])["model"] == str(final)
    assert json.loads(argv[argv.index("--default-chat-template-kwargs") + 1]) == CHAT["kwargs"]
    assert (final / "chat_template.jinja").read_text() == CHAT["template"]
    # scripts/serve.sh builds the same command.
    (final / "serve.sh").unlink()
    again, done = run_stubbed([SERVE, final, *extra], tmp_path)
    assert done.returncode == 0, done.stderr
    assert again == argv
    # The model card's command line is the same argv, quoted.
    card = (final / "README.md").read_text()
    line = next(ln.strip() for ln in card.splitlines() if ln.strip().startswith("vllm serve "))
    assert shlex.split(line) == serve_argv(cfg, "THIS_DIRECTORY")


def test_scripts_serve_never_runs_the_drafters_files(exported, tmp_path):
    """A drafter directory holding an executable serve.sh (and a `dspark` package, for a user who
    serves from inside it): scripts/serve.sh runs neither; vllm gets the recipe built from config.json."""
    final, cfg = drafter_copy(exported, tmp_path / "downloaded", verifier="Qwen/Qwen3-32B")
    marker = tmp_path / "marker"
    (final / "serve.sh").write_text(f"#!/usr/bin/env bash\ntouch {marker}\nexec vllm pwned\n")
    (final / "serve.sh").chmod(0o755)
    (final / "dspark").mkdir()
    (final / "dspark" / "__init__.py").write_text(f"open({str(marker)!r}, 'w')\n")
    (final / "dspark" / "recipe.py").write_text(f"open({str(marker)!r}, 'w')\n")
    argv, done = run_stubbed([SERVE, final, "--tensor-parallel-size", "8"], tmp_path, cwd=final)
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    assert argv == serve_argv(cfg, final, extra=["--tensor-parallel-size", "8"])[1:]
    assert argv[:3] == ["serve", "Qwen/Qwen3-32B", "--speculative-config"]
    assert json.loads(argv[3]) == {"model": str(final), **RECIPE}


def test_trust_remote_code_comes_only_from_the_user(exported, tmp_path):
    """A config.json that says the target needed remote code gets a note, never the flag; the
    user's own `--trust-remote-code` goes through once."""
    final, cfg = drafter_copy(
        exported, tmp_path / "d", verifier="org/remote-target", dspark_cluster={"target_trust_remote_code": True}
    )
    write_recipe(final, TRAINING, EVALUATION)
    script = (final / "serve.sh").read_text()
    exec_line = next(ln for ln in script.splitlines() if ln.startswith("exec "))
    assert "--trust-remote-code" not in exec_line
    assert "add that flag yourself" in script and "--trust-remote-code" in script  # the comment
    card = (final / "README.md").read_text()
    assert "add that flag yourself" in card and "--trust-remote-code" not in next(
        ln for ln in card.splitlines() if ln.strip().startswith("vllm serve ")
    )

    for cmd in ([final / "serve.sh"], [SERVE, final]):
        argv, done = run_stubbed(cmd, tmp_path)
        assert done.returncode == 0, done.stderr
        assert "--trust-remote-code" not in argv
        argv, done = run_stubbed([*cmd, "--trust-remote-code"], tmp_path)
        assert done.returncode == 0, done.stderr
        assert argv.count("--trust-remote-code") == 1 and argv[-1] == "--trust-remote-code"
    _, done = run_stubbed([SERVE, final], tmp_path)
    assert "add that flag yourself" in done.stderr  # scripts/serve.sh says so too
