"""Placement: one placement group per inference replica, one per trainer node.

Why bundles are sorted by node: a TP-8 replica spanning two 4-GPU nodes is one placement
group of eight 1-GPU bundles (vLLM starts one worker per bundle). Ray's PACK strategy keeps
the bundles on as few nodes as it can, but it does not keep *consecutive* bundle indices on
the same node: bundles 0,1,4,5 may land on node A and 2,3,6,7 on node B. vLLM gives TP ranks
to bundles in index order, so tensor-parallel neighbours would talk across the network. After
the group is placed we read where each bundle went and hand vLLM the indices sorted by node
(`VLLM_RAY_BUNDLE_INDICES`), so ranks 0-3 share one node's NVLink and 4-7 the other's.

Before any group is created, `check_topology` compares what the config needs with what the
cluster has, in GPUs per node (a replica and a trainer may share a node: the single-node split,
e.g. a TP-4 replica on four GPUs of an 8-GPU node and four trainer ranks on the other four),
and names the missing resource; a group that still cannot be placed in time fails with the
group's name and shape instead of pending forever.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from cluster.config import JobConfig


class PlacementError(RuntimeError):
    pass


@dataclass
class RoleSpec:
    group: str
    role: str  # inference | trainer
    index: int  # replica index, or trainer node index
    bundles: list[dict]
    strategy: str
    nodes: int  # how many nodes the bundles must span
    run: str = ""  # placement group names are cluster-wide: two jobs (or one job's runs) must not clash
    generation: int = 0  # bumped when a role is placed anew (a resized trainer) while the old one may linger

    @property
    def label(self) -> str:
        return f"{self.group}/{self.role}{self.index}"

    @property
    def name(self) -> str:
        """The placement group's name."""
        name = f"{self.run}/{self.label}" if self.run else self.label
        return f"{name}.{self.generation}" if self.generation else name


@dataclass
class Placed:
    spec: RoleSpec
    pg: object
    bundle_nodes: list[str]  # node id per bundle index
    node_ips: dict[str, str]
    order: list[int] = field(default_factory=list)  # bundle indices sorted by node

    def rows(self) -> list[tuple[str, str, str, int]]:
        """(role, node ip, device, bundle index) in rank order."""
        per_node = Counter()
        out = []
        gpu = any(b.get("GPU") for b in self.spec.bundles)
        for b in self.order:
            node = self.bundle_nodes[b]
            slot = per_node[node]
            per_node[node] += 1
            label = f"{self.node_ips.get(node, '?')}/{node[:6]}"  # fake nodes share an IP
            out.append((self.spec.label, label, f"GPU{slot}" if gpu else f"CPU{slot}", b))
        return out


def replica_bundles(cfg: JobConfig, group_index: int) -> list[dict]:
    """One inference replica's bundles: one per GPU of its tensor-parallel group (spread over
    `nodes_per_replica` nodes), or one CPU bundle on a CPU-only group — and for a replay
    replica, which replays stored samples and runs no model, so that a GPU job can be
    exercised with all its GPUs on the trainer side (e.g. one GPU: `scripts/gpu_check.sh`)."""
    g = cfg.topology.groups[group_index]
    if g.gpus_per_node > 0 and cfg.inference.backend == "vllm":
        return [{"GPU": 1.0, "CPU": g.cpus_per_replica} for _ in range(cfg.target.tensor_parallel_size)]
    if cfg.inference.backend == "vllm" and cfg.target.nodes_per_replica > 1:
        # a CPU engine across nodes (vLLM's multi-node multiprocessing executor): one bundle per node
        return [{"CPU": g.cpus_per_replica} for _ in range(cfg.target.nodes_per_replica)]
    return [{"CPU": g.cpus_per_replica}]


def cluster_request(cfg: JobConfig, shapes: list[tuple[int, int]]) -> list[dict]:
    """Every bundle the job needs with (replicas, trainer ranks) per group, for Ray's
    `request_resources`: it sizes the cluster so that the listed bundles fit in total, running
    work included, and each call replaces the last, so it lists the whole job, not the increment."""
    layout = {g.name: ranks for g, (_, ranks) in zip(cfg.topology.groups, shapes)}
    bundles = [
        dict(b) for gi, (replicas, _) in enumerate(shapes) for _ in range(replicas) for b in replica_bundles(cfg, gi)
    ]
    return bundles + [dict(b) for s in trainer_specs(cfg, layout) for b in s.bundles]


