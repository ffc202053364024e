"""Chat-template options are config, recorded in the exported drafter, and applied identically
where answers are rendered (replicas), where τ is measured (`dspark.evaluate` reads the record)
and in the serving recipe (`--chat-template`, `--default-chat-template-kwargs`)."""

from __future__ import annotations

import json
import subprocess

import pytest

from cluster.config import ROOT, ConfigError
from cluster.config_load import load_config
from cluster.target import read_chat_format
from dspark import evaluate
from dspark.chat import TOKENIZER_DEFAULT, ChatFormat, render_prompt, render_with_loss_mask
from dspark.checkpoint import save_drafter
from dspark.config import DSparkConfig
from dspark.recipe import CHAT_TEMPLATE_FILE, write_recipe
from tests.helpers import PERSONA_TEMPLATE as TEMPLATE
from tests.helpers import make_drafter

MESSAGES = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello there."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture
def template_file(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


def tokenizer(target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target))


def test_options_change_the_rendering_and_keep_the_loss_mask(tiny_target, template_file):
    tok = tokenizer(tiny_target)
    chat = ChatFormat.from_options(str(template_file), {"persona": "You are terse."})
    plain = ChatFormat.from_options(str(template_file), {})
    with_persona = tok.decode(render_prompt(tok, MESSAGES, chat))
    assert with_persona.startswith("<|im_start|>system\nYou are terse.") and with_persona.endswith(
        "<|im_start|>assistant\n"
    )
    assert tok.decode(render_prompt(tok, MESSAGES, plain)).startswith("<|im_start|>user\nHi")
    assert render_prompt(tok, MESSAGES, TOKENIZER_DEFAULT) != render_prompt(tok, MESSAGES, chat)
    ids, mask = render_with_loss_mask(tok, MESSAGES, chat)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "Hello there.<|im_end|>"
    record = chat.record(tok)
    assert (
        record["template"] == TEMPLATE
        and record["kwargs"] == {"persona": "You are terse."}
        and record["source"] == "config"
    )
    assert TOKENIZER_DEFAULT.record(tok)["template"] == tok.chat_template


def test_the_format_travels_with_the_drafter(tiny_target, template_file, tmp_path):
    tok = tokenizer(tiny_target)
    chat = ChatFormat.from_options(str(template_file), {"persona": "You are terse."})
    drafter = make_drafter(tiny_target, block_size=4)
    drafter.config.chat_format = chat.record(tok)
    final = save_drafter(drafter, tmp_path / "final")
    assert (
        ChatFormat.from_record(
            DSparkConfig.from_speculators_dict(json.loads((final / "config.json").read_text())).chat_format
        )
        == chat
    )

    write_recipe(final, {}, {})
    assert (final / CHAT_TEMPLATE_FILE).read_text() == TEMPLATE
    serve = (final / "serve.sh").read_text()
    assert f'--chat-template "$DRAFTER/{CHAT_TEMPLATE_FILE}"' in serve
    assert """--default-chat-template-kwargs '{"persona": "You are terse."}'""" in serve
    assert subprocess.run(["bash", "-n", str(final / "serve.sh")]).returncode == 0

    # τ is measured on prompts rendered as the drafter's data was.
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "c0", "messages": MESSAGES}) + "\n")
    res = evaluate.evaluate(
        evaluate.parse_args(
            [
                "--target",
                str(tiny_target),
                "--drafter",
                str(final),
                "--prompts",
                str(prompts),
                "--json",
                str(tmp_path / "e.json"),
                "--max-new-tokens",
                "4",
            ]
        )
    )
    assert res["requests"][0]["prompt_tokens"] == len(render_prompt(tok, MESSAGES, chat))
    assert res["requests"][0]["prompt_tokens"] != len(render_prompt(tok, MESSAGES))


def test_bad_chat_options_fail_before_any_actor(tiny_target, template_file, tmp_path):
    local = ROOT / "configs" / "local.yaml"
    with pytest.raises(ConfigError, match=r"`target\.chat_template`: cannot read"):
        read_chat_format(load_config(local, [f"target.chat_template={tmp_path / 'missing.jinja'}"]), str(tiny_target))
    failing = tmp_path / "failing.jinja"
    failing.write_text("{% if persona is defined %}{{ raise_exception('no personas here') }}{% endif %}" + TEMPLATE)
    cfg = load_config(local, [f"target.chat_template={failing}", "target.chat_template_kwargs.persona=x"])
    with pytest.raises(ConfigError, match=r"`target\.chat_template`.*no personas here"):
        read_chat_format(cfg, str(tiny_target))
    cfg = load_config(local, [f"target.chat_template={template_file}", "target.chat_template_kwargs.persona=x"])
    assert read_chat_format(cfg, str(tiny_target)).kwargs == {"persona": "x"}
