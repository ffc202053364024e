"""The settings each part of the job gets, derived from the config and the target's facts."""

from __future__ import annotations

import os

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
                                  hang_on=list(i.replay_hang_on), fault_dir=str(job.run_dir))
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

    c, t = job.cfg, job.cfg.target
    return InferenceSettings(
        target_path=job.target_path, layer_ids=job.layer_ids, key_prefix=f"{c.run_name}/{group}",
        store=StoreConfig(), device=c.device, dtype=t.dtype, tensor_parallel_size=t.tensor_parallel_size,
        max_model_len=t.max_model_len, max_num_seqs=t.max_num_seqs, kv_cache_dtype=t.kv_cache_dtype,
        kv_cache_blocks=t.kv_cache_blocks, cpu_threads=c.inference.cpu_threads, enforce_eager=t.enforce_eager, gpu_memory_utilization=t.gpu_memory_utilization,
        cpu_kvcache_space_gb=t.cpu_kvcache_space_gb, temperature=c.sampling.temperature, top_p=c.sampling.top_p,
        max_tokens=c.sampling.max_tokens, trust_remote_code=t.trust_remote_code, chat=job.target.chat)


def trainer_settings(job):
    from cluster.training import TrainerSettings

    return TrainerSettings(target_path=job.target_path, trust_remote_code=job.cfg.target.trust_remote_code,
                           chat=job.target.chat, drafter=job.cfg.drafter, trainer=job.cfg.trainer,
                           store=job.services.store_config(), device=job.cfg.device, total_steps=job.total_steps,
                           aux_layer_ids=job.aux_layer_ids, extensions_dir=os.environ.get("TORCH_EXTENSIONS_DIR"))
