"""`ReplicaPool`: one group's sample producers (vLLM replicas, or the replay backend), each in
its own placement group, each pulling prompts from the job's ledger in a loop (`serve`).

The pool starts them, replaces a dead one in its placement group (its prompts go back to
pending first), adds one in a new placement group and drains one for the autoscaler, and stops
them all at the end. A producer that keeps dying is replaced at most
`inference.max_replica_restarts` times per group within any `inference.restart_window_s`
(`RestartBudget`: a rate, so a week of scattered deaths goes on and a crash loop stops); then
`supervise` raises with the last error, which ends the job with that message instead of
recreating it forever. A replica that fails to
start with the error another one of the group failed to start with ends the job at once: a
deterministic start-up error (a bad engine setting, a class a worker cannot load) would fail
every replacement the same way, for minutes of restarts and backoff. A replica that stays
alive but holds a prompt in generation for longer than `inference.generation_timeout_s` is
taken for hung: it is killed and goes the same way. Thread-safe: the training loop supervises
while the autoscaler thread adds and removes.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace

from cluster.errors import cause_of
from cluster.hardware import one_node_env
from cluster.restart_budget import RestartBudget
from cluster.scaling import Placed, RoleSpec, place
from cluster.store import StoreServices

PRODUCER_LEDGER_TIMEOUT_S = 60.0  # a producer's call on the ledger (it answers in milliseconds)

log = logging.getLogger("dspark.replicas")


class ReplicaFailure(RuntimeError):
    pass


@dataclass
class ProducerSpec:
    """How to make one of a group's producers: the actor class (`InferenceActor` or
    `ReplayActor`) and its settings (the store config is filled in at start, when the node's
    daemon is known), and how many prompts it asks the ledger for at a time."""

    actor_class: type
    settings: object
    prompt_batch: int
    env: dict | None = None  # environment of the producer's process (CPU engines: threads, preloaded libraries)


@dataclass
class Replica:
    actor: object
    serving: object  # the ObjectRef of its `serve` loop: ready when it ends or dies
    placed: Placed
    owned: bool  # its placement group was made by the pool (the autoscaler's), not the job's
    helpers: list = field(default_factory=list)  # its headless engine workers on other nodes (CPU, multi-node)
    # Ready when every actor of the replica has finished its constructor (the engine started)
    starting: list = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)


def engine_actor_options(placed: Placed, tensor_parallel_size: int, env: dict | None = None, node: int = 0) -> dict:
    """Ray options for an actor that runs a vLLM engine in a replica's placement group: on its
    first bundle (node order), or the first of the `node`-th node it spans (a CPU replica's
    headless worker); with GPU TP > 1 the engine's own Ray workers take the GPUs, in the bundle
    order vLLM is told (node by node). `env`: more of the actor's environment."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    index = placed.order[node * len(placed.order) // placed.spec.nodes]
    bundle = placed.spec.bundles[index]
    env = dict(env or {})
    if len(set(placed.bundle_nodes)) == 1:
        # vLLM's own torch.distributed world (a file rendezvous, then gloo, NCCL on GPUs) has all
        # its ranks on this node: its listeners on loopback.
        env.update(one_node_env())
    if bundle.get("GPU"):
        env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, placed.order))
    return {
        "num_cpus": bundle.get("CPU", 1),
        "num_gpus": 0 if tensor_parallel_size > 1 else bundle.get("GPU", 0),
        "scheduling_strategy": PlacementGroupSchedulingStrategy(placed.pg, placement_group_bundle_index=index),
        "runtime_env": {"env_vars": env} if env else None,
    }


def spans_nodes(settings, placed: Placed) -> bool:
    """Whether a replica's engine is vLLM's multi-node multiprocessing executor: a CPU engine
    whose placement group spans nodes (GPU engines span them with vLLM's Ray executor)."""
    from cluster.inference.replica import InferenceSettings

    return isinstance(settings, InferenceSettings) and settings.device == "cpu" and placed.spec.nodes > 1


