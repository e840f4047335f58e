"""The real server for end-to-end tests: `orpheus-serve serve` on CPU with the tiny model and
SNAC's real architecture (random weights), started as a subprocess and stopped with SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import IO

import pytest

from bench.load.servers import ORPHEUS_SERVE, orpheus_serve_argv
from llm_worker.engine.env import MULTIPROCESSING_ENV, RPC_DIR_ENV
from orchestrator import proctree
from orchestrator.settings import is_set, set_overrides
from shm.records import SAMPLES_PER_FRAME
from shm.ring import SHM_DIR
from testkit.local_server import free_port, wait_ready

EXE = ORPHEUS_SERVE
BYTES_PER_FRAME = SAMPLES_PER_FRAME * 2
NO_STORE = {"Cache-Control": "no-store"}
"""The header of a request that must be synthesised: the sentence audio cache is on by
default, and a test that says one body again and again (a stream after each fault, twins
compared with each other) would otherwise hear its third saying from the cache, and its
concurrent twins would share one synthesis."""
START_TIMEOUT_S = 600.0  # vLLM's CPU start-up on a busy 2-core machine

NO_ENGINE_ENV = "TESTS_NO_ENGINE"
"""Set by `make check`: a test that starts an engine there fails, saying to mark it."""
ENGINE_STARTS: Counter[tuple[str, str]] = Counter()
"""Engine start-ups of this test run by (test module, what started): each costs 35 s to
3 min on a CPU, so the run's summary prints them (tests/conftest.py)."""


def note_engine_start(what: str) -> None:
    """Count one vLLM engine start-up (a server, a worker restart, an offline engine)."""
    if os.environ.get(NO_ENGINE_ENV):
        pytest.fail(f"this test starts an engine ({what}): mark it `engine` (tests/conftest.py)")
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[0]
    ENGINE_STARTS[(test, what)] += 1


