"""The settings each part of the job gets, derived from the config and the target's facts."""

from __future__ import annotations

import os
from dataclasses import replace

from cluster.hardware import cpu_process_env



def producer_spec(job, group_index: int):
    from cluster.inference import InferenceActor
    from cluster.data import ReplayActor, ReplaySettings
    from cluster.inference import ProducerSpec
    from cluster.store import StoreConfig

    c, g = job.cfg, job.cfg.topology.groups[group_index]
    if c.inference.backend == "replay":
        i = c.inference
        rate = g.replay_samples_per_s if g.replay_samples_per_s is not None else i.replay_samples_per_s
        settings = ReplaySettings(i.replay_dir, StoreConfig(), rate, crash_on=list(i.replay_crash_on),
                                  hang_on=list(i.replay_hang_on), start_hangs=i.replay_start_hangs,
                                  fault_dir=str(job.run_dir))
        return ProducerSpec(ReplayActor, settings, i.prompt_batch)
    return ProducerSpec(InferenceActor, inference_settings(job, g.name), c.inference.prompt_batch, cpu_engine_env(job))


def cpu_engine_env(job) -> dict | None:
    """A CPU engine's process: its OpenMP threads and what vLLM's CPU guide preloads."""
    if job.cfg.device != "cpu":
        return None
    # (cpu_threads is set from the machine's cores when the config was read)
    return cpu_process_env(tuple(job.cfg.inference.preload), job.cfg.inference.cpu_threads) or None


def cpu_rank_env(job) -> dict | None:
    """A CPU trainer rank's process: the preloaded libraries (its threads it sets itself)."""
    if job.cfg.device != "cpu":
        return None
    return cpu_process_env(tuple(job.cfg.trainer.preload)) or None


def inference_settings(job, group: str):
    from cluster.inference import InferenceSettings
    from cluster.store import StoreConfig

    c = job.cfg
    return InferenceSettings(
        target=replace(c.target, path=job.target_path), layer_ids=job.layer_ids, key_prefix=f"{c.run_name}/{group}",
        sampling=c.sampling, store=StoreConfig(), device=c.device, cpu_threads=c.inference.cpu_threads,
        chat=job.target.chat)


def trainer_settings(job):
    from cluster.training import TrainerSettings

    return TrainerSettings(target_path=job.target_path, trust_remote_code=job.cfg.target.trust_remote_code,
                           chat=job.target.chat, drafter=job.cfg.drafter, trainer=job.cfg.trainer,
                           store=job.services.store_config(), device=job.cfg.device, total_steps=job.total_steps,
                           aux_layer_ids=job.aux_layer_ids, extensions_dir=os.environ.get("TORCH_EXTENSIONS_DIR"))