def replica_spec(cfg: JobConfig, group_index: int, index: int = 0) -> RoleSpec:
    g, t = cfg.topology.groups[group_index], cfg.target
    bundles = replica_bundles(cfg, group_index)
    if any(b.get("GPU") for b in bundles):
        return RoleSpec(g.name, "inference", index, bundles, "PACK", t.nodes_per_replica, cfg.run_name)
    # CPU bundles: one per node the engine spans, each on its own node
    return RoleSpec(
        g.name, "inference", index, bundles, "STRICT_SPREAD" if len(bundles) > 1 else "PACK", len(bundles), cfg.run_name
    )


def trainer_specs(cfg: JobConfig, layout: dict[str, int] | None = None, generation: int = 0) -> list[RoleSpec]:
    """One placement group per trainer node of every group, group by group (the world's rank
    order). `layout` (group -> ranks) asks for resized trainers: full nodes of
    `trainer_ranks_per_node` ranks and the remainder on one more; `generation` keeps their
    placement group names new."""
    specs = []
    for g in cfg.topology.groups:
        rank = {"GPU": 1.0, "CPU": g.cpus_per_trainer_rank} if g.gpus_per_node > 0 else {"CPU": g.cpus_per_trainer_rank}
        total = (layout or {}).get(g.name, g.trainer_ranks)
        for n, start in enumerate(range(0, total, g.trainer_ranks_per_node)):
            bundles = [dict(rank) for _ in range(min(g.trainer_ranks_per_node, total - start))]
            specs.append(RoleSpec(g.name, "trainer", n, bundles, "STRICT_PACK", 1, cfg.run_name, generation))
    return specs


def role_specs(cfg: JobConfig) -> list[RoleSpec]:
    """Every placement group of the configured topology: one per inference replica, one per
    trainer node."""
    replicas = [
        replica_spec(cfg, gi, r) for gi, g in enumerate(cfg.topology.groups) for r in range(g.inference_replicas)
    ]
    return replicas + trainer_specs(cfg)


def node_chunks(spec: RoleSpec) -> list[tuple[float, float]]:
    """(GPUs, CPUs) the placement group needs on each node it spans."""
    per_node = len(spec.bundles) // spec.nodes
    return [
        (sum(b.get("GPU", 0) for b in part), sum(b.get("CPU", 0) for b in part))
        for part in (spec.bundles[i * per_node : (i + 1) * per_node] for i in range(spec.nodes))
    ]


def _fits(chunks: list[float], capacity: list[float], max_states: int = 200_000) -> bool:
    """Whether per-node shares `chunks` pack into nodes of `capacity` GPUs: an exact search
    (largest share first; nodes with the same free room are interchangeable, so only one of them
    is tried; states seen are not searched again). Past `max_states` it answers yes and leaves
    the verdict to Ray's placement, which fails with the group's name if it really does not fit."""
    chunks = sorted(chunks, reverse=True)
    seen: set = set()

    def place(i: int, free: tuple) -> bool:
        if i == len(chunks):
            return True
        if (i, free) in seen:
            return False
        if len(seen) > max_states:
            raise OverflowError
        seen.add((i, free))
        for f in sorted(set(free), reverse=True):
            if f >= chunks[i]:
                k = free.index(f)
                if place(i + 1, tuple(sorted(free[:k] + (f - chunks[i],) + free[k + 1 :], reverse=True))):
                    return True
        return False

    try:
        return place(0, tuple(sorted(capacity, reverse=True)))
    except OverflowError:
        return True


