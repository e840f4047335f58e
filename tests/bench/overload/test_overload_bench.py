"""``bench overload``: which stream is real-time, a level's numbers, refusal latency, the
server's gauges and the streams' lead (hand-built traces, no timing); and one short run of the
command against two real servers (tiny model on CPU)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import msgspec
import pytest
from rich.console import Console

from bench.load.summary import LevelRun, Slo
from bench.load.trace import Outcome, StreamTrace, stream_metrics
from bench.overload.classify import (
    OverloadLevel,
    aggregate,
    is_realtime,
    refusal_code,
    refusal_latency,
    verdict,
)
from bench.overload.cli import (
    DEFAULT_ARMS,
    Arm,
    ArmError,
    arms_from_args,
    build_parser,
    server_argv,
)
from bench.overload.shares import key_shares, weights_of
from bench.overload.timeline import lead_series, parse_gauges

SLO = Slo(ttfb_s=1.0, ttfb_report_s=(1.0,), jitter_buffer_s=0.1)
SECOND = 48_000  # bytes of one second of 24 kHz int16 audio


def stream(
    index: int,
    scheduled: float,
    pieces: list[tuple[float, float]],
    *,
    measured: bool = True,
) -> StreamTrace:
    """Answered 200; ``pieces``: (arrival time, audio seconds) in order."""
    t = StreamTrace(index=index, kind="short", chars=20, scheduled=scheduled, measured=measured)
    t.sent, t.status, t.outcome = scheduled, 200, Outcome.OK
    for at, seconds in pieces:
        t.record(at, int(seconds * SECOND))
    t.done = pieces[-1][0]
    return t


def refused(index: int, scheduled: float, answered_at: float, status: int = 429) -> StreamTrace:
    t = StreamTrace(index=index, kind="short", chars=20, scheduled=scheduled, measured=True)
    t.sent, t.status, t.outcome, t.done = scheduled, status, Outcome.HTTP_ERROR, answered_at
    t.error = "busy"
    return t


def realtime(trace: StreamTrace) -> bool:
    return is_realtime(stream_metrics(trace, jitter_buffer_s=SLO.jitter_buffer_s), SLO)


def test_a_stream_is_realtime_when_its_first_byte_is_in_time_and_it_never_runs_dry() -> None:
    # first byte 0.5 s after the scheduled send; 1 s, then 1 s more at 1.4 s: the player
    # (started at 0.6 s) needs the second second at 1.6 s
    assert realtime(stream(0, 0.0, [(0.5, 1.0), (1.4, 1.0)]))
    # the same audio, the second piece 0.1 s after the player needed it: an underrun
    assert not realtime(stream(1, 0.0, [(0.5, 1.0), (1.7, 1.0)]))
    # smooth, but the first byte came 1.2 s after the scheduled send
    assert not realtime(stream(2, 0.0, [(1.2, 1.0), (1.9, 1.0)]))
    # refused: not answered, so never real-time
    assert not realtime(refused(3, 0.0, 0.05))


def test_refusal_latency_runs_from_the_scheduled_send_to_the_answer() -> None:
    assert refusal_latency(refused(0, 10.0, 10.25)) == pytest.approx(0.25)
    assert refusal_latency(refused(1, 10.0, 12.0, status=503)) == pytest.approx(2.0)
    assert refusal_latency(stream(2, 0.0, [(0.5, 1.0)])) is None
    other = refused(3, 0.0, 0.1, status=400)
    assert refusal_latency(other) is None


def test_a_level_counts_answered_realtime_refused_and_failed() -> None:
    broken = StreamTrace(index=5, kind="long", chars=400, scheduled=3.0, measured=True)
    broken.sent, broken.status, broken.outcome, broken.done = 3.0, 200, Outcome.BROKEN, 4.0
    broken.error = "ClientPayloadError: reset"
    traces = [
        stream(0, 0.0, [(0.3, 2.0)], measured=False),  # first wave: real-time, not measured
        stream(1, 2.0, [(2.4, 1.0), (3.3, 1.0)]),  # real-time
        stream(2, 2.5, [(3.0, 1.0), (4.9, 1.0)]),  # underrun
        stream(3, 3.0, [(4.5, 1.0)]),  # TTFB 1.5 s
        refused(4, 3.5, 3.6),
        broken,
        refused(6, 5.0, 5.3, status=503),
        stream(7, 9.0, [(9.2, 1.0)], measured=False),  # a filler, ends after the window
    ]
    run = LevelRun(
        mode="closed",
        concurrency=3,
        started=0.0,
        measure_start=1.0,
        measure_end=6.0,
        finished=10.0,
        traces=traces,
    )
    lv = aggregate(run, SLO, label="c=3")
    assert (lv.label, lv.concurrency, lv.key) == ("c=3", 3, None)
    assert (lv.requests, lv.answered, lv.realtime, lv.refused, lv.failed) == (6, 3, 1, 2, 1)
    assert lv.share_realtime == pytest.approx(1 / 3)
    # real-time streams that ended inside [1, 6], any of the level's: #1 only (#0 ended at
    # 0.3, before the window), over the window's 5 s
    assert lv.realtime_per_s == pytest.approx(1 / 5)
    assert lv.refusal_s.n == 2
    assert lv.refusal_s.p50 == pytest.approx(0.2)
    assert lv.refusals == {"429": 1, "503": 1}
    assert lv.refusal_codes == {"429": 1, "503": 1}  # "busy": no code in the body
    assert lv.errors == {"ClientPayloadError: reset": 1}
    assert lv.ttfb_s.n == 3 and lv.ttfb_s.max == pytest.approx(1.5)
    assert lv.window_s == pytest.approx(5.0)
    # audio that arrived inside the window: streams 1 (2 s), 2 (2 s), 3 (1 s), 0 and 7 outside
    assert lv.audio_s_per_s == pytest.approx(5.0 / 5)


def test_a_refusal_is_counted_by_the_code_its_body_names() -> None:
    openai, eleven = refused(0, 0.0, 0.1), refused(1, 0.0, 0.1)
    openai.error = '{"error":{"message":"m","type":"rate_limit_error","param":null,"code":"too_many_concurrent_requests"}}'
    eleven.error = '{"detail":{"status":"system_busy","message":"m"}}'
    assert (refusal_code(openai), refusal_code(eleven)) == (
        "too_many_concurrent_requests",
        "system_busy",
    )


def test_each_key_is_judged_against_its_fair_share_and_its_solo_rate() -> None:
    def mixed(key: str, clients: int, rate: float, share: float) -> OverloadLevel:
        return msgspec.structs.replace(
            level(clients, share, rate), key=key, refusal_codes={"server_busy": 1}
        )

    # The node played 0.57 streams/s under the flood; B alone played 0.2 (less than half):
    # its fair rate is its solo rate, and A's the rest.
    a, b = mixed("a", 16, 0.4, 0.8), mixed("b", 1, 0.17, 1.0)
    sa, sb = key_shares("fairness 16+1", [a, b], {"b": 0.2}, {})
    assert sa.fair_realtime_per_s == pytest.approx(0.37) and sa.held is None
    assert sb.fair_realtime_per_s == pytest.approx(0.2) and sb.of_bound == pytest.approx(0.85)
    assert sb.held and sb.refusal_codes == {"server_busy": 1}
    # Three keys, B weighing 2: a node of 0.8 gives B 0.4, C and A 0.2 each; C at 0.1 holds
    # half of its share: not held.
    a, b, c = mixed("a", 16, 0.3, 1.0), mixed("b", 1, 0.4, 1.0), mixed("c", 1, 0.1, 1.0)
    weights = weights_of(["gateway.admission=learned", 'gateway.key_weights={"b": 2}'])
    assert weights == {"b": 2.0}
    shares = key_shares("fairness 16+1+1", [a, b, c], {"b": 1.0, "c": 1.0}, weights)
    assert [s.fair_realtime_per_s for s in shares] == pytest.approx([0.2, 0.4, 0.2])
    assert [s.held for s in shares] == [None, True, False]


def test_a_level_with_nothing_answered_has_no_share() -> None:
    run = LevelRun(
        mode="closed",
        concurrency=1,
        started=0.0,
        measure_start=1.0,
        measure_end=3.0,
        finished=3.0,
        traces=[refused(0, 1.5, 1.6)],
    )
    lv = aggregate(run, SLO, label="c=1")
    assert lv.answered == 0 and math.isnan(lv.share_realtime) and lv.realtime_per_s == 0.0


def level(clients: int, share: float, per_s: float, refusal_p99: float | None = None):  # type: ignore[no-untyped-def]
    """A level with ``per_s`` real-time streams/s over a 10 s window and ``share`` of its
    answered streams real-time (100 answered)."""
    traces = []
    good = round(100 * share)
    for i in range(100):
        t0 = 1.0 + i * 0.05
        pieces = [(t0 + 0.2, 1.0)] if i < good else [(t0 + 1.5, 1.0)]
        traces.append(stream(i, t0, pieces))
    # real-time streams/s are counted over the window: scale it to give per_s
    window = good / per_s if per_s else 10.0
    if refusal_p99 is not None:
        traces.append(refused(100, 2.0, 2.0 + refusal_p99))
    run = LevelRun(
        mode="closed",
        concurrency=clients,
        started=0.0,
        measure_start=1.0,
        measure_end=1.0 + window,
        finished=1.0 + window,
        traces=traces,
    )
    return aggregate(run, SLO, label=f"c={clients}")


def test_the_verdict_judges_the_highest_level_against_the_best() -> None:
    collapsed = [level(1, 1.0, 1.5), level(2, 0.98, 2.5), level(16, 0.01, 0.02)]
    v = verdict(collapsed)
    assert v is not None
    assert (v.level, v.best_level, v.held) == ("c=16", "c=2", False)
    assert v.share_realtime == pytest.approx(0.01)
    held = [level(1, 1.0, 1.5), level(2, 1.0, 2.5), level(16, 0.96, 2.2, refusal_p99=0.05)]
    v = verdict(held)
    assert v is not None and v.held and v.goodput_ratio == pytest.approx(2.2 / 2.5, rel=0.05)
    slow_refusals = [level(2, 1.0, 2.5), level(16, 0.96, 2.2, refusal_p99=3.0)]
    v = verdict(slow_refusals)
    assert v is not None and not v.held and v.refusal_p99_s == pytest.approx(3.0)
    assert verdict([]) is None


def test_gauges_are_read_from_the_exposition_and_summed_over_labels() -> None:
    text = "\n".join(
        [
            "# HELP orpheus_gateway_active_streams Streams admitted",
            "# TYPE orpheus_gateway_active_streams gauge",
            "orpheus_gateway_active_streams 3.0",
            'orpheus_gateway_engine_active_streams{engine="0"} 2.0',
            'orpheus_gateway_engine_active_streams{engine="1"} 1.0',
            "orpheus_gateway_saturation 0.046875",
            "orpheus_gateway_active_streams_total 99",
            'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
        ]
    )
    names = [
        "orpheus_gateway_active_streams",
        "orpheus_gateway_engine_active_streams",
        "orpheus_gateway_saturation",
        "orpheus_gateway_capacity",
    ]
    assert parse_gauges(text, names) == {
        "orpheus_gateway_active_streams": 3.0,
        "orpheus_gateway_engine_active_streams": 3.0,
        "orpheus_gateway_saturation": 0.046875,
    }


def test_the_lead_is_audio_received_minus_audio_played() -> None:
    a = stream(0, 0.0, [(1.0, 1.0), (2.5, 1.0)])  # its player starts at 1.1 s
    b = stream(1, 0.0, [(2.0, 0.5), (3.2, 0.5)])  # starts at 2.1 s, runs dry at 2.6 s
    samples = lead_series([a, b], [0.5, 1.0, 1.5, 2.0, 3.0, 4.0], SLO.jitter_buffer_s)
    by_t = {s.t: s for s in samples}
    # a stream counts from its first byte to its last: nothing at 0.5 s nor at 4.0 s
    assert sorted(by_t) == [1.0, 1.5, 2.0, 3.0]
    assert by_t[1.0].streams == 1 and by_t[1.0].min_s == pytest.approx(1.0)
    assert by_t[1.5].min_s == pytest.approx(1.0 - 0.4)
    assert by_t[2.0].streams == 2
    assert by_t[2.0].min_s == pytest.approx(1.0 - 0.9)
    assert by_t[2.0].p50_s == pytest.approx((0.1 + 0.5) / 2)
    # at 3.0 s, a has ended; b has received 0.5 s and played 0.9 s: 0.4 s dry
    assert by_t[3.0].streams == 1 and by_t[3.0].min_s == pytest.approx(-0.4)


def test_arms_default_to_fixed_and_learned_admission() -> None:
    assert arms_from_args([], []) == [Arm(n, o) for n, o in DEFAULT_ARMS.items()]
    assert [a.overrides for a in arms_from_args([], [])] == [
        ["gateway.admission=fixed"],
        ["gateway.admission=learned"],
    ]
    arms = arms_from_args(
        ["fixed", "low"],
        ["low:gateway.max_active_streams=2", 'low:gateway.key_max_streams={"a": 1}'],
    )
    assert arms == [
        Arm("fixed", []),
        Arm("low", ["gateway.max_active_streams=2", 'gateway.key_max_streams={"a": 1}']),
    ]
    for names, sets in (
        ([], ["low:gateway.max_active_streams=2"]),
        (["a", "a"], []),
        (["a"], ["b:gateway.port=1"]),
        (["a"], ["a=gateway.port=1"]),
    ):
        with pytest.raises(ArmError):
            arms_from_args(names, sets)


def test_the_server_gets_the_shared_settings_then_the_keys_then_the_arms() -> None:
    args = build_parser().parse_args(
        ["--model", "m", "--device", "cpu", "--scenario", "fairness", "--keys", "ka,kb",
         "--set", "llm.max_num_seqs=8"]
    )  # fmt: skip
    argv = server_argv(Arm("low", ['gateway.api_keys=["ka"]']), args, 8123)
    sets = [a for a in argv if a.startswith("--set=")]
    assert sets == [
        "--set=llm.max_num_seqs=8",
        '--set=gateway.api_keys=["ka", "kb"]',
        '--set=gateway.api_keys=["ka"]',
    ]
    assert argv[argv.index("--port") + 1] == "8123" and "--codec-model" not in argv


def test_the_report_prints_each_arm_and_plots_the_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.lib.environment import machine, versions
    from bench.overload.plot import plot_report
    from bench.overload.report import ArmResult, OverloadReport, Phase, Timeline, print_report
    from bench.overload.timeline import LeadSample

    def arm(name: str, capacity: float | None) -> ArmResult:
        levels = [level(1, 1.0, 1.5), level(2, 0.98, 2.5), level(16, 0.5, 0.5, refusal_p99=0.1)]
        gauges = {"orpheus_gateway_active_streams": [[0.0, 0.0], [1.0, 2.0], [2.0, 16.0]]}
        if capacity is not None:
            gauges["orpheus_gateway_capacity"] = [[0.0, capacity], [2.0, capacity]]
        lead = [LeadSample(t=t, streams=1, p50_s=0.5, min_s=-0.2) for t in (0.5, 1.0, 5.0)]
        return ArmResult(
            name=name, overrides=[f"gateway.admission={name}"], argv=[], log="x",
            ready_after_s=1.0, warmup_level=None, levels=levels, verdict=verdict(levels),
            fairness=[level(16, 0.2, 0.3), level(1, 1.0, 1.0)],
            shares=key_shares("fairness 16+1", [level(16, 0.2, 0.3), level(1, 1.0, 1.0)], {}, {}),
            timeline=Timeline(
                interval_s=0.5, gauges=gauges, scrape_errors=0, lead=lead,
                phases=[Phase(label="c=1", clients=1, start=0.0, end=2.0)],
            ),
        )  # fmt: skip

    report = OverloadReport(
        created="now", machine=machine(), versions=versions(), config={}, corpus={}, slo=SLO,
        model="tiny", device="cpu", scenario="both",
        arms=[arm("fixed", 256.0), arm("learned", 3.0)],
    )  # fmt: skip
    print_report(Console(width=250), report)
    printed = capsys.readouterr().out
    for text in ("arm fixed: gateway.admission=fixed", "share real-time", "refusal ms p50/p99",
                 "arm learned at c=16", "not held", "arm learned, fairness: key B",
                 "fair shares", "of min(fair, solo)"):  # fmt: skip
        assert text in printed, text
    png = tmp_path / "overload.png"
    plot_report(report, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- one short run against real servers ----------------------------------------------------


CLIENTS = 6


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_overload_runs_two_arms_against_real_servers(tiny_model: Path, tmp_path: Path) -> None:
    """The default arms (fixed and learned admission) each with one short level of six
    clients, more than the two-core machine plays in real time, and the fairness scenario:
    the whole path, refusals included, end to end.

    The learned arm's node learns a limit below the load (``orpheus_gateway_capacity``),
    answers every request with audio or a 429 (never a 5xx), refuses within the TTFB budget
    (not after ``gateway.queue_timeout_s``), and never holds more streams than the highest
    limit it has had (a falling limit cuts nobody). Whether its streams play in real time
    depends on what else the machine runs: that is the bench's to measure on a quiet machine
    and tests/gateway/admission/test_capacity.py's to check against a node of known capacity."""
    from bench.overload.cli import main

    out, png = tmp_path / "overload.json", tmp_path / "overload.png"
    argv = [
        "--model", str(tiny_model), "--device", "cpu", "--scenario", "both",
        "--concurrency", str(CLIENTS), "--duration", "12", "--warmup", "0",
        "--drain-timeout", "60", "--warmup-level", "0", "--flood-clients", "3",
        "--solo-duration", "6",
        "--fixed-tokens", "168",
        "--ready-timeout", os.environ.get("LOADGEN_TEST_READY_S", "420"),
        "--log-dir", str(tmp_path / "logs"), "--json", str(out), "--plot", str(png),
        "--no-progress",
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["schema"] == "orpheus-serve/bench-overload/1"
    assert [(a["name"], a["overrides"]) for a in report["arms"]] == [
        ("fixed", ["gateway.admission=fixed"]),
        ("learned", ["gateway.admission=learned"]),
    ]
    for arm in report["arms"]:
        (lv,) = arm["levels"]
        assert lv["label"] == f"c={CLIENTS}" and lv["requests"] > 0
        assert lv["answered"] + lv["refused"] + lv["failed"] == lv["requests"]
        assert lv["answered"] >= 1 and lv["failed"] == 0, lv
        assert [f["key"] for f in arm["fairness"]] == ["bench-key-flood", "bench-key-single"]
        assert all(f["requests"] > 0 for f in arm["fairness"])
        gauges = arm["timeline"]["gauges"]
        assert {"orpheus_gateway_active_streams", "orpheus_gateway_capacity"} <= set(gauges)
        assert max(v for _, v in gauges["orpheus_gateway_active_streams"]) >= 1
        assert [p["label"] for p in arm["timeline"]["phases"]] == [
            f"c={CLIENTS}",
            "solo key B c=1",
            "fairness 3+1",
        ]
        assert [(s["key"], s["clients"]) for s in arm["shares"]] == [
            ("bench-key-flood", 3),
            ("bench-key-single", 1),
        ]
        assert arm["timeline"]["lead"]
    fixed, learned = report["arms"]
    assert fixed["levels"][0]["refused"] == 0  # 64 slots on the CPU profile: all admitted
    lv = learned["levels"][0]
    assert lv["refused"] >= 1 and lv["refusals"].keys() <= {"429"}, lv
    assert lv["refusal_s"]["p99"] < 2.0, lv["refusal_s"]  # the TTFB budget, not 10 s
    gauges = learned["timeline"]["gauges"]
    capacity = [v for _, v in gauges["orpheus_gateway_capacity"]]
    assert 0 < capacity[-1] < CLIENTS, capacity  # below 1: the node holds no stream in real time
    highest = 0.0
    active = dict(gauges["orpheus_gateway_active_streams"])
    for t, limit in gauges["orpheus_gateway_capacity"]:
        highest = max(highest, math.ceil(limit))  # the limit in force is at least 1
        assert active.get(t, 0) <= highest, (t, active.get(t), highest)
    # Fair shares: the light key waits for its turn (never refused for the node or a share),
    # and the flood, while the light key has demand, is refused for its share.
    flood, light = learned["fairness"]
    assert set(light["refusal_codes"]) <= {"queue_timeout"}, light["refusal_codes"]
    over_share = flood["refusal_codes"].get("too_many_concurrent_requests", 0)
    assert over_share >= 0.5 * flood["refused"], flood["refusal_codes"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_result_files_name_the_command_relative_to_the_directory_run_from(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from bench.load.servers import recorded_argv

    monkeypatch.chdir(tmp_path)
    exe = str(tmp_path / ".venv" / "bin" / "orpheus-serve")
    assert recorded_argv([exe, "serve", "--port", "1"]) == [
        os.path.join(".venv", "bin", "orpheus-serve"), "serve", "--port", "1",
    ]  # fmt: skip
    assert recorded_argv(["/usr/bin/orpheus-serve", "serve"]) == ["/usr/bin/orpheus-serve", "serve"]
