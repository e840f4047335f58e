"""vLLM's CPU processes hand their free heap memory back (issue 36): the llm worker puts
``llm.cpu_heap_trim_s`` into the environment vLLM's processes inherit, and the project's vLLM
plugin starts one trimming thread per process from it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from common.config.llm import LLMConfig
from common.host_heap import HeapBound
from llm_worker.engine.env import HEAP_TRIM_ENV, trim_vllm_heap
from llm_worker.vllm_ext import heap_trim


@pytest.fixture
def fresh_process_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(heap_trim, "_started", None)
    monkeypatch.delenv(heap_trim.ENV, raising=False)
    yield
    heap_trim.stop()


def test_the_interval_goes_into_the_environment_vllm_hands_down() -> None:
    env: dict[str, str] = {}
    note = trim_vllm_heap(LLMConfig().cpu_heap_trim_s, env)
    assert HEAP_TRIM_ENV == heap_trim.ENV and env == {heap_trim.ENV: "15.0"}
    assert note == "vLLM's processes hand free heap memory back at most every 15 s"
    assert trim_vllm_heap(0, env) is None and env[heap_trim.ENV] == "0"
    with pytest.raises(ValueError, match=r"llm\.cpu_heap_trim_s must be >= 0, not -1"):
        trim_vllm_heap(-1, {})


@pytest.mark.usefixtures("fresh_process_state")
def test_no_thread_unless_the_environment_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert heap_trim.start_from_environment() is None
    monkeypatch.setenv(heap_trim.ENV, "0")
    assert heap_trim.start_from_environment() is None


@pytest.mark.usefixtures("fresh_process_state")
def test_the_thread_hands_free_memory_back_once_started(monkeypatch: pytest.MonkeyPatch) -> None:
    if not HeapBound().active:
        pytest.skip("not glibc 2.33+")
    monkeypatch.setenv(heap_trim.ENV, "0.05")
    bound = heap_trim.start_from_environment()
    assert bound is not None and bound.keep_bytes == heap_trim.KEEP_FREE_BYTES
    assert heap_trim.start_from_environment() is bound  # one thread per process
    # Free more than the bound below a block still held (glibc trims a free top itself).
    blocks = [bytearray(1 << 16) for _ in range(2 * heap_trim.KEEP_FREE_BYTES >> 16)]
    pin = bytearray(1 << 16)
    del blocks
    deadline = time.monotonic() + 5.0
    while bound.trims == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert bound.trims >= 1
    del pin


def test_the_memory_probe_reads_rss_heap_and_malloc() -> None:
    from common.host_heap import mallinfo2
    from common.memory_probe import sample

    rec = sample(mallinfo2(), types=3)
    assert rec["rollup"]["Rss"] > 0 and rec["rollup"]["Anonymous"] > 0
    assert rec["heap_rss"] > 0 and len(rec["objects"]) == 3
    if mallinfo2() is not None:
        assert rec["malloc"]["uordblks"] > 0


def test_trim_if_free_trims_only_past_keep() -> None:
    heap = HeapBound(keep_bytes=1 << 40, every_s=15.0)
    if not heap.active:
        pytest.skip("not glibc 2.33+")
    assert not heap.trim_if_free() and heap.trims == 0
    heap.keep_bytes = 0
    assert heap.trim_if_free() and heap.trims == 1
