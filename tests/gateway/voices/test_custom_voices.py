"""Custom (zero-shot) voices without the engine: prompt layout, SNAC encode/decode, the store,
the llm_worker's lookup, and the gateway's API with the real SNAC encoder behind it."""

from __future__ import annotations

import asyncio
import io
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import av
import msgspec
import numpy as np
import pytest
import torch
from gateway_harness import running_gateway

from codec_worker.encoder import EncodeServer, VoiceEncoder
from codec_worker.levels import frames_to_levels
from codec_worker.snac_model import SNAC_24KHZ, SNAC_24KHZ_SMALL, fuse_weight_norm
from common.config.llm import LLMConfig
from common.voice_lookup import VoiceLookup, unknown_voice
from gateway.errors import APIError
from gateway.voices.custom import decode_reference
from llm_worker.codes import FrameAssembler
from llm_worker.model_info import ModelInfo
from llm_worker.prompt import PromptBuilder
from llm_worker.requests import BadRequest, plan_request
from llm_worker.vllm_ext import tokens as T
from llm_worker.voices.custom import ZeroShotVoices
from shm.layout import InstanceLayout
from shm.messages import LlmSubmit
from store.lora import LoraEntry, LoraRegistry
from store.voices import TooManyVoices, VoiceExists, VoicesConfig, VoiceStore, new_record, voice_id
from testkit.clips import wav_bytes
from testkit.tiny_model import build_tokenizer, random_snac

RATE = 24_000


# -- clips ---------------------------------------------------------------------------------------


def tone(seconds: float, rate: int = RATE, amplitude: float = 0.3, channels: int = 1) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    x = amplitude * np.sin(2 * np.pi * 220 * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t))
    return np.repeat(x[:, None], channels, axis=1).astype(np.float32)


