"""common.heap.settle: the start-up heap leaves the collector, the older generations
are collected rarely, and cycles made after it are still freed."""

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