def leader_port(placed: Placed, timeout_s: float = 60.0) -> tuple[str, int]:
    """The leader node's address and a port free there, found by a task on the leader's bundle
    (the driver may run on another node)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from cluster.store import free_port

    @ray.remote(num_cpus=0)
    def probe() -> int:
        return free_port(ray.util.get_node_ip_address())

    strategy = PlacementGroupSchedulingStrategy(placed.pg, placement_group_bundle_index=placed.order[0])
    port = ray.get(probe.options(scheduling_strategy=strategy).remote(), timeout=timeout_s)
    return placed.node_ips[placed.bundle_nodes[placed.order[0]]], port


def start_engine_actors(
    actor_class: type, settings, placed: Placed, env: dict | None, name: str, args: tuple = ()
) -> tuple[object, list]:
    """A replica's engine actors: the engine (`actor_class`, e.g. `InferenceActor`) on the
    placement group's first node, and where a CPU engine spans nodes, one `HeadlessEngineWorker`
    on each other node, started together (each waits for the others at the leader's address).
    Returns (the engine actor, the headless workers)."""
    import ray

    from cluster.inference.replica import EngineSpan, HeadlessEngineWorker, InferenceSettings

    # (a replay producer is one process: no engine, no ranks)
    tp = settings.target.tensor_parallel_size if isinstance(settings, InferenceSettings) else 1
    helpers = []
    if spans_nodes(settings, placed):
        addr, port = leader_port(placed)
        nodes = placed.spec.nodes
        for rank in range(1, nodes):
            helpers.append(
                ray.remote(HeadlessEngineWorker)
                .options(
                    name=f"{name}-node{rank}",
                    **engine_actor_options(placed, tp, env, node=rank),
                )
                .remote(replace(settings, span=EngineSpan(nodes, rank, addr, port)))
            )
        settings = replace(settings, span=EngineSpan(nodes, 0, addr, port))
    engine = (
        ray.remote(actor_class)
        .options(max_concurrency=2, name=name, **engine_actor_options(placed, tp, env))
        .remote(settings, *args)
    )
    return engine, helpers


class ReplicaPool:
    def __init__(
        self,
        group: str,
        spec: ProducerSpec,
        ledger,
        services: StoreServices,
        role: RoleSpec,
        run_name: str,
        placement_timeout_s: float,
        restarts: RestartBudget,
        generation_timeout_s: float = 1800.0,
        backoff_s: float = 1.0,
        start_timeout_s: float = 1800.0,
    ) -> None:
        import ray

        self.ray, self.group, self.spec, self.ledger, self.services = ray, group, spec, ledger, services
        self.role, self.run_name, self.placement_timeout_s = role, run_name, placement_timeout_s
        self.restarts, self.generation_timeout_s, self.backoff_s = restarts, generation_timeout_s, backoff_s
        self.start_timeout_s = start_timeout_s
        self.hung: dict[str, str] = {}  # replica -> why it was killed
        self.waiting: list[tuple[float, Placed, bool]] = []  # replacements due at a time (backoff)
        self._hung_checked = 0.0
        self.replicas: dict[str, Replica] = {}
        self.seq = 0
        self.start_failures: set[str] = set()  # causes of replicas that died in their constructor
        self.stopping = False
        self.events: list[str] = []
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return len(self.replicas) + len(self.waiting)

    def start(self, placed: Placed, owned: bool = False) -> str:
        with self._lock:
            rid = f"{self.group}-r{self.seq}"
            self.seq += 1
            self.services.ensure_node_stores([placed])
            settings = replace(self.spec.settings, store=self.services.store_config())
            actor, helpers = start_engine_actors(
                self.spec.actor_class, settings, placed, self.spec.env, f"{self.run_name}-{rid}", (rid, self.group)
            )
            serving = actor.serve.remote(self.ledger.with_timeout(PRODUCER_LEDGER_TIMEOUT_S), self.spec.prompt_batch)
            # (Ray's own readiness call: it runs once the actor's constructor has returned)
            starting = [a.__ray_ready__.remote() for a in [actor, *helpers]]
            self.replicas[rid] = Replica(actor, serving, placed, owned, helpers, starting)
            return rid

    def _kill_replica(self, rep: Replica) -> None:
        for actor in [rep.actor, *rep.helpers]:
            self.ray.kill(actor, no_restart=True)

    def supervise(self) -> None:
        """Kill hung producers; replace those whose serve loop died (their prompts go back to
        pending first)."""
        self._kill_hung()
        with self._lock:
            for rid, rep in list(self.replicas.items()):
                done, _ = self.ray.wait([rep.serving], timeout=0)
                if not done:
                    continue
                try:
                    self.ray.get(rep.serving, timeout=10)
                    continue  # it finished normally (stopped)
                except Exception as e:  # noqa: BLE001 - any failure of the replica
                    error = e
                cause = self.hung.pop(rid, None) or cause_of(error, 1000)
                returned = self.ledger.replica_died(rid, cause)
                del self.replicas[rid]
                self._kill_replica(rep)
                at_start = bool(getattr(error, "actor_init_failed", False))
                self._event(
                    f"replica {rid} {'failed to start' if at_start else 'died'} ({cause}); "
                    f"{returned} prompts back to pending",
                    logging.WARNING,
                )
                if self.stopping:
                    continue
                if at_start and cause in self.start_failures:
                    raise ReplicaFailure(
                        f"group {self.group}: replica {rid} failed to start with the same error as "
                        f"an earlier one, so every replacement would: {cause}"
                    )
                if at_start:
                    self.start_failures.add(cause)
                if not self.restarts.spend():
                    raise ReplicaFailure(
                        f"group {self.group}: replicas died {self.restarts.recent() + 1} times within "
                        f"{self.restarts.window_s:g} s (inference.max_replica_restarts="
                        f"{self.restarts.limit} per inference.restart_window_s); last: {cause}"
                    )
                # Backoff: the k-th replacement within the window waits backoff x 2^(k-1) s (at
                # most 60), so that a fault that repeats (a node going bad) does not spin through
                # the restart budget.
                delay = min(self.backoff_s * 2.0 ** (self.restarts.recent() - 1), 60.0)
                self.waiting.append((time.monotonic() + delay, rep.placed, rep.owned))
            now = time.monotonic()
            due, self.waiting = [w for w in self.waiting if w[0] <= now], [w for w in self.waiting if w[0] > now]
            for _, placed, owned in due:
                if not self.stopping:
                    self.start(placed, owned)

    def _kill_hung(self, every_s: float = 5.0) -> None:
        if time.monotonic() - self._hung_checked < every_s:
            return
        self._hung_checked = time.monotonic()
        hung = {
            rid: (
                f"hung: a prompt generating for {age:.0f}s "
                f"(inference.generation_timeout_s={self.generation_timeout_s:g})"
            )
            for rid, age in self.ledger.hung_replicas(self.generation_timeout_s).items()
        }
        with self._lock:
            for rid, rep in self.replicas.items():
                if rep.starting:
                    _, rep.starting = self.ray.wait(rep.starting, num_returns=len(rep.starting), timeout=0)
                age = time.monotonic() - rep.started_at
                if rep.starting and age > self.start_timeout_s:
                    hung[rid] = (
                        f"hung in start-up: its engine had not started after {age:.0f}s "
                        f"(inference.start_timeout_s={self.start_timeout_s:g})"
                    )
            for rid, why in hung.items():
                if rid in self.replicas and rid not in self.hung:
                    self.hung[rid] = why
                    self.ray.kill(self.replicas[rid].actor, no_restart=True)

    def add(self) -> str | None:
        """A new producer in a new placement group; PlacementError if the cluster has no room,
        None if the pool is stopping (the job is past training)."""
        from ray.util.placement_group import remove_placement_group

        placed = place(replace(self.role, index=self.seq), self.placement_timeout_s)
        with self._lock:
            if self.stopping:
                remove_placement_group(placed.pg)
                return None
            rid = self.start(placed, owned=True)
        self._event(f"added replica {rid}")
        return rid

    def remove(self, drain_timeout_s: float = 600.0) -> str | None:
        """Drain the newest producer: its in-flight batch finishes and is reported, then it goes."""
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            if len(self.replicas) <= 1:
                return None
            rid = list(self.replicas)[-1]
            rep = self.replicas.pop(rid)
        try:
            self.ray.get(rep.actor.stop.remote(), timeout=30)
            self.ray.get(rep.serving, timeout=drain_timeout_s)
        except Exception:  # noqa: BLE001 - died (or hung) while draining: its prompts go back
            self.ledger.replica_died(rid)
        self._kill_replica(rep)
        if rep.owned:
            remove_placement_group(rep.placed.pg)
        self._event(f"removed replica {rid}")
        return rid

    def stop(self, drain_timeout_s: float = 120.0) -> None:
        """Drain and stop every producer; placement groups the pool made go with them (the
        job's own are released by the job)."""
        from ray.util.placement_group import remove_placement_group

        with self._lock:
            self.stopping = True
            reps, self.replicas, self.waiting = list(self.replicas.values()), {}, []
        for rep in reps:
            try:
                self.ray.get(rep.actor.stop.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for rep in reps:
            try:
                self.ray.get(rep.serving, timeout=drain_timeout_s)
            except Exception:  # noqa: BLE001
                pass
            self._kill_replica(rep)
            if rep.owned:
                remove_placement_group(rep.placed.pg)

    def stats(self) -> list[dict]:
        """Each live producer's totals (prompts, tokens, busy seconds); a producer that does not
        answer within 5 s (being replaced) is left out."""
        with self._lock:
            actors = [r.actor for r in self.replicas.values()]
        out = []
        for actor in actors:
            try:
                out.append(self.ray.get(actor.stats.remote(), timeout=5))
            except Exception:  # noqa: BLE001 - a replica being replaced
                pass
        return out

    def _event(self, text: str, level: int = logging.INFO) -> None:
        self.events.append(text)
        log.log(level, "[%s] %s", self.group, text)
