"""The playground page at / in headless Chromium (Debian's chromium driven by Playwright):
voices load, audio streams into Web Audio, TTFB is shown, errors are shown."""

from __future__ import annotations

import os

import pytest
from gateway_harness import running_gateway

from shm.layout import InstanceLayout

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
