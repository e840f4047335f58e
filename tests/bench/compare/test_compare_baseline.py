"""The baseline: the reference streaming decoder's schedule and layout, its token filter,
and a small real run of the load generator against the baseline server (vLLM on CPU,
tiny model, narrow random SNAC)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench.compare.baseline.constraint import UNCONSTRAINED, blocked_table
from bench.compare.baseline.decoder import ReferenceStreamDecoder, window_to_levels
from bench.load.servers import ServerProcess, baseline_argv
from codec_worker.levels import frames_to_levels
from codec_worker.snac_model import CONFIG_FILE, SNAC_24KHZ_SMALL, WEIGHTS_FILE
from llm_worker.vllm_ext import tokens as T
from shm.records import CODEBOOK_SIZE
from testkit.local_server import free_port
from testkit.tiny_model import random_snac

CPU = torch.device("cpu")


def audio_token(position: int, code: int) -> int:
    return T.AUDIO_TOKEN_BASE + (position % 7) * CODEBOOK_SIZE + code


@pytest.fixture(scope="module")
def small_snac() -> torch.nn.Module:
    return random_snac(seed=1, config=SNAC_24KHZ_SMALL)


def test_window_layout_matches_the_codec_workers_levels() -> None:
    codes = torch.randint(0, 4096, (4, 7))
    mine = window_to_levels(codes.reshape(-1).tolist(), CPU)
    theirs = frames_to_levels(codes[None])
    for a, b in zip(mine, theirs, strict=True):
        assert torch.equal(a, b)
    assert [t.shape for t in mine] == [(1, 4), (1, 8), (1, 16)]


def test_emits_the_second_frame_of_the_last_four_every_seven_tokens(
    small_snac: torch.nn.Module,
) -> None:
    frames = 7
    codes = [(p * 37 + 11) % 4096 for p in range(7 * frames)]
    dec = ReferenceStreamDecoder(small_snac, CPU)
    emitted: dict[int, bytes] = {}
    for p, code in enumerate(codes):
        torch.manual_seed(p)  # SNAC's noise blocks draw from the global generator
        pcm = dec.push(audio_token(p, code))
        if pcm is not None:
            emitted[p + 1] = pcm
    # after 28 tokens, then every 7: frames - 3 chunks, of 2048 samples each
    assert sorted(emitted) == [28, 35, 42, 49]
    assert all(len(pcm) == 2048 * 2 for pcm in emitted.values())
    assert dec.windows_decoded == frames - 3
    # each chunk is samples 2048..4095 of one decode of the last 28 codes
    count = 35
    torch.manual_seed(count - 1)
    with torch.inference_mode():
        audio = small_snac.decode(window_to_levels(codes[count - 28 : count], CPU))
    expected = (audio[0, 0, 2048:4096].numpy() * 32767).astype("int16").tobytes()
    assert emitted[count] == expected


def test_tokens_that_are_not_audio_are_skipped_without_counting(
    small_snac: torch.nn.Module,
) -> None:
    dec = ReferenceStreamDecoder(small_snac, CPU)
    assert dec.push(1000) is None  # a text token
    assert dec.push(T.START_OF_SPEECH) is None  # <custom_token_1>: negative code
    assert dec.count == 0
    dec.push(audio_token(0, 5))
    assert dec.count == 1


def test_code_zero_is_kept_by_default_and_dropped_with_the_reference_bug(
    small_snac: torch.nn.Module,
) -> None:
    frames = 10
    tokens = [audio_token(p, 0 if p == 3 else 9) for p in range(7 * frames)]
    fixed = ReferenceStreamDecoder(small_snac, CPU)
    for t in tokens:
        fixed.push(t)
    assert (fixed.count, fixed.windows_decoded, fixed.windows_dropped) == (70, frames - 3, 0)
    buggy = ReferenceStreamDecoder(small_snac, CPU, keep_zero_filter_bug=True)
    for t in tokens:
        buggy.push(t)
    # Code 0 is dropped without counting; from then on every token is read one slot
    # behind: those that come out negative are dropped too (count falls further behind),
    # the others are >= 4096 and spoil the windows they are in.
    assert buggy.count < len(tokens) - 1
    assert buggy.windows_dropped > 0
    assert buggy.windows_decoded < fixed.windows_decoded


def test_constraint_table_allows_exactly_the_slot_range() -> None:
    blocked = blocked_table(T.AUDIO_TOKEN_END + 2)
    for slot in range(7):
        allowed = (~blocked[slot]).nonzero().flatten().tolist()
        lo = T.AUDIO_TOKEN_BASE + slot * CODEBOOK_SIZE
        expected = list(range(lo, lo + CODEBOOK_SIZE))
        if slot == 0:
            expected = [T.END_OF_SPEECH, *expected]
        assert allowed == expected
    assert not blocked[UNCONSTRAINED].any()


# --- a real run -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from testkit.tiny_model import write_tiny_model

    root = tmp_path_factory.mktemp("tiny")
    write_tiny_model(root)
    snac_dir = root / "snac-small"
    snac_dir.mkdir()
    (snac_dir / CONFIG_FILE).write_text(json.dumps(SNAC_24KHZ_SMALL))
    torch.save(random_snac(seed=0, config=SNAC_24KHZ_SMALL).state_dict(), snac_dir / WEIGHTS_FILE)
    return root


@pytest.fixture(scope="module")
def baseline_url(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    argv = baseline_argv(
        str(tiny_model), str(tiny_model / "snac-small"), "cpu", port,
        ["--set", "llm.max_num_seqs=8", "--set", "llm.max_model_len=1024"],
    )  # fmt: skip
    log = tmp_path_factory.mktemp("logs") / "baseline.log"
    server = ServerProcess("baseline", argv, f"http://127.0.0.1:{port}", log)
    with server:
        server.wait_ready(timeout_s=float(os.environ.get("LOADGEN_TEST_READY_S", "420")))
        yield server.url


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_load_generator_against_the_baseline_server(baseline_url: str, tmp_path: Path) -> None:
    from bench.load.cli import main

    out = tmp_path / "baseline.json"
    frames = 10
    argv = [
        "--url", baseline_url, "--concurrency", "2", "--duration", "60", "--warmup", "0",
        "--max-requests", "3", "--fixed-tokens", str(7 * frames), "--json", str(out),
        "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    (level,) = json.loads(out.read_text())["levels"]
    assert level["requests"] == 3 and level["ok"] == 3, level["outcomes"]
    # the reference emits every frame but the first and the last two: 7 of 10, all windows
    # valid, which holds only if the constraint kept every token in its slot
    assert level["audio_s_mean"] == pytest.approx((frames - 3) * 2048 / 24_000)
    assert level["ttfb_s"]["n"] == 3 and level["ttfb_s"]["p50"] > 0
    assert level["audio_s_per_s"] > 0


def test_the_baseline_rejects_what_it_does_not_serve(baseline_url: str) -> None:
    import urllib.error
    import urllib.request

    body = json.dumps({"input": "Hello.", "voice": "tara", "response_format": "mp3"}).encode()
    req = urllib.request.Request(
        f"{baseline_url}/v1/audio/speech", data=body, headers={"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400
    assert "pcm" in json.loads(err.value.read())["error"]["message"]
