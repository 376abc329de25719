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
import re
import subprocess
import sys
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


# --- the image and the manifests' start commands ------------------------------------------------

# What Debian's /etc/profile (base-files, bookworm: the image's base) does for a login shell: it
# sets PATH anew, then sources /etc/profile.d/*.sh. IMAGE_ROOT stands for the image's /.
DEBIAN_PROFILE = """\
if [ "$(id -u)" -eq 0 ]; then
  PATH="IMAGE_ROOT/usr/local/sbin:IMAGE_ROOT/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
else
  PATH="IMAGE_ROOT/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
fi
export PATH
if [ -d IMAGE_ROOT/etc/profile.d ]; then
  for i in IMAGE_ROOT/etc/profile.d/*.sh; do
    if [ -r $i ]; then
      . $i
    fi
  done
  unset i
fi
"""
IMAGE_PATHS = ("/app", "/usr/local/bin", "/etc/profile.d", "/shared", "/mnt/efs")


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def pins(text: str) -> dict[str, str]:
    """``name==version`` pins in a text (a Dockerfile, the Makefile, pyproject's list)."""
    return {m.group(1).lower(): m.group(2)
            for m in re.finditer(r"(?<![\w.-])([A-Za-z][\w.-]*)(?:\[[\w,]+\])?==([\w.]+)", text)}