def encoded_bytes(x: np.ndarray, rate: int, container: str, codec: str) -> bytes:
    """A clip in a compressed format, written by PyAV (as a client's file would be)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        st = out.add_stream(codec, rate=rate)
        st.layout = "mono"
        frame = av.AudioFrame.from_ndarray(
            (x[:, 0] * 32767).astype(np.int16)[None], format="s16", layout="mono"
        )
        frame.sample_rate = rate
        for p in st.encode(frame):
            out.mux(p)
        for p in st.encode(None):
            out.mux(p)
    return buf.getvalue()


# -- prompt layout -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def builder(tmp_path_factory: pytest.TempPathFactory) -> PromptBuilder:
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer().save(str(d / "tokenizer.json"))
    return PromptBuilder.from_pretrained(str(d))


def test_zero_shot_prompt_layout_is_the_issue_template(builder: PromptBuilder) -> None:
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 4096, size=(5, 7)).astype("<i2")
    prefix = builder.build_reference("The quick brown fox.", frames)
    turn = builder.build_plain("Hello there!")
    ref_text = builder._tok.encode("The quick brown fox.", add_special_tokens=True).ids
    target = builder._tok.encode("Hello there!", add_special_tokens=True).ids
    assert ref_text[0] == T.BOS and target[0] == T.BOS
    audio = [T.AUDIO_TOKEN_BASE + (p % 7) * 4096 + int(c) for p, c in enumerate(frames.reshape(-1))]
    expected = [
        128259, *ref_text, 128009, 128260, 128261, 128257,  # human: ref text; AI: speech
        *audio, 128258, 128262,  # the reference audio, end of speech, end of AI
        128259, *target, 128009, 128260, 128261, 128257,  # human: target text; AI: speech
    ]  # fmt: skip
    assert [*prefix, *turn] == expected
    assert "tara" not in builder._tok.decode(turn), "no voice name in a zero-shot turn"


def test_reference_tokens_are_laid_out_as_the_model_emits_them(builder: PromptBuilder) -> None:
    """The worker's own token -> frame mapping reads the prefix's audio back exactly."""
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 4096, size=(9, 7)).astype("<i2")
    frames[0, 0] = 0  # code 0 is valid and must not shift anything
    prefix = builder.build_reference("x", frames)
    start = prefix.index(T.START_OF_SPEECH) + 1
    audio = np.array(prefix[start : prefix.index(T.END_OF_SPEECH)], dtype=np.int64)
    fa = FrameAssembler(4)
    row = fa.open()
    step = fa.map(np.array([row]), np.array([len(audio)]), audio)
    assert step.invalid_tokens.sum() == 0
    np.testing.assert_array_equal(step.frames, frames)


# -- SNAC encode/decode --------------------------------------------------------------------------


def test_encoder_frames_are_snac_codes_in_orpheus_slot_order() -> None:
    snac = fuse_weight_norm(random_snac(3, SNAC_24KHZ_SMALL))
    x = tone(1.0)[:, 0]
    frames = VoiceEncoder(snac).encode(x)
    assert frames.dtype == np.dtype("<i2") and frames.shape == (math.ceil(len(x) / 2048), 7)
    with torch.inference_mode():
        ref = snac.encode(torch.from_numpy(x)[None, None])
    got = frames_to_levels(torch.from_numpy(frames.astype(np.int64))[None])
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b)


def test_round_trip_through_the_real_snac_architecture() -> None:
    """Full-size SNAC 24 kHz (random weights): the clip's frames, regrouped as the codec worker
    regroups what the model emits, decode (SNAC's decoder, same noise) to exactly what SNAC's
    own encode -> decode gives, 2048 samples per frame, covering the clip."""
    snac = fuse_weight_norm(random_snac(0, SNAC_24KHZ))
    x = tone(3.2)[:, 0]
    frames = VoiceEncoder(snac).encode(x)
    assert len(frames) == math.ceil(len(x) / 2048)
    assert ((frames >= 0) & (frames < 4096)).all()
    with torch.inference_mode():
        levels = frames_to_levels(torch.from_numpy(frames.astype(np.int64))[None])
        torch.manual_seed(0)
        ours = snac.decode(list(levels))
        torch.manual_seed(0)
        theirs = snac.decode(snac.encode(torch.from_numpy(x)[None, None]))
    assert ours.shape[-1] == len(frames) * 2048 >= len(x)
    torch.testing.assert_close(ours, theirs)


# -- the store -----------------------------------------------------------------------------------


def _record(vid: str, frames: int = 4) -> object:
    codes = np.arange(frames * 7, dtype=np.int16).reshape(frames, 7)
    return new_record(vid, vid.upper(), "Hello.", "d", codes, 3.5)


def test_store_create_list_get_delete(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path)
    store.create(_record("anna"), max_voices=2)
    store.create(_record("bob", 6), max_voices=2)
    assert store.ids() == ["anna", "bob"]
    assert [v.frames for v in store.list()] == [4, 6]
    rec = store.get("anna")
    assert rec is not None and rec.transcript == "Hello." and rec.code_frames().shape == (4, 7)
    with pytest.raises(VoiceExists):
        store.create(_record("anna"), max_voices=5)
    with pytest.raises(TooManyVoices):
        store.create(_record("carl"), max_voices=2)
    assert VoiceStore(tmp_path).ids() == ["anna", "bob"], "another process sees the same set"
    assert store.delete("anna") and not store.delete("anna")
    assert store.get("anna") is None
    leftovers = [n for n in os.listdir(store.directory) if n not in ("bob.voice", ".lock")]
    assert leftovers == [], "no temporary file is left behind"


def test_store_concurrent_creates_of_one_name_have_one_winner(tmp_path: Path) -> None:
    results: list[str] = []

    def make(i: int) -> None:
        try:
            VoiceStore(tmp_path).create(_record("same", 4 + i), max_voices=10)
            results.append("ok")
        except VoiceExists:
            results.append("exists")

    threads = [threading.Thread(target=make, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == ["exists"] * 7 + ["ok"]


def test_voice_ids() -> None:
    assert voice_id(" My.Voice-1 ") == "my.voice-1"
    for bad in ["", "-x", "a b", "x" * 65, "a/b", "é"]:
        with pytest.raises(ValueError):
            voice_id(bad)


# -- the llm_worker's side -----------------------------------------------------------------------


def test_worker_prefix_follows_the_store(tmp_path: Path, builder: PromptBuilder) -> None:
    store = VoiceStore(tmp_path)
    voices = ZeroShotVoices(store, builder, supported=True)
    assert voices.prefix("anna") is None
    store.create(_record("anna", 4), max_voices=5)
    first = voices.prefix("anna")
    assert first is not None and voices.prefix("anna") is first, "cached while unchanged"
    store.delete("anna")
    assert voices.prefix("anna") is None, "a deleted voice is gone at once"
    store.create(_record("anna", 6), max_voices=5)
    again = voices.prefix("anna")
    assert again is not None and len(again) == len(first) + 14, "made again: the new codes"
    with pytest.raises(BadRequest, match="zero-shot"):
        ZeroShotVoices(store, builder, supported=False).prefix("anna")


def test_plan_accepts_a_custom_voice_only_when_the_worker_knows_it() -> None:
    info = ModelInfo(voices=("tara",), emotion_tags=(), source="test")
    msg = LlmSubmit(stream_id=1, text="Hi.", voice="Anna")
    with pytest.raises(BadRequest, match="unknown voice"):
        plan_request(msg, LLMConfig(), info)
    lookup = VoiceLookup(info.voices, is_custom=lambda v: v == "anna")
    plan = plan_request(msg, LLMConfig(), info, lookup)
    assert (plan.voice, plan.kind) == ("anna", "custom")


def test_one_lookup_order_for_every_process(tmp_path: Path) -> None:
    """common.voice_lookup.VoiceLookup: the model's voices, then LoRA, then custom; one message."""
    asked: list[str] = []

    def lora(v: str) -> bool:
        asked.append(f"lora:{v}")
        return v in ("both", "ada")

    def custom(v: str) -> bool:
        asked.append(f"custom:{v}")
        return v in ("both", "anna")

    lookup = VoiceLookup(["Tara", " leo "], lora, custom)
    assert lookup.kind("TARA") == "model" and asked == [], "a model voice touches no file"
    assert lookup.kind(" Ada ") == "lora" and asked == ["lora:ada"]
    assert lookup.kind("anna") == "custom" and asked[-2:] == ["lora:anna", "custom:anna"]
    assert lookup.kind("both") == "lora", "a LoRA voice wins over a custom voice"
    assert lookup.kind("nobody") is None and lookup.kind("no body") is None
    assert asked[-1] == "custom:nobody", "a name that cannot be an id is not looked up"
    assert (
        lookup.unknown("Nobody")
        == unknown_voice("Nobody", ["tara", "leo"])
        == (
            "unknown voice 'Nobody'; voices: tara, leo "
            "(and the custom voices listed by GET /v1/audio/voices)"
        )
    )
    registry = LoraRegistry(tmp_path)
    assert not registry.has("ada") and not registry.has("not a name")
    registry.save(LoraEntry(name="Ada", path="/adapters/ada"))
    assert registry.has("ada") and registry.has("ADA")
    assert registry.delete("ada") and not registry.has("ada")


def test_lora_failure_marker_round_trip(tmp_path: Path) -> None:
    """``<id>.failed`` beside the entry: one line, cleared by a successful save and by
    delete, never taken for an entry."""
    registry = LoraRegistry(tmp_path)
    registry.save(LoraEntry(name="ada", path="/adapters/ada"))
    assert registry.failure("ada") is None and registry.failure("not a name") is None
    registry.mark_failed("Ada", "OSError: no adapter\n  at /adapters/ada")
    assert registry.failure("ADA") == "OSError: no adapter at /adapters/ada"
    assert (registry.directory / "ada.failed").read_text() == (
        "OSError: no adapter at /adapters/ada\n"
    )
    assert registry.has("ada"), "the entry stays: an admin load or unload settles it"
    assert [e.name for e in registry.entries()] == ["ada"]
    assert not [n for n in os.listdir(registry.directory) if n.startswith(".tmp-")]
    registry.save(LoraEntry(name="ada", path="/adapters/ada2"))
    assert registry.failure("ada") is None, "a successful load clears the marker"
    registry.mark_failed("ada", "gone")
    assert registry.delete("ada") and registry.failure("ada") is None
    assert os.listdir(registry.directory) == []


class LoraEngine:
    """The two calls ``LoraVoices`` makes of vLLM's AsyncLLM; adapters under ``bad`` fail.

    ``loaded``: the names added, in order; ``tried``: every ``add_lora`` (failed ones too);
    ``adapters``: what the engine holds now (id -> path); ``removed``: ids removed.
    ``gate``: if set, ``add_lora`` waits for it."""

    def __init__(self, *bad: str) -> None:
        self.bad = set(bad)
        self.loaded: list[str] = []
        self.tried: list[str] = []
        self.adapters: dict[int, str] = {}
        self.removed: list[int] = []
        self.gate: asyncio.Event | None = None

    async def add_lora(self, request: Any) -> bool:
        self.tried.append(request.lora_name)
        if self.gate is not None:
            await self.gate.wait()
        if request.lora_path in self.bad:
            raise ValueError(f"no adapter at {request.lora_path}\n(adapter_config.json)")
        self.loaded.append(request.lora_name)
        self.adapters[request.lora_int_id] = request.lora_path
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return self.adapters.pop(lora_id, None) is not None


async def test_a_lora_voice_that_fails_to_restore_is_marked(tmp_path: Path) -> None:
    """The llm_worker is the authority: an entry it cannot load again at start is marked
    failed (the gateways refuse it), one that loads clears a stale marker, and loading the
    voice again through the admin API works."""
    from llm_worker.voices.lora import LoraVoices
    from shm.messages import LoraLoad, LoraUnload

    registry = LoraRegistry(tmp_path)
    registry.save(LoraEntry(name="ada", path="/adapters/ada"))
    registry.save(LoraEntry(name="ben", path="/adapters/gone"))
    cfg = LLMConfig(enable_lora=True)
    engine = LoraEngine("/adapters/gone")
    voices = LoraVoices(cfg, registry, ("tara",))
    await voices.restore(engine)  # type: ignore[arg-type]
    assert voices.names() == ["ada"] and engine.loaded == ["ada"]
    assert (
        registry.failure("ben") == "ValueError: no adapter at /adapters/gone (adapter_config.json)"
    )
    assert registry.failure("ada") is None and registry.has("ben")

    # The adapter came back: the next start loads it and clears the marker.
    again = LoraVoices(cfg, registry, ("tara",))
    await again.restore(LoraEngine())  # type: ignore[arg-type]
    assert again.names() == ["ada", "ben"] and registry.failure("ben") is None

    # Failed again; then loaded through the admin API (from another path): the worker
    # dropped it, so the name is free, and the saved entry clears the marker.
    voices = LoraVoices(cfg, registry, ("tara",))
    await voices.restore(engine)  # type: ignore[arg-type]
    assert registry.failure("ben") is not None
    reply = await voices.handle(engine, LoraLoad(1, "ben", "/adapters/ben"))  # type: ignore[arg-type]
    assert (reply.status, reply.message) == (200, "ben"), reply
    assert voices.names() == ["ada", "ben"] and registry.failure("ben") is None
    assert [e.path for e in registry.entries() if e.name == "ben"] == ["/adapters/ben"]

    # A failed entry can also be removed: the worker does not hold it, the registry does.
    registry.save(LoraEntry(name="cy", path="/adapters/gone"))
    voices = LoraVoices(cfg, registry, ("tara",))
    await voices.restore(engine)  # type: ignore[arg-type]
    assert "cy" not in voices.names() and registry.failure("cy") is not None
    reply = await voices.handle(engine, LoraUnload(2, "cy"))  # type: ignore[arg-type]
    assert reply.status == 200, reply
    assert not registry.has("cy") and registry.failure("cy") is None
    reply = await voices.handle(engine, LoraUnload(3, "cy"))  # type: ignore[arg-type]
    assert reply.status == 404


async def test_lora_voices_follow_other_workers_sharing_the_state_directory(
    tmp_path: Path,
) -> None:
    """Two workers (two pods) on one state directory: what one loads or unloads through the
    admin API, the other loads or unloads at its next sync; its own load is not loaded
    again; an entry written by another worker is loaded too."""
    from llm_worker.voices.lora import LoraVoices
    from shm.messages import LoraLoad, LoraUnload

    registry = LoraRegistry(tmp_path)
    cfg = LLMConfig(enable_lora=True)
    engine_a, engine_b = LoraEngine(), LoraEngine()
    a = LoraVoices(cfg, registry, ("tara",))
    b = LoraVoices(cfg, LoraRegistry(tmp_path), ("tara",))
    await a.restore(engine_a)  # type: ignore[arg-type]
    await b.restore(engine_b)  # type: ignore[arg-type]

    reply = await a.handle(engine_a, LoraLoad(1, "Ben", "/adapters/ben", "Benny"))  # type: ignore[arg-type]
    assert (reply.status, reply.message) == (200, "ben"), reply
    assert b.get("ben") is None
    reply = await b.handle(engine_b, LoraLoad(2, "ben", "/adapters/other"))  # type: ignore[arg-type]
    assert reply.status == 409, "the voice exists (another worker holds it)"
    await b.sync(engine_b)  # type: ignore[arg-type]
    lv = b.get("ben")
    assert lv is not None and lv.runtime and lv.speaker == "benny"
    assert lv.request.lora_path == "/adapters/ben" and engine_b.loaded == ["ben"]
    await a.sync(engine_a)  # type: ignore[arg-type]
    await b.sync(engine_b)  # type: ignore[arg-type]
    assert engine_a.loaded == ["ben"] and engine_b.loaded == ["ben"], "loaded once each"
    assert engine_a.removed == engine_b.removed == []

    # Another worker's load, as it leaves the registry.
    registry.save(LoraEntry(name="cy", path="/adapters/cy"))
    await a.sync(engine_a)  # type: ignore[arg-type]
    assert a.names() == ["ben", "cy"] and sorted(engine_a.adapters.values()) == [
        "/adapters/ben",
        "/adapters/cy",
    ]

    # An unload through b: a drops the adapter from its engine and its table.
    ben_id = a.get("ben").request.lora_int_id  # type: ignore[union-attr]
    reply = await b.handle(engine_b, LoraUnload(3, "ben"))  # type: ignore[arg-type]
    assert reply.status == 200 and b.get("ben") is None
    await a.sync(engine_a)  # type: ignore[arg-type]
    assert a.names() == ["cy"] and engine_a.removed == [ben_id]
    assert list(engine_a.adapters.values()) == ["/adapters/cy"]

    # Unloaded through b before b synced it: the entry goes, a follows.
    reply = await b.handle(engine_b, LoraUnload(4, "cy"))  # type: ignore[arg-type]
    assert reply.status == 200 and not registry.has("cy")
    await a.sync(engine_a)  # type: ignore[arg-type]
    assert a.names() == [] and engine_a.adapters == {}

    # Loaded again elsewhere with another adapter: the worker holding it swaps adapters.
    await a.handle(engine_a, LoraLoad(5, "dee", "/adapters/dee"))  # type: ignore[arg-type]
    old_id = a.get("dee").request.lora_int_id  # type: ignore[union-attr]
    registry.save(LoraEntry(name="dee", path="/adapters/dee2"))
    await a.sync(engine_a)  # type: ignore[arg-type]
    assert a.get("dee").request.lora_path == "/adapters/dee2"  # type: ignore[union-attr]
    assert old_id in engine_a.removed and list(engine_a.adapters.values()) == ["/adapters/dee2"]

    # Nothing to do with LoRA off.
    off = LoraVoices(LLMConfig(), registry, ("tara",))
    engine_off = LoraEngine()
    await off.sync(engine_off)  # type: ignore[arg-type]
    assert off.names() == [] and engine_off.tried == []


async def test_lora_sync_never_removes_a_configured_voice(tmp_path: Path) -> None:
    from common.config.llm import LoraVoice
    from llm_worker.voices.lora import LoraVoices

    registry = LoraRegistry(tmp_path)
    cfg = LLMConfig(lora_voices={"Ava": LoraVoice("/adapters/ava")})
    engine = LoraEngine()
    voices = LoraVoices(cfg, registry, ("tara",))
    await voices.restore(engine)  # type: ignore[arg-type]
    await voices.sync(engine)  # type: ignore[arg-type]
    assert voices.names() == ["ava"] and engine.removed == []
    # An entry of the same name (written elsewhere) neither replaces it nor, once gone,
    # takes it away.
    registry.save(LoraEntry(name="ava", path="/adapters/elsewhere"))
    await voices.sync(engine)  # type: ignore[arg-type]
    registry.delete("ava")
    await voices.sync(engine)  # type: ignore[arg-type]
    lv = voices.get("ava")
    assert lv is not None and not lv.runtime and lv.request.lora_path == "/adapters/ava"
    assert engine.loaded == ["ava"] and engine.removed == []


async def test_a_lora_entry_that_fails_to_sync_is_marked_once(tmp_path: Path) -> None:
    """An entry that fails to load here is marked and not tried again on every pass, only
    once its entry is written again; a bad entry never makes sync raise."""
    from llm_worker.voices.lora import LoraVoices
    from shm.messages import LoraLoad

    registry = LoraRegistry(tmp_path)
    cfg = LLMConfig(enable_lora=True)
    engine = LoraEngine("/adapters/gone")
    voices = LoraVoices(cfg, registry, ("tara",))
    await voices.restore(engine)  # type: ignore[arg-type]

    registry.save(LoraEntry(name="cy", path="/adapters/gone"))
    await voices.sync(engine)  # type: ignore[arg-type]
    assert voices.names() == [] and engine.tried == ["cy"]
    assert registry.failure("cy") == (
        "ValueError: no adapter at /adapters/gone (adapter_config.json)"
    )
    registry.clear_failure("cy")  # e.g. another worker loaded it
    for _ in range(3):
        await voices.sync(engine)  # type: ignore[arg-type]
    assert engine.tried == ["cy"], "not tried again while its entry is unchanged"

    # Written again (same content): tried again, fails again, marked again.
    registry.save(LoraEntry(name="cy", path="/adapters/gone"))
    await voices.sync(engine)  # type: ignore[arg-type]
    assert engine.tried == ["cy", "cy"] and registry.failure("cy") is not None

    # Loaded again through the admin API of this worker, from another path: allowed
    # (the name is taken only by a failed entry), and the marker goes.
    reply = await voices.handle(engine, LoraLoad(1, "cy", "/adapters/cy"))  # type: ignore[arg-type]
    assert reply.status == 200, reply
    assert voices.names() == ["cy"] and registry.failure("cy") is None
    await voices.sync(engine)  # type: ignore[arg-type]
    assert engine.loaded == ["cy"]

    # Fixed by another worker (the entry rewritten to a good adapter): loaded here.
    registry.save(LoraEntry(name="dee", path="/adapters/gone"))
    await voices.sync(engine)  # type: ignore[arg-type]
    registry.save(LoraEntry(name="dee", path="/adapters/dee"))
    await voices.sync(engine)  # type: ignore[arg-type]
    assert voices.names() == ["cy", "dee"] and registry.failure("dee") is None

    # An unreadable entry leaves what is loaded alone; an engine that raises anything is
    # logged per entry; neither makes sync raise.
    (registry.directory / "dee.json").write_bytes(b"{not json")
    (registry.directory / "Bad Name.json").write_bytes(b"{}")
    await voices.sync(engine)  # type: ignore[arg-type]
    assert voices.names() == ["cy", "dee"]

    class Broken(LoraEngine):
        async def add_lora(self, request: Any) -> bool:
            raise RuntimeError("engine trouble")

        async def remove_lora(self, lora_id: int) -> bool:
            raise RuntimeError("engine trouble")

    registry.save(LoraEntry(name="eve", path="/adapters/eve"))
    registry.delete("cy")
    await voices.sync(Broken())  # type: ignore[arg-type]
    assert voices.names() == ["dee"] and registry.failure("eve") == "RuntimeError: engine trouble"


async def test_lora_sync_and_admin_calls_do_not_interleave(tmp_path: Path) -> None:
    """A sync that starts while an admin load waits on the engine waits for it: it would
    otherwise see the voice in the table before its entry is written, and unload it."""
    from llm_worker.voices.lora import LoraVoices
    from shm.messages import LoraLoad

    registry = LoraRegistry(tmp_path)
    engine = LoraEngine()
    voices = LoraVoices(LLMConfig(enable_lora=True), registry, ("tara",))
    engine.gate = asyncio.Event()
    load = asyncio.create_task(voices.handle(engine, LoraLoad(1, "ben", "/adapters/ben")))  # type: ignore[arg-type]
    while engine.tried != ["ben"]:
        await asyncio.sleep(0)
    sync = asyncio.create_task(voices.sync(engine))  # type: ignore[arg-type]
    for _ in range(5):
        await asyncio.sleep(0)
    assert not sync.done()
    engine.gate.set()
    reply = await load
    await sync
    assert reply.status == 200 and voices.names() == ["ben"]
    assert engine.loaded == ["ben"] and engine.removed == []


async def test_the_lora_sync_loop_survives_a_failed_pass() -> None:
    from llm_worker.main import _lora_sync_loop

    passes: list[int] = []

    class Voices:
        async def sync(self, engine: Any) -> None:
            passes.append(1)
            if len(passes) == 1:
                raise OSError("state directory away")

    task = asyncio.create_task(_lora_sync_loop(None, Voices(), 0.001))  # type: ignore[arg-type]
    while len(passes) < 3:
        await asyncio.sleep(0.001)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_the_gateway_refuses_a_lora_voice_that_failed_to_load(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    """A run-time LoRA voice whose marker is set: 503 ``voice_unavailable`` before admission
    (the request never reaches the worker), in every front end; listed with its error."""
    registry = LoraRegistry(tmp_path)
    registry.save(LoraEntry(name="ada", path="/adapters/ada"))
    registry.save(LoraEntry(name="ben", path="/adapters/gone"))
    registry.mark_failed("ben", "ValueError: no adapter at /adapters/gone")
    serve = {
        "voices": VoicesConfig(state_dir=str(tmp_path)),
        "llm": LLMConfig(voices=["tara", "leah"], enable_lora=True),
    }
    message = (
        "LoRA voice 'ben' failed to load in the llm worker: ValueError: no adapter "
        "at /adapters/gone; load it again with POST /v1/admin/lora (or remove it with "
        "DELETE /v1/admin/lora/ben)"
    )
    async with (
        running_gateway(layout, serve=serve, backend={"voices": ["tara", "leah", "ada"]}) as h,
        aiohttp.ClientSession() as s,
    ):
        body = {"model": "tts-1", "input": "Hi.", "response_format": "pcm"}
        async with s.post(f"{h.url}/v1/audio/speech", json={**body, "voice": "Ben"}) as r:
            err = (await r.json())["error"]
            assert r.status == 503, err
        assert (err["code"], err["message"], err["param"]) == (
            "voice_unavailable",
            message,
            "voice",
        )
        eleven = "/v1/text-to-speech/ben/stream?output_format=pcm_24000"
        async with s.post(h.url + eleven, json={"text": "Hi."}) as r:
            err = (await r.json())["error"]
            assert (r.status, err["code"], err["message"]) == (503, "voice_unavailable", message)
        async with s.post(f"{h.url}/v1/audio/speech", json={**body, "voice": "ada"}) as r:
            assert r.status == 200
            await r.read()
        assert [sub.voice for sub in h.backend.submitted()] == ["ada"]
        async with s.get(f"{h.url}/v1/audio/voices") as r:
            listing = await r.json()
        assert listing["voices"] == ["tara", "leah", "ada"]
        assert [(v["id"], v["error"]) for v in listing["lora"]] == [
            ("ada", None),
            ("ben", "ValueError: no adapter at /adapters/gone"),
        ]
        registry.save(LoraEntry(name="ben", path="/adapters/ben"))  # loaded again
        async with s.get(f"{h.url}/v1/audio/voices") as r:
            listing = await r.json()
        assert listing["voices"] == ["tara", "leah", "ada", "ben"]
        assert all(v["error"] is None for v in listing["lora"])


# -- decoding the upload -------------------------------------------------------------------------

CFG = VoicesConfig(min_seconds=3.0, max_seconds=8.0)


@pytest.mark.parametrize(
    ("container", "codec"),
    [("wav", None), ("mp3", "libmp3lame"), ("ogg", "libopus"), ("flac", "flac")],
)
def test_any_format_pyav_reads_becomes_24k_mono(container: str, codec: str | None) -> None:
    rate = 48_000 if codec == "libopus" else 44_100
    x = tone(4.0, rate, channels=2 if codec is None else 1)
    data = wav_bytes(x, rate) if codec is None else encoded_bytes(x, rate, container, codec)
    pcm = decode_reference(data, CFG)
    assert pcm.dtype == np.float32
    assert abs(len(pcm) / RATE - 4.0) < 0.1
    assert 0.1 < float(np.abs(pcm).max()) <= 1.0


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"this is not audio at all" * 100, "invalid_audio"),
        (wav_bytes(tone(1.0), RATE), "audio_too_short"),
        (wav_bytes(tone(9.0), RATE), "audio_too_long"),
        (wav_bytes(np.zeros((RATE * 4, 1), np.float32), RATE), "audio_silent"),
        (wav_bytes(tone(4.0, 8000), 8000), "unsupported_sample_format"),
    ],
    ids=["not-audio", "too-short", "too-long", "silent", "8khz"],
)
def test_bad_clips_are_named(data: bytes, code: str) -> None:
    with pytest.raises(APIError) as e:
        decode_reference(data, CFG)
    assert e.value.status == 400 and e.value.code == code, e.value.message


