"""The rack's deployment agrees with the job it deploys: deploy/kimi_k3_rayjob.yaml (a KubeRay
RayJob) against configs/kimi_k3.yaml as the project's own loader reads it, and against the
Dockerfile, constraints/gpu.txt and pyproject.toml.

`deployment_mismatches` lists every disagreement in words; the shipped files must give none, and a
copy changed in one place must give the one that names it (each check can fail).

What is compared:
- worker pods = groups x (nodes_per_replica x inference_replicas + trainer_nodes) (`replicas`), the
  fewest the config's lower bounds leave (`minReplicas`), and `maxReplicas` between that and what
  the job's autoscaler could ask for, within one NVL72 NVLink domain (72 GPUs);
- GPUs per worker pod = the groups' gpus_per_node; CPUs per pod >= what a trainer tray or a replica
  tray reserves; /dev/shm and memory room for the store's segment;
- the entrypoint runs jobs/train_kimi_k3.py with configs/kimi_k3.yaml (paths in the image mapped back
  to the repository through the Dockerfile's WORKDIR), and the config it runs is loaded from there;
- one image everywhere, named dspark-cluster:<pyproject version>; the Dockerfile's vLLM base, the
  constraints and the `gpu` extra name the same vLLM and Mooncake; Ray's version is pyproject's;
  the image holds the job and what scripts/gpu_check.py runs;
- Ray token auth on (authOptions and RAY_AUTH_MODE in every container, the Secret mounted where the
  image looks for it, no token in the file); RDMA for the store and NCCL's variables in every pod;
  every worker in the ComputeDomain; /shared mounted everywhere and holding the config's paths.
"""

from __future__ import annotations

import copy
import math
import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from cluster.config import JobConfig
from cluster.config_load import load_config

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "kimi_k3_rayjob.yaml"
CONFIG = ROOT / "configs" / "kimi_k3.yaml"
NVLINK_DOMAIN_GPUS = 72  # one GB300 NVL72 rack: the most GPUs one multi-node NVLink domain has
JOB_SCRIPT = "jobs/train_kimi_k3.py"
REQUIRED_ENV = ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA")
# What the image must hold: the packages and the job, its configs and prompt sets, and what
# scripts/gpu_check.py runs (benchmarks/serve_dspark_gpu.py, benchmarks/serving.py).
IMAGE_DIRS = ("dspark", "cluster", "jobs", "configs", "data", "scripts", "benchmarks", "constraints")


