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
  pod's RAY_AUTH_TOKEN_PATH says, no token in the file, no pod-only path in the image's ENV); RDMA for
  the store and NCCL's variables in every pod; every worker in the ComputeDomain; /shared mounted
  everywhere and holding the config's paths, the target on a read-only mount;
- the submitter pod on the image's arch, in the image; the head without GPUs (num-gpus "0");
- the image's user numeric and not root, every pod runAsNonRoot, the token readable by it;
- the NetworkPolicy: selects every pod of the job (labels), admits the job's pods to each other on
  every port (the config's ports are chosen at run time), others only to the head's dashboard and
  metrics ports.
The fields themselves are checked against the CRDs' schemas in tests/unit/test_crd_schemas.py.
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
    """The Dockerfile's base image (ARG defaults substituted), WORKDIR, ENV values, RUN lines, COPY
    sources and the last USER."""
    joined = re.sub(r"\\\n", " ", text)
    lines = [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    args, env, runs, copies, base, workdir, user = {}, {}, [], [], None, None, None
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
        elif word == "USER":
            user = rest.strip()
    return {"base": base, "workdir": workdir, "env": env, "runs": runs, "copies": copies, "user": user}


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
    """The Ray pods' specs (head, worker groups): not the submitter's."""
    return [(where, template["spec"]) for where, template in pod_templates(rayjob, submitter=False)]


def pod_templates(rayjob: dict, submitter: bool = True) -> list[tuple[str, dict]]:
    """Every pod template of the RayJob (metadata and spec): head, worker groups, and the submitter's
    where the manifest has one."""
    spec = rayjob["spec"]["rayClusterSpec"]
    out = [("head", spec["headGroupSpec"]["template"])] + [
        (f"worker group {w['groupName']}", w["template"]) for w in spec["workerGroupSpecs"]
    ]
    if submitter and rayjob["spec"].get("submitterPodTemplate"):
        out.append(("submitter", rayjob["spec"]["submitterPodTemplate"]))
    return out


def selects(selector: dict, labels: dict) -> bool:
    """A label selector with matchLabels only (what the manifest uses) against a pod's labels."""
    if set(selector) - {"matchLabels"}:
        return False  # matchExpressions: not read here, so not taken as matching
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def mounts_at(container: dict, pod: dict, path: str) -> dict | None:
    """The volume mount of `container` that holds `path` (the deepest), with its volume as "volume"."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    best = None
    for m in container.get("volumeMounts", []):
        if Path(path).is_relative_to(m["mountPath"]) and (
            best is None or len(Path(m["mountPath"]).parts) > len(Path(best["mountPath"]).parts)
        ):
            best = {**m, "volume": volumes.get(m["name"], {})}
    return best


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
    if docker["env"].get("RAY_AUTH_MODE") != "token":
        bad.append("the Dockerfile does not set RAY_AUTH_MODE=token")
    bad += image_env_mismatches(docker, rayjob)
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
            token_path = env.get("RAY_AUTH_TOKEN_PATH", {}).get("value")
            if not token_path:
                bad.append(f"{where}: no RAY_AUTH_TOKEN_PATH where the pod mounts the token Secret")
            elif not any(
                m["name"] in secret_volumes and m["mountPath"] == token_path for m in c.get("volumeMounts", [])
            ):
                bad.append(f"{where}: the token Secret is not mounted at RAY_AUTH_TOKEN_PATH {token_path}")
            missing = [k for k in REQUIRED_ENV if k not in env]
            if missing:
                bad.append(f"{where}: no {missing}")
            if not any(m["name"] in pvc and m["mountPath"] == "/shared" for m in c.get("volumeMounts", [])):
                bad.append(f"{where}: /shared is not mounted")
    shared = [cfg.target.path, cfg.output_dir, *cfg.data.prompts]
    outside = [p for p in shared if not Path(p).is_relative_to("/shared")]
    if outside:
        bad.append(f"the config reads or writes {outside} outside /shared, which the pods do not share")
    bad += volume_mismatches(rayjob, cfg)
    bad += submitter_mismatches(rayjob, images)
    bad += head_mismatches(rayjob)
    bad += user_mismatches(docker, rayjob)
    bad += network_policy_mismatches(docs, rayjob, cfg)
    return bad


def image_env_mismatches(docker: dict, rayjob: dict) -> list[str]:
    """The image's ENV names no file that only a pod has: Ray stops at start on a RAY_AUTH_TOKEN_PATH
    it cannot read, and the image is also run outside Kubernetes (scripts/gpu_check.py, README)."""
    bad = []
    if "RAY_AUTH_TOKEN_PATH" in docker["env"]:
        bad.append(
            f"the Dockerfile sets RAY_AUTH_TOKEN_PATH={docker['env']['RAY_AUTH_TOKEN_PATH']}: a file the image "
            "does not have (set it in the pods that mount the token)"
        )
    mounted = {
        m["mountPath"] for _, pod in pod_specs(rayjob) for c in pod["containers"] for m in c.get("volumeMounts", [])
    }
    mounted -= {"/shared", "/dev/shm"}  # mounts the image's ENV may name: every pod has them, and they are data
    for name, value in docker["env"].items():
        if value.startswith("/") and any(Path(value).is_relative_to(m) for m in mounted):
            bad.append(f"the Dockerfile's {name}={value} is a path only a pod mounts")
    return bad


def volume_mismatches(rayjob: dict, cfg: JobConfig) -> list[str]:
    """The target (weights and the code trust_remote_code runs) is read-only in every pod; the
    outputs are not."""
    bad = []
    for where, pod in pod_specs(rayjob):
        for c in pod["containers"]:
            target = mounts_at(c, pod, cfg.target.path)
            if not target or not target.get("readOnly"):
                bad.append(f"{where}: the target {cfg.target.path} is not on a read-only mount")
            out = mounts_at(c, pod, cfg.output_dir)
            if not out or out.get("readOnly"):
                bad.append(f"{where}: the outputs {cfg.output_dir} are not on a writable mount")
    return bad


def arch(pod: dict) -> str | None:
    return (pod.get("nodeSelector") or {}).get("kubernetes.io/arch")


def submitter_mismatches(rayjob: dict, images: set[str]) -> list[str]:
    """`ray job submit` runs where the image runs: KubeRay's default submitter pod (K8sJobMode without
    a template) takes the head's image with no nodeSelector, and the image is built for one arch."""
    spec = rayjob["spec"]
    mode = spec.get("submissionMode", "K8sJobMode")
    if mode in ("SidecarMode", "HTTPMode"):
        return []  # no submitter pod: the head's container (SidecarMode) or the operator itself
    if mode != "K8sJobMode":
        return [f"submissionMode {mode}: the job would not be submitted by KubeRay"]
    template = spec.get("submitterPodTemplate")
    if not template:
        return ["no submitterPodTemplate: KubeRay's default submitter pod has no nodeSelector for the image's arch"]
    pod, bad = template.get("spec", {}), []
    head_arch = arch(rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"])
    if not arch(pod) or arch(pod) != head_arch:
        bad.append(f"submitter: nodeSelector kubernetes.io/arch {arch(pod)} is not the head's {head_arch}")
    containers = pod.get("containers") or []
    if not containers or containers[0].get("image") not in images:
        bad.append(f"submitter: its first container's image is not the job's {sorted(images)}")
    if pod.get("restartPolicy") != "Never":
        bad.append("submitter: restartPolicy is not Never (the Job retries; a restarted pod would submit twice)")
    return bad


def head_mismatches(rayjob: dict) -> list[str]:
    """The head runs no GPU work: Ray must not offer a GPU there (num-gpus 0), nor the pod ask for one."""
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]
    bad = []
    if str(head.get("rayStartParams", {}).get("num-gpus")) != "0":
        bad.append(f'head: rayStartParams num-gpus is {head.get("rayStartParams", {}).get("num-gpus")!r}, not "0"')
    for c in head["template"]["spec"]["containers"]:
        if any("nvidia.com/gpu" in c.get("resources", {}).get(k, {}) for k in ("requests", "limits")):
            bad.append("head: the pod asks for nvidia.com/gpu")
    return bad


def user_mismatches(docker: dict, rayjob: dict) -> list[str]:
    """The image's user is not root, and numeric (runAsNonRoot can only verify a number); every pod
    of the job runs as it (runAsNonRoot, no root uid: head and trays write the same run directory, so
    one owner), and can read the token Secret's files, which Kubernetes makes root's."""
    bad = []
    user = (docker["user"] or "").split(":")[0]
    if not user.isdigit() or int(user) == 0:
        bad.append(f"the Dockerfile's USER is {docker['user']!r}: a numeric uid other than 0 expected")
    for where, template in pod_templates(rayjob):
        pod = template.get("spec", {})
        pod_ctx = pod.get("securityContext") or {}
        for c in pod.get("containers", []):
            ctx = {**pod_ctx, **(c.get("securityContext") or {})}
            if ctx.get("runAsUser") == 0 or ctx.get("privileged") or not ctx.get("runAsNonRoot"):
                bad.append(f"{where}: {c['name']} may run as root (runAsNonRoot, runAsUser, privileged)")
        for v in pod.get("volumes", []):
            mode = (v.get("secret") or {}).get("defaultMode", 0o644)
            if v.get("secret") and not mode & 0o004 and "fsGroup" not in pod_ctx:
                bad.append(f"{where}: Secret volume {v['name']} mode {mode:o}: root's file, unreadable by its user")
    return bad


def network_policy_mismatches(docs: list[dict], rayjob: dict, cfg: JobConfig) -> list[str]:
    """One NetworkPolicy selects every pod of the job (head, trays, submitter) and admits to them the
    job's own pods (on every port while the config leaves its ports to be chosen at run time), the
    operator to the dashboard and Prometheus to the metrics port, both the head's declared ports."""
    policies = [d for d in docs if d and d.get("kind") == "NetworkPolicy"]
    if len(policies) != 1 or policies[0].get("apiVersion") != "networking.k8s.io/v1":
        return [f"expected one networking.k8s.io/v1 NetworkPolicy, found {len(policies)}"]
    spec, bad = policies[0]["spec"], []
    labels = {where: (t.get("metadata") or {}).get("labels") or {} for where, t in pod_templates(rayjob)}
    for where, lab in labels.items():
        if not selects(spec.get("podSelector", {}), lab):
            bad.append(f"NetworkPolicy: its podSelector does not select the {where} pod ({lab})")
    if "Ingress" not in spec.get("policyTypes", []):
        bad.append("NetworkPolicy: policyTypes has no Ingress")
    head = rayjob["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head_ports = {p.get("name"): p["containerPort"] for p in head.get("ports", [])}
    job_rules = []
    for i, rule in enumerate(spec.get("ingress", [])):
        peers = rule.get("from") or []
        if not peers:
            bad.append(f"NetworkPolicy: ingress rule {i} admits every source")
            continue
        ports = [p.get("port") for p in rule.get("ports") or []]
        ours = [p for p in peers if "namespaceSelector" not in p and "ipBlock" not in p and "podSelector" in p]
        if ours and all(all(selects(p["podSelector"], lab) for lab in labels.values()) for p in ours):
            job_rules.append(rule)
            if len(ours) != len(peers):
                bad.append(f"NetworkPolicy: ingress rule {i} admits others besides the job's pods")
            # every port the job's services use must be open between its pods: chosen at run time
            # (transport.master_port 0, free ports for the daemons and the trainer's rendezvous) -> all
            fixed = [cfg.transport.master_port] if cfg.transport.master_port else []
            if ports and (not fixed or set(fixed) - set(ports)):
                bad.append(
                    f"NetworkPolicy: the job's pods reach each other only on {ports}, but its services' "
                    f"ports are chosen at run time (transport.master_port {cfg.transport.master_port})"
                )
        else:
            if not ports:
                bad.append(f"NetworkPolicy: ingress rule {i} admits pods outside the job on every port")
            for port in ports:
                if port not in (head_ports.get("dashboard"), head_ports.get("metrics")):
                    bad.append(
                        f"NetworkPolicy: ingress rule {i} admits others to port {port}, not the head's "
                        f"dashboard {head_ports.get('dashboard')} or metrics {head_ports.get('metrics')} port"
                    )
    if not job_rules:
        bad.append("NetworkPolicy: no ingress rule admits the job's own pods to each other")
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


def _policy(docs):
    return next(d for d in docs if d["kind"] == "NetworkPolicy")


def _without_readonly_target(docs):
    c = _worker_container(docs)
    c["volumeMounts"] = [m for m in c["volumeMounts"] if not m.get("readOnly") or m["mountPath"] != "/shared/models"]


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
    "a pod's token path baked into the image": (
        lambda s: s.update(
            dockerfile=s["dockerfile"].replace(
                "ENV HOME=/home/dspark", "ENV RAY_AUTH_TOKEN_PATH=/run/secrets/ray-auth-token HOME=/home/dspark"
            )
        ),
        "sets RAY_AUTH_TOKEN_PATH=/run/secrets/ray-auth-token",
    ),
    "no token path in a pod": (
        lambda s: _set_env(_worker_container(s["docs"]), "RAY_AUTH_TOKEN_PATH", None),
        "no RAY_AUTH_TOKEN_PATH",
    ),
    "KubeRay's default submitter": (
        lambda s: _rayjob(s["docs"])["spec"].pop("submitterPodTemplate"),
        "no submitterPodTemplate",
    ),
    "a submitter on any arch": (
        lambda s: _rayjob(s["docs"])["spec"]["submitterPodTemplate"]["spec"].pop("nodeSelector"),
        "submitter: nodeSelector kubernetes.io/arch None",
    ),
    "a submitter on another image": (
        lambda s: _rayjob(s["docs"])["spec"]["submitterPodTemplate"]["spec"]["containers"][0].update(
            image="rayproject/ray:2.60.0"
        ),
        "submitter: its first container's image",
    ),
    "a head that offers GPUs": (
        lambda s: _rayjob(s["docs"])["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"].pop("num-gpus"),
        "num-gpus is None",
    ),
    "an image that runs as root": (
        lambda s: s.update(dockerfile=s["dockerfile"].replace("USER 10001:10001", "")),
        "USER is None",
    ),
    "a named image user": (
        lambda s: s.update(dockerfile=s["dockerfile"].replace("USER 10001:10001", "USER dspark")),
        "USER is 'dspark'",
    ),
    "a root head": (
        lambda s: _head_container(s["docs"])["securityContext"].update(runAsUser=0),
        "head: ray-head may run as root",
    ),
    "root trays": (
        lambda s: _worker(s["docs"])["template"]["spec"].pop("securityContext"),
        "worker group gb300: ray-worker may run as root",
    ),
    "a token only root can read": (
        lambda s: _worker(s["docs"])["template"]["spec"]["volumes"][1]["secret"].update(defaultMode=0o400),
        "mode 400: root's file",
    ),
    "a writable target": (lambda s: _without_readonly_target(s["docs"]), "is not on a read-only mount"),
    "no NetworkPolicy": (
        lambda s: s.update(docs=[d for d in s["docs"] if d["kind"] != "NetworkPolicy"]),
        "expected one networking.k8s.io/v1 NetworkPolicy",
    ),
    "a policy that misses the submitter": (
        lambda s: _rayjob(s["docs"])["spec"]["submitterPodTemplate"]["metadata"]["labels"].pop(
            "app.kubernetes.io/instance"
        ),
        "does not select the submitter pod",
    ),
    "a policy that closes the job's run-time ports": (
        lambda s: _policy(s["docs"])["spec"]["ingress"][0].update(ports=[{"protocol": "TCP", "port": 6379}]),
        "reach each other only on [6379]",
    ),
    "a policy that opens the GCS to others": (
        lambda s: _policy(s["docs"])["spec"]["ingress"][2]["ports"][0].update(port=6379),
        "admits others to port 6379",
    ),
    "a policy that admits everyone": (
        lambda s: _policy(s["docs"])["spec"]["ingress"].append({}),
        "admits every source",
    ),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_copy_disagrees(shipped, change):
    mutate, expected = CHANGES[change]
    copy_ = copy.deepcopy(shipped)
    mutate(copy_)
    found = deployment_mismatches(**copy_)
    assert any(expected in m for m in found), found


def test_image_env_names_no_pod_only_path(shipped):
    """Outside Kubernetes (the GPU checks in the image, a node started by hand) no Secret is mounted:
    an image that named the pod's token file would stop every ray.init() (Ray: a RAY_AUTH_TOKEN_PATH
    it cannot read is fatal). The pods set the path where they mount the token."""
    docker = read_dockerfile(shipped["dockerfile"])
    assert "RAY_AUTH_TOKEN_PATH" not in docker["env"] and docker["env"]["RAY_AUTH_MODE"] == "token"
    rayjob = _rayjob(shipped["docs"])
    assert image_env_mismatches(docker, rayjob) == []
    for _, pod in pod_specs(rayjob):
        for c in pod["containers"]:
            assert {e["name"]: e.get("value") for e in c["env"]}["RAY_AUTH_TOKEN_PATH"] == "/run/secrets/ray-auth-token"


def test_a_changed_config_disagrees(shipped, tmp_path):
    """The manifest is checked against the config's own figures: a config with a fifth group
    (so 15 nodes) no longer matches the manifest's 12 workers."""
    text = CONFIG.read_text()
    g3 = next(ln for ln in text.splitlines() if ln.strip().startswith("- {name: g3"))
    changed = tmp_path / "kimi_k3.yaml"
    changed.write_text(text.replace(g3, g3 + "\n" + g3.replace("name: g3", "name: g4")))
    found = deployment_mismatches(**shipped, cfg=load_config(changed))
    assert any("!= the config's 15 nodes" in m for m in found), found
