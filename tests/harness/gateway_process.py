"""A gateway in its own process, as the orchestrator runs it (``gateway.main.run``), for the
tests that need the real process: its port, its signals, its metrics directory."""

from __future__ import annotations

import os
import subprocess
import sys

import msgspec

from shm.layout import InstanceLayout

CHILD = """
import sys, msgspec
from gateway.main import run
from common.config import ServeConfig
from shm.layout import InstanceLayout
run(msgspec.json.decode(sys.argv[1], type=ServeConfig),
    msgspec.json.decode(sys.argv[2], type=InstanceLayout), int(sys.argv[3]))
print("torch imported:", "torch" in sys.modules, flush=True)
"""


def start_gateway(
    config: object, layout: InstanceLayout, index: int, metrics_dir: str = ""
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        gateway_argv(config, layout, index), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=gateway_env(metrics_dir),
    )  # fmt: skip


def gateway_argv(config: object, layout: InstanceLayout, index: int) -> list[str]:
    """The command line of gateway process ``index``."""
    return [sys.executable, "-c", CHILD, msgspec.json.encode(config).decode(),
            msgspec.json.encode(layout).decode(), str(index)]  # fmt: skip


def gateway_env(metrics_dir: str) -> dict[str, str]:
    """The child's environment. Without a metrics directory the variable must be absent:
    prometheus_client treats a set-but-empty PROMETHEUS_MULTIPROC_DIR as the working
    directory and leaves its .db files there."""
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    if metrics_dir:
        env["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    return env
