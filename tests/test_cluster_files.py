"""The cluster files, checked as their tools check them: a misspelt field fails here.

``cluster.yaml`` against Ray's own schema (``ray/autoscaler/ray-schema.json``, which ``ray up``
validates with), ``kuberay-rayjob.yaml`` against the RayJob custom resource's schema of a
KubeRay release (``tests/fixtures/kuberay``: the CRD file, its source and licence), with the
API server's strict field validation (the default of ``kubectl apply`` since Kubernetes 1.27):
an object with declared properties accepts no other field, unless the schema keeps unknown
fields (``x-kubernetes-preserve-unknown-fields``) or declares a map (``additionalProperties``).
"""

from __future__ import annotations

import copy
import gzip
import hashlib
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
KUBERAY = Path(__file__).resolve().parent / "fixtures" / "kuberay"
# sha256 of ray-operator/config/crd/bases/ray.io_rayjobs.yaml at KubeRay's tag v1.7.0
RAYJOB_CRD_SHA256 = "01a5cf3b17c1769fda44af7e82debcd98722f0c27b9ab84d084681c6649121f5"
# The fields of ObjectMeta a manifest sets (the CRD leaves `metadata` to the API server).
OBJECT_META = {"type": "object", "additionalProperties": False, "properties": {
    "name": {"type": "string"}, "generateName": {"type": "string"},
    "namespace": {"type": "string"},
    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}
# Fields whose schema holds CEL rules (x-kubernetes-validations), which jsonschema cannot check.
CEL_FIELDS = ("deletionStrategy", "managedBy", "gcsFaultToleranceOptions")


def strict(schema: Any) -> Any:
    """The schema with the API server's strict field validation written out: every object with
    declared properties and no rule of its own for other fields refuses them."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def rayjob_schema() -> dict:
    raw = gzip.decompress((KUBERAY / "ray.io_rayjobs.yaml.gz").read_bytes())
    assert hashlib.sha256(raw).hexdigest() == RAYJOB_CRD_SHA256  # the release's file, unmodified
    crd = yaml.load(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 1.4 MB
    assert crd["spec"]["names"]["kind"] == "RayJob" and crd["spec"]["group"] == "ray.io"
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = strict(version["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = OBJECT_META
    return schema


def check_rayjob(manifest: dict, schema: dict) -> None:
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayJob"
    jsonschema.validate(manifest, schema)
    text = json.dumps(manifest)
    assert not any(f'"{field}"' in text for field in CEL_FIELDS)  # rules not checked here


def test_kuberay_rayjob_follows_the_rayjob_schema(rayjob_schema: dict) -> None:
    manifest = yaml.safe_load((ROOT / "kuberay-rayjob.yaml").read_text())
    check_rayjob(manifest, rayjob_schema)
    cluster = manifest["spec"]["rayClusterSpec"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no trials on the head
    assert cluster["enableInTreeAutoscaling"] is True
    gpus = sum(g["maxReplicas"] * int(c["resources"]["limits"]["nvidia.com/gpu"])
               for g in cluster["workerGroupSpecs"] for c in g["template"]["spec"]["containers"])
    assert all(g["minReplicas"] == 0 for g in cluster["workerGroupSpecs"])
    # The autoscaler runs in its own container there: the entrypoint says what it can reach,
    # and a worker's CPUs per GPU (no worker runs when the study sizes its trials).
    assert f"--gpus {gpus}" in manifest["spec"]["entrypoint"]
    per_gpu = {int(c["resources"]["limits"]["cpu"]) // int(c["resources"]["limits"]["nvidia.com/gpu"])
               for g in cluster["workerGroupSpecs"] for c in g["template"]["spec"]["containers"]}
    assert f"--cpus-per-trial {min(per_gpu)}" in manifest["spec"]["entrypoint"]


@pytest.mark.parametrize("path, misspelt", [
    (("spec",), "shutdownAfterJobFinish"),
    (("spec", "rayClusterSpec"), "enableInTreeAutoscale"),
    (("spec", "rayClusterSpec", "workerGroupSpecs", 0), "maxReplica"),
    (("spec", "rayClusterSpec", "workerGroupSpecs", 0, "template", "spec", "containers", 0),
     "volumeMount"),
    (("metadata",), "nmae"),
])
def test_a_misspelt_rayjob_field_fails(rayjob_schema: dict, path: tuple, misspelt: str) -> None:
    manifest = yaml.safe_load((ROOT / "kuberay-rayjob.yaml").read_text())
    broken = copy.deepcopy(manifest)
    node = broken
    for key in path:
        node = node[key]
    node[misspelt] = "x"
    with pytest.raises(jsonschema.ValidationError, match=misspelt):
        check_rayjob(broken, rayjob_schema)


def test_a_misspelt_cluster_yaml_field_fails() -> None:
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    jsonschema.validate(config, schema)
    for where, misspelt in ((config, "idle_timeout_minute"),
                            (config["available_node_types"]["worker_gpu1"], "max_worker")):
        where[misspelt] = 1
        with pytest.raises(jsonschema.ValidationError, match=misspelt):
            jsonschema.validate(config, schema)
        del where[misspelt]