# -- the HTTP API, with the real SNAC encoder on the encode socket --------------------------------


@pytest.fixture
def encode_server(layout: InstanceLayout) -> Iterator[EncodeServer]:
    snac = fuse_weight_norm(random_snac(5, SNAC_24KHZ_SMALL))
    srv = EncodeServer(VoiceEncoder(snac), layout.encode)
    srv.start()
    yield srv
    srv.stop()


def _form(
    name: str | None, audio: bytes | None, transcript: str | None, **extra: str
) -> aiohttp.FormData:
    f = aiohttp.FormData(default_to_multipart=True)
    if name is not None:
        f.add_field("name", name)
    if transcript is not None:
        f.add_field("transcript", transcript)
    for k, v in extra.items():
        f.add_field(k, v)
    if audio is not None:
        f.add_field("audio", audio, filename="clip.wav", content_type="audio/wav")
    return f


def _serve(tmp_path: Path, zero_shot: bool = True, **voices: object) -> dict[str, object]:
    return {
        "voices": VoicesConfig(state_dir=str(tmp_path), max_seconds=8.0, **voices),  # type: ignore[arg-type]
        "llm": LLMConfig(zero_shot=zero_shot, voices=["tara", "leah"]),
    }


async def test_create_list_delete_over_http(
    layout: InstanceLayout, tmp_path: Path, encode_server: EncodeServer
) -> None:
    clip = wav_bytes(tone(3.5, 44_100), 44_100)
    async with (
        running_gateway(layout, serve=_serve(tmp_path, max_voices=2)) as h,
        aiohttp.ClientSession() as s,
    ):
        async with s.post(
            f"{h.url}/v1/audio/voices", data=_form("Anna", clip, "Hello.", description="warm")
        ) as r:
            body = await r.json()
            assert r.status == 201, body
        assert body["id"] == "anna" and body["frames"] == math.ceil(3.5 * RATE / 2048)
        assert encode_server.served == 1
        async with s.get(f"{h.url}/v1/audio/voices") as r:
            listing = await r.json()
        assert listing["voices"] == ["tara", "leah", "anna"] and listing["zero_shot"] is True
        assert listing["custom"][0]["description"] == "warm"
        stored = VoiceStore(tmp_path).get("anna")
        assert stored is not None and stored.frames == body["frames"]
        # every bad input gets its 4xx, named
        cases = [
            (_form("anna", clip, "Hi."), 409, "voice_exists"),
            (_form("alloy", clip, "Hi."), 409, "voice_exists"),
            (_form("tara", clip, "Hi."), 409, "voice_exists"),
            (_form("b", clip, "   "), 400, "empty_transcript"),
            (_form("b", clip, None), 400, "empty_transcript"),
            (_form("b c", clip, "Hi."), 400, "invalid_name"),
            (_form("b", None, "Hi."), 400, "missing_audio"),
            (_form("b", b"RIFF garbage" * 50, "Hi."), 400, "invalid_audio"),
            (_form("b", wav_bytes(tone(1.0), RATE), "Hi."), 400, "audio_too_short"),
            (_form("b", wav_bytes(tone(9.0), RATE), "Hi."), 400, "audio_too_long"),
            (_form("b", wav_bytes(np.zeros((RATE * 4, 1), np.float32), RATE), "Hi."), 400, "audio_silent"),
            (_form("b", wav_bytes(tone(4.0, 8000), 8000), "Hi."), 400, "unsupported_sample_format"),
        ]  # fmt: skip
        for form, status, code in cases:
            async with s.post(f"{h.url}/v1/audio/voices", data=form) as r:
                err = await r.json()
                assert (r.status, err["error"]["code"]) == (status, code), err
        async with s.post(f"{h.url}/v1/audio/voices", json={"name": "x"}) as r:
            assert r.status == 400
        async with s.post(f"{h.url}/v1/audio/voices", data=_form("bob", clip, "Hi.")) as r:
            assert r.status == 201
        async with s.post(f"{h.url}/v1/audio/voices", data=_form("carl", clip, "Hi.")) as r:
            err = await r.json()
            assert (r.status, err["error"]["code"]) == (409, "too_many_voices")
        async with s.delete(f"{h.url}/v1/audio/voices/anna") as r:
            assert r.status == 200 and (await r.json())["deleted"] is True
        async with s.delete(f"{h.url}/v1/audio/voices/anna") as r:
            assert r.status == 404
        async with s.delete(f"{h.url}/v1/audio/voices/tara") as r:
            assert r.status == 400
        assert VoiceStore(tmp_path).ids() == ["bob"]


