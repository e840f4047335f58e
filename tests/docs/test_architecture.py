"""The layering of docs/architecture.md holds: import-linter's contracts (.importlinter)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from import_contracts import lint, lint_gateway_with

REPO = Path(__file__).resolve().parents[2]


def test_import_contracts_are_kept() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    res = subprocess.run(
        [str(lint), "--no-cache", "--config", str(REPO / ".importlinter")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
    assert "0 broken" in res.stdout


def test_a_layer_violation_is_reported(tmp_path: Path) -> None:
    """The check is live: a floor module importing a process package breaks the contract."""
    for pkg in ("common", "gateway"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "common" / "bad.py").write_text("import gateway\n")
    (tmp_path / ".importlinter").write_text(
        "[importlinter]\nroot_packages =\n    gateway\n    common\n\n"
        "[importlinter:contract:layers]\nname = layers\ntype = layers\n"
        "layers =\n    gateway\n    common\n"
    )
    res = lint(tmp_path)
    assert res.returncode == 1
    assert "common.bad -> gateway" in res.stdout


def test_a_cycle_inside_the_gateway_is_reported(tmp_path: Path) -> None:
    """The gateway's acyclic contract is live: two modules importing each other (as
    ``service`` and ``session`` once did) break it."""
    pkg = tmp_path / "gateway"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "service.py").write_text("from gateway import session\n")
    (pkg / "session.py").write_text("from gateway import service\n")
    res = lint_gateway_with(tmp_path, "gateway-acyclic")
    assert res.returncode == 1, res.stdout
    assert "BROKEN" in res.stdout


def _edges(mermaid: str) -> set[tuple[str, str]]:
    return set(re.findall(r"^\s+(\w+) -->\|\d+\| (\w+)$", mermaid, re.M))


def _drawings(kind: str) -> list[str]:
    doc = (REPO / "docs" / "architecture.md").read_text()
    return re.findall(rf"```mermaid\nflowchart {kind}\n(.*?)```", doc, re.S)


def _generated(*args: str) -> str:
    res = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "dev" / "import_graph.py"), *args, str(REPO)],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return res.stdout


def test_the_drawing_in_docs_is_current() -> None:
    """docs/architecture.md's "after" drawing shows the package imports the code has."""
    drawings = _drawings("TD")
    assert drawings, "docs/architecture.md has no mermaid drawing of the packages"
    assert _edges(drawings[-1]) == _edges(_generated()), (
        "regenerate it: python scripts/dev/import_graph.py"
    )


def _gateway_edges(mermaid: str) -> set[tuple[str, str]]:
    return set(re.findall(r"^\s+(\w+)\[[\w/]+\] -->\|\d+\| (\w+)\[[\w/]+\]$", mermaid, re.M))


def test_the_gateway_drawing_in_docs_is_current() -> None:
    """docs/architecture.md's last drawing of the gateway's modules is the code's."""
    drawings = _drawings("LR")
    assert drawings, "docs/architecture.md has no mermaid drawing of the gateway"
    generated = _gateway_edges(_generated("--gateway"))
    assert generated, "import_graph.py --gateway drew nothing"
    assert _gateway_edges(drawings[-1]) == generated, (
        "regenerate it: python scripts/dev/import_graph.py --gateway"
    )


