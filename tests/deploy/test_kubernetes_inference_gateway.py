"""deploy/kubernetes/components/inference-gateway: the recipe behind an inference gateway
(Gateway API Inference Extension InferencePool, the llm-d router's endpoint picker).

Rendered as its kustomization says to (added to overlays/gpu). The built-in kinds are
validated as in tests/deploy/test_kubernetes.py (kubernetes-validate, strict); the InferencePool and
the HTTPRoute against their upstream CRDs' schemas pinned under tests/data/crds/ (each file's
header names its release), made strict: an object with properties takes no other field, as
the API server's pruning and ``kubectl apply --validate=strict`` treat it. The endpoint
picker's own configuration has no CRD: it is checked against the structure of llm-d-router
v0.10.0's EndpointPickerConfig and its plugins' parameters (the EPP decodes it strictly), the
plugin types against that release's registry. Against the server: the metrics the picker
reads are ones a real gateway's ``/metrics`` carries, each as exactly one sample the EPP's
metric spec selects (the saturation in 0..1); the pool's port and the metrics path are the
gateway's; every route of the server reaches the backend the recipe means (WebSockets and
other GETs never the pool).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import re
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest
import yaml
from gateway_harness import NO_STORE, running_gateway, wait_until
from prometheus_client.parser import text_string_to_metric_families
from test_kubernetes import (
    CHECKOV_ACCEPTED,
    CHECKOV_REQUIRED,
    OVERLAYS,
    Obj,
    checkov_results,
    metric_names,
    render,
    render_gpu_with,
    routes,
    validate,
)

from gateway.frontends.baseten import websocket as baseten
from gateway.frontends.elevenlabs import messages as elevenlabs
from gateway.frontends.omni import speech_stream as omni
from shm.layout import InstanceLayout

ROOT = Path(__file__).resolve().parents[2]
COMPONENT = "inference-gateway"
CRDS = Path(__file__).resolve().parents[1] / "data" / "crds"
TTS = "orpheus-serve"
EPP = "orpheus-serve-epp"
STALENESS_S = 2.0
"""The EPP's --metrics-staleness-threshold default (llm-d-router v0.10.0
pkg/epp/server/options.go): a pod's metrics older than this count as stale."""

# The plugin types these manifests use, as llm-d-router v0.10.0 registers them (the
# *Type constants of pkg/epp/framework/plugins/...; cmd/epp/runner registers each).
PLUGIN_TYPES = {
    "passthrough-parser",
    "metrics-data-source",
    "core-metrics-extractor",
    "queue-scorer",
    "kv-cache-utilization-scorer",
    "session-affinity-scorer",
    "max-score-picker",
}


def objects() -> list[Obj]:
    return render_gpu_with(COMPONENT)