async def test_upload_limit_and_unsupported_model(
    layout: InstanceLayout, tmp_path: Path, encode_server: EncodeServer
) -> None:
    clip = wav_bytes(tone(3.5), RATE)
    async with (
        running_gateway(layout, serve=_serve(tmp_path, max_upload_bytes=50_000)) as h,
        aiohttp.ClientSession() as s,
    ):
        async with s.post(f"{h.url}/v1/audio/voices", data=_form("a", clip, "Hi.")) as r:
            assert r.status == 413
    async with (
        running_gateway(layout, serve=_serve(tmp_path, zero_shot=False)) as h,
        aiohttp.ClientSession() as s,
    ):
        async with s.post(f"{h.url}/v1/audio/voices", data=_form("a", clip, "Hi.")) as r:
            err = await r.json()
        assert r.status == 400 and err["error"]["code"] == "zero_shot_unsupported"
        assert "zero-shot" in err["error"]["message"]
    assert encode_server.served == 0


async def test_codec_worker_away_is_a_503(layout: InstanceLayout, tmp_path: Path) -> None:
    serve = _serve(tmp_path, encode_timeout_s=0.5)
    async with running_gateway(layout, serve=serve) as h, aiohttp.ClientSession() as s:
        async with s.post(
            f"{h.url}/v1/audio/voices", data=_form("a", wav_bytes(tone(3.5), RATE), "Hi.")
        ) as r:
            err = await r.json()
        assert r.status == 503 and err["error"]["code"] == "codec_unavailable"
    assert VoiceStore(tmp_path).ids() == []