def test_the_image_installs_what_make_install_installs() -> None:
    """torch and torchvision, then the project, each with the lock as the Makefile installs them
    (nothing pinned in the Dockerfile itself); the manifests run the image the Dockerfile's
    header builds."""
    made = re.findall(r"pip install -qq -c constraints\.txt (.+)$", (ROOT / "Makefile").read_text(),
                      re.M)
    built = re.findall(r"pip install -q -c constraints\.txt (.+?)(?: \\)?$", dockerfile(), re.M)
    assert made == ["torch torchvision", "-e '.[dev]'"]
    assert built == ["torch torchvision", "-e ."]  # the dev extra's test tools stay out
    assert re.search(r"^COPY constraints\.txt \./$", dockerfile(), re.M)
    assert not pins(dockerfile())
    locked = pins((ROOT / "constraints.txt").read_text())
    assert {"torch", "torchvision", "ray", "optuna", "mlflow"} <= set(locked)
    pyproject = (ROOT / "pyproject.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
    tag = f"icr-studies:{version}"
    assert f"docker build -t {tag} ." in dockerfile()
    cluster = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    job = yaml.safe_load((ROOT / "kuberay-rayjob.yaml").read_text())["spec"]["rayClusterSpec"]
    pods = [job["headGroupSpec"], *job["workerGroupSpecs"]]
    images = {c["image"] for p in pods for c in p["template"]["spec"]["containers"]}
    assert images == {cluster["docker"]["image"]} == {tag}
    # every package the image copies in is one of the project's, and the installed layout
    copied = re.findall(r"^COPY (\S+) \1$", dockerfile(), re.M)
    assert set(project_packages()) <= set(copied)


def project_packages() -> list[str]:
    return ["icr", "studies", "search_spaces"]


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    """A tree laid out as the image is, under a temporary root: /app holding the project and
    its venv (this test's own environment, as `make install` built it), and what the
    Dockerfile's last RUN makes of it, its paths taken under the root: the link to `ray` and
    the script in /etc/profile.d."""
    root = tmp_path_factory.mktemp("image")
    app = root / "app"
    app.mkdir()
    for name in ["pyproject.toml", "README.md", *project_packages()]:
        (app / name).symlink_to(ROOT / name)
    (app / ".venv").symlink_to(Path(sys.prefix))
    for sub in ("usr/local/bin", "usr/local/sbin", "etc/profile.d", "root", "shared", "mnt/efs"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    link = re.search(r"ln -s (/\S+) (/\S+)", dockerfile())
    assert link, "the Dockerfile links no command onto the PATH"
    (root / link.group(2).lstrip("/")).symlink_to(root / link.group(1).lstrip("/"))
    script = re.search(r"echo '([^']+)' > (/etc/profile\.d/\S+)", dockerfile())
    assert script, "the Dockerfile puts nothing in /etc/profile.d"
    (root / script.group(2).lstrip("/")).write_text(in_image(script.group(1), root) + "\n")
    (root / "etc" / "profile").write_text(DEBIAN_PROFILE.replace("IMAGE_ROOT", str(root)))
    return root


def in_image(text: str, root: Path) -> str:
    """``text`` with the image's absolute paths taken under ``root``."""
    for path in IMAGE_PATHS:
        text = re.sub(rf"(?<![\w/.]){re.escape(path)}(?=[/\s:'\"]|$)", f"{root}{path}", text)
    return text


def login_shell(root: Path, command: str, cwd: Path | None = None,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``bash -lc COMMAND`` in the image: a clean environment, the image's /etc/profile (the
    login shell's first step) and then the command, its paths taken under ``root``."""
    script = f". {root}/etc/profile\n{in_image(command, root)}"
    clean = {"HOME": str(root / "root"), "LANG": "C.UTF-8", "PATH": "/usr/bin:/bin",
             **(env or {})}
    return subprocess.run(["bash", "--noprofile", "--norc", "-c", script], cwd=cwd or root / "app",
                          env=clean, capture_output=True, text=True, timeout=300)


def checked(command: str) -> str:
    """A start command whose every ``ray`` call parses its options and prints its help
    instead of starting or stopping Ray (``--help`` comes after them: click refuses an
    unknown option first)."""
    return re.sub(r"(\bray (?:start|stop)\b[^;&|]*)", lambda m: m.group(1).rstrip() + " --help ",
                  command)


def kuberay_start(params: dict[str, str], head: bool) -> str:
    """The command KubeRay v1.7 runs in a Ray pod, as ``bash -lc``: ulimit, then ``ray start``
    with the group's rayStartParams and the options it adds itself."""
    options = {"dashboard-agent-listen-port": "52365", "metrics-export-port": "8080", **params}
    where = "--head --dashboard-host=0.0.0.0" if head else "--address=icr-head-svc.default.svc.cluster.local:6379"
    flags = " ".join(f"--{k}={v}" for k, v in options.items())
    return f"ulimit -n 65536; ray start {where} {flags} --block"


def test_ray_is_on_a_login_shell_s_path_in_the_image(image: Path) -> None:
    """Through /etc/profile.d (the venv's bin first) and, were that script gone, the link in
    /usr/local/bin: either way the venv's ``ray``."""
    venv_ray = str((Path(sys.prefix) / "bin" / "ray").resolve())
    found = login_shell(image, "readlink -f $(command -v ray); command -v python; ray --version")
    assert found.returncode == 0, found.stderr
    ray_path, python_path, version = found.stdout.split("\n")[:3]
    assert ray_path == venv_ray and python_path == f"{image}/app/.venv/bin/python"
    assert version.endswith("2.60.0")
    for script in (image / "etc" / "profile.d").iterdir():
        script.rename(script.with_suffix(".off"))
    try:
        linked = login_shell(image, "readlink -f $(command -v ray)")
    finally:
        for script in (image / "etc" / "profile.d").iterdir():
            script.rename(script.with_suffix(".sh"))
    assert linked.stdout.strip() == venv_ray


@pytest.mark.slow  # five Python starts each: make test-all and CI run it
def test_the_rayjob_s_pods_start_and_its_entrypoint_runs_in_the_image(image: Path) -> None:
    manifest = yaml.safe_load((ROOT / "kuberay-rayjob.yaml").read_text())
    cluster = manifest["spec"]["rayClusterSpec"]
    groups = [(cluster["headGroupSpec"], True)] + [(g, False) for g in cluster["workerGroupSpecs"]]
    for group, head in groups:
        started = login_shell(image, checked(kuberay_start(group["rayStartParams"], head)))
        assert started.returncode == 0 and "Usage: ray start" in started.stdout, started.stderr
    entry = login_shell(image, manifest["spec"]["entrypoint"] + " --plan")
    assert entry.returncode == 0, entry.stderr
    assert "ltd_bound" in entry.stdout


@pytest.mark.slow  # five Python starts each: make test-all and CI run it
def test_cluster_yaml_s_start_commands_run_in_the_image(image: Path) -> None:
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        for command in config[key]:
            ran = login_shell(image, checked(command), env={"RAY_HEAD_IP": "10.0.0.5"})
            assert ran.returncode == 0 and "Usage: ray" in ran.stdout, (command, ran.stderr)
    assert config["setup_commands"] == [] and config["worker_setup_commands"] == []
    pip = login_shell(image, "command -v pip")  # what head_setup_commands' pip is
    assert pip.stdout.strip() == f"{image}/app/.venv/bin/pip"
    options = " ".join(config["docker"]["run_options"])
    workspace = re.search(r"--env ICR_WORKSPACE=(\S+)", options).group(1)
    mount = re.search(r"--volume (\S+):(\S+)", options)
    assert mount.group(1) == mount.group(2) and workspace.startswith(mount.group(2) + "/")
    # the study as the header's `ray exec --tmux` runs it, in the container's working folder
    study = re.search(r"ray exec cluster.yaml --tmux '([^']+)'", (ROOT / "cluster.yaml").read_text())
    planned = login_shell(image, study.group(1) + " --plan",
                          env={"ICR_WORKSPACE": in_image(workspace, image)})
    assert planned.returncode == 0, planned.stderr
