"""``bench overload``'s CPU per part of the server (bench/overload/cpu.py): a process tree
read from ``/proc``, each process counted under the part its title names or, untitled, its
parent's (vLLM's processes under the llm worker's)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from bench.overload.cpu import cores, process_tree_cpu_s

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")

BUSY = (
    "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    "import sys\nsys.stdin.read()\n"
)
TREE = f"""
import subprocess, sys
busy = {BUSY!r}
exe = {sys.executable!r}  # a child titled otherwise cannot find its own
llm = (
    "import subprocess, sys; p = subprocess.Popen([%r, '-c', %r]); "
    "sys.stdin.read(); p.wait()" % (exe, busy)
)
procs = [
    subprocess.Popen(["orpheus-serve codec", "-c", busy], executable=sys.executable),
    subprocess.Popen(["orpheus-serve llm", "-c", llm], executable=sys.executable),
]
sys.stdin.read()  # every process of the tree reads this pipe to its end, then leaves
for p in procs:
    p.wait()
"""


def test_a_server_tree_is_counted_by_part() -> None:
    root = subprocess.Popen(
        [sys.executable, "-c", TREE], stdin=subprocess.PIPE, start_new_session=True
    )
    try:
        before = process_tree_cpu_s(root.pid)
        t0 = time.perf_counter()
        deadline = time.monotonic() + 20
        after = before
        while time.monotonic() < deadline:
            time.sleep(0.1)
            after = process_tree_cpu_s(root.pid)
            if after.get("codec", 0) >= 0.25 and after.get("llm", 0) >= 0.25:
                break
        used = cores(before, after, time.perf_counter() - t0)
    finally:
        try:
            root.communicate(b"", timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(root.pid, signal.SIGKILL)
            root.wait(10)
    assert after.get("codec", 0) >= 0.25, after  # its own title
    assert after.get("llm", 0) >= 0.25, after  # an untitled child: its parent's part
    assert "gateway" not in after and after["bench"] > 0
    assert set(used) == set(after) and all(v >= 0 for v in used.values())


def test_no_server_reads_only_the_bench() -> None:
    assert set(process_tree_cpu_s(None)) == {"bench"}
    assert cores({"bench": 1.0}, {"bench": 2.0}, 0.0) == {}
    assert cores({}, {"gateway": 0.5}, 2.0) == {"gateway": 0.25}