def test_messages_are_structs() -> None:
    from shm.messages import (
        EncodeReply,
        EncodeRequest,
        encode_reply_decoder,
        encode_request_decoder,
    )

    raw = msgspec.msgpack.encode(EncodeRequest(3, b"\x00" * 8))
    assert encode_request_decoder.decode(raw).request_id == 3
    assert (
        encode_reply_decoder.decode(msgspec.msgpack.encode(EncodeReply(3, error="x"))).error == "x"
    )
    asyncio.get_event_loop_policy()  # (asyncio imported for the async tests' plugin)


def test_zero_shot_support_is_the_models_configuration(tmp_path: Path) -> None:
    import json

    from llm_worker.model_info import load_model_info

    (tmp_path / "config.json").write_text(json.dumps({"orpheus": {"voices": ["tara"]}}))
    assert load_model_info(LLMConfig(model=str(tmp_path))).zero_shot is False
    assert load_model_info(LLMConfig(model=str(tmp_path), zero_shot=True)).zero_shot is True
    (tmp_path / "config.json").write_text(
        json.dumps({"orpheus": {"voices": ["tara"], "zero_shot": True}})
    )
    assert load_model_info(LLMConfig(model=str(tmp_path))).zero_shot is True
    from testkit.tiny_model import _model_config

    assert _model_config()["orpheus"]["zero_shot"] is True, "the test model declares it"


