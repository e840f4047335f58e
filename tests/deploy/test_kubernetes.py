"""deploy/kubernetes: every overlay renders, validates and matches what the server serves.

Offline: ``kubectl kustomize`` renders each overlay; the ``kubernetes-validate`` package checks
every built-in object against the Kubernetes OpenAPI schemas it ships (strict: an unknown or
misspelt field fails); the two custom resources (ServiceMonitor, ScaledObject) have no schema
there and are checked against the structure of their CRDs written out below; checkov checks
the security defaults. The probes' paths and ports, the ports, the drain timing, /dev/shm and
the autoscalers' metric names are read from the server's own code and configuration loader,
not from a copy; so are the body limits and timeouts of the optional ingress component
(rendered added to overlays/gpu). A tool that is missing skips its tests with the way to
install it.
"""

from __future__ import annotations

import base64
import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml
from front_limits import body_limits, longest_node_silence_s, nginx_size, routes_only_gateway
from prometheus_client import CollectorRegistry

from common.config import ServeConfig
from common.mps import control_path
from gateway.app import build_app
from gateway.metrics import GatewayMetrics
from orchestrator.settings import load_config
from orchestrator.supervisor import STOP_GRACE_S
from orpheus_wire.zeromq import endpoint_for
from shm.admission import segment_bytes

ROOT = Path(__file__).resolve().parents[2]


KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = {"gpu": "orpheus", "gpu-hpa": "orpheus", "cpu-dev": "orpheus-dev"}
"""Each overlay and the namespace it deploys to."""
KINDS = {
    "gpu": {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "NetworkPolicy",
            "PersistentVolumeClaim", "ServiceMonitor", "ScaledObject"},
    "gpu-hpa": {"ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "NetworkPolicy",
                "PersistentVolumeClaim", "ServiceMonitor", "HorizontalPodAutoscaler"},
    "cpu-dev": {"Namespace", "ConfigMap", "Secret", "Service", "Deployment",
                "PodDisruptionBudget", "NetworkPolicy", "PersistentVolumeClaim"},
}  # fmt: skip
# The oldest Kubernetes the manifests support (the preStop `sleep` action is on by default
# from 1.30) and the newest the installed kubernetes-validate knows.
OLDEST_KUBERNETES = "1.31.0"
PLACEHOLDER_SECRET = {"ORPHEUS_GATEWAY__API_KEYS": '["placeholder"]', "HF_TOKEN": "hf_x"}
"""What the Secret an operator creates for overlays/gpu holds (see its kustomization)."""

Obj = dict[str, Any]


def tool(name: str) -> str | None:
    """A command from PATH or from this interpreter's environment (the venv's bin/)."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


@functools.cache
def render(overlay: str) -> list[Obj]:
    kubectl = tool("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (it renders the overlays: `kubectl kustomize`)")
    out = subprocess.run(
        [kubectl, "kustomize", str(KUBE / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [o for o in yaml.safe_load_all(out) if o]


def one(objs: list[Obj], kind: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def container(objs: list[Obj]) -> Obj:
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    return c


def served_config(objs: list[Obj], tmp: Path) -> ServeConfig:
    """The configuration the pod's server would load: the ConfigMap's TOML file, then the
    container's environment (its literal values and the Secret's keys), via the real loader."""
    cm = one(objs, "ConfigMap")
    c = container(objs)
    mount = next(m for m in c["volumeMounts"] if m["name"] == "config")
    args = c["args"]
    path = args[args.index("--config") + 1]
    assert Path(path).parent == Path(mount["mountPath"])
    toml = tmp / "config.toml"
    toml.write_text(cm["data"][Path(path).name])
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    for src in c.get("envFrom", []):
        name = src["secretRef"]["name"]
        secrets = [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == name]
        if secrets:
            env.update({k: base64.b64decode(v).decode() for k, v in secrets[0]["data"].items()})
        else:
            env.update(PLACEHOLDER_SECRET)
    return load_config(str(toml), environ=env)


@functools.cache
def routes() -> set[tuple[str, str]]:
    """(method, path) of every route of the gateway's aiohttp application."""
    app = build_app(routes_only_gateway())
    return {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}


@functools.cache
def metric_names() -> set[str]:
    """Every metric the gateway defines, as Prometheus exposes it."""
    registry = CollectorRegistry()
    GatewayMetrics(registry)
    names: set[str] = set()
    for family in registry.collect():
        names.add(family.name)
        names.update(s.name for s in family.samples)
    return names


def promql_metrics(query: str) -> set[str]:
    return set(re.findall(r"\b(orpheus_[a-z_]+)\b", query))


