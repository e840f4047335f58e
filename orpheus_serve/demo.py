"""``make demo``: start the server on CPU with the tiny model, speak one sentence over HTTP into
demo.wav, print TTFB and RTF, stop the server and check that it left nothing behind.

The console gets a few lines of progress and the result; everything the server's processes
print (vLLM's engine core and workers included, at the libraries' own INFO level) goes to
demo.log, whose path is printed (orpheus_serve.console)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from orpheus_serve.console import Console, NotReady, stop
from orpheus_serve.say import synthesize, write_wav
from shm.ring import SHM_DIR
from testkit.local_server import free_port

TEXT = "Hello from orpheus-serve! This sentence travelled through vLLM, SNAC and shared memory."
MODEL_DIR = Path("tiny-model")
OUTPUT = "demo.wav"
LOG = Path("demo.log")
READY_TIMEOUT_S = 600.0


def main() -> int:
    exe = Path(sys.executable).parent / "orpheus-serve"
    con = Console(LOG)
    con.begin("orpheus-serve demo: a tiny random-weight model speaks one sentence, on CPU")
    if not (MODEL_DIR / "config.json").exists():
        con.step(f"writing the tiny model (random weights) to {MODEL_DIR}/")
        if (written := con.run([exe, "tiny-model", str(MODEL_DIR)])) != 0:
            return con.fail(f"writing the tiny model failed (exit {written})")
    else:
        con.step(f"using the tiny model in {MODEL_DIR}/ (written by an earlier run)")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        exe, "serve", "--model", str(MODEL_DIR), "--codec-model", str(MODEL_DIR / "snac"),
        "--device", "cpu", "--port", str(port),
        "--set", "log_level=DEBUG",  # the log gets vLLM's own INFO lines and progress bars
    ]  # fmt: skip
    con.step(f"starting the server at {url}; its log: {con.log_path}")
    con.step("(vLLM takes one to three minutes to start on a CPU)")
    t0 = time.monotonic()
    server = con.start(cmd)
    failure: str | None = None
    speech = None
    try:
        con.wait_ready(url, server, timeout_s=READY_TIMEOUT_S)
        con.step(f"server ready after {time.monotonic() - t0:.1f} s")
        con.step(f'speaking "{TEXT}"')
        args = argparse.Namespace(
            text=TEXT, voice="tara", url=url, zmq=None, api_key=None, max_tokens=None, seed=7
        )
        speech = synthesize(args)
        write_wav(OUTPUT, speech.pcm)
    except NotReady as exc:
        failure = str(exc)
    except KeyboardInterrupt:
        failure = "interrupted"
    except Exception as exc:  # the request failed: said in one line, the log has the rest
        failure = f"speaking failed: {exc}"
    finally:
        code = stop(server, signal.SIGTERM)
    if failure is not None:
        # A server that exited by itself keeps its code (78: a permanent failure).
        exit_code = 130 if failure == "interrupted" else code if code > 0 else 1
        return con.fail(failure, exit_code)
    instance = f"orpheus-{server.pid}"
    left = [n for n in os.listdir(SHM_DIR) if n.startswith(instance)]
    if code != 0 or left:
        return con.fail(f"the server stopped with exit {code}, shared-memory segments left: {left}")
    con.step("server stopped: exit 0, no shared-memory segment left")
    assert speech is not None
    ttfb = f"{speech.ttfb_s * 1000:.0f} ms" if speech.ttfb_s is not None else "n/a"
    con.line(
        f"result: {OUTPUT}: {speech.audio_s:.2f} s of audio; time to first audio {ttfb}; "
        f"real-time factor {speech.rtf:.2f} (time to generate over audio time; CPU, tiny model)"
    )
    con.line(
        "NOTE: the tiny model and SNAC have random weights, so demo.wav is noise, not speech. "
        "Serve a real checkpoint (--model canopylabs/orpheus-3b-0.1-ft --device cuda) for speech."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