async def test_two_gateways_see_the_same_voices(
    layout: InstanceLayout, tmp_path: Path, encode_server: EncodeServer
) -> None:
    """Two gateway instances on one state directory: made through one, listed and deleted
    through the other."""
    import tempfile

    from shm.segments import destroy_instance

    other = InstanceLayout(
        instance=f"orpheus-{os.getpid()}-t{os.urandom(3).hex()}",
        run_dir=tempfile.mkdtemp(prefix="i-"),  # as the layout fixture's (tests/conftest.py)
    )
    os.makedirs(other.socket_dir)
    serve = _serve(tmp_path)
    try:
        async with (
            running_gateway(layout, serve=serve) as a,
            running_gateway(other, serve=serve) as b,
            aiohttp.ClientSession() as s,
        ):
            clip = wav_bytes(tone(3.5), RATE)
            async with s.post(f"{a.url}/v1/audio/voices", data=_form("shared", clip, "Hi.")) as r:
                assert r.status == 201
            async with s.get(f"{b.url}/v1/audio/voices") as r:
                assert "shared" in (await r.json())["voices"]
            async with s.post(f"{b.url}/v1/audio/voices", data=_form("shared", clip, "Hi.")) as r:
                assert r.status == 409
            async with s.delete(f"{b.url}/v1/audio/voices/shared") as r:
                assert r.status == 200
            async with s.get(f"{a.url}/v1/audio/voices") as r:
                assert "shared" not in (await r.json())["voices"]
    finally:
        destroy_instance(other)
        os.rmdir(other.run_dir)