def quantity(q) -> float:
    """A Kubernetes quantity ("768Gi", "16", "500m") as a number (bytes, cores)."""
    s = str(q)
    for suffix, factor in (("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30), ("Ti", 2**40), ("m", 1e-3)):
        if s.endswith(suffix):
            return float(s[: -len(suffix)]) * factor
    return float(s)


def read_dockerfile(text: str) -> dict:
    """The Dockerfile's base image (ARG defaults substituted), WORKDIR, ENV values and RUN lines."""
    joined = re.sub(r"\\\n", " ", text)
    lines = [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    args, env, runs, copies, base, workdir = {}, {}, [], [], None, None
    for ln in lines:
        word, _, rest = ln.partition(" ")
        word = word.upper()
        if word == "ARG" and "=" in rest:
            k, _, v = rest.partition("=")
            args[k.strip()] = v.strip()
        elif word == "FROM":
            base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), rest.split()[0])
        elif word == "WORKDIR":
            workdir = rest.strip()
        elif word == "ENV":
            env.update(dict(pair.split("=", 1) for pair in shlex.split(rest)))
        elif word == "RUN":
            runs.append(rest)
        elif word == "COPY":
            copies.extend(rest.split()[:-1])
    return {"base": base, "workdir": workdir, "env": env, "runs": runs, "copies": copies}


def pins(lines) -> dict[str, str]:
    """name -> exact version of every `name==version` requirement among the lines."""
    out = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            out[req.name.lower()] = exact[0]
    return out


def worker_nodes(cfg: JobConfig) -> tuple[int, int, int]:
    """(nodes the topology starts with, the fewest its lower bounds allow, the most its upper
    bounds could ask for): a replica spans nodes_per_replica nodes, a trainer takes whole nodes."""
    spread = cfg.target.nodes_per_replica
    start = lo = hi = 0
    for g in cfg.topology.groups:
        rmin, rmax = g.trainer_rank_bounds()
        start += spread * g.inference_replicas + g.trainer_nodes
        lo += spread * g.min_replicas + math.ceil(rmin / g.trainer_ranks_per_node)
        hi += spread * g.max_replicas + math.ceil(rmax / g.trainer_ranks_per_node)
    return start, lo, hi


def pod_specs(rayjob: dict) -> list[tuple[str, dict]]:
    spec = rayjob["spec"]["rayClusterSpec"]
    return [("head", spec["headGroupSpec"]["template"]["spec"])] + [
        (f"worker group {w['groupName']}", w["template"]["spec"]) for w in spec["workerGroupSpecs"]
    ]


def deployment_mismatches(
    docs: list[dict], dockerfile: str, pyproject: dict, constraints: str, cfg: JobConfig | None = None
) -> list[str]:
    """Every way the manifest, the config its entrypoint runs, the Dockerfile, the constraints and
    pyproject disagree, in words; empty when they agree. `cfg`: the config to hold the manifest to;
    by default the one its entrypoint names, loaded with the entrypoint's overrides."""
    bad: list[str] = []
    rayjobs = [d for d in docs if d and d.get("kind") == "RayJob"]
    if len(rayjobs) != 1 or rayjobs[0].get("apiVersion") != "ray.io/v1":
        return [f"expected one ray.io/v1 RayJob, found {[(d.get('apiVersion'), d.get('kind')) for d in docs if d]}"]
    rayjob = rayjobs[0]
    spec, cluster = rayjob["spec"], rayjob["spec"]["rayClusterSpec"]
    docker = read_dockerfile(dockerfile)
    workdir = docker["workdir"] or "/"

    # The entrypoint: python <image>/jobs/train_kimi_k3.py --config <image>/configs/kimi_k3.yaml [overrides]
    argv = shlex.split(spec.get("entrypoint", ""))

    def in_repo(p: str) -> Path:
        path = Path(p)
        if path.is_absolute():
            if not path.is_relative_to(workdir):
                return Path("/outside-the-project") / path.relative_to("/")  # not the project's copy in the image
            path = path.relative_to(workdir)
        return ROOT / path

    if len(argv) < 4 or argv[0] not in ("python", "python3") or argv[2] != "--config":
        return bad + [
            f"entrypoint {spec.get('entrypoint')!r} is not `python {JOB_SCRIPT} --config CONFIG [key=value ...]`"
        ]
    if in_repo(argv[1]) != ROOT / JOB_SCRIPT:
        bad.append(f"entrypoint runs {argv[1]}, not {JOB_SCRIPT} under the image's WORKDIR {workdir}")
    config_path, overrides = in_repo(argv[3]), argv[4:]
    if config_path != CONFIG:
        bad.append(
            f"entrypoint's config {argv[3]} is not {CONFIG.relative_to(ROOT)} (in the image's WORKDIR {workdir})"
        )
    if not config_path.exists():
        return bad + [f"entrypoint's config {argv[3]} does not exist in the image ({config_path})"]
    if any("=" not in o or o.startswith("-") for o in overrides):
        bad.append(f"entrypoint passes {overrides}: only key=value overrides may follow the config (no --plan)")
    if cfg is None:
        cfg = load_config(config_path, [o for o in overrides if "=" in o and not o.startswith("-")])

    # Worker pods against the topology.
    workers = cluster.get("workerGroupSpecs") or []
    gpus = {g.gpus_per_node for g in cfg.topology.groups}
    if len(workers) != 1:
        bad.append(f"{len(workers)} worker groups: the rack's trays are alike, one group of them is expected")
    start, lo, hi = worker_nodes(cfg)
    total = sum(w.get("replicas", 0) for w in workers)
    if total != start:
        bad.append(
            f"worker replicas {total} != the config's {start} nodes "
            f"(groups x (nodes_per_replica x inference_replicas + trainer_nodes))"
        )
    for w in workers:
        if w.get("minReplicas") != lo:
            bad.append(
                f"worker group {w['groupName']}: minReplicas {w.get('minReplicas')} != {lo}, the fewest nodes the "
                "config's min_replicas and min_trainer_ranks leave"
            )
        top = w.get("maxReplicas", 2**31 - 1)
        if not start <= top <= hi:
            bad.append(
                f"worker group {w['groupName']}: maxReplicas {top} outside [{start}, {hi}] (the configured nodes, "
                "the most the job's autoscaler could ask for)"
            )
        if len(gpus) == 1 and top * next(iter(gpus)) > NVLINK_DOMAIN_GPUS:
            bad.append(
                f"worker group {w['groupName']}: {top} pods x {next(iter(gpus))} GPUs exceed one NVL72 NVLink domain"
            )
    if len(gpus) != 1:
        bad.append(f"groups disagree on gpus_per_node {sorted(gpus)}: one worker group cannot serve them")
    need_cpus = max(
        max(
            g.trainer_ranks_per_node * g.cpus_per_trainer_rank,
            cfg.target.tensor_parallel_size // cfg.target.nodes_per_replica * g.cpus_per_replica,
        )
        for g in cfg.topology.groups
    )
    segment = cfg.transport.segment_mb * 2**20
    claim_templates = {
        d["spec"]["channel"]["resourceClaimTemplate"]["name"] for d in docs if d and d.get("kind") == "ComputeDomain"
    }
    for w in workers:
        pod = w["template"]["spec"]
        (c,) = [c for c in pod["containers"] if c["name"] == "ray-worker"] or [None]
        if c is None:
            bad.append(f"worker group {w['groupName']}: no ray-worker container")
            continue
        res = c.get("resources", {})
        for kind in ("requests", "limits"):
            n = res.get(kind, {}).get("nvidia.com/gpu")
            if len(gpus) == 1 and (n is None or int(n) != next(iter(gpus))):
                bad.append(
                    f"worker group {w['groupName']}: {kind} nvidia.com/gpu {n} != gpus_per_node {next(iter(gpus))}"
                )
        cpus = quantity(res.get("limits", {}).get("cpu", 0))
        if cpus < need_cpus:
            bad.append(
                f"worker group {w['groupName']}: {cpus:g} CPUs < {need_cpus:g} that a trainer or replica tray reserves"
            )
        shm = [v for v in pod.get("volumes", []) if v["name"] == "dshm"]
        shm_size = quantity(shm[0]["emptyDir"].get("sizeLimit", 0)) if shm else 0
        if shm_size < segment:
            bad.append(
                f"worker group {w['groupName']}: /dev/shm {shm_size / 2**30:g} GiB < the store segment "
                f"(transport.segment_mb = {cfg.transport.segment_mb})"
            )
        if quantity(res.get("limits", {}).get("memory", 0)) < shm_size + segment:
            bad.append(f"worker group {w['groupName']}: memory limit below /dev/shm + the store segment")
        if "IPC_LOCK" not in c.get("securityContext", {}).get("capabilities", {}).get("add", []):
            bad.append(f"worker group {w['groupName']}: no IPC_LOCK (RDMA pins the store's memory)")
        if not any(k.startswith("rdma/") for k in res.get("limits", {})):
            bad.append(
                f"worker group {w['groupName']}: no RDMA device resource (transport.protocol={cfg.transport.protocol})"
            )
        claims = {rc.get("resourceClaimTemplateName") for rc in pod.get("resourceClaims", [])}
        if not claim_templates or not claim_templates & claims:
            bad.append(
                f"worker group {w['groupName']}: not in the ComputeDomain (TP across trays needs multi-node NVLink)"
            )
    if cfg.transport.protocol != "rdma":
        bad.append(f"the config moves hidden states over {cfg.transport.protocol}, not rdma")

    # One image everywhere, the project's, built from this Dockerfile with these pins.
    project = pyproject["project"]
    images = {c["image"] for _, pod in pod_specs(rayjob) for c in pod["containers"]}
    want = f"/{project['name']}:{project['version']}"
    if len(images) != 1 or not next(iter(images)).endswith(want):
        bad.append(f"images {sorted(images)}: one image ending in {want} expected (built from the Dockerfile)")
    extra = pins(project["optional-dependencies"]["gpu"])
    constrained = pins(constraints.splitlines())
    base_version = re.search(r"vllm-openai:v([\w.]+?)(-cu\d+)?$", docker["base"] or "")
    if not base_version or base_version.group(1) != extra.get("vllm"):
        bad.append(f"Dockerfile base {docker['base']} is not vLLM {extra.get('vllm')} (the `gpu` extra)")
    for name, version in extra.items():
        if constrained.get(name) != version:
            bad.append(f"constraints/gpu.txt pins {name} {constrained.get(name)}, the `gpu` extra {version}")
    missing_dirs = [d for d in IMAGE_DIRS if d not in docker["copies"]]
    if missing_dirs:
        bad.append(f"the Dockerfile does not copy {missing_dirs} into the image")
    if not any("-c constraints/gpu.txt" in r and ".[gpu" in r for r in docker["runs"]):
        bad.append("the Dockerfile does not install the `gpu` extra with -c constraints/gpu.txt")
    ray_pin = pins(project["dependencies"]).get("ray")
    if str(cluster.get("rayVersion")) != ray_pin:
        bad.append(f"rayVersion {cluster.get('rayVersion')} != Ray {ray_pin} in pyproject")

    # Token auth on, the token kept out of the file, where the image reads it.
    auth = cluster.get("authOptions") or {}
    if auth.get("mode") != "token" or not auth.get("secretName"):
        bad.append(f"authOptions {auth}: token mode with a Secret expected")
    token_path = docker["env"].get("RAY_AUTH_TOKEN_PATH")
    if docker["env"].get("RAY_AUTH_MODE") != "token" or not token_path:
        bad.append("the Dockerfile does not set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH")
    for d in docs:
        if d and d.get("kind") == "Secret":
            bad.append(f"a Secret {d['metadata']['name']} is in the manifest: tokens stay out of git")
    for where, pod in pod_specs(rayjob):
        secret_volumes = {
            v["name"] for v in pod.get("volumes", []) if v.get("secret", {}).get("secretName") == auth.get("secretName")
        }
        pvc = {v["name"] for v in pod.get("volumes", []) if v.get("persistentVolumeClaim")}
        for c in pod["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            if env.get("RAY_AUTH_MODE", {}).get("value") != "token":
                bad.append(f"{where}: RAY_AUTH_MODE is not token")
            if "value" in env.get("RAY_AUTH_TOKEN", {}):
                bad.append(f"{where}: a literal RAY_AUTH_TOKEN in the manifest")
            if env.get("RAY_AUTH_TOKEN_PATH", {}).get("value", token_path) != token_path:
                bad.append(f"{where}: RAY_AUTH_TOKEN_PATH differs from the image's {token_path}")
            if not any(m["name"] in secret_volumes and m["mountPath"] == token_path for m in c.get("volumeMounts", [])):
                bad.append(f"{where}: the token Secret is not mounted at {token_path}")
            missing = [k for k in REQUIRED_ENV if k not in env]
            if missing:
                bad.append(f"{where}: no {missing}")
            if not any(m["name"] in pvc and m["mountPath"] == "/shared" for m in c.get("volumeMounts", [])):
                bad.append(f"{where}: /shared is not mounted")
    shared = [cfg.target.path, cfg.output_dir, *cfg.data.prompts]
    outside = [p for p in shared if not Path(p).is_relative_to("/shared")]
    if outside:
        bad.append(f"the config reads or writes {outside} outside /shared, which the pods do not share")
    return bad


@pytest.fixture(scope="module")
def shipped():
    return {
        "docs": list(yaml.safe_load_all(MANIFEST.read_text())),
        "dockerfile": (ROOT / "Dockerfile").read_text(),
        "pyproject": tomllib.loads((ROOT / "pyproject.toml").read_text()),
        "constraints": (ROOT / "constraints" / "gpu.txt").read_text(),
    }


def test_shipped_deployment_agrees_with_the_config(shipped):
    assert deployment_mismatches(**shipped) == []


def test_worker_count_is_the_configs(shipped):
    """The figures behind the first check, by hand: 4 groups x (2 replica nodes + 1 trainer node)."""
    cfg = load_config(CONFIG)
    assert worker_nodes(cfg) == (12, 12, 24)
    (workers,) = [d for d in shipped["docs"] if d["kind"] == "RayJob"][0]["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert (workers["replicas"], workers["minReplicas"], workers["maxReplicas"]) == (12, 12, 18)


def _rayjob(docs):
    return next(d for d in docs if d["kind"] == "RayJob")


def _worker(docs):
    return _rayjob(docs)["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]


def _worker_container(docs):
    return _worker(docs)["template"]["spec"]["containers"][0]


def _head_container(docs):
    return _rayjob(docs)["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]


def _set_env(container, name, value):
    container["env"] = [e for e in container["env"] if e["name"] != name] + (
        [{"name": name, "value": value}] if value else []
    )


# Each change breaks one agreement; the mismatch found must name it.
CHANGES = {
    "one worker too few": (lambda s: _worker(s["docs"]).update(replicas=11), "worker replicas 11"),
    "more trays than a rack": (lambda s: _worker(s["docs"]).update(maxReplicas=24), "NVL72"),
    "8-GPU pods": (
        lambda s: _worker_container(s["docs"])["resources"]["limits"].update({"nvidia.com/gpu": "8"}),
        "limits nvidia.com/gpu 8",
    ),
    "too few CPUs": (lambda s: _worker_container(s["docs"])["resources"]["limits"].update(cpu="32"), "32 CPUs"),
    "another config": (
        lambda s: _rayjob(s["docs"])["spec"].update(
            entrypoint="python /opt/dspark-cluster/jobs/train_kimi_k3.py "
            "--config /opt/dspark-cluster/configs/local.yaml"
        ),
        "configs/kimi_k3.yaml",
    ),
    "a plan, not the job": (
        lambda s: _rayjob(s["docs"])["spec"].update(entrypoint=_rayjob(s["docs"])["spec"]["entrypoint"] + " --plan"),
        "--plan",
    ),
    "an override that changes the topology": (
        lambda s: _rayjob(s["docs"])["spec"].update(
            entrypoint=_rayjob(s["docs"])["spec"]["entrypoint"] + " topology.groups.0.inference_replicas=2"
        ),
        "!= the config's 14",
    ),
    "another WORKDIR": (
        lambda s: s.update(dockerfile=s["dockerfile"].replace("WORKDIR /opt/dspark-cluster", "WORKDIR /app")),
        "not jobs/train_kimi_k3.py",
    ),
    "head on another image": (
        lambda s: _head_container(s["docs"]).update(image="registry.example.com/dspark-cluster:0.0.9"),
        "one image",
    ),
    "another vLLM base": (
        lambda s: s.update(dockerfile=s["dockerfile"].replace("vllm-openai:v0.32.0", "vllm-openai:v0.33.0")),
        "is not vLLM 0.32.0",
    ),
    "no benchmarks in the image": (
        lambda s: s.update(dockerfile=s["dockerfile"].replace("COPY benchmarks ./benchmarks", "")),
        "does not copy ['benchmarks']",
    ),
    "constraints drift": (
        lambda s: s.update(constraints=s["constraints"].replace("vllm==0.32.0", "vllm==0.31.0")),
        "pins vllm 0.31.0",
    ),
    "no auth": (lambda s: _rayjob(s["docs"])["spec"]["rayClusterSpec"].pop("authOptions"), "authOptions {}"),
    "auth off in a pod": (
        lambda s: _set_env(_worker_container(s["docs"]), "RAY_AUTH_MODE", "disabled"),
        "RAY_AUTH_MODE is not token",
    ),
    "a token in the file": (
        lambda s: _set_env(_head_container(s["docs"]), "RAY_AUTH_TOKEN", "abc"),
        "literal RAY_AUTH_TOKEN",
    ),
    "no NCCL interface": (
        lambda s: _set_env(_worker_container(s["docs"]), "NCCL_SOCKET_IFNAME", None),
        "NCCL_SOCKET_IFNAME",
    ),
    "no shared volume": (
        lambda s: _worker_container(s["docs"]).update(
            volumeMounts=[m for m in _worker_container(s["docs"])["volumeMounts"] if m["mountPath"] != "/shared"]
        ),
        "/shared is not mounted",
    ),
    "outside the NVLink domain": (
        lambda s: _worker(s["docs"])["template"]["spec"].update(resourceClaims=[]),
        "ComputeDomain",
    ),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_copy_disagrees(shipped, change):
    mutate, expected = CHANGES[change]
    copy_ = copy.deepcopy(shipped)
    mutate(copy_)
    found = deployment_mismatches(**copy_)
    assert any(expected in m for m in found), found


def test_a_changed_config_disagrees(shipped, tmp_path):
    """The manifest is checked against the config's own figures: a config with a fifth group
    (so 15 nodes) no longer matches the manifest's 12 workers."""
    text = CONFIG.read_text()
    g3 = next(ln for ln in text.splitlines() if ln.strip().startswith("- {name: g3"))
    changed = tmp_path / "kimi_k3.yaml"
    changed.write_text(text.replace(g3, g3 + "\n" + g3.replace("name: g3", "name: g4")))
    found = deployment_mismatches(**shipped, cfg=load_config(changed))
    assert any("!= the config's 15 nodes" in m for m in found), found