# -- rendering and schemas ---------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_the_expected_objects(overlay: str) -> None:
    objs = render(overlay)
    assert {o["kind"] for o in objs} == KINDS[overlay]
    for o in objs:
        if o["kind"] != "Namespace":
            assert o["metadata"]["namespace"] == OVERLAYS[overlay], o["metadata"]
        labels = o["metadata"].get("labels", {})
        if o["kind"] != "Namespace":
            assert labels.get("app.kubernetes.io/name") == "orpheus-serve", o["kind"]


# The structure of the two custom resources, after their CRDs (monitoring.coreos.com/v1
# ServiceMonitor of the Prometheus operator, keda.sh/v1alpha1 ScaledObject of KEDA 2.x): the
# fields these manifests use, with their types; anything else is rejected (as strict
# validation does for the built-in kinds).
_STR = {"type": "string"}
_INT = {"type": "integer"}
_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": _STR},
        "matchExpressions": {"type": "array"},
    },
}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}  # fmt: skip
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": _STR, "namespace": _STR, "labels": {"type": "object"}},
}
_HPA_POLICY = {
    "type": "object",
    "required": ["type", "value", "periodSeconds"],
    "additionalProperties": False,
    "properties": {"type": {"enum": ["Pods", "Percent"]}, "value": _INT, "periodSeconds": _INT},
}
_HPA_RULES = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "stabilizationWindowSeconds": _INT,
        "selectPolicy": {"enum": ["Max", "Min", "Disabled"]},
        "policies": {"type": "array", "items": _HPA_POLICY},
    },
}
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "required": ["selector", "endpoints"],
                "additionalProperties": False,
                "properties": {
                    "selector": _LABEL_SELECTOR,
                    "namespaceSelector": {"type": "object"},
                    "jobLabel": _STR,
                    "endpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "port": _STR,
                                "path": {"type": "string", "pattern": "^/"},
                                "scheme": {"enum": ["http", "https"]},
                                "interval": _DURATION,
                                "scrapeTimeout": _DURATION,
                                "honorLabels": {"type": "boolean"},
                            },
                        },
                    },
                },
            },
        },
    },
    ("keda.sh/v1alpha1", "ScaledObject"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "required": ["scaleTargetRef", "triggers"],
                "additionalProperties": False,
                "properties": {
                    "scaleTargetRef": {
                        "type": "object",
                        "required": ["name"],
                        "additionalProperties": False,
                        "properties": {"apiVersion": _STR, "kind": _STR, "name": _STR},
                    },
                    "minReplicaCount": {"type": "integer", "minimum": 0},
                    "maxReplicaCount": {"type": "integer", "minimum": 1},
                    "pollingInterval": {"type": "integer", "minimum": 1},
                    "cooldownPeriod": {"type": "integer", "minimum": 0},
                    "fallback": {
                        "type": "object",
                        "required": ["failureThreshold", "replicas"],
                        "additionalProperties": False,
                        "properties": {
                            "failureThreshold": _INT,
                            "replicas": _INT,
                            "behavior": {
                                "enum": [
                                    "static",
                                    "currentReplicas",
                                    "currentReplicasIfHigher",
                                    "currentReplicasIfLower",
                                ],
                            },
                        },
                    },
                    "advanced": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "restoreToOriginalReplicaCount": {"type": "boolean"},
                            "horizontalPodAutoscalerConfig": {
                                "type": "object",
                                "additionalProperties": False,
                                "properties": {
                                    "name": _STR,
                                    "behavior": {
                                        "type": "object",
                                        "additionalProperties": False,
                                        "properties": {
                                            "scaleUp": _HPA_RULES,
                                            "scaleDown": _HPA_RULES,
                                        },
                                    },
                                },
                            },
                        },
                    },
                    "triggers": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["type", "metadata"],
                            "additionalProperties": False,
                            "properties": {
                                "type": _STR,
                                "name": _STR,
                                "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                # KEDA reads every trigger parameter as a string.
                                "metadata": {"type": "object", "additionalProperties": _STR},
                            },
                        },
                    },
                },
            },
        },
    },
}


