"""A newcomer's first run is quiet (issue 13): `make demo` prints a few lines of progress and
the result while everything the server's processes print goes to a log file it names;
`orpheus-serve serve` logs one line per phase at INFO, the libraries only their warnings (checked
on the servers of tests/e2e/test_e2e_heads_and_logs.py, with tests/harness/serve_logs.py); an
error still reaches the console in one line."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_harness import EXE
from serve_logs import PHASES, VLLM_INFO, in_order, left_behind

from orchestrator.failures import EXIT_PERMANENT
from orchestrator.logs import (
    LIBRARY_LOGGERS,
    library_env,
    library_level,
    setup_logging,
)
from orpheus_serve.console import Console, last_cause

MAX_CONSOLE_LINES = 15
CAUSE = re.compile(r"^orpheus-serve: .+; fix: .+$")


# -- the demo -----------------------------------------------------------------------------------
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_demo_console_is_short_and_its_log_is_full(tmp_path: Path) -> None:
    # The sentence audio cache (on by default) of the demo's server in the test's directory,
    # not the user's state directory.
    env = {**os.environ, "ORPHEUS_CACHE__DIR": str(tmp_path / "audio-cache")}
    r = subprocess.run(
        [sys.executable, "-m", "orpheus_serve.demo"],
        cwd=tmp_path, capture_output=True, text=True, timeout=840, check=False, env=env,
    )  # fmt: skip
    console = (r.stdout + r.stderr).strip().splitlines()
    log_path = tmp_path / "demo.log"
    print("\n" + "\n".join(console))
    assert r.returncode == 0, r.stdout + r.stderr
    assert len(console) <= MAX_CONSOLE_LINES, f"{len(console)} lines"
    assert any(f"its log: {log_path}" in ln for ln in console), "the console names the log"
    result = console[-2]
    assert re.match(
        r"result: demo\.wav: \d+\.\d\d s of audio; time to first audio \d+ ms; real-time factor",
        result,
    ), result
    assert any(re.search(r"llm worker \(vLLM\) ready after \d+\.\d s", ln) for ln in console)
    assert not any(VLLM_INFO.search(ln) or "Traceback" in ln for ln in console)
    # The log has it all: every phase of the orchestrator, every worker, vLLM's engine core and
    # its model worker (which runs in it: llm_worker.engine.env) at their own INFO level, the
    # weight-loading bar.
    log = log_path.read_text(errors="replace")
    assert in_order(log, ("$ ", "tiny-model", "$ ", " serve ", *PHASES)) == []
    for role in ("codec", "llm", "gateway-0"):
        assert f" [{role}:" in log, role
    assert re.search(r" INFO \[llm:\d+/EngineCore\S*\] vllm\.", log), "the engine core's lines"
    worker = r" INFO \[llm:\d+/EngineCore\S*\] vllm\.v1\.worker\.\S+: Starting to load model"
    assert re.search(worker, log), "vLLM's model worker's lines"
    assert "Loading safetensors checkpoint shards" in log
    assert len(log.splitlines()) > 5 * len(console)
    assert (tmp_path / "demo.wav").stat().st_size > 44
    assert left_behind(log) == ([], [])


def test_a_demo_failure_shows_the_log_tail_and_the_cause_in_one_line(tmp_path: Path) -> None:
    """A broken tiny model (config.json but no SNAC: an interrupted first run): the server
    exits 78 before it is ready; the console shows the log's last lines, then the cause."""
    (tmp_path / "tiny-model").mkdir()
    (tmp_path / "tiny-model" / "config.json").write_text("{}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # no hub probe: the cause comes at once
    r = subprocess.run(
        [sys.executable, "-m", "orpheus_serve.demo"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False, env=env,
    )  # fmt: skip
    console = (r.stdout + r.stderr).strip().splitlines()
    print("\n" + "\n".join(console))
    log_path = tmp_path / "demo.log"
    assert r.returncode == EXIT_PERMANENT, r.stdout + r.stderr
    assert len(console) <= 6 + 15
    assert CAUSE.match(console[-1]) and "tiny-model/snac" in console[-1], console[-1]
    assert console.count(console[-1]) == 1, "the cause once, last"
    assert any(ln.startswith("FAILED: the server exited with 78") for ln in console)
    assert any(str(log_path) in ln for ln in console[:-1]), "the log is named"
    assert "Traceback" not in r.stdout + r.stderr
    assert console[-1] in log_path.read_text(), "the log has the cause too"


# -- orpheus-serve serve -------------------------------------------------------------------------
def test_serve_with_a_missing_model_says_why_in_one_line(tmp_path: Path) -> None:
    missing, snac = tmp_path / "no-model", tmp_path / "snac"
    snac.mkdir()
    for name in ("config.json", "pytorch_model.bin"):  # enough for the preflight's check
        (snac / name).write_text("{}")
    r = subprocess.run(
        [EXE, "serve", "--model", str(missing), "--codec-model", str(snac), "--device", "cpu"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    err = r.stderr.strip().splitlines()
    assert r.returncode == EXIT_PERMANENT, r.stderr
    assert CAUSE.match(err[-1]) and f"model directory {str(missing)!r} does not exist" in err[-1]
    assert len(err) <= 4 and r.stdout == "", r.stdout + r.stderr
    assert "Traceback" not in r.stderr


# -- the pieces ----------------------------------------------------------------------------------
@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    libs = {n: logging.getLogger(n).level for n in LIBRARY_LOGGERS}
    # The workers run vLLM with VLLM_CONFIGURE_LOGGING=0 (library_env): its logger has no
    # handler of its own and propagates. This test process may not: a test that built vLLM's
    # engine arguments here (arg_utils' configure_logging_if_needed) gave it vLLM's handler.
    vllm = logging.getLogger("vllm")
    vllm_handlers, vllm_propagate = vllm.handlers[:], vllm.propagate
    vllm.handlers[:], vllm.propagate = [], True
    with warnings.catch_warnings():
        yield
    vllm.handlers[:], vllm.propagate = vllm_handlers, vllm_propagate
    logging.captureWarnings(False)
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, lib_level in libs.items():
        logging.getLogger(name).setLevel(lib_level)


@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_library_chatter_is_below_info_unless_debug(
    level: str, restore_logging: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    setup_logging("text", level)
    logging.getLogger("vllm.engine").info("library chatter")
    logging.getLogger("httpx").info("HTTP Request: GET")
    logging.getLogger("vllm.engine").warning("a library warning")
    logging.getLogger("orchestrator.supervisor").info("a phase")
    warnings.warn_explicit("old api", FutureWarning, "vllm/x.py", 1, module="vllm.x")
    warnings.warn_explicit("careful", UserWarning, "vllm/x.py", 2, module="vllm.x")
    text = out.getvalue()
    assert "a library warning" in text and "a phase" in text
    assert "careful" in text, "a library's UserWarning is a warning: it is shown"
    assert ("library chatter" in text) is (level == "DEBUG")
    assert ("HTTP Request" in text) is (level == "DEBUG")
    assert ("old api" in text) is (level == "DEBUG"), "deprecations only at DEBUG"
    assert library_level(level) == (logging.INFO if level == "DEBUG" else logging.WARNING)
    assert library_level("ERROR") == logging.ERROR


def test_vllms_own_level_switch_is_its_loggers_level(
    restore_logging: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM installs no handler of its own (VLLM_CONFIGURE_LOGGING=0): VLLM_LOGGING_LEVEL,
    the operator's or ``library_env``'s, is the level of the ``vllm`` logger."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    setup_logging("json", "INFO")
    logging.getLogger("vllm.engine").info("library chatter")
    logging.getLogger("vllm.engine").debug("library detail")
    logging.getLogger("torch").info("torch chatter")
    lines = [json.loads(ln) for ln in out.getvalue().splitlines()]
    assert [(r["logger"], r["msg"]) for r in lines] == [("vllm.engine", "library chatter")]


def test_library_env_sets_their_own_switches_and_keeps_the_operators() -> None:
    assert library_env("INFO", {}) == {
        "VLLM_LOGGING_LEVEL": "WARNING",
        "VLLM_CONFIGURE_LOGGING": "0",
        "TQDM_DISABLE": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    assert library_env("DEBUG", {}) == {"VLLM_LOGGING_LEVEL": "INFO", "VLLM_CONFIGURE_LOGGING": "0"}
    assert library_env("warning", {"VLLM_LOGGING_LEVEL": "DEBUG", "TQDM_DISABLE": "0"}) == {
        "VLLM_CONFIGURE_LOGGING": "0",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }
    # An operator's vLLM logging config file needs vLLM's own configuration: left on.
    assert "VLLM_CONFIGURE_LOGGING" not in library_env("INFO", {"VLLM_LOGGING_CONFIG_PATH": "x"})


@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_nanobind_teardown_report_is_silenced_below_debug(tmp_path: Path, level: str) -> None:
    """What triton's nanobind bindings print at interpreter teardown (after every atexit
    handler); a warning logged before the exit still shows."""
    script = tmp_path / "w.py"
    script.write_text(
        f"import atexit, logging, os, sys\nsys.path.insert(0, {str(Path(__file__).parents[2])!r})\n"
        "from orchestrator.logs import quiet_teardown, setup_logging\n"
        "atexit.register(lambda: os.write(2, b'nanobind: leaked 4 instances!\\n'))\n"
        f"setup_logging('text', {level!r})\nquiet_teardown({level!r})\n"
        "sys.modules['triton._C.libtriton'] = sys\n"
        "logging.getLogger('x').warning('a warning before the exit')\n"
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "a warning before the exit" in r.stderr
    assert ("nanobind" in r.stderr) is (level == "DEBUG")


def test_quiet_teardown_needs_a_nanobind_module(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text(
        f"import atexit, os, sys\nsys.path.insert(0, {str(Path(__file__).parents[2])!r})\n"
        "from orchestrator.logs import quiet_teardown\n"
        "atexit.register(lambda: os.write(2, b'said at exit\\n'))\nquiet_teardown('INFO')\n"
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert "said at exit" in r.stderr


def test_console_follows_the_phases_and_fails_with_the_servers_cause(tmp_path: Path) -> None:
    out = io.StringIO()
    con = Console(tmp_path / "run.log", out)
    con.begin("title")
    cause = "orpheus-serve: SNAC codec directory 'x' does not exist; fix: pass --codec-model DIR"
    with open(con.log_path, "a") as f:
        f.write(
            "t INFO [orchestrator:1] orchestrator.supervisor: codec ready (pid 2, 6.2s): SNAC\n"
            "t ERROR [orchestrator:1] orchestrator.supervisor: llm exited with 1; "
            "restarting in 0.5s\n(EngineCore pid=3) INFO chatter\nt INFO [orchestrator:1] "
            "orchestrator.supervisor: llm ready (pid 4, 80.9s): dev"
        )
    con._follow()
    with open(con.log_path, "a") as f:
        f.write(f"ice cpu\n{cause}\n")
    con._follow()
    assert out.getvalue().splitlines() == [
        "title",
        "  codec worker (SNAC) ready after 6.2 s",
        "  llm exited with 1; restarting in 0.5s (the log says why)",
        "  llm worker (vLLM) ready after 80.9 s",
    ]
    assert last_cause(con.log_lines()) == cause
    out.truncate(0)
    out.seek(0)
    assert con.fail("the server exited with 78 before it was ready", 78) == 78
    shown = out.getvalue().splitlines()
    assert shown[0] == (
        f"FAILED: the server exited with 78 before it was ready. The last lines of {con.log_path}:"
    )
    assert shown[-1] == cause and shown.count(cause) == 1
    assert "  | (EngineCore pid=3) INFO chatter" in shown

    empty = Console(tmp_path / "other.log", out)
    empty.begin("again")
    out.truncate(0)
    out.seek(0)
    assert empty.fail("writing the tiny model failed (exit 1)") == 1
    assert out.getvalue().splitlines()[-1] == (
        "orpheus-serve: writing the tiny model failed (exit 1)"
    )