def named(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def generated(objs: list[Obj], prefix: str) -> Obj:
    """The ConfigMap a generator made from ``prefix`` (its name carries a content hash)."""
    (cm,) = [
        o
        for o in objs
        if o["kind"] == "ConfigMap"
        and re.fullmatch(rf"{prefix}-[a-z0-9]{{10}}", o["metadata"]["name"])
    ]
    return cm


def epp_config(objs: list[Obj]) -> dict[str, Any]:
    return yaml.safe_load(generated(objs, "orpheus-serve-epp-config")["data"]["epp-config.yaml"])


def plugin(cfg: dict[str, Any], type_: str) -> dict[str, Any]:
    (p,) = [p for p in cfg["plugins"] if p["type"] == type_]
    return p


# -- pinned CRD schemas --------------------------------------------------------------------------
def strict(schema: Any) -> Any:
    """``schema`` with every object that lists its properties closed to any other field."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@functools.cache
def pinned_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the strict schema, from every file under tests/data/crds/."""
    schemas = {}
    for path in sorted(CRDS.glob("*.yaml")):
        text = path.read_text()
        assert re.search(r"^# Source: github\.com/\S+ v\d+\.\d+\.\d+ ", text, re.M), path
        pin = yaml.safe_load(text)
        schemas[(f"{pin['group']}/{pin['version']}", pin["kind"])] = strict(pin["schema"])
    return schemas


def validate_any(obj: Obj) -> None:
    schema = pinned_schemas().get((obj["apiVersion"], obj["kind"]))
    if schema is not None:
        jsonschema.validate(obj, schema)
    else:
        validate(obj)


def test_every_object_matches_its_schema() -> None:
    objs = objects()
    kinds = {o["kind"] for o in objs}
    assert {"InferencePool", "HTTPRoute", "ServiceAccount", "Role", "RoleBinding"} <= kinds
    for obj in objs:
        validate_any(obj)
        assert obj["metadata"]["namespace"] == OVERLAYS["gpu"], obj["metadata"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == TTS, obj["kind"]
    # The rest of overlays/gpu is unchanged but for the TTS pods' engine-type label.
    added = {(o["kind"], o["metadata"]["name"]) for o in objs} - {
        (o["kind"], o["metadata"]["name"]) for o in render("gpu")
    }
    assert {k for k, _ in added} == {
        "InferencePool", "HTTPRoute", "Deployment", "Service", "ServiceAccount", "Role",
        "RoleBinding", "ConfigMap", "NetworkPolicy",
    }  # fmt: skip
    tts = copy.deepcopy(named(objs, "Deployment", TTS))
    labels = tts["spec"]["template"]["metadata"]["labels"]
    assert labels.pop("llm-d.ai/engine-type") == TTS
    assert tts == named(render("gpu"), "Deployment", TTS)


def test_the_pinned_schemas_are_strict() -> None:
    objs = objects()
    pool = copy.deepcopy(named(objs, "InferencePool", TTS))
    pool["spec"]["targetPort"] = [{"number": 8000}]  # a misspelt field
    with pytest.raises(jsonschema.ValidationError):
        validate_any(pool)
    pool = copy.deepcopy(named(objs, "InferencePool", TTS))
    pool["spec"]["endpointPickerRef"]["failureMode"] = "Open"  # not one of the enum
    with pytest.raises(jsonschema.ValidationError):
        validate_any(pool)
    route = copy.deepcopy(named(objs, "HTTPRoute", TTS))
    route["spec"]["rules"][0]["backendRef"] = route["spec"]["rules"][0].pop("backendRefs")
    with pytest.raises(jsonschema.ValidationError):
        validate_any(route)
    route = copy.deepcopy(named(objs, "HTTPRoute", TTS))
    route["spec"]["rules"][0]["timeouts"]["request"] = "10 minutes"
    with pytest.raises(jsonschema.ValidationError):
        validate_any(route)


# -- the endpoint picker's configuration (llm-d-router v0.10.0) ----------------------------------
_STR = {"type": "string"}
_REF = {"type": "object", "required": ["pluginRef"], "additionalProperties": False, "properties": {"pluginRef": _STR}}  # fmt: skip
_PARAMETERS = {
    # The parameter structs of the plugins used here (each decoded strictly by the EPP).
    "metrics-data-source": {  # source/metrics/datasource.go
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "scheme": {"enum": ["http", "https"]},
            "path": {"type": "string", "pattern": "^/"},
            "port": {"type": "integer"},
            "insecureSkipVerify": {"type": "boolean"},
            "caCertPath": _STR,
            "clientCertPath": _STR,
            "clientKeyPath": _STR,
            "interval": {"type": "string", "pattern": r"^[0-9]+(ms|s)$"},
        },
    },
    "core-metrics-extractor": {  # extractor/metrics/factories.go
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "engineLabelKey": _STR,
            "defaultEngine": _STR,
            "engineConfigs": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        k: _STR
                        for k in (
                            "name",
                            "queuedRequestsSpec",
                            "runningRequestsSpec",
                            "kvUsageSpec",
                            "loraSpec",
                            "cacheInfoSpec",
                            "cacheBlockSizeLabelName",
                            "cacheNumBlocksLabelName",
                            "cacheBlockSizeSpec",
                            "cacheNumBlocksSpec",
                        )
                    },
                },
            },
        },
    },
    "session-affinity-scorer": {  # scorer/sessionaffinity, util/sessionaffinity
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "strategy": {"enum": ["encoded_endpoint_header", "session_id"]},
            "profileName": _STR,
            "encodedEndpointHeaderConfig": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"header": _STR},
            },
            "sessionIdConfig": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "sources": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "minProperties": 1,
                            "maxProperties": 1,
                            "properties": {"header": _STR, "attribute": _STR},
                        },
                    },
                    "evictionTtlSeconds": {"type": "number", "exclusiveMinimum": 0},
                    "evictionSweepSeconds": {"type": "number", "exclusiveMinimum": 0},
                },
            },
        },
    },
}
EPP_CONFIG_SCHEMA = {  # apix/config/v1alpha1/endpointpickerconfig_types.go
    "type": "object",
    "required": ["apiVersion", "kind", "plugins", "schedulingProfiles"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "llm-d.ai/v1alpha1"},
        "kind": {"const": "EndpointPickerConfig"},
        "featureGates": {"type": "array", "items": _STR},
        "plugins": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["type"],
                "additionalProperties": False,
                "properties": {"name": _STR, "type": _STR, "parameters": {"type": "object"}},
            },
        },
        "schedulingProfiles": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "plugins"],
                "additionalProperties": False,
                "properties": {
                    "name": _STR,
                    "plugins": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["pluginRef"],
                            "additionalProperties": False,
                            "properties": {"pluginRef": _STR, "weight": {"type": "number"}},
                        },
                    },
                },
            },
        },
        "dataLayer": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "injectDefaults": {"type": "boolean"},
                "sources": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["pluginRef", "extractors"],
                        "additionalProperties": False,
                        "properties": {
                            "pluginRef": _STR,
                            "extractors": {"type": "array", "items": _REF},
                        },
                    },
                },
                "discovery": _REF,
            },
        },
        "requestHandler": {
            "type": "object",
            "additionalProperties": False,
            "properties": {"parsers": {"type": "array", "items": _REF}},
        },
        "flowControl": {"type": "object"},
        "saturationDetector": _REF,
    },
}


