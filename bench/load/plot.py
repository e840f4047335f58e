"""PNG of TTFB and RTF against offered load, with the SLO lines (matplotlib, Agg)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from bench.lib.plot import pyplot, save
from bench.load.criteria import Capacity
from bench.load.summary import LevelResult, Slo

CAPACITY_STYLE = {"published": ("tab:green", ":"), "real-time": ("green", "-"),
                  "interactive": ("darkgreen", "--")}  # fmt: skip


def _x(level: LevelResult) -> float:
    return float(level.concurrency if level.mode == "closed" else level.rate or 0.0)


def plot_levels(
    series: dict[str, Sequence[LevelResult]],
    slo: Slo,
    path: Path,
    *,
    title: str,
    capacities: Sequence[Capacity] = (),
) -> None:
    """One curve set per named series (e.g. "orpheus-serve", "baseline").

    Closed-loop levels are plotted against concurrency and open-loop levels against
    arrival rate, each in its own pair of panels.
    """
    plt = pyplot()

    modes = [
        m for m in ("closed", "open") if any(lv.mode == m for s in series.values() for lv in s)
    ]
    if not modes:
        raise ValueError("nothing to plot")
    fig, axes = plt.subplots(
        len(modes), 3, figsize=(17, 4.4 * len(modes)), squeeze=False, constrained_layout=True
    )
    for row, mode in zip(axes, modes, strict=True):
        ax_ttfb, ax_rtf, ax_tput = row
        for si, (name, levels) in enumerate(series.items()):
            pts = sorted((lv for lv in levels if lv.mode == mode), key=_x)
            if not pts:
                continue
            xs = [_x(lv) for lv in pts]
            color = f"C{si}"
            prefix = f"{name} " if len(series) > 1 else ""
            ttfb_lines = (("mean", "-.", "x"), ("p50", ":", "o"), ("p90", "--", "s"),
                          ("p99", "-", "^"))  # fmt: skip
            for q, style, marker in ttfb_lines:
                ax_ttfb.plot(
                    xs,
                    [getattr(lv.ttfb_s, q) * 1000 for lv in pts],
                    style,
                    marker=marker,
                    color=color,
                    label=f"{prefix}{q}",
                )
            for q, style, marker in (("mean", ":", "o"), ("p90", "--", "s"), ("p99", "-", "^")):
                ax_rtf.plot(
                    xs,
                    [getattr(lv.rtf, q) for lv in pts],
                    style,
                    marker=marker,
                    color=color,
                    label=f"{prefix}{q}",
                )
            ax_tput.plot(
                xs, [lv.audio_s_per_s for lv in pts], "-", marker="o", color=color,
                label=f"{prefix}audio s/s",
            )  # fmt: skip
        for budget in sorted({slo.ttfb_s, *slo.ttfb_report_s}):
            ax_ttfb.axhline(budget * 1000, color="red", alpha=0.5, lw=1)
            ax_ttfb.annotate(
                f"SLO {budget * 1000:.0f} ms",
                (0.01, budget * 1000),
                xycoords=("axes fraction", "data"),
                color="red",
                fontsize=8,
                va="bottom",
            )
        ax_rtf.axhline(slo.rtf, color="red", alpha=0.5, lw=1)
        ax_rtf.annotate(
            f"real time (RTF {slo.rtf:g})",
            (0.01, slo.rtf),
            xycoords=("axes fraction", "data"),
            color="red",
            fontsize=8,
            va="bottom",
        )
        xlabel = (
            "concurrent streams (closed loop)" if mode == "closed" else "arrivals/s (open loop)"
        )
        ax_ttfb.set(
            xlabel=xlabel, ylabel="TTFB from scheduled send (ms)", title="Time to first audio"
        )
        ax_rtf.set(
            xlabel=xlabel, ylabel="RTF = generation time / audio time", title="Real-time factor"
        )
        ax_tput.set(
            xlabel=xlabel,
            ylabel="audio seconds per wall second",
            title="Throughput (stable window)",
        )
        ax_tput.set_ylim(bottom=0)
        for ax in row:
            xs_all = [_x(lv) for s in series.values() for lv in s if lv.mode == mode]
            if xs_all and min(xs_all) > 0 and max(xs_all) / min(xs_all) >= 8:
                ax.set_xscale("log", base=2)
            ticks = sorted(set(xs_all))
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.grid(True, alpha=0.3)
            if mode == "closed":
                for cap in capacities:
                    if cap.concurrency <= 0:
                        continue
                    color, style = CAPACITY_STYLE[cap.criterion]
                    ax.axvline(
                        cap.concurrency, color=color, ls=style, alpha=0.7, lw=1.2,
                        label=f"{cap.criterion}: {'>= ' if cap.at_least else ''}"
                        f"{cap.concurrency}",
                    )  # fmt: skip
            ax.legend(fontsize=8)
        ax_ttfb.set_ylim(bottom=0)
        if any(
            not math.isnan(lv.rtf.p99) and lv.rtf.p99 > 20 * slo.rtf
            for s in series.values()
            for lv in s
        ):
            ax_rtf.set_yscale("log")  # a CPU run sits far above real time
        else:
            ax_rtf.set_ylim(bottom=0)
    fig.suptitle(title)
    save(fig, path)
