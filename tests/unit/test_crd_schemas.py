"""The rack's manifests against the CRD schemas of the oldest releases they need (tests/schemas:
KubeRay v1.6.0's RayJob, NVIDIA DRA driver v25.8.0's ComputeDomain), offline.

The API server prunes a field a structural schema does not name, without an error: a field the
operator of the manifest's minimum version does not know is silently gone (as `authOptions.secretName`
is under KubeRay 1.5). So here every object schema with `properties` and no
`x-kubernetes-preserve-unknown-fields` takes no other property: an unknown field fails."""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "tests" / "schemas"
DEPLOY = sorted((ROOT / "deploy").glob("*.yaml"))


def strict(schema):
    """A copy of an OpenAPI v3 schema in which an object schema with `properties` (and without
    `x-kubernetes-preserve-unknown-fields` or an `additionalProperties` of its own) allows no other."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) if k not in ("enum", "default", "example") else v for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in schema:
            out["additionalProperties"] = False
    return out


def crd_schema(path: Path, version: str) -> dict:
    crd = yaml.safe_load(path.read_text())
    (v,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return v["schema"]["openAPIV3Schema"]


@cache
def validators() -> dict[tuple[str, str], jsonschema.Draft4Validator]:
    """(apiVersion, kind) -> a validator (Draft 4: OpenAPI 3.0's schema dialect) of the strict schema."""
    raw = {
        ("ray.io/v1", "RayJob"): json.loads((SCHEMAS / "kuberay-v1.6.0-rayjob-v1.json").read_text()),
        ("resource.nvidia.com/v1beta1", "ComputeDomain"): crd_schema(
            SCHEMAS / "nvidia-dra-driver-gpu-v25.8.0-computedomains.yaml", "v1beta1"
        ),
    }
    return {key: jsonschema.Draft4Validator(strict(s)) for key, s in raw.items()}


def errors(doc: dict) -> list[str]:
    v = validators()[(doc["apiVersion"], doc["kind"])]
    return sorted(f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in v.iter_errors(doc))


def crd_docs() -> list[tuple[str, dict]]:
    out = []
    for path in DEPLOY:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and (doc.get("apiVersion"), doc.get("kind")) in validators():
                out.append((f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc))
    return out


def test_the_deploy_files_have_both_kinds():
    kinds = {doc["kind"] for _, doc in crd_docs()}
    assert kinds == {"RayJob", "ComputeDomain"}, kinds


@pytest.mark.parametrize("name,doc", crd_docs(), ids=[n for n, _ in crd_docs()])
def test_manifest_matches_its_crd_schema(name, doc):
    assert errors(doc) == []


def _rayjob():
    return copy.deepcopy(next(d for _, d in crd_docs() if d["kind"] == "RayJob"))


def _computedomain():
    return copy.deepcopy(next(d for _, d in crd_docs() if d["kind"] == "ComputeDomain"))


def _head(doc):
    return doc["spec"]["rayClusterSpec"]["headGroupSpec"]


def _worker_container(doc):
    return doc["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]


# Each change must be refused, with the path of what changed in the message.
CHANGES = {
    # a field the operator does not know: pruned by the API server, never seen by KubeRay
    "a misspelt spec field": (
        _rayjob,
        lambda d: d["spec"].update(shutdownAfterJobFinish=True),
        "shutdownAfterJobFinish",
    ),
    "a pod field one level too high": (
        _rayjob,
        lambda d: _head(d).update(nodeSelector={"kubernetes.io/arch": "arm64"}),
        "nodeSelector",
    ),
    "a container field KubeRay 1.6 does not have": (
        _rayjob,
        lambda d: _worker_container(d).update(gpuCount=4),
        "gpuCount",
    ),
    "a submitter pod with an unknown field": (
        _rayjob,
        lambda d: d["spec"]["submitterPodTemplate"]["spec"].update(arch="arm64"),
        "arch",
    ),
    "an unknown authOptions field": (
        _rayjob,
        lambda d: d["spec"]["rayClusterSpec"]["authOptions"].update(secretKey="auth_token"),
        "secretKey",
    ),
    "a number where Ray takes strings": (
        _rayjob,
        lambda d: _head(d)["rayStartParams"].update({"num-gpus": 0}),
        "num-gpus",
    ),
    "a wrong type": (_rayjob, lambda d: d["spec"].update(backoffLimit="0"), "backoffLimit"),
    "a ComputeDomain field v25.8.0 does not know": (
        _computedomain,
        lambda d: d["spec"].update(numNode=0),
        "numNode",
    ),
    "a ComputeDomain without numNodes": (_computedomain, lambda d: d["spec"].pop("numNodes"), "numNodes"),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_copy_fails(change):
    make, mutate, expected = CHANGES[change]
    doc = make()
    mutate(doc)
    found = errors(doc)
    assert any(expected in e for e in found), found


def test_strict_keeps_what_kubernetes_keeps():
    """Maps (additionalProperties of their own) and preserved objects still take any key."""
    schema = {
        "type": "object",
        "properties": {
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "raw": {
                "type": "object",
                "properties": {"a": {"type": "string"}},
                "x-kubernetes-preserve-unknown-fields": True,
            },
            "known": {"type": "object", "properties": {"a": {"type": "string"}}},
        },
    }
    v = jsonschema.Draft4Validator(strict(schema))
    assert v.is_valid({"labels": {"any": "x"}, "raw": {"b": 1}, "known": {"a": "x"}})
    assert not v.is_valid({"known": {"b": "x"}})
    assert not v.is_valid({"other": 1})


def test_the_manifest_needs_kuberay_1_6():
    """KubeRay v1.5.1's (and v1.5.2's) RayJob CRD has authOptions with `mode` only; `secretName` came
    in v1.6.0. Under the older schema the shipped manifest fails on it: that operator would prune it."""
    schema = json.loads((SCHEMAS / "kuberay-v1.6.0-rayjob-v1.json").read_text())
    auth = schema["properties"]["spec"]["properties"]["rayClusterSpec"]["properties"]["authOptions"]
    assert {"mode", "secretName"} <= set(auth["properties"])
    auth["properties"] = {"mode": auth["properties"]["mode"]}  # v1.5.1's authOptions
    old = jsonschema.Draft4Validator(strict(schema))
    found = [e.message for e in old.iter_errors(_rayjob())]
    assert any("'secretName' was unexpected" in m for m in found), found
