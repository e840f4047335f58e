"""Permanent start-up failures end `orpheus-serve serve` at once with exit 78 and one line
naming the cause and the fix, instead of a restart loop (issue 12)."""

from __future__ import annotations

import errno
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
from e2e_harness import EXE, instance_pids, wait_no_instance_pids

from codec_worker.snac_model import load_snac
from common.config import ServeConfig
from orchestrator import proctree
from orchestrator.failures import EXIT_PERMANENT, PermanentError, classify, preflight
from orchestrator.settings import is_set, load_config
from orpheus_serve.cli import _with_codec_from_model_dir
from shm.ring import SHM_DIR
from testkit.local_server import free_port

pytestmark = pytest.mark.timeout(300)


def _cfg(model: Path, **over: object) -> ServeConfig:
    flags: dict[str, object] = {
        "device": "cpu",
        "llm": {"model": str(model)},
        "codec": {"model": str(model / "snac")},
        "gateway": {"port": free_port()},
    }
    flags.update(over)
    return load_config(None, flags, {})


# -- classification of real exceptions ------------------------------------------------------
def test_codec_missing_and_unreadable_checkpoints_are_permanent(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    with pytest.raises(FileNotFoundError) as missing:
        load_snac(str(tmp_path / "nowhere"))
    f = classify("codec", missing.value, cfg)
    assert f is not None and "not found" in f.cause and "--codec-model DIR" in f.fix

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    (bad / "pytorch_model.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(Exception) as unreadable:
        load_snac(str(bad))
    f = classify("codec", unreadable.value, cfg)
    assert f is not None and "unreadable" in f.cause and "--codec-model" in f.fix


def test_any_damaged_codec_checkpoint_is_permanent(tmp_path: Path) -> None:
    """Random bytes make torch's unpickler fail in many ways (UnpicklingError, EOFError, a
    KeyError of its memo...): each is one permanent failure, never a restart loop (the e2e
    test below once drew a KeyError)."""
    cfg = _cfg(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    rng = random.Random(5)
    for _ in range(40):
        (bad / "pytorch_model.bin").write_bytes(rng.randbytes(4096))
        with pytest.raises(Exception) as damaged:
            load_snac(str(bad))
        f = classify("codec", damaged.value, cfg)
        assert f is not None and "unreadable" in f.cause, repr(damaged.value)


def test_gateway_port_in_use_is_permanent_and_named(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    exc = OSError(errno.EADDRINUSE, "Address already in use")
    f = classify("gateway", exc, cfg)
    assert f is not None and f"port {cfg.gateway.port}" in f.cause and "--port" in f.fix


def test_llm_failures_oom_config_and_unknown(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    oom = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
    f = classify("llm", oom, cfg)
    assert f is not None and "memory" in f.cause and "gpu_memory_utilization" in f.fix
    try:
        try:
            raise ValueError("max_model_len 100000 is larger than the model's 2048")
        except ValueError as inner:
            raise RuntimeError("engine args") from inner
    except RuntimeError as chained:
        f = classify("llm", chained, cfg)
    assert f is not None and "max_model_len" in f.cause
    assert classify("llm", RuntimeError("EngineCore died unexpectedly"), cfg) is None
    assert classify("codec", KeyError("x"), cfg) is None
    f = classify("gateway", PermanentError("it cannot", "do this"), cfg)
    assert f is not None and f.line() == "it cannot; fix: do this"


# -- preflight --------------------------------------------------------------------------------
def test_preflight_passes_on_the_tiny_model(tiny_model: Path) -> None:
    assert preflight(_cfg(tiny_model), probe_hub=False) is None


def test_preflight_finds_missing_paths_and_a_port_in_use(tiny_model: Path, tmp_path: Path) -> None:
    cfg = _cfg(tiny_model, codec={"model": str(tmp_path / "nosnac")})
    f = preflight(cfg, probe_hub=False)
    assert f is not None and "does not exist" in f.cause and "--codec-model DIR" in f.fix
    cfg = _cfg(tmp_path / "nomodel", codec={"model": str(tiny_model / "snac")})
    f = preflight(cfg, probe_hub=False)
    assert f is not None and "model directory" in f.cause and "--model DIR" in f.fix
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    f = preflight(_cfg(tiny_model, codec={"model": str(tmp_path / "half")}), probe_hub=False)
    assert f is not None and "has no pytorch_model.bin" in f.cause
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        cfg = _cfg(tiny_model, gateway={"port": port})
        f = preflight(cfg, probe_hub=False)
    assert f is not None and f.cause == f"port {port} on 127.0.0.1 is in use"


def test_preflight_hub_name_not_cached_and_offline(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    cfg = _cfg(tiny_model, codec={"model": "hubertsiuzdak/snac_24khz"})
    f = preflight(cfg)
    assert f is not None and "not in the local hub cache" in f.cause
    assert "--codec-model DIR" in f.fix


# -- codec from --model DIR/snac -------------------------------------------------------------
def test_codec_defaults_to_the_snac_next_to_the_model(
    tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    base = load_config(None, {"device": "cpu", "llm": {"model": str(tiny_model)}}, {})
    assert not is_set(None, {"llm": {"model": "x"}}, "codec", "model", {})
    with caplog.at_level("INFO"):
        cfg = _with_codec_from_model_dir(base, explicit=False)
    assert cfg.codec.model == str(tiny_model / "snac")
    assert f"codec: SNAC from {tiny_model / 'snac'}" in caplog.text
    # Explicit in any layer wins: flag, environment, TOML.
    assert is_set(None, {"codec": {"model": "x"}}, "codec", "model", {})
    assert is_set(None, {}, "codec", "model", {"ORPHEUS_CODEC__MODEL": "x"})
    toml = tmp_path / "c.toml"
    toml.write_text('[codec]\nmodel = "elsewhere"\n')
    assert is_set(str(toml), {}, "codec", "model", {})
    kept = _with_codec_from_model_dir(base, explicit=True)
    assert kept.codec.model == base.codec.model
    plain = msgspec.structs.replace(
        base, llm=msgspec.structs.replace(base.llm, model=str(tmp_path))
    )
    assert _with_codec_from_model_dir(plain, explicit=False).codec.model == base.codec.model


# -- the real command --------------------------------------------------------------------------
def _serve(model: Path, *extra: str, timeout_s: float) -> tuple[int, str, float, int, set[int]]:
    """Run `orpheus-serve serve`; (exit code, stderr, seconds, orchestrator pid, the sessions
    of the workers it started: every process they started stays in them)."""
    cmd = [EXE, "serve", "--model", str(model), "--device", "cpu", "--port", str(free_port())]
    sessions: set[int] = set()
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([*cmd, *extra], stderr=err)
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"serve did not exit within {timeout_s:.0f}s")
                sessions |= proctree.worker_sessions(proc.pid)
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        text = err.read().decode(errors="replace")
    return proc.returncode, text, time.monotonic() - t0, proc.pid, sessions


def test_serve_without_a_codec_exits_78_at_once_with_one_line(
    tiny_model: Path, tmp_path: Path
) -> None:
    code, err, took, _, _ = _serve(
        tiny_model, "--codec-model", str(tmp_path / "missing"), timeout_s=60
    )
    last = err.strip().splitlines()[-1]
    assert code == EXIT_PERMANENT, err
    assert last.startswith("orpheus-serve: SNAC codec directory") and "--codec-model DIR" in last
    assert "Traceback" not in err
    print(f"\nmissing codec: exit {code} after {took:.1f}s: {last}")


def test_serve_with_a_port_in_use_exits_78(tiny_model: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        cmd = [EXE, "serve", "--model", str(tiny_model), "--device", "cpu", "--port", str(port)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_PERMANENT, r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"orpheus-serve: port {port} on 127.0.0.1 is in use; fix: pass --port N, "
        "or stop the process listening there"
    )


def test_unreadable_codec_found_by_the_worker_stops_everything(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Past the preflight (the files exist): the codec worker classifies the failure, reports
    it, and the orchestrator stops the llm worker mid start-up and exits 78, nothing left."""
    bad = tmp_path / "badsnac"
    bad.mkdir()
    (bad / "config.json").write_text((tiny_model / "snac" / "config.json").read_text())
    (bad / "pytorch_model.bin").write_bytes(os.urandom(4096))
    shm_before = set(os.listdir(SHM_DIR))
    code, err, took, pid, sessions = _serve(tiny_model, "--codec-model", str(bad), timeout_s=240)
    last = err.strip().splitlines()[-1]
    assert code == EXIT_PERMANENT, err[-3000:]
    assert last.startswith(f"orpheus-serve: SNAC checkpoint {str(bad)!r} is unreadable")
    assert "--codec-model DIR" in last
    assert err.count("restarting in") == 0, "no restart loop"
    assert len(sessions) >= 2, "the codec and llm workers had started"
    assert wait_no_instance_pids(f"orpheus-{pid}", 10, sessions) == []
    left = [n for n in set(os.listdir(SHM_DIR)) - shm_before if n.startswith(f"orpheus-{pid}")]
    assert left == []
    print(f"\nunreadable codec: exit {code} after {took:.1f}s: {last}")
    assert instance_pids(f"orpheus-{pid}", sessions) == []


def test_a_full_disk_under_the_log_keeps_the_exit_code(tiny_model: Path, tmp_path: Path) -> None:
    """stderr on a full disk (/dev/full: every write fails with ENOSPC): the failing log
    writes are dropped, the exit code is still 78, not a traceback's 1."""
    cmd = [EXE, "serve", "--model", str(tiny_model), "--device", "cpu", "--port", str(free_port())]
    with open("/dev/full", "wb") as full:
        r = subprocess.run(
            [*cmd, "--codec-model", str(tmp_path / "missing")],
            stdout=full, stderr=full, timeout=60, check=False,
        )  # fmt: skip
    assert r.returncode == EXIT_PERMANENT


def test_logging_drops_lines_on_enospc_and_reports_format_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import contextlib
    import logging

    from orchestrator.logs import QuietStreamHandler

    full = open("/dev/full", "w")
    h = QuietStreamHandler(full)
    log = logging.getLogger("test.full")
    log.addHandler(h)
    log.propagate = False
    try:
        log.warning("a line the full disk cannot take")
        assert h.dropped == 1
        log.warning("%d", "not a number")  # a bug in a log call is still reported
        assert h.dropped == 1
        assert "--- Logging error ---" in capsys.readouterr().err
    finally:
        log.removeHandler(h)
        with contextlib.suppress(OSError):
            full.close()


@pytest.mark.parametrize("protect", [True, False], ids=["protected", "unprotected"])
def test_stdio_on_a_full_disk_does_not_kill_a_worker(tmp_path: Path, protect: bool) -> None:
    """What vLLM does while it loads weights (a tqdm bar on stderr, prints), in the worker and
    in a forked child (its EngineCore), with stdout and stderr on a full disk."""
    script = tmp_path / "w.py"
    script.write_text(
        f"import os, sys\nsys.path.insert(0, {str(Path(__file__).parents[2])!r})\n"
        "from orchestrator.logs import protect_stdio\n"
        f"if {protect}: protect_stdio()\n"
        "from tqdm import tqdm\n"
        "for _ in tqdm(range(3), desc='Loading safetensors checkpoint shards'): pass\n"
        "print('to stdout'); print('to stderr', file=sys.stderr)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    print('child', file=sys.stderr); sys.stderr.flush(); os._exit(0)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "sys.exit(os.waitstatus_to_exitcode(status))\n"
    )
    with open("/dev/full", "wb") as full:
        r = subprocess.run([sys.executable, str(script)], stdout=full, stderr=full, timeout=60)
    assert (r.returncode == 0) is protect
