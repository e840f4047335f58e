"""common.heap.settle: the start-up heap leaves the collector, the older generations
are collected rarely, cycles made after it are still freed, and a full collection runs on
the clock (the old generation's garbage does not wait for hours)."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import gc, weakref
from common.heap import OLDER_GENERATION_EVERY, settle

before = gc.get_freeze_count()
frozen = settle()
assert frozen > before and frozen == gc.get_freeze_count(), (before, frozen)
assert gc.get_threshold()[1:] == (OLDER_GENERATION_EVERY, OLDER_GENERATION_EVERY)
assert gc.isenabled()

class Node:
    pass

a, b = Node(), Node()
a.peer, b.peer = b, a  # a cycle made after start-up
ref = weakref.ref(a)
del a, b
gc.collect()
assert ref() is None, "a cycle made after settle() is still collected"
print("ok")
"""


def test_settle_freezes_start_up_heap_and_still_collects_new_cycles() -> None:
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


SWEEP = """
import gc, time, weakref
from common.heap import settle, sweeps

settle(full_min_s=0.1, full_max_s=0.4)
settle(full_min_s=0.1)  # a second call starts no second thread
gc.disable()  # only the clock's collections run from here

class Node:
    pass

a, b = Node(), Node()
a.peer, b.peer = b, a
ref = weakref.ref(a)
del a, b
deadline = time.monotonic() + 10
while ref() is not None and time.monotonic() < deadline:
    time.sleep(0.02)
assert ref() is None, "the cycle was not collected on the clock"
s = sweeps()
assert s.count >= 1 and s.collected >= 2 and 0 < s.max_s < 1, s
import threading
assert sum(t.name == "orpheus-gc-sweep" for t in threading.enumerate()) == 1
print("ok")
"""


def test_settle_collects_everything_on_a_clock() -> None:
    out = subprocess.run([sys.executable, "-c", SWEEP], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_the_clock_backs_off_while_sweeps_find_nothing() -> None:
    from common.heap import next_period

    period, seen = 60.0, []
    for found in [0, 0, 0, 0, 0, 0, 12, 0]:
        period = next_period(period, found, 60.0, 960.0)
        seen.append(period)
    assert seen == [120, 240, 480, 960, 960, 960, 60, 120]


RARELY = """
import gc
from common.heap import OLDER_GENERATION_EVERY, collect_older_rarely

gen0 = gc.get_threshold()[0]
collect_older_rarely()
assert gc.get_threshold() == (gen0, OLDER_GENERATION_EVERY, OLDER_GENERATION_EVERY)
assert gc.get_freeze_count() == 0 and gc.isenabled()  # nothing frozen yet: start-up goes on
print("ok")
"""


def test_start_up_collects_the_older_generations_as_rarely_as_a_settled_process() -> None:
    out = subprocess.run([sys.executable, "-c", RARELY], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
