"""``make demo``: start the server on CPU with the tiny model, speak one sentence over HTTP into
demo.wav, print TTFB and RTF, stop the server and check that it left nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from bench.doubles.local_server import free_port, wait_ready
from shm.ring import SHM_DIR

TEXT = "Hello from orpheus-serve! This sentence travelled through vLLM, SNAC and shared memory."
MODEL_DIR = Path("tiny-model")


def main() -> int:
    exe = Path(sys.executable).parent / "orpheus-serve"
    if not (MODEL_DIR / "config.json").exists():
        subprocess.run([exe, "tiny-model", str(MODEL_DIR)], check=True)
    port = free_port()
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
        wait_ready(url, server.poll, timeout_s=600)
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