def validate_epp_config(cfg: dict[str, Any]) -> None:
    jsonschema.validate(cfg, EPP_CONFIG_SCHEMA)
    names = {}
    for p in cfg["plugins"]:
        assert p["type"] in PLUGIN_TYPES, f"not a plugin type of llm-d-router v0.10.0: {p['type']}"
        jsonschema.validate(
            p.get("parameters", {}), _PARAMETERS.get(p["type"], {"maxProperties": 0})
        )
        names[p.get("name", p["type"])] = p["type"]
    refs = [r["pluginRef"] for prof in cfg["schedulingProfiles"] for r in prof["plugins"]]
    refs += [r["pluginRef"] for r in cfg.get("requestHandler", {}).get("parsers", [])]
    for source in cfg.get("dataLayer", {}).get("sources", []):
        refs += [source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])]
    missing = set(refs) - names.keys()
    assert not missing, f"references to no plugin: {missing}"


def test_epp_config_matches_the_pickers_structure() -> None:
    cfg = epp_config(objects())
    validate_epp_config(cfg)
    # The passthrough parser is the only one: any other would claim paths it cannot read.
    assert [plugin(cfg, "passthrough-parser")] == [
        p for p in cfg["plugins"] if p["type"].endswith("-parser")
    ]
    assert cfg["requestHandler"]["parsers"] == [{"pluginRef": "passthrough-parser"}]
    bad = copy.deepcopy(cfg)
    plugin(bad, "core-metrics-extractor")["parameters"]["engineConfigs"][0]["kvUsage"] = "x"
    with pytest.raises(jsonschema.ValidationError):
        validate_epp_config(bad)
    bad = copy.deepcopy(cfg)
    bad["schedulingProfiles"][0]["plugins"].append({"pluginRef": "prefix-cache-scorer"})
    with pytest.raises(AssertionError, match="references to no plugin"):
        validate_epp_config(bad)


# -- the picker against the server ---------------------------------------------------------------
SPEC = re.compile(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{([^}]*)\})?\s*$")


def select(exposition: str, spec: str) -> list[float]:
    """The samples of ``exposition`` the EPP's metric spec ``name{label=value,...}`` selects
    (extractor/metrics/spec.go: the family by name, then every sample whose labels match)."""
    m = SPEC.match(spec)
    assert m, spec
    name, block = m.group(1), m.group(2) or ""
    want = dict(re.findall(r'(\w+)\s*=\s*"?([^",}]*)"?', block))
    values = []
    for family in text_string_to_metric_families(exposition):
        if family.name != name:
            continue
        for s in family.samples:
            if s.name == name and want.items() <= s.labels.items():
                values.append(s.value)
    return values