def validate(obj: Obj) -> None:
    """Raise if ``obj`` does not match its schema (built-in kinds: at the oldest supported
    and the newest known Kubernetes version, strictly)."""
    kv = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (pip install '.[dev]')"
    )
    crd = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if crd is not None:
        import jsonschema

        jsonschema.validate(obj, crd)
        return
    for version in (OLDEST_KUBERNETES, kv.latest_version()):
        kv.validate(obj, version, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_matches_its_schema(overlay: str) -> None:
    for obj in render(overlay):
        validate(obj)


def test_the_schema_checks_can_fail() -> None:
    import jsonschema

    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    deployment = json.loads(json.dumps(one(render("gpu"), "Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"][
        "pathh"
    ] = "/ready"
    with pytest.raises(kv.ValidationError):
        validate(deployment)
    scaled = json.loads(json.dumps(one(render("gpu"), "ScaledObject")))
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 192  # KEDA wants a string
    with pytest.raises(jsonschema.ValidationError):
        validate(scaled)
    monitor = json.loads(json.dumps(one(render("gpu"), "ServiceMonitor")))
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)


# -- security defaults (checkov) ---------------------------------------------------------------
CHECKOV_ACCEPTED = {
    "CKV_K8S_43": "images by tag: the digest exists only once the operator builds and pushes "
    "the image; pin it then with `kustomize edit set image orpheus-serve=REPO@sha256:...`",
    "CKV_K8S_35": "API keys reach the server as ORPHEUS_GATEWAY__API_KEYS: configuration is "
    "one TOML file plus environment variables (orchestrator/settings.py), and the TOML file is "
    "a ConfigMap; HF_TOKEN is read from the environment by huggingface_hub",
}
CHECKOV_ACCEPTED_CPU_DEV = {
    "CKV_K8S_15": "cpu-dev pulls IfNotPresent: its image is built and loaded into a local "
    "cluster (kind load docker-image), where Always would try a registry that has no such image",
}
CHECKOV_REQUIRED = {
    "CKV_K8S_8": "liveness probe",
    "CKV_K8S_9": "readiness probe",
    "CKV_K8S_10": "CPU requests",
    "CKV_K8S_11": "CPU limits",
    "CKV_K8S_12": "memory requests",
    "CKV_K8S_13": "memory limits",
    "CKV_K8S_16": "not privileged",
    "CKV_K8S_20": "no privilege escalation",
    "CKV_K8S_22": "read-only root filesystem",
    "CKV_K8S_23": "not root",
    "CKV_K8S_28": "no NET_RAW",
    "CKV_K8S_31": "seccomp RuntimeDefault",
    "CKV_K8S_37": "capabilities dropped",
    "CKV_K8S_38": "no service account token",
    "CKV_K8S_40": "high UID",
}


def checkov() -> str:
    for candidate in (ROOT / ".venv-checkov" / "bin" / "checkov", tool("checkov")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    pytest.skip(
        "checkov is not installed: `make checkov` puts it in .venv-checkov/ (its own "
        "environment: its pins conflict with the project's)"
    )


def checkov_results(objects: list[Obj], name: str, tmp_path: Path) -> dict[str, Any]:
    """checkov's ``results`` (``passed_checks``, ``failed_checks``, ...) on ``objects``, written
    as ``name``.yaml under ``tmp_path``; skips the test where checkov is not installed."""
    exe = checkov()
    manifest = tmp_path / f"{name}.yaml"
    manifest.write_text(yaml.safe_dump_all(objects))
    proc = subprocess.run(
        [exe, "-f", str(manifest), "--framework", "kubernetes", "--skip-download",
         "--output", "json", "--soft-fail"],
        capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "BC_SKIP_MAPPING": "TRUE"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    return report["results"] if isinstance(report, dict) else report[0]["results"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_security_defaults_pass_checkov(overlay: str, tmp_path: Path) -> None:
    results = checkov_results(render(overlay), overlay, tmp_path)
    failed = {(c["check_id"], c["resource"].split(".")[0]) for c in results["failed_checks"]}
    accepted = CHECKOV_ACCEPTED | (CHECKOV_ACCEPTED_CPU_DEV if overlay == "cpu-dev" else {})
    unexpected = {f for f in failed if f[0] not in accepted}
    assert not unexpected, f"checkov failed: {sorted(unexpected)}"
    passed = {
        c["check_id"] for c in results["passed_checks"] if c["resource"].startswith("Deployment")
    }
    missing = {k: v for k, v in CHECKOV_REQUIRED.items() if k not in passed}
    assert not missing, f"the Deployment must pass: {missing}"


# -- the manifests against the server's code ---------------------------------------------------
def port_of(c: Obj, name_or_number: str | int) -> int:
    if isinstance(name_or_number, int):
        return name_or_number
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name_or_number)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_ports_and_drain_match_the_server(overlay: str, tmp_path: Path) -> None:
    objs = render(overlay)
    cfg = served_config(objs, tmp_path)
    g = cfg.gateway
    c = container(objs)
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]

    # The pod's server listens where probes and the Service reach it.
    assert g.host in ("0.0.0.0", "::"), "gateway.host must not be loopback in a pod"
    probes = {k: c[k]["httpGet"] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["readinessProbe"]["path"] == "/ready"
    assert probes["livenessProbe"]["path"] == probes["startupProbe"]["path"] == "/health"
    for probe in probes.values():
        assert ("GET", probe["path"]) in routes(), probe
        assert port_of(c, probe["port"]) == g.port
    # The gateways listen only once the workers are warm: the startup budget covers that.
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= cfg.ready_timeout_s

    # Every gateway process's ZeroMQ port, exactly, in the pod, the Service, the policy.
    zmq = [int(endpoint_for(g.zmq_endpoint, i).rsplit(":", 1)[1]) for i in range(g.processes)]
    assert g.zmq_endpoint and g.zmq_endpoint.startswith("tcp://0.0.0.0:")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": g.port, **{f"zmq-{i}": p for i, p in enumerate(zmq)}}
    svc = one(objs, "Service")
    svc_targets = {port_of(c, p["targetPort"]) for p in svc["spec"]["ports"]}
    assert svc_targets == set(ports.values())
    assert svc["spec"]["sessionAffinity"] == "None"
    policy_ports = {port_of(c, p["port"]) for p in one(objs, "NetworkPolicy")["spec"]["ingress"][0]["ports"]}  # fmt: skip
    assert policy_ports == set(ports.values())

    # Drain: SIGTERM comes after preStop; the orchestrator lets streams finish for
    # drain_timeout_s, then gives gateways and workers STOP_GRACE_S each.
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    needed = pre_stop + cfg.drain_timeout_s + 2 * STOP_GRACE_S
    assert pod["terminationGracePeriodSeconds"] > needed
    assert pod["terminationGracePeriodSeconds"] > pre_stop + cfg.drain_timeout_s

    # /dev/shm: a memory emptyDir that holds the instance's rings and admission counters.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    dshm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert dshm["medium"] == "Memory"
    rings = cfg.shm.code_ring_bytes + g.processes * cfg.shm.pcm_ring_bytes
    rings += segment_bytes(g.processes) if g.processes > 1 else 0
    assert quantity(dshm["sizeLimit"]) >= 2 * rings, "room for the rings and torch"
    assert quantity(dshm["sizeLimit"]) < quantity(c["resources"]["limits"]["memory"]) / 4

    # Read-only root: everything the server writes is on a mounted volume.
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    env = {e["name"]: e["value"] for e in c["env"]}
    assert {"HOME", "HF_HOME", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR"} <= env.keys()
    paths = [cfg.shm.run_dir, *(v for v in env.values() if v.startswith("/"))]
    for path in paths:
        assert any(Path(path).is_relative_to(m) for m in mounts), f"{path} is not writable"

    # API keys come from the Secret, and the server would require them.
    assert g.api_keys, "the Secret's ORPHEUS_GATEWAY__API_KEYS reaches gateway.api_keys"
    in_file = tomllib.loads(one(objs, "ConfigMap")["data"]["config.toml"])["gateway"]
    assert not in_file.get("api_keys"), "keys belong in the Secret, not the ConfigMap"

    # Selectors: Service, PDB, NetworkPolicy (and ServiceMonitor) select the pods.
    pod_labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    selectors = [svc["spec"]["selector"],
                 one(objs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
                 one(objs, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"]]  # fmt: skip
    for sel in selectors:
        assert sel.items() <= pod_labels.items(), sel
    for mon in (o for o in objs if o["kind"] == "ServiceMonitor"):
        assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
        (ep,) = mon["spec"]["endpoints"]
        assert ("GET", ep["path"]) in routes() and ep["path"] == "/metrics"
        assert port_of(c, next(p["targetPort"] for p in svc["spec"]["ports"] if p["name"] == ep["port"])) == g.port  # fmt: skip


def image_user(dockerfile: Path) -> tuple[int, int]:
    """The uid:gid an image runs as: its last ``USER`` instruction (numeric, as the
    Dockerfiles write it so that ``runAsNonRoot`` can check it)."""
    users = re.findall(r"^USER\s+(\d+):(\d+)\s*$", dockerfile.read_text(), flags=re.M)
    assert users, f"{dockerfile.name} sets no numeric USER uid:gid"
    uid, gid = users[-1]
    return int(uid), int(gid)


def max_replicas(objs: list[Obj]) -> int:
    """The most pods the rendering may run at once: the autoscaler's maximum, else the
    Deployment's replicas (a rollout's surge pod comes and goes on the same node's volume)."""
    most = one(objs, "Deployment")["spec"].get("replicas", 1)
    for o in objs:
        if o["kind"] == "ScaledObject":
            most = max(most, o["spec"]["maxReplicaCount"])
        elif o["kind"] == "HorizontalPodAutoscaler":
            most = max(most, o["spec"]["maxReplicas"])
    return most


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_voice_state_is_on_a_persistent_volume_every_pod_shares(
    overlay: str, tmp_path: Path
) -> None:
    """voices.state_dir (custom voices, run-time LoRA voices) outlives the pod: the server
    container mounts a PersistentVolumeClaim of the same rendering there, writable by the
    image's user, and shared by every pod the autoscaler may run."""
    objs = render(overlay)
    cfg = served_config(objs, tmp_path)
    c = container(objs)
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}

    # The directory as the server in the pod resolves it (store.voices.resolve_state_dir).
    state = cfg.voices.state_dir
    if state.startswith("~"):
        state = env.get("HOME", "/") + state[1:]
    state_dir = Path(state)
    assert state_dir.is_absolute(), cfg.voices.state_dir

    # The most specific mount that holds it is a claim of this rendering, read-write.
    holding = [m for m in c["volumeMounts"] if state_dir.is_relative_to(m["mountPath"])]
    assert holding, f"voices.state_dir {state_dir} is on no volume (the read-only root)"
    mount = max(holding, key=lambda m: len(Path(m["mountPath"]).parts))
    assert not mount.get("readOnly", False), mount
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert "persistentVolumeClaim" in volume, (
        f"voices.state_dir {state_dir} is on volume {mount['name']!r}, which is not a "
        f"PersistentVolumeClaim: custom voices would be lost with the pod ({volume})"
    )
    claim_name = volume["persistentVolumeClaim"]["claimName"]
    claims = {o["metadata"]["name"]: o for o in objs if o["kind"] == "PersistentVolumeClaim"}
    assert claim_name in claims, f"the claim {claim_name!r} is not part of the rendering"
    claim = claims[claim_name]["spec"]
    assert not volume["persistentVolumeClaim"].get("readOnly", False)
    assert quantity(claim["resources"]["requests"]["storage"]) >= 2**30
    assert claim.get("volumeMode", "Filesystem") == "Filesystem"

    # Several pods (on different GPU nodes) share one claim: a voice made through one pod is
    # spoken by any other, so only ReadWriteMany schedules them all. One pod may have RWO.
    modes = set(claim["accessModes"])
    if max_replicas(objs) > 1:
        assert modes == {"ReadWriteMany"}, f"{overlay} runs up to {max_replicas(objs)} pods"
    else:
        assert modes <= {"ReadWriteOnce", "ReadWriteMany"} and modes, modes

    # The container runs as the image's non-root user and can write the volume.
    dockerfile = "Dockerfile.cpu" if cfg.device == "cpu" else "Dockerfile"
    uid, gid = image_user(ROOT / "deploy" / "docker" / dockerfile)
    ctx = pod["securityContext"] | c.get("securityContext", {})
    assert uid != 0 and ctx["runAsNonRoot"] is True
    assert (ctx["runAsUser"], ctx["runAsGroup"]) == (uid, gid)
    assert pod["securityContext"]["fsGroup"] == gid, "the claim's files are the user's group's"


def quantity(q: str | int) -> float:
    """A Kubernetes resource quantity in bytes (binary and decimal suffixes)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(m|[KMGT]i?)?", str(q))
    assert m, q
    scale = {None: 1, "m": 1e-3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}[m.group(2)]  # fmt: skip
    return float(m.group(1)) * scale


@pytest.mark.parametrize("overlay", ["gpu", "gpu-hpa"])
def test_autoscaling_is_on_the_servers_stream_metrics(overlay: str, tmp_path: Path) -> None:
    objs = render(overlay)
    cfg = served_config(objs, tmp_path)
    svc = one(objs, "Service")
    if overlay == "gpu":
        so = one(objs, "ScaledObject")
        assert so["spec"]["scaleTargetRef"]["name"] == one(objs, "Deployment")["metadata"]["name"]
        (trigger,) = so["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
        query = trigger["metadata"]["query"]
        target = float(trigger["metadata"]["threshold"])
        # The query selects this deployment's series: the labels the ServiceMonitor gives.
        assert f'namespace="{OVERLAYS[overlay]}"' in query
        assert f'service="{svc["metadata"]["name"]}"' in query
        queries = [query]
        replicas = (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"])
    else:
        hpa = one(objs, "HorizontalPodAutoscaler")
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
        target = quantity(metric["pods"]["target"]["averageValue"])
        adapter = yaml.safe_load((KUBE / "prometheus-adapter" / "values.yaml").read_text())
        rules = [r for r in adapter["rules"]["custom"] if r["name"]["as"] == metric["pods"]["metric"]["name"]]  # fmt: skip
        assert len(rules) == 1, "prometheus-adapter serves the metric the HPA asks for"
        queries = [rules[0]["seriesQuery"], rules[0]["metricsQuery"]]
        replicas = (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"])
    used = set().union(*(promql_metrics(q) for q in queries))
    assert used >= {"orpheus_gateway_active_streams", "orpheus_gateway_capacity"}, used
    assert used <= metric_names(), f"not defined by the server: {used - metric_names()}"
    # Demand in pods' worth (over the capacity each pod learned, gateway.admission): scale
    # before the pods are full, as a full pod answers /ready 503 and queues or refuses.
    assert cfg.gateway.admission == "learned"
    assert 0.5 <= target < 1.0
    # The PDB lets one pod go at a time; two replicas keep serving through it.
    assert replicas[0] >= 2 and replicas[1] > replicas[0]


def test_autoscaler_queries_are_valid_promql() -> None:
    promtool = tool("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    so = one(render("gpu"), "ScaledObject")
    adapter = yaml.safe_load((KUBE / "prometheus-adapter" / "values.yaml").read_text())
    exprs = [so["spec"]["triggers"][0]["metadata"]["query"]]
    for rule in adapter["rules"]["custom"]:
        for q in (rule["seriesQuery"], rule["metricsQuery"]):
            exprs.append(
                q.replace("<<.LabelMatchers>>", 'namespace="orpheus",pod="p"').replace(
                    "<<.GroupBy>>", "pod"
                )
            )
    rules = {"groups": [{"name": "q", "rules": [{"record": f"q:{i}", "expr": e} for i, e in enumerate(exprs)]}]}  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "queries.yml"
        f.write_text(yaml.safe_dump(rules))
        ok = subprocess.run([promtool, "check", "rules", str(f)], capture_output=True, text=True)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        f.write_text(yaml.safe_dump({"groups": [{"name": "q", "rules": [{"record": "q:x", "expr": "sum(x"}]}]}))  # fmt: skip
        bad = subprocess.run([promtool, "check", "rules", str(f)], capture_output=True, text=True)
        assert bad.returncode != 0, "promtool rejects a broken query"


def test_cpu_dev_overlay_serves_the_cpu_image_configuration(tmp_path: Path) -> None:
    objs = render("cpu-dev")
    from_overlay = served_config(objs, tmp_path)
    image = load_config(
        str(ROOT / "deploy" / "docker" / "cpu.toml"),
        environ={"ORPHEUS_GATEWAY__API_KEYS": json.dumps(from_overlay.gateway.api_keys)},
    )
    assert from_overlay == image
    assert from_overlay.device == "cpu"
    assert container(objs)["image"].startswith("orpheus-serve-cpu:")
    gpu = container(render("gpu"))
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    # Guaranteed QoS: whole CPUs that the static CPU manager can give the pod for itself, so
    # the gateways' and the codec's real-time loops are never throttled by a CPU quota.
    for key in ("cpu", "memory", "nvidia.com/gpu"):
        assert gpu["resources"]["requests"][key] == gpu["resources"]["limits"][key], key
    assert "nvidia.com/gpu" not in container(objs)["resources"]["limits"]


# -- the optional ingress (components/ingress-nginx) -------------------------------------------
INGRESS_NGINX = KUBE / "components" / "ingress-nginx"


@functools.cache
def render_gpu_with(component: str) -> list[Obj]:
    """overlays/gpu with an optional component added, as its kustomization says to."""
    kubectl = tool("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (it renders the overlays: `kubectl kustomize`)")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "kube").symlink_to(KUBE)
        (Path(tmp) / "kustomization.yaml").write_text(
            yaml.safe_dump({
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "namespace": OVERLAYS["gpu"],
                "resources": ["kube/overlays/gpu"],
                "components": [f"kube/components/{component}"],
            })
        )  # fmt: skip
        out = subprocess.run(
            [kubectl, "kustomize", "--load-restrictor", "LoadRestrictionsNone", tmp],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    return [o for o in yaml.safe_load_all(out) if o]


def render_with_ingress() -> list[Obj]:
    return render_gpu_with("ingress-nginx")


def ingress_for(ingresses: list[Obj], path: str) -> Obj:
    """The Ingress whose rule ingress-nginx picks for ``path`` (Exact, else the longest
    Prefix)."""
    matches = []
    for ing in ingresses:
        for rule in ing["spec"]["rules"]:
            for p in rule["http"]["paths"]:
                if p["pathType"] == "Exact" and p["path"] == path:
                    return ing
                if p["pathType"] == "Prefix" and path.startswith(p["path"]):
                    matches.append((len(p["path"]), ing))
    return max(matches, key=lambda m: m[0])[1]


def test_ingress_objects_match_their_schema_and_the_service() -> None:
    objs = render_with_ingress()
    ingresses = [o for o in objs if o["kind"] == "Ingress"]
    assert len(ingresses) == 2
    service = one(objs, "Service")
    ports = {p["name"] for p in service["spec"]["ports"]}
    for ing in ingresses:
        validate(ing)
        assert ing["metadata"]["namespace"] == OVERLAYS["gpu"]
        for rule in ing["spec"]["rules"]:
            for p in rule["http"]["paths"]:
                backend = p["backend"]["service"]
                assert backend["name"] == service["metadata"]["name"]
                assert backend["port"]["name"] in ports
    # The rest of the overlay is unchanged by the component.
    assert [o for o in objs if o["kind"] != "Ingress"] == render("gpu")


@pytest.mark.parametrize("path", body_limits())
def test_ingress_carries_every_body_the_gateway_takes(path: str) -> None:
    """Each POST route's Ingress lets through the largest body the gateway takes there (the
    gateway's own 413 names the limit), at most twice it; it streams responses, buffers
    request bodies (a refused request is resent) and waits longer than a node is silent."""
    ingresses = [o for o in render_with_ingress() if o["kind"] == "Ingress"]
    notes = ingress_for(ingresses, path)["metadata"]["annotations"]
    ann = {k.removeprefix("nginx.ingress.kubernetes.io/"): v for k, v in notes.items()}
    gateway = body_limits()[path]
    assert gateway < nginx_size(ann["proxy-body-size"]) <= 2 * gateway, (path, ann)
    assert ann["proxy-buffering"] == "off" and ann["proxy-request-buffering"] == "on"
    for name in ("proxy-read-timeout", "proxy-send-timeout"):
        assert int(ann[name]) > longest_node_silence_s(), name
    assert {"http_429", "http_503", "non_idempotent"} <= set(ann["proxy-next-upstream"].split())
    assert "timeout" not in ann["proxy-next-upstream"].split()


# -- the optional CUDA MPS daemon in the pod (components/mps) ------------------------------------
MPS = KUBE / "components" / "mps"


def mps_script(c: Obj) -> tuple[list[str], str, list[str]]:
    """The container's command as (the entrypoint's wrapper, the shell script, its $0 and the
    Deployment's args after it)."""
    command = c["command"]
    sh = command.index("/bin/sh")
    assert command[sh + 1] == "-c"
    return command[:sh], command[sh + 2], [*command[sh + 3 :], *c["args"]]


def test_mps_component_objects_match_their_schema() -> None:
    objs = render_gpu_with("mps")
    for obj in objs:
        validate(obj)
    # Only the Deployment changes.
    gpu = render("gpu")
    assert [o for o in objs if o["kind"] != "Deployment"] == [
        o for o in gpu if o["kind"] != "Deployment"
    ]


@pytest.mark.skipif(not shutil.which("sh"), reason="no POSIX shell")
def test_mps_component_starts_the_daemon_then_the_image_entrypoints_server(tmp_path: Path) -> None:
    """The container runs the image's entrypoint (dumb-init, then ``orpheus-serve serve`` with
    the Deployment's args) with the MPS control daemon started first. The script runs here
    under sh with two recording programs on PATH in place of the driver's daemon and the
    server: the order, the directories, the environment and the args are the script's."""
    c = container(render_gpu_with("mps"))
    wrapper, script, argv = mps_script(c)
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    entrypoint = json.loads(re.findall(r"^ENTRYPOINT\s+(\[.*\])\s*$", dockerfile, flags=re.M)[-1])
    assert wrapper == entrypoint[: len(wrapper)] == ["dumb-init", "--single-child", "--"]
    server = entrypoint[len(wrapper) :]
    assert server == ["orpheus-serve", "serve"]

    env = {e["name"]: e["value"] for e in c["env"]}
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "calls"
    for name in ("nvidia-cuda-mps-control", "orpheus-serve"):
        prog = bin_dir / name
        prog.write_text(
            "#!/bin/sh\n"
            f'echo "{name} $* pipe=$CUDA_MPS_PIPE_DIRECTORY" >> {record}\n'
            f'[ "{name}" != nvidia-cuda-mps-control ] || [ -z "$FAIL_DAEMON" ] || exit 3\n'
        )
        prog.chmod(0o755)
    root = tmp_path / "pod"
    mps_env = {k: str(root) + v for k, v in env.items() if k.startswith("CUDA_MPS_")}
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin", **mps_env}
    ok = subprocess.run(["sh", "-c", script, *argv], env=base, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    pipe = mps_env["CUDA_MPS_PIPE_DIRECTORY"]
    assert record.read_text().splitlines() == [
        f"nvidia-cuda-mps-control -d pipe={pipe}",
        f"{' '.join([*server, *c['args']])} pipe={pipe}",
    ]
    for directory in mps_env.values():
        assert Path(directory).is_dir()
    # A daemon that cannot start stops the container with its reason; no server without MPS.
    record.unlink()
    failed = subprocess.run(
        ["sh", "-c", script, *argv], env={**base, "FAIL_DAEMON": "1"}, capture_output=True
    )
    assert failed.returncode == 3
    assert record.read_text().splitlines() == [f"nvidia-cuda-mps-control -d pipe={pipe}"]


def test_mps_component_keeps_the_pod_to_itself(tmp_path: Path) -> None:
    """The daemon's directories are on the pod's writable volumes (the root is read-only),
    the server looks where the daemon listens, and the pod shares nothing with the node:
    its own /dev/shm (the rings), the whole GPU, no host namespaces or paths."""
    objs = render_gpu_with("mps")
    c = container(objs)
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in c["env"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for key in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        holding = [m for m in mounts if Path(env[key]).is_relative_to(m)]
        assert holding, f"{key}={env[key]} is on the read-only root"
        mount = mounts[max(holding, key=lambda m: len(Path(m).parts))]
        assert not mount.get("readOnly") and "emptyDir" in volumes[mount["name"]]
    assert control_path(env) == f"{env['CUDA_MPS_PIPE_DIRECTORY']}/control"
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    assert not {"hostIPC", "hostPID", "hostNetwork"} & pod.keys()
    assert not [v for v in pod["volumes"] if "hostPath" in v]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    # The server the pod runs is the one overlays/gpu runs.
    assert served_config(objs, tmp_path) == served_config(render("gpu"), tmp_path)


def test_mps_component_passes_checkov(tmp_path: Path) -> None:
    exe = checkov()
    manifest = tmp_path / "gpu-mps.yaml"
    manifest.write_text(yaml.safe_dump_all(render_gpu_with("mps")))
    proc = subprocess.run(
        [exe, "-f", str(manifest), "--framework", "kubernetes", "--skip-download",
         "--output", "json", "--soft-fail"],
        capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "BC_SKIP_MAPPING": "TRUE"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    results = report["results"] if isinstance(report, dict) else report[0]["results"]
    failed = {c["check_id"] for c in results["failed_checks"]}
    assert not failed - CHECKOV_ACCEPTED.keys(), f"checkov failed: {sorted(failed)}"


def kustomization_files(directory: Path, seen: set[Path]) -> None:
    """Every file a kustomization uses, following resources and components."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    seen.add(directory / "kustomization.yaml")
    refs = [*k.get("resources", []), *k.get("components", [])]
    refs += [p["path"] for p in k.get("patches", []) if "path" in p]
    for gen in (*k.get("configMapGenerator", []), *k.get("secretGenerator", [])):
        refs += [f.split("=")[-1] for f in gen.get("files", [])]
    for ref in refs:
        path = (directory / ref).resolve()
        if path.is_dir():
            kustomization_files(path, seen)
        else:
            seen.add(path)


def test_every_kubernetes_file_is_used_by_an_overlay_or_checked_here() -> None:
    used: set[Path] = set()
    for overlay in OVERLAYS:
        kustomization_files(KUBE / "overlays" / overlay, used)
    used.add(KUBE / "prometheus-adapter" / "values.yaml")  # test_autoscaling_... reads it
    kustomization_files(INGRESS_NGINX, used)  # optional: test_ingress_... add it to gpu
    kustomization_files(MPS, used)  # optional: test_mps_component_... add it to gpu
    # optional: tests/deploy/test_kubernetes_inference_gateway.py adds it to gpu
    kustomization_files(KUBE / "components" / "inference-gateway", used)
    present = {p.resolve() for p in KUBE.rglob("*") if p.is_file()}
    assert present == used, f"unused or unchecked: {sorted(map(str, present ^ used))}"