def test_voice_configuration_is_checked() -> None:
    from orchestrator.settings import ConfigError, load_config

    for bad in (
        {"llm": {"max_lora_rank": 12}},
        {"llm": {"lora_sync_s": -1.0}},
        {"voices": {"min_seconds": 40.0}},
        {"llm": {"lora_voices": {"bad name": {"path": "/x"}}}},
        {"llm": {"voices": ["tara"], "lora_voices": {"tara": {"path": "/x"}}}},
    ):
        with pytest.raises(ConfigError):
            load_config(None, bad, {})
    ok = load_config(None, {"llm": {"lora_voices": {"ava": {"path": "/x"}}}}, {})
    assert ok.llm.lora_enabled and ok.llm.lora_voices["ava"].path == "/x"
    assert ok.llm.lora_sync_s == 5.0
    assert load_config(None, {"llm": {"lora_sync_s": 0}}, {}).llm.lora_sync_s == 0


def test_a_lora_voice_named_like_a_model_voice_is_refused_at_start(tmp_path: Path) -> None:
    """With the model's own voice list (``llm.voices`` unset), a LoRA voice that a model voice
    would shadow is refused once the list is known, in one line, before anything starts."""
    from common.config import ServeConfig
    from common.config.llm import LLMConfig, LoraVoice
    from orpheus_serve.cli import _with_model_voices

    def cfg(name: str) -> ServeConfig:
        return ServeConfig(llm=LLMConfig(model=str(tmp_path), lora_voices={name: LoraVoice("/x")}))

    with pytest.raises(ValueError, match=r"'Tara' is also a voice of the model \(default\)"):
        _with_model_voices(cfg("Tara"))
    resolved = _with_model_voices(cfg("ava"))
    assert "tara" in (resolved.llm.voices or [])