def test_the_pickers_metrics_are_the_gateways_gauges(layout: InstanceLayout) -> None:
    objs = objects()
    cfg = epp_config(objs)
    extractor = plugin(cfg, "core-metrics-extractor")["parameters"]
    (engine,) = extractor["engineConfigs"]
    assert engine["name"] == extractor["defaultEngine"], "an unlabelled pod is not read as vLLM"
    pod = named(objs, "Deployment", TTS)["spec"]["template"]["metadata"]["labels"]
    assert pod[extractor["engineLabelKey"]] == engine["name"]
    specs = {k: engine[k] for k in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec")}
    assert specs == {
        "queuedRequestsSpec": "orpheus_gateway_queued_streams",
        "runningRequestsSpec": "orpheus_gateway_active_streams",
        "kvUsageSpec": "orpheus_gateway_saturation",
    }
    assert {SPEC.match(s).group(1) for s in specs.values()} <= metric_names()  # type: ignore[union-attr]

    # Scraped where the pool points: the gateway's port, a GET route, often enough.
    source = plugin(cfg, "metrics-data-source")["parameters"]
    assert ("GET", source["path"]) in routes() and source["scheme"] == "http"
    pool = named(objs, "InferencePool", TTS)["spec"]
    container = named(objs, "Deployment", TTS)["spec"]["template"]["spec"]["containers"][0]
    http = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert pool["targetPorts"] == [{"number": http}]
    interval = source["interval"]
    seconds = float(interval[:-2]) / 1000 if interval.endswith("ms") else float(interval[:-1])
    assert 0.1 <= seconds < STALENESS_S / 2

    # A real gateway's /metrics: each spec selects exactly one sample, with streams open.
    async def scrape_with_streams() -> str:
        backend = {"realtime": True, "first_chunk_delay_s": 0.2}
        body = {"model": "orpheus", "input": "Hello there. " * 4, "voice": "tara"}
        async with (
            running_gateway(layout, backend=backend, max_active_streams=4) as h,
            aiohttp.ClientSession() as s,
        ):
            # no-store: two streams of the synthesis path, not a leader and its follower
            posts = [asyncio.create_task(s.post(f"{h.url}/v1/audio/speech", json=body, headers=NO_STORE)) for _ in range(2)]  # fmt: skip
            await wait_until(lambda: len(h.backend.submitted()) == 2, what="two streams")
            async with s.get(f"{h.url}{source['path']}") as r:
                text = await r.text()
            for r in await asyncio.gather(*posts):
                await r.read()
            return text

    text = asyncio.run(scrape_with_streams())
    values = {k: select(text, spec) for k, spec in specs.items()}
    assert values == {
        "queuedRequestsSpec": [0.0],
        "runningRequestsSpec": [2.0],
        "kvUsageSpec": [0.5],
    }


def test_the_pool_the_picker_and_its_permissions_fit_together() -> None:
    objs = objects()
    pool = named(objs, "InferencePool", TTS)
    tts_pod = named(objs, "Deployment", TTS)["spec"]["template"]["metadata"]["labels"]
    epp = named(objs, "Deployment", EPP)
    epp_pod = epp["spec"]["template"]["metadata"]["labels"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= tts_pod.items()
    assert not selector.items() <= epp_pod.items(), "the picker is not a pool member"
    # Nothing of the TTS pods' selects the picker's pod, and the reverse.
    for kind in ("Service", "PodDisruptionBudget", "NetworkPolicy"):
        for o in (o for o in objs if o["kind"] == kind and o["metadata"]["name"] == TTS):
            sel = o["spec"].get("selector") or o["spec"]["podSelector"]
            sel = sel.get("matchLabels", sel)
            assert not sel.items() <= epp_pod.items(), kind

    # The pool's picker is the EPP Service's ext-proc port, which reaches the EPP's gRPC port.
    ref = pool["spec"]["endpointPickerRef"]
    svc = named(objs, "Service", ref["name"])
    assert svc["spec"]["selector"].items() <= epp_pod.items()
    (port,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    (c,) = epp["spec"]["template"]["spec"]["containers"]
    target = next(p["containerPort"] for p in c["ports"] if p["name"] == port["targetPort"])
    args = c["args"]
    flag = lambda f: args[args.index(f) + 1]  # noqa: E731
    assert int(flag("--grpc-port")) == target
    assert flag("--pool-name") == pool["metadata"]["name"]
    assert flag("--pool-group") == pool["apiVersion"].split("/")[0]
    assert {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}} in c["env"]  # fmt: skip
    assert ref["failureMode"] == "FailOpen"
    # Its configuration file is the generated ConfigMap's key, where it is mounted.
    config_file = Path(flag("--config-file"))
    mount = next(m for m in c["volumeMounts"] if Path(m["mountPath"]) == config_file.parent)
    volume = next(
        v for v in epp["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    )
    cm = generated(objs, "orpheus-serve-epp-config")
    assert volume["configMap"]["name"] == cm["metadata"]["name"]
    assert config_file.name in cm["data"]
    # Its policy opens exactly the ports its Service serves.
    policy = named(objs, "NetworkPolicy", EPP)
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= epp_pod.items()
    opened = {p["port"] for p in policy["spec"]["ingress"][0]["ports"]}
    assert opened == {p["targetPort"] for p in svc["spec"]["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"]["port"] == int(flag("--grpc-health-port"))

    # Read access to what it watches, through its own account, in its namespace only.
    sa = epp["spec"]["template"]["spec"]["serviceAccountName"]
    binding = named(objs, "RoleBinding", EPP)
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa, "namespace": OVERLAYS["gpu"]}
    ]
    role = named(objs, "Role", binding["roleRef"]["name"])
    granted = {
        (g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
    }
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted
    assert all(set(rule["verbs"]) <= {"get", "list", "watch"} for rule in role["rules"])
    assert not [o for o in objs if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]


# -- the route: which backend each of the server's routes reaches --------------------------------
def rule_for(route: Obj, method: str, path: str) -> dict[str, Any]:
    """The HTTPRoute rule a request matches (Gateway API precedence: an Exact path before
    any prefix, a longer prefix before a shorter, a match with a method before one without)."""
    candidates = []
    for rule in route["spec"]["rules"]:
        for m in rule["matches"]:
            p = m["path"]
            if m.get("method", method) != method:
                continue
            if p["type"] == "Exact" and p["value"] == path:
                candidates.append(((2, len(p["value"]), "method" in m), rule))
            elif p["type"] == "PathPrefix" and (
                p["value"] == "/"
                or path == p["value"]
                or path.startswith(p["value"].rstrip("/") + "/")
            ):
                candidates.append(((1, len(p["value"]), "method" in m), rule))
    assert candidates, f"{method} {path} matches no rule"
    return max(candidates, key=lambda c: c[0])[1]


def test_only_the_speech_post_goes_through_the_picker() -> None:
    """WebSockets (and every other GET) reach the Service: an upgrade sent to the pool never
    completes and a bodiless request is placed at random; raw-audio POSTs would be held
    whole. POST /v1/audio/speech goes to the pool, on the gateway's own port."""
    objs = objects()
    route = named(objs, "HTTPRoute", TTS)
    (parent,) = route["spec"]["parentRefs"]
    assert parent["kind"] == "Gateway"
    svc = named(objs, "Service", TTS)
    http_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "http")
    pool_routes = set()
    for method, path in routes():
        if method == "HEAD":
            continue
        (backend,) = rule_for(route, method, path)["backendRefs"]
        if backend.get("kind") == "InferencePool":
            assert backend["group"] == "inference.networking.k8s.io"
            assert backend["name"] == named(objs, "InferencePool", TTS)["metadata"]["name"]
            pool_routes.add((method, path))
        else:
            assert backend.get("kind", "Service") == "Service"
            assert (backend["name"], backend["port"]) == (TTS, http_port)
    assert pool_routes == {("POST", "/v1/audio/speech")}
    websockets = {omni.PATH, elevenlabs.WS_PATH, elevenlabs.WS_SINGLE_PATH, baseten.PATH}
    assert {("GET", p) for p in websockets} <= routes()
    for path in websockets:
        (backend,) = rule_for(route, "GET", path)["backendRefs"]
        assert backend.get("kind", "Service") == "Service", path
    for rule in route["spec"]["rules"]:
        assert rule["timeouts"]["request"] == "0s", "a stream lasts as long as its audio"


def test_the_component_passes_checkov(tmp_path: Path) -> None:
    """The security defaults hold for the picker too, except the API token it needs."""
    results = checkov_results(objects(), "gpu-inference-gateway", tmp_path)
    failed = {(c["check_id"], c["resource"]) for c in results["failed_checks"]}
    accepted = set(CHECKOV_ACCEPTED) | {"CKV_K8S_38"}  # the EPP reads pods and the pool
    unexpected = {f for f in failed if f[0] not in accepted}
    assert not unexpected, f"checkov failed: {sorted(unexpected)}"
    assert not {f for f in failed if f[0] == "CKV_K8S_38" and EPP not in f[1]}
    for deployment in (TTS, EPP):
        passed = {
            c["check_id"]
            for c in results["passed_checks"]
            if c["resource"].startswith(f"Deployment.{OVERLAYS['gpu']}.{deployment}")
        }
        required = set(CHECKOV_REQUIRED) - ({"CKV_K8S_38"} if deployment == EPP else set())
        assert required <= passed, f"{deployment} must pass {sorted(required - passed)}"