def engine_starts_summary() -> str:
    """One line per test module: the engine start-ups it made, and the run's total."""
    by_module: dict[str, list[str]] = {}
    for (test, what), n in sorted(ENGINE_STARTS.items()):
        by_module.setdefault(test, []).append(f"{n} {what}")
    lines = [f"engine start-ups: {sum(ENGINE_STARTS.values())}"]
    lines += [f"  {test}: {', '.join(parts)}" for test, parts in by_module.items()]
    return "\n".join(lines)


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, zmq_endpoint: str) -> None:
        self.proc = proc
        self.url = url
        self.zmq_endpoint = zmq_endpoint
        self.log_path: Path | None = None
        """Where the server's stdout and stderr go, when the test gave it a file."""

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until ``/ready`` answers 200 (again); fails at once if the orchestrator
        exited (it must survive worker faults)."""
        return wait_ready(self.url, self.proc.poll, timeout_s, interval_s=0.25)

    @property
    def instance(self) -> str:
        return f"orpheus-{self.proc.pid}"

    def segments_left(self) -> list[str]:
        return [n for n in os.listdir(SHM_DIR) if n.startswith(self.instance)]

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            return r.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for line in self.metrics().splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            m = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)", line)
            if not m or m.group(1) != name:
                continue
            text = m.group(2) or ""
            if all(f'{k}="{v}"' in text for k, v in labels.items()):
                total += float(m.group(3))
        return total


def instance_pids(instance: str, sessions: set[int] | None = None) -> list[int]:
    """Live processes of an instance ``orpheus-<orchestrator pid>``
    (``orchestrator.proctree.instance_processes``; ``sessions``: its workers' sessions, noted
    while the orchestrator lived, to look after it died)."""
    return proctree.instance_processes(int(instance.rsplit("-", 1)[1]), sessions)


def child_pid(orchestrator_pid: int, role: str) -> int:
    """The pid of the orchestrator's child running `role` (llm, codec, gateway)."""
    out = subprocess.run(
        # Children retitle themselves "orpheus-serve <role>" (setproctitle) once started.
        ["pgrep", "-P", str(orchestrator_pid), "-f", f"(orchestrator\\.child |orpheus-serve ){role}"],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 1, f"expected one {role} child, found {pids}"
    return pids[0]


def rss_bytes(pids: list[int]) -> int:
    """Sum of the resident set sizes (VmRSS) of the processes."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def describe_pids(pids: list[int]) -> str:
    """What each process is, for a failure's message: its title (the workers and vLLM's
    processes retitle themselves), state, parent, session and what it waits in (wchan)."""

    def read(pid: int, name: str) -> str:
        try:
            with open(f"/proc/{pid}/{name}", "rb") as f:
                return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            return "?"

    lines = []
    for pid in pids:
        p = proctree.read_proc(pid)
        where = f"ppid {p.ppid} sid {p.sid} state {p.state}" if p else "gone"
        lines.append(
            f"{pid} [{read(pid, 'comm')}] {read(pid, 'cmdline')[:160]!r} {where} "
            f"wchan {read(pid, 'wchan')}"
        )
    return "; ".join(lines)


def wait_no_instance_pids(
    instance: str, timeout_s: float, sessions: set[int] | None = None
) -> list[int]:
    """Wait until no process of the instance is alive; returns those left at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (left := instance_pids(instance, sessions)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def present(files: dict[str, int]) -> set[str]:
    """Those of the files still in /dev/shm under their name and inode."""
    out = set()
    for name, inode in files.items():
        try:
            if os.stat(os.path.join(SHM_DIR, name)).st_ino == inode:
                out.add(name)
        except FileNotFoundError:
            pass
    return out


def wait_segments_gone(names: set[str], timeout_s: float) -> set[str]:
    """Wait until none of these /dev/shm segments exists; returns those left at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {n for n in names if os.path.exists(os.path.join(SHM_DIR, n))}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def make_tiny_model(out: Path) -> Path:
    subprocess.run([EXE, "tiny-model", str(out)], check=True)
    return out


def start_server(
    model: Path,
    *extra: str,
    zmq: bool = False,
    codec_model: bool = True,
    log: IO[bytes] | None = None,
    admission: str = "fixed",
    worker_process: bool = False,
) -> Server:
    """Start the server on free loopback ports and wait until ``/ready``.

    ``codec_model=False`` leaves out ``--codec-model`` (the server finds ``model/snac``);
    ``log``: where the server's stdout and stderr go (a file; default: inherited);
    ``admission``: ``gateway.admission``. These tests start several streams at once on a
    two-core CPU that holds about two in real time, and check what happens to each of them
    (placement, faults, cleanup), so they admit by a fixed count unless asked; learned
    admission against the real engine is tested in tests/bench/overload/test_overload_bench.py.
    ``worker_process``: vLLM's model worker in a process of its own, vLLM's CPU default, which
    the server changes (``llm_worker.engine.env.worker_in_engine_core``) and an operator's
    ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` restores: for the tests of what that process leaves
    behind (its ``psm_*`` queues, as tensor parallelism has on a GPU)."""
    port = free_port()
    zmq_endpoint = f"tcp://127.0.0.1:{free_port()}" if zmq else ""
    codec = str(model / "snac") if codec_model else None
    zmq_set = ["--set", f"gateway.zmq_endpoint={zmq_endpoint}"] if zmq else []
    admission_set = ["--set", f"gateway.admission={admission}"]
    admission_set += _own_state_dirs(extra)
    cmd = orpheus_serve_argv(str(model), codec, "cpu", port, [*admission_set, *extra, *zmq_set])
    note_engine_start("server")
    # Without the test run's VLLM_RPC_BASE_PATH (tests/conftest.py): the server puts vLLM's
    # ipc sockets where it does in production, in the instance's socket directory.
    env = {k: v for k, v in os.environ.items() if k not in (RPC_DIR_ENV, MULTIPROCESSING_ENV)}
    if worker_process:
        env[MULTIPROCESSING_ENV] = "1"
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, env=env)
    srv = Server(proc, f"http://127.0.0.1:{port}", zmq_endpoint)
    try:
        srv.wait_ready(START_TIMEOUT_S)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return srv


def _own_state_dirs(extra: tuple[str, ...]) -> list[str]:
    """``--set cache.dir=`` and ``jobs.dir=`` new directories in the run's own temporary
    directory (removed at the run's end, tests/conftest.py), unless the test's configuration
    names them or a state directory. The sentence audio cache is on by default, and in the
    user's state directory its entries and sightings would outlive the test and answer
    another's repeats (the tiny model is one per run, so its identity, part of every key, is
    the same all run); a job's files would stay there too (test_e2e_watermark's did)."""
    config = extra[extra.index("--config") + 1] if "--config" in extra else None
    sets = [extra[i + 1] for i, a in enumerate(extra[:-1]) if a == "--set"]
    flags = set_overrides(sets)
    if is_set(config, flags, "voices", "state_dir"):
        return []
    out = []
    if not is_set(config, flags, "cache", "dir"):
        out += ["--set", f"cache.dir={tempfile.mkdtemp(prefix='audio-cache-')}"]
    if not is_set(config, flags, "jobs", "dir"):  # a job's files, as the cache's entries
        out += ["--set", f"jobs.dir={tempfile.mkdtemp(prefix='jobs-')}"]
    return out


def stop_server(srv: Server) -> int:
    """SIGTERM (a drain); returns the exit code. The caller checks it and the segments."""
    if srv.proc.poll() is None:
        srv.proc.send_signal(signal.SIGTERM)
    return srv.proc.wait(120)
