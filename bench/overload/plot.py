"""PNG of a ``bench overload`` run (matplotlib, Agg): per arm, the server's limit and active
streams and the streams' lead over the run, level by level; then goodput and share
real-time against clients, the arms side by side."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.lib.plot import pyplot, save
from bench.overload.report import ArmResult, OverloadReport

LIMIT = "orpheus_gateway_capacity"
ACTIVE = "orpheus_gateway_active_streams"
QUEUED = "orpheus_gateway_queued_streams"
SATURATION = "orpheus_gateway_saturation"
OFF_SCALE = 4.0
"""A limit more than this many times the most streams ever offered is drawn off scale."""


def _xy(pairs: list[list[float]]) -> tuple[list[float], list[float]]:
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _phases(ax: Any, arm: ArmResult) -> None:
    for i, ph in enumerate(arm.timeline.phases):
        ax.axvspan(ph.start, ph.end, color="grey", alpha=0.08 if i % 2 else 0.16, lw=0)
        ax.annotate(
            ph.label, ((ph.start + ph.end) / 2, 1.005), xycoords=("data", "axes fraction"),
            ha="center", va="bottom", fontsize=7, color="dimgrey",
        )  # fmt: skip


def _streams_panel(ax: Any, arm: ArmResult) -> None:
    g = arm.timeline.gauges
    offered = [(ph.start, ph.end, ph.clients) for ph in arm.timeline.phases]
    for start, end, clients in offered:
        ax.plot([start, end], [clients, clients], color="black", lw=1, ls=":")
    ax.plot([], [], color="black", lw=1, ls=":", label="clients offered")
    most = max([c for _, _, c in offered] + [v for _, v in g.get(ACTIVE, [])], default=1.0)
    for name, label, style in ((ACTIVE, "active streams", "C0-"), (QUEUED, "queued", "C1--")):
        if name in g:
            ax.plot(*_xy(g[name]), style, lw=1.2, label=label)
    if LIMIT in g:
        xs, ys = _xy(g[LIMIT])
        if max(ys) > OFF_SCALE * most:
            ys = [min(y, OFF_SCALE * most) for y in ys]
            label = f"limit (capacity; max {max(_xy(g[LIMIT])[1]):.0f}, clipped)"
        else:
            label = "limit (orpheus_gateway_capacity)"
        ax.plot(xs, ys, "C3-", lw=1.6, label=label)
    ax.set(xlabel="time (s)", ylabel="streams")
    ax.set_title(f"{arm.name}: limit and streams", pad=14)
    ax.set_ylim(bottom=0)
    if SATURATION in g:
        ax2 = ax.twinx()
        ax2.plot(*_xy(g[SATURATION]), "C2:", lw=1, label="saturation")
        ax2.set_ylim(0, 1.05)
        ax2.set_ylabel("saturation")
        ax2.legend(loc="upper right", fontsize=7)
    ax.legend(loc="upper left", fontsize=7)


def _lead_panel(ax: Any, arm: ArmResult, jitter_buffer_s: float) -> None:
    points: list[tuple[float, float, float]] = []
    for s in arm.timeline.lead:
        if points and s.t - points[-1][0] > 2 * arm.timeline.interval_s:
            points.append((math.nan, math.nan, math.nan))  # nothing played: no line across
        points.append((s.t, s.p50_s, s.min_s))
    if points:
        ts, p50, least = zip(*points, strict=True)
        ax.plot(ts, p50, "C0-", lw=1.2, label="median stream")
        ax.plot(ts, least, "C3-", lw=1, label="least-ahead stream")
    ax.axhline(0, color="red", lw=1, alpha=0.6)
    ax.annotate(
        "underrun below", (0.01, 0), xycoords=("axes fraction", "data"), color="red",
        fontsize=7, va="top",
    )  # fmt: skip
    ax.set(xlabel="time (s)", ylabel="audio held by the player (s)")
    ax.set_title(
        f"{arm.name}: streams' lead ({jitter_buffer_s * 1000:.0f} ms jitter buffer)", pad=14
    )
    ax.set_yscale("symlog", linthresh=1.0)
    ax.legend(loc="upper left", fontsize=7)


def _levels_panels(ax_rate: Any, ax_share: Any, report: OverloadReport) -> None:
    for i, arm in enumerate(report.arms):
        levels = sorted(arm.levels, key=lambda lv: lv.concurrency)
        xs = [lv.concurrency for lv in levels]
        ax_rate.plot(xs, [lv.realtime_per_s for lv in levels], "o-", color=f"C{i}", label=arm.name)
        ax_share.plot(
            xs, [100 * lv.share_realtime for lv in levels], "o-", color=f"C{i}", label=arm.name
        )
    ticks = sorted({lv.concurrency for arm in report.arms for lv in arm.levels})
    for ax in (ax_rate, ax_share):
        if ticks and max(ticks) / min(ticks) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_rate.set(xlabel="clients (closed loop)", ylabel="real-time streams/s", title="Goodput")
    ax_rate.set_ylim(bottom=0)
    ax_share.set(
        xlabel="clients (closed loop)", ylabel="% of answered streams", title="Share real-time"
    )
    ax_share.set_ylim(0, 105)


def plot_report(report: OverloadReport, path: Path) -> None:
    plt = pyplot()

    with_levels = any(arm.levels for arm in report.arms)
    rows = len(report.arms) + (1 if with_levels else 0)
    fig, axes = plt.subplots(
        rows, 2, figsize=(16, 4.2 * rows), squeeze=False, constrained_layout=True
    )
    for row, arm in zip(axes, report.arms, strict=False):
        _streams_panel(row[0], arm)
        _lead_panel(row[1], arm, report.slo.jitter_buffer_s)
        for ax in row:
            _phases(ax, arm)
    if with_levels:
        _levels_panels(axes[-1][0], axes[-1][1], report)
    fig.suptitle(
        f"overload: {report.model} on {report.device}, arms {', '.join(a.name for a in report.arms)}"
    )
    save(fig, path, dpi=100)