def check_topology(cfg: JobConfig, nodes: list[dict]) -> None:
    """Fail early, naming the resource, when the cluster cannot hold the topology.

    GPUs are counted per node: every replica's per-node share (TP GPUs / nodes_per_replica)
    and every trainer node's ranks must fit on some node, several roles per node allowed.
    `nodes` is `ray.nodes()` (alive ones count)."""
    alive = [n for n in nodes if n.get("Alive", n.get("alive", True))]
    gpus = sorted((n["Resources"].get("GPU", 0) for n in alive), reverse=True)
    cpus = sum(n["Resources"].get("CPU", 0) for n in alive)
    specs = role_specs(cfg)
    chunks = [c for s in specs for c in node_chunks(s)]
    need_gpu = sum(g for g, _ in chunks)
    need_cpu = sum(c for _, c in chunks)
    biggest = max((g for g, _ in chunks), default=0)
    if biggest and (not gpus or gpus[0] < biggest):
        what = next(s for s in specs if any(g == biggest for g, _ in node_chunks(s)))
        raise PlacementError(
            f"{what.label} needs {biggest:g} GPUs on one node; the largest node has {gpus[0] if gpus else 0:g}"
        )
    gpu_chunks = [g for g, _ in chunks if g]
    if gpu_chunks and not _fits(gpu_chunks, gpus):
        # How many more nodes like the largest would make it fit: what an operator adds.
        missing = 1
        while not _fits(gpu_chunks, gpus + [gpus[0]] * missing):
            missing += 1
        raise PlacementError(
            f"topology needs {need_gpu:g} GPUs in per-node shares {sorted(gpu_chunks, reverse=True)}, the cluster has "
            f"{sum(gpus):g} GPUs on {len(gpus)} node(s) "
            f"({', '.join(f'{x:g}' for x in gpus[:8])}{'...' if len(gpus) > 8 else ''}): "
            f"missing {missing} node(s) of {gpus[0]:g} GPUs, {max(0.0, need_gpu - sum(gpus)):g} GPU(s)"
        )
    if need_cpu > cpus:
        raise PlacementError(
            f"topology needs {need_cpu:g} CPUs, the cluster has {cpus:g} (missing {need_cpu - cpus:g} CPU)"
        )


def sort_bundles_by_node(bundle_nodes: list[str]) -> list[int]:
    """Bundle indices grouped by node (nodes in order of their lowest index, so rank 0's node
    comes first), ascending within a node: the rank order to give vLLM."""
    by_node = defaultdict(list)
    for i, node in enumerate(bundle_nodes):
        by_node[node].append(i)
    return [i for node in sorted(by_node, key=lambda n: min(by_node[n])) for i in sorted(by_node[node])]


def place(spec: RoleSpec, timeout_s: float) -> Placed:
    import ray
    from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

    pg = placement_group(spec.bundles, strategy=spec.strategy, name=spec.name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        free = ray.available_resources()
        shape = Counter(tuple(sorted(b.items())) for b in spec.bundles)
        raise PlacementError(
            f"placement group {spec.name} ({', '.join(f'{n}x{dict(k)}' for k, n in shape.items())}, {spec.strategy}) "
            f"not placed within {timeout_s:.0f}s; free now: GPU={free.get('GPU', 0):g} CPU={free.get('CPU', 0):g}"
        )
    table = placement_group_table(pg)
    bundle_nodes = [table["bundles_to_node_id"][i] for i in range(len(spec.bundles))]
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    order = sort_bundles_by_node(bundle_nodes)
    counts = sorted(Counter(bundle_nodes).values())
    if len(counts) > spec.nodes or counts[0] != counts[-1]:
        remove_placement_group(pg)
        raise PlacementError(
            f"{spec.name}: {len(spec.bundles)} bundles landed {counts} per node; expected {spec.nodes} node(s) "
            f"with {len(spec.bundles) // spec.nodes} each (are other jobs holding part of a node?)"
        )
    return Placed(spec, pg, bundle_nodes, ips, order)


def place_all(cfg: JobConfig, specs: list[RoleSpec] | None = None) -> list[Placed]:
    """Place `specs` (default: the whole configured topology) after checking that the cluster
    can hold the topology; on failure nothing stays placed."""
    import ray

    check_topology(cfg, ray.nodes())
    placed = []
    try:
        for s in specs if specs is not None else role_specs(cfg):
            placed.append(place(s, cfg.topology.placement_timeout_s))
    except PlacementError:
        release(placed)
        raise
    return placed


def release(placed: list[Placed]) -> None:
    from ray.util.placement_group import remove_placement_group

    for p in placed:
        try:
            remove_placement_group(p.pg)
        except Exception:  # noqa: BLE001 - already removed (a resized trainer's old group)
            pass


def describe(placed: list[Placed]) -> str:
    lines = [f"{'role':22} {'node':24} {'device':7} bundle"]
    for p in placed:
        for role, node, dev, b in p.rows():
            lines.append(f"{role:22} {node:24} {dev:7} {b}")
    return "\n".join(lines)
