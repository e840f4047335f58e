"""``make demo``: start the server on CPU with the tiny model, speak one sentence over HTTP into
demo.wav, print TTFB and RTF, stop the server and check that it left nothing behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from shm.ring import SHM_DIR

TEXT = "Hello from orpheus-serve! This sentence travelled through vLLM, SNAC and shared memory."
MODEL_DIR = Path("tiny-model")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready after {timeout_s:.0f}s")


def main() -> int:
    exe = Path(sys.executable).parent / "orpheus-serve"
    if not (MODEL_DIR / "config.json").exists():
        subprocess.run([exe, "tiny-model", str(MODEL_DIR)], check=True)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        exe, "serve", "--model", str(MODEL_DIR), "--codec-model", str(MODEL_DIR / "snac"),
        "--device", "cpu", "--port", str(port),
    ]  # fmt: skip
    print("$", " ".join(map(str, cmd)), flush=True)
    t0 = time.monotonic()
    server = subprocess.Popen(cmd)
    code = 1
    try:
        _wait_ready(url, server, timeout_s=600)
        print(f"server ready after {time.monotonic() - t0:.1f}s", flush=True)
        say = [exe, "say", TEXT, "--voice", "tara", "-o", "demo.wav", "--url", url, "--seed", "7"]
        code = subprocess.run(say).returncode
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    instance = f"orpheus-{server.pid}"
    left = [n for n in os.listdir(SHM_DIR) if n.startswith(instance)]
    print(f"server stopped (exit {server.returncode}); shared-memory segments left: {len(left)}")
    print(
        "NOTE: the tiny model and SNAC have random weights, so demo.wav is noise, not speech. "
        "Serve a real checkpoint (--model canopylabs/orpheus-3b-0.1-ft --device cuda) for speech."
    )
    return code if not left else 1


if __name__ == "__main__":
    sys.exit(main())
