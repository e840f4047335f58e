"""``orpheus-serve bench load`` end to end against a loopback test server in a thread:
table, JSON, plot, and the capacity search finding a server's admission limit."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from bench.load.cli import main

pytestmark = pytest.mark.timeout(120)

PIECE = b"\x01\x00" * 12_000  # 0.5 s of audio


class ThreadedSpeechServer:
    """Streams 1.5 s of audio in three pieces 20 ms apart (RTF ~0.05, robust to a busy
    machine); answers 503 beyond ``limit`` streams."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.active = 0
        self.requests = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._runner: web.AppRunner | None = None

    async def speech(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        if self.limit is not None and self.active >= self.limit:
            return web.json_response(
                {"error": {"message": "at capacity", "type": "overloaded", "code": 503}},
                status=503,
                headers={"Retry-After": "1"},
            )
        self.active += 1
        released = False
        try:
            resp = web.StreamResponse(headers={"Content-Type": "audio/pcm"})
            await resp.prepare(request)
            for _ in range(3):
                await asyncio.sleep(0.02)
                await resp.write(PIECE)
            self.active -= 1  # before the end reaches the client, who may send at once
            released = True
            await resp.write_eof()
            return resp
        finally:
            if not released:
                self.active -= 1

    async def ready(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/v1/audio/speech", self.speech)
        app.router.add_get("/ready", self.ready)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> ThreadedSpeechServer:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def unlimited() -> Iterator[ThreadedSpeechServer]:
    with ThreadedSpeechServer(limit=None) as server:
        yield server


def test_load_writes_table_json_and_plot(
    unlimited: ThreadedSpeechServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_png = tmp_path / "load.json", tmp_path / "load.png"
    argv = [
        "--url", unlimited.url, "--concurrency", "1,2", "--open-rate", "5",
        "--duration", "1.0", "--warmup", "0", "--max-requests", "4", "--fixed-tokens", "70",
        "--json", str(out_json), "--plot", str(out_png), "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out_json.read_text())
    assert report["schema"] == "orpheus-serve/bench-load/1"
    assert report["machine"]["cores"] >= 1 and report["machine"]["cpu_model"]
    assert report["versions"]["torch"] and "git_commit" in report["versions"]
    assert report["config"]["fixed_tokens"] == 70
    assert report["corpus"]["long_fraction"] == 0.2
    levels = report["levels"]
    assert [(lv["mode"], lv["concurrency"], lv["rate"]) for lv in levels] == [
        ("closed", 1, None),
        ("closed", 2, None),
        ("open", None, 5.0),
    ]
    for lv in levels:
        assert lv["requests"] == 4 and lv["ok"] == 4
        assert set(lv["ttfb_s"]) == {"n", "mean", "p50", "p90", "p99", "max"}
        assert set(lv["rtf"]) >= {"mean", "p90", "p99"}
        assert 0 < lv["rtf"]["p99"] < 1
        assert lv["underruns"] == 0
        assert lv["audio_s_per_s"] > 0 and lv["tokens_per_s"] > 0
        assert set(lv["goodput_per_s"]) == {"500", "1000"}
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "TTFB" in printed and "c=2" in printed and "5/s" in printed


def test_search_finds_the_admission_limit(tmp_path: Path) -> None:
    out_json = tmp_path / "search.json"
    with ThreadedSpeechServer(limit=2) as server:
        argv = [
            "--url", server.url, "--search", "--search-start", "1", "--search-max", "8",
            "--search-resolution", "0", "--duration", "1.5", "--warmup", "0",
            "--warmup-level", "3", "--warmup-level-duration", "0.5",
            "--json", str(out_json), "--no-progress",
        ]  # fmt: skip
        assert main(argv) == 0
    report = json.loads(out_json.read_text())
    search = report["search"]
    assert search["probes"] == [1, 2, 4, 3]
    assert report["capacities"] == search["capacities"]
    caps = {c["criterion"]: c for c in report["capacities"]}
    assert list(caps) == ["published", "real-time", "interactive"]
    for cap in caps.values():
        assert cap["concurrency"] == 2 and cap["first_failure"] == 3
        assert any("failed requests" in r for r in cap["bounded_by"])
    # the warm-up level ran first, at 3 streams, is marked as such, and is in no level list
    # and no capacity (3 fails; a capacity counting the warm-up level could say 3)
    warm = report["warmup_level"]
    assert warm["concurrency"] == 3 and warm["requests"] > 0
    assert report["config"]["warmup_level"] == 3
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2, 4, 3]


def test_recompute_reads_a_stored_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = Path(__file__).resolve().parents[3] / "docs/results/h100_capacity_v1.json"
    out_json, out_png = tmp_path / "v1.json", tmp_path / "v1.png"
    assert main(["--recompute", str(src), "--json", str(out_json), "--plot", str(out_png)]) == 0
    data = json.loads(out_json.read_text())
    caps = [(c["criterion"], c["concurrency"], c["first_failure"]) for c in data["capacities"]]
    # 192, the start level, stalled: no request finished in it, a failure under all three
    assert caps == [("published", 96, 192), ("real-time", 45, 48), ("interactive", 45, 48)]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "capacity, published" in capsys.readouterr().out
    assert main(["--recompute", str(tmp_path / "missing.json")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_no_server_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--url", "http://127.0.0.1:9", "--no-progress"]) == 1
    assert "no server ready" in capsys.readouterr().err


def test_a_negative_warmup_level_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--search", "--warmup-level", "-1", "--no-progress"])
    assert exc.value.code == 2
    assert "--warmup-level: must be 0 or more" in capsys.readouterr().err
