"""The inference room: the frozen target, serving and extracting hidden states.

Owns the replica actor (`replica`: one vLLM engine that regenerates answers and stores their
hidden states), the capture model vLLM loads by name (`capture_model`), the KV connector vLLM
loads by module path (`hidden_states_connector`, not imported here: it imports vLLM), the
producer loop every producer runs (`producer`), the replay producer that stores recorded
answers instead of generating them (`replay`), a group's replica pool (`replica_pool`) and the
served evaluation (`served_eval`). The target's up-front checks are on the ground floor
(`cluster.target`): the capacity plan reads the target too.
"""

from cluster.inference.capture_model import LAYER_IDS_KEY
from cluster.inference.producer import Producer
from cluster.inference.replay import ReplayActor, ReplaySettings
from cluster.inference.replica import (
    InferenceActor,
    InferenceSettings,
    engine_kwargs,
    executor_backend,
    omp_bind_per_rank,
)
from cluster.inference.replica_pool import (
    ProducerSpec,
    Replica,
    ReplicaFailure,
    ReplicaPool,
    engine_actor_options,
    start_engine_actors,
)
from cluster.inference.served_eval import ServedEvalSettings, ServedEvaluator, compare_greedy, first_difference

__all__ = [
    "LAYER_IDS_KEY",
    "InferenceActor",
    "InferenceSettings",
    "Producer",
    "ProducerSpec",
    "ReplayActor",
    "ReplaySettings",
    "Replica",
    "ReplicaFailure",
    "ReplicaPool",
    "ServedEvalSettings",
    "ServedEvaluator",
    "compare_greedy",
    "engine_actor_options",
    "engine_kwargs",
    "executor_backend",
    "first_difference",
    "omp_bind_per_rank",
    "start_engine_actors",
]