async def test_the_audio_head_refuses_an_adapter_that_changes_the_vocabulary_rows(
    tmp_path: Path,
) -> None:
    """The audio output head serves the LM head and embedding rotated and sliced: an adapter
    that targets or saves them is refused at load with one line naming the fix; the same
    adapter loads with the full head, and an ordinary adapter loads with either."""
    import json

    from llm_worker.voices.lora import LoraVoices
    from shm.messages import LoraLoad

    def adapter(name: str, **cfg: object) -> str:
        path = tmp_path / name
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps(cfg))
        return str(path)

    head = adapter("head", target_modules=["q_proj", "v_proj", "lm_head"])
    saved = adapter("saved", target_modules="q_proj|v_proj", modules_to_save=["embed_tokens"])
    plain = adapter("plain", target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    cfg = LLMConfig(enable_lora=True)
    engine = LoraEngine()
    voices = LoraVoices(cfg, LoraRegistry(tmp_path / "state"), ("tara",), audio_head=True)
    for i, (name, path, what) in enumerate(
        (("ada", head, "lm_head"), ("ben", saved, "embed_tokens")), start=1
    ):
        reply = await voices.handle(engine, LoraLoad(i, name, path))  # type: ignore[arg-type]
        assert reply.status == 400 and reply.code == "lora_load_failed", reply
        assert what in reply.message and "llm.output_head = full" in reply.message
        assert "\n" not in reply.message
    reply = await voices.handle(engine, LoraLoad(3, "cy", plain))  # type: ignore[arg-type]
    assert reply.status == 200 and engine.loaded == ["cy"]

    full = LoraVoices(cfg, LoraRegistry(tmp_path / "state2"), ("tara",), audio_head=False)
    reply = await full.handle(engine, LoraLoad(4, "ada", head))  # type: ignore[arg-type]
    assert reply.status == 200 and engine.loaded == ["cy", "ada"]
