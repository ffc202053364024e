"""The inference room: the frozen target, serving and extracting hidden states.

Owns the replica actor (`replica`: one vLLM engine that regenerates answers and stores their
hidden states), the capture model vLLM loads by name (`capture_model`), the producer loop
every producer runs (`producer`), a group's replica pool (`replica_pool`), the served
evaluation (`served_eval`) and the target's up-front checks (`target`).
"""

from cluster.inference.capture_model import LAYER_IDS_KEY
from cluster.inference.producer import Producer
from cluster.inference.replica import InferenceActor, InferenceSettings, engine_kwargs, executor_backend, omp_bind_per_rank
from cluster.inference.replica_pool import (ProducerSpec, Replica, ReplicaFailure, ReplicaPool, engine_actor_options,
                                            start_engine_actors)
from cluster.inference.served_eval import ServedEvalSettings, ServedEvaluator, compare_greedy, first_difference
from cluster.inference.target import read_chat_format, read_config, read_target, resolve_target, vllm_extraction_gap

__all__ = ["LAYER_IDS_KEY", "InferenceActor", "InferenceSettings", "Producer", "ProducerSpec", "Replica", "ReplicaFailure",
           "ReplicaPool", "ServedEvalSettings", "ServedEvaluator", "compare_greedy", "engine_actor_options", "engine_kwargs",
           "executor_backend", "first_difference", "omp_bind_per_rank", "read_chat_format", "read_config", "read_target",
           "resolve_target", "start_engine_actors", "vllm_extraction_gap"]
