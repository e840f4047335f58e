"""What `orpheus-serve serve`'s log must say, in either format (``log_format``): one line per
phase at INFO, the libraries only their warnings (text); one JSON object per line, vLLM's
included (json). The checks read a whole log of one start and one stop: the demo's
(tests/e2e/test_demo_console.py) and the two servers of tests/e2e/test_e2e_heads_and_logs.py."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from e2e_harness import Server, stop_server

from orchestrator import proctree
from shm.ring import SHM_DIR

VLLM_INFO = re.compile(
    r"(\((MainProcess|EngineCore\S*|Worker\S*) pid=\d+\) INFO| INFO \[llm:\d+(/\S+)?\] vllm\.)"
)
VLLM_WARNING = re.compile(r"(\(\S+ pid=\d+\) WARNING|WARNING \[llm:\d+(/\S+)?\] vllm\.)")
PHASES = (
    "orchestrator: config loaded (",
    "orchestrator.supervisor: shared memory: 2 segments created in",
    "orchestrator.supervisor: started codec (pid",
    "orchestrator.supervisor: started llm (pid",
    "orchestrator.supervisor: codec ready (pid",
    "orchestrator.supervisor: llm ready (pid",
    "orchestrator.supervisor: started gateway-0 (pid",
    "orchestrator.supervisor: ready in ",
    "orchestrator.supervisor: received SIGTERM: draining and stopping",
    "orchestrator.supervisor: stopped; instance orpheus-",
)
MAX_LINES = 60
"""A start and a stop at INFO, beside the one line of each stream."""
STREAM_LINE = re.compile(r" orpheus\.streams: stream 0x[0-9a-f]+ ok: ")
SUPERVISOR_READY = re.compile(r"ready in [\d.]+s: http://")
NOT_PYTHON_LOGGING = re.compile(
    r"^(\[W\d{4} "  # torch's C++ warnings (TORCH_WARN), printed by its C++ runtime
    r"|\S+/multiprocessing/resource_tracker\.py:\d+: UserWarning"  # the tracker process's
    r"|\s+warnings\.warn\()"  # ... warning at exit, and its source line
)


def in_order(text: str, needles: tuple[str, ...]) -> list[str]:
    """The needles not found in ``text`` in this order."""
    missing, at = [], 0
    for n in needles:
        i = text.find(n, at)
        if i < 0:
            missing.append(n)
        else:
            at = i + len(n)
    return missing


def stop_after_ready_line(srv: Server, log_path: Path) -> int:
    """Stop the server once its log has the supervisor's "ready in" line (the gateway answers
    /ready a moment before the supervisor hears of it, and a stop signal ends the pass it
    lands in): the phases then read one start, then one stop. Returns the exit code."""
    deadline = time.monotonic() + 30  # past it, stop anyway: the phase check says what is missing
    # the llm worker's own start-up line also ends "ready in 3.1s": wait for the supervisor's
    while not SUPERVISOR_READY.search(log_path.read_text(errors="replace")):
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return stop_server(srv)


def left_behind(log: str) -> tuple[list[int], list[str]]:
    """Processes and segments left by the server whose log this is (its orchestrator pid and
    the sessions its workers led are in the log)."""
    orch = int(re.search(r"instance orpheus-(\d+)", log).group(1))  # type: ignore[union-attr]
    workers = {int(p) for p in re.findall(r"started \S+ \(pid (\d+)\)", log)}
    pids = proctree.instance_processes(orch, workers)
    segs = [n for n in os.listdir(SHM_DIR) if n.startswith(f"orpheus-{orch}-")]
    return pids, segs


def check_text_log(text: str, streams: int) -> None:
    """A text log at INFO of a server that served ``streams`` streams: every phase in order,
    one line per stream, vLLM's warnings but none of the libraries' INFO lines or progress
    bars, a short log, and nothing of the server left after it: nor left by a worker on its
    clean stop for the orchestrator to kill (its warning)."""
    lines = text.splitlines()
    assert sum(1 for ln in lines if STREAM_LINE.search(ln)) == streams
    assert in_order(text, PHASES) == []
    assert "log level INFO (libraries WARNING)" in text
    noise = [
        ln for ln in lines
        if VLLM_INFO.search(ln) or "Loading safetensors" in ln or "nanobind" in ln
        or "FutureWarning" in ln or (" INFO [llm:" in ln and " vllm." in ln)
    ]  # fmt: skip
    assert noise == []
    assert any(VLLM_WARNING.search(ln) for ln in lines), "vLLM's warnings still reach the log"
    assert len(lines) - streams <= MAX_LINES, text
    assert left_behind(text) == ([], [])
    assert [ln for ln in lines if "left processes" in ln or "did not stop in time" in ln] == []


def check_json_log(text: str) -> None:
    """A JSON log: every line Python logging writes is one JSON object, vLLM's included (in
    the engine's own processes too), for a log shipper to parse; every phase in order."""
    records, other = [], []
    for ln in text.splitlines():
        try:
            records.append(json.loads(ln))
        except ValueError:
            other.append(ln)
    assert [ln for ln in other if not NOT_PYTHON_LOGGING.match(ln)] == []
    assert {"ts", "level", "proc", "pid", "logger", "msg"} <= set(records[0])
    vllm = [r for r in records if r["logger"].split(".")[0] == "vllm"]
    assert vllm, "vLLM's warnings are in the log, as JSON"
    assert all(r["proc"] == "llm" and r["level"] != "INFO" for r in vllm)
    assert in_order("\n".join(f"{r['logger']}: {r['msg']}" for r in records), PHASES) == []
