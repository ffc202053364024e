"""The settings each part of the job gets, derived from the config and the target's facts
(`JobInputs`): what a producer, a CPU engine, a trainer rank is started with."""

from __future__ import annotations

import os
from dataclasses import replace

from cluster.config import JobConfig
from cluster.hardware import cpu_process_env
from cluster.job.inputs import JobInputs


def producer_spec(cfg: JobConfig, inputs: JobInputs, group_index: int, fault_dir: str):
    from cluster.inference import InferenceActor, ProducerSpec, ReplayActor, ReplaySettings
    from cluster.store import StoreConfig

    g = cfg.topology.groups[group_index]
    if cfg.inference.backend == "replay":
        i = cfg.inference
        rate = g.replay_samples_per_s if g.replay_samples_per_s is not None else i.replay_samples_per_s
        hooks = cfg.testing
        settings = ReplaySettings(
            i.replay_dir,
            StoreConfig(),
            rate,
            crash_on=list(hooks.replay_crash_on),
            hang_on=list(hooks.replay_hang_on),
            start_hangs=hooks.replay_start_hangs,
            fault_dir=fault_dir,
        )
        return ProducerSpec(ReplayActor, settings, i.prompt_batch)
    return ProducerSpec(
        InferenceActor, inference_settings(cfg, inputs, g.name), cfg.inference.prompt_batch, cpu_engine_env(cfg)
    )


def cpu_engine_env(cfg: JobConfig) -> dict | None:
    """A CPU engine's process: its OpenMP threads and what vLLM's CPU guide preloads."""
    if cfg.device != "cpu":
        return None
    # (cpu_threads is set from the machine's cores when the config was read)
    return cpu_process_env(tuple(cfg.inference.preload), cfg.inference.cpu_threads) or None


def cpu_rank_env(cfg: JobConfig) -> dict | None:
    """A CPU trainer rank's process: the preloaded libraries (its threads it sets itself)."""
    if cfg.device != "cpu":
        return None
    return cpu_process_env(tuple(cfg.trainer.preload)) or None


def inference_settings(cfg: JobConfig, inputs: JobInputs, group: str):
    from cluster.inference import InferenceSettings
    from cluster.store import StoreConfig

    return InferenceSettings(
        target=replace(cfg.target, path=inputs.target.path),
        layer_ids=inputs.layer_ids,
        key_prefix=f"{cfg.run_name}/{group}",
        sampling=cfg.sampling,
        store=StoreConfig(),
        device=cfg.device,
        cpu_threads=cfg.inference.cpu_threads,
        chat=inputs.target.chat,
    )


def trainer_settings(cfg: JobConfig, inputs: JobInputs, store, lr_horizon: int):
    from cluster.training import TrainerSettings

    return TrainerSettings(
        target_path=inputs.target.path,
        trust_remote_code=cfg.target.trust_remote_code,
        chat=inputs.target.chat,
        drafter=cfg.drafter,
        trainer=cfg.trainer,
        store=store,
        device=cfg.device,
        total_steps=lr_horizon,
        aux_layer_ids=inputs.aux_layer_ids,
        extensions_dir=os.environ.get("TORCH_EXTENSIONS_DIR"),
        testing=cfg.testing,
    )
