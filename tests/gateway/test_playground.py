"""The playground page at / in headless Chromium (Debian's chromium driven by Playwright):
voices load, audio streams into Web Audio, TTFB is shown, errors are shown."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from gateway_harness import running_gateway

from shm.layout import InstanceLayout
from testkit.clips import wav_bytes

pytestmark = pytest.mark.timeout(90)

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]  # fmt: skip


@pytest.mark.skipif(
    not os.path.exists(CHROMIUM),
    reason=f"{CHROMIUM} is absent (apt-get install -y chromium; the Makefile installs it)",
)
async def test_playground_streams_audio_in_headless_chromium(layout: InstanceLayout) -> None:
    from playwright.async_api import async_playwright

    async with running_gateway(layout, backend={"realtime": True}) as h, async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = await browser.new_page()
            await page.goto(h.url + "/")
            await page.wait_for_function("window.playground && window.playground.loaded === true")
            assert "noise" in (await page.inner_text("#noise-note"))
            voices = await page.evaluate("window.playground.voices")
            assert {"tara", "leo", "alloy", "verse"} <= set(voices)

            await page.fill("#text", "Hello from the browser.")
            await page.fill("#max-tokens", str(7 * 12))
            await page.select_option("#voice", "nova")
            await page.click("#speak")
            await page.wait_for_function("window.playground.state === 'done'", timeout=30_000)
            state = await page.evaluate("window.playground")
            assert state["error"] is None
            assert state["bytes"] == 12 * 2048 * 2
            assert state["samplesScheduled"] == 12 * 2048
            assert state["ttfbMs"] > 0
            assert (await page.inner_text("#ttfb")).endswith(" ms")
            sub = h.backend.submitted()[-1]
            assert sub.voice == "leah" and sub.text == "Hello from the browser."

            await page.fill("#text", "   ")
            await page.click("#speak")
            await page.wait_for_function("window.playground.state === 'error'", timeout=10_000)
            assert "400" in await page.inner_text("#error")

            # The WebSocket mode speaks vLLM-Omni's protocol, the text sent word by word.
            await page.select_option("#protocol", "ws")
            await page.fill("#text", "Two words. And three more.")
            await page.click("#speak")
            await page.wait_for_function("window.playground.state === 'done'", timeout=30_000)
            state = await page.evaluate("window.playground")
            assert state["error"] is None
            assert state["bytes"] == (len("Two words.") + len("And three more.")) * 2048 * 2
            assert state["samplesScheduled"] == state["bytes"] // 2
            assert [sub.text for sub in h.backend.submitted()[-2:]] == [
                "Two words.", "And three more."]  # fmt: skip
            assert not h.backend.submitted()[-1].text_open
        finally:
            await browser.close()


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent")
async def test_playground_makes_a_custom_voice_from_an_uploaded_clip(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    """Upload a clip, name it, type its words: the voice is made (the real SNAC encoder on
    the encode socket), listed, selected, and spoken with."""
    from playwright.async_api import async_playwright

    from codec_worker.encoder import EncodeServer, VoiceEncoder
    from codec_worker.snac_model import SNAC_24KHZ_SMALL, fuse_weight_norm
    from common.config.llm import LLMConfig
    from store.voices import VoicesConfig
    from testkit.tiny_model import random_snac

    t = np.arange(int(3.5 * 16_000)) / 16_000
    (tmp_path / "me.wav").write_bytes(wav_bytes(0.3 * np.sin(2 * np.pi * 200 * t), 16_000))
    (tmp_path / "short.wav").write_bytes(
        wav_bytes(0.3 * np.sin(2 * np.pi * 200 * t[:8000]), 16_000)
    )
    encoder = EncodeServer(
        VoiceEncoder(fuse_weight_norm(random_snac(1, SNAC_24KHZ_SMALL))), layout.encode
    )
    encoder.start()
    serve = {"voices": VoicesConfig(state_dir=str(tmp_path / "state")),
             "llm": LLMConfig(zero_shot=True, voices=["tara", "leah"])}  # fmt: skip
    try:
        async with (
            running_gateway(
                layout, backend={"realtime": True, "voices": ["tara", "me"]}, serve=serve
            ) as h,
            async_playwright() as p,
        ):
            browser = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
            try:
                page = await browser.new_page()
                await page.goto(h.url + "/")
                await page.wait_for_function("window.playground && window.playground.loaded")
                await page.fill("#voice-name", "Me")
                await page.fill("#voice-transcript", "Hello, this is my voice.")
                await page.set_input_files("#voice-file", str(tmp_path / "short.wav"))
                await page.click("#create-voice")
                await page.wait_for_function("window.playground.voiceError", timeout=30_000)
                assert await page.evaluate("window.playground.voiceError") == "audio_too_short"
                await page.set_input_files("#voice-file", str(tmp_path / "me.wav"))
                await page.click("#create-voice")
                await page.wait_for_function("window.playground.createdVoice", timeout=60_000)
                assert await page.evaluate("window.playground.createdVoice") == "me"
                assert "me" in await page.evaluate("window.playground.voices")
                assert await page.input_value("#voice") == "me"
                await page.fill("#text", "Now in my voice.")
                await page.fill("#max-tokens", str(7 * 4))
                await page.click("#speak")
                await page.wait_for_function("window.playground.state === 'done'", timeout=30_000)
                assert h.backend.submitted()[-1].voice == "me"
            finally:
                await browser.close()
    finally:
        encoder.stop()


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"{CHROMIUM} is absent")
async def test_playground_speaks_an_uploaded_text_file_as_a_job(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    """The long-text box: a text file becomes a job, its progress is shown, the file is
    offered for download."""
    from playwright.async_api import async_playwright

    from common.config.jobs import JobsConfig

    chapter = tmp_path / "chapter.txt"
    chapter.write_text(" ".join(f"Sentence {i} of the chapter." for i in range(6)))
    serve = {"jobs": JobsConfig(dir=str(tmp_path / "jobs"), poll_s=0.05)}
    async with running_gateway(layout, serve=serve) as h, async_playwright() as p:
        browser = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = await browser.new_page()
            await page.goto(h.url + "/")
            await page.wait_for_function("window.playground && window.playground.loaded === true")
            await page.fill("#max-tokens", str(7 * 4))
            await page.select_option("#job-format", "pcm")
            await page.set_input_files("#job-file", str(chapter))
            await page.click("#job-start")
            await page.wait_for_function(
                "window.playground.job && window.playground.job.bytes !== undefined",
                timeout=30_000,
            )
            job = await page.evaluate("window.playground.job")
            assert job["state"] == "done" and job["unitsDone"] == job["unitsTotal"] == 6
            assert job["bytes"] == 6 * 4 * 2048 * 2
            assert "6/6 units" in await page.inner_text("#job-status")
            assert (await page.inner_text("#job-download")).startswith("Download job_")
            assert len(h.backend.submitted()) == 6
        finally:
            await browser.close()