# Every route a client sees, as the gateway served them before the front ends became packages
# (45b6fc3): the registry loop must add exactly these.
ROUTES = {
    ("POST", "/v1/audio/speech"),
    ("GET", "/v1/audio/speech/stream"),
    ("GET", "/v1/baseten/orpheus/websocket"),
    ("POST", "/v1/baseten/orpheus/predict"),
    ("GET", "/v1/text-to-speech/{voice_id}/multi-stream-input"),
    ("POST", "/v1/text-to-speech/{voice_id}/stream"),
    ("POST", "/v1/text-to-speech/{voice_id}/stream/with-timestamps"),
    # Added since: pronunciation dictionaries and text-to-dialogue (ElevenLabs').
    ("POST", "/v1/pronunciation-dictionaries/add-from-rules"),
    ("POST", "/v1/pronunciation-dictionaries/add-from-file"),
    ("GET", "/v1/pronunciation-dictionaries"),
    ("GET", "/v1/pronunciation-dictionaries/{dictionary_id}"),
    ("PATCH", "/v1/pronunciation-dictionaries/{dictionary_id}"),
    ("POST", "/v1/pronunciation-dictionaries/{dictionary_id}/add-rules"),
    ("POST", "/v1/pronunciation-dictionaries/{dictionary_id}/remove-rules"),
    ("POST", "/v1/pronunciation-dictionaries/{dictionary_id}/set-rules"),
    ("GET", "/v1/pronunciation-dictionaries/{dictionary_id}/{version_id}/download"),
    ("POST", "/v1/text-to-dialogue"),
    ("GET", "/v1/text-to-speech/{voice_id}/stream-input"),
    ("POST", "/v1/text-to-dialogue/stream"),
    ("POST", "/v1/text-to-dialogue/stream/with-timestamps"),
    ("POST", "/v1/text-to-dialogue/with-timestamps"),
    # ElevenLabs' whole speech, voices (issue 46).
    ("POST", "/v1/text-to-speech/{voice_id}"),
    ("POST", "/v1/text-to-speech/{voice_id}/with-timestamps"),
    ("GET", "/v1/voices"),
    ("GET", "/v2/voices"),
    ("GET", "/v1/voices/{voice_id}"),
    ("GET", "/v1/audio/voices"),
    ("POST", "/v1/audio/voices"),
    ("DELETE", "/v1/audio/voices/{voice_id}"),
    ("POST", "/v1/admin/lora"),
    ("DELETE", "/v1/admin/lora/{name}"),
    ("POST", "/v1/watermark/detect"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/ready"),
    ("GET", "/metrics"),
    ("GET", "/"),
    # long-form jobs (gateway/jobs/, added with the job runner by app.py)
    ("POST", "/v1/audio/jobs"),
    ("GET", "/v1/audio/jobs"),
    ("GET", "/v1/audio/jobs/{job_id}"),
    ("DELETE", "/v1/audio/jobs/{job_id}"),
    ("GET", "/v1/audio/jobs/{job_id}/audio"),
    # the sentence audio cache (on by default; gateway/cache/routes.py, gateway/warm.py)
    ("DELETE", "/v1/cache"),
    ("DELETE", "/v1/admin/cache"),
    ("POST", "/v1/cache/warm"),
}


def test_the_front_end_registry_adds_every_route() -> None:
    from types import SimpleNamespace

    from common.config import ServeConfig
    from gateway.app import build_app

    gateway = SimpleNamespace(
        config=ServeConfig(), custom_voices=None, voices=SimpleNamespace(listing=None), tracing=None,
        metrics=None, cache=SimpleNamespace(shared=False),
    )  # fmt: skip
    app = build_app(gateway)  # type: ignore[arg-type]
    routes = {
        (r.method, r.resource.canonical)
        for r in app.router.routes()
        if r.resource is not None and r.method != "HEAD"
    }
    assert routes == ROUTES


FRONTENDS = REPO / "gateway" / "frontends"


def _frontend_packages() -> set[str]:
    return {p.name for p in FRONTENDS.iterdir() if (p / "__init__.py").exists()}


def test_every_front_end_is_in_the_independence_contract() -> None:
    """Step 4 of adding a protocol (gateway/frontends/registry.py)."""
    config = (REPO / ".importlinter").read_text()
    contract = config[config.index("[importlinter:contract:frontends-independent]") :]
    modules = contract.split("modules =", 1)[1].split("ignore_imports", 1)[0].split()
    assert {m.removeprefix("gateway.frontends.") for m in modules} == _frontend_packages()


def test_every_front_end_is_served() -> None:
    """Step 2: each package is in the registry, or started by gateway.main (its own socket)."""
    from gateway.frontends.registry import HTTP_FRONTENDS

    registered = {f.__name__.rsplit(".", 1)[1] for f in HTTP_FRONTENDS}
    own_socket = {"zeromq"}
    assert "gateway.frontends.zeromq" in (REPO / "gateway" / "main.py").read_text()
    assert registered | own_socket == _frontend_packages()
    assert not registered & own_socket


def test_every_front_end_has_its_api_label() -> None:
    """Step 3: each front end labels its requests with a member of ``apis.Api``, and each
    member labels some front end's requests."""
    from gateway.apis import Api

    used: dict[str, set[str]] = {}
    for name in _frontend_packages():
        source = "".join(p.read_text() for p in (FRONTENDS / name).glob("*.py"))
        used[name] = set(re.findall(r"\bApi\.([A-Z_]+)", source))
    assert all(used.values()), used
    # Long-form jobs are not a front end, but their units are requests of their own label.
    jobs = "".join(p.read_text() for p in (FRONTENDS.parent / "jobs").glob("*.py"))
    used["jobs"] = set(re.findall(r"\bApi\.([A-Z_]+)", jobs))
    assert set().union(*used.values()) == set(Api.__members__), used
