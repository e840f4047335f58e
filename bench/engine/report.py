"""``bench engine``'s table (and the phases' table) and its PNG: t(N) and tokens/s per
variant and K, with the real-time line."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.engine.levels import mean, phase_key
from bench.engine.results import REAL_TIME_STEP_MS, VariantResult
from bench.lib.plot import pyplot, save
from bench.lib.report import show, table


def _reference(results: list[VariantResult]) -> VariantResult | None:
    """The run the others are compared with: the first one measured."""
    return next((r for r in results if r.levels), None)


def _key(r: VariantResult) -> str:
    return f"{r.variant} K={r.engines}"


def _rows(results: list[VariantResult], streams: list[int]) -> list[Sequence[str] | None]:
    first = _reference(results)
    ref = {lv.streams: lv for lv in first.levels} if first is not None else {}
    rows: list[Sequence[str] | None] = []
    for n in streams:
        for r in results:
            for lv in r.levels:
                if lv.streams != n:
                    continue
                base = ref.get(n)
                ratio = f"{lv.step_ms_p50 / base.step_ms_p50:.2f}" if base else "-"
                gain = f"{lv.tokens_per_s / base.tokens_per_s:.2f}" if base else "-"
                cpu = lv.engine_cpu_ms_per_step
                each = "/".join(f"{e.step_ms_p50:.1f}" for e in lv.per_engine) or "-"
                rows.append((
                    r.variant, str(lv.engines), str(n), f"{lv.step_ms_p50:.2f}",
                    f"{lv.step_ms_p99:.2f}", each, ratio,
                    "-" if cpu is None else f"{cpu:.2f}",
                    "-" if lv.gpu_busy_fraction is None else f"{lv.gpu_busy_fraction:.2f}",
                    f"{lv.tokens_per_s:.0f}", gain,
                ))  # fmt: skip
        rows.append(None)
    return rows


def _phase_rows(results: list[VariantResult]) -> tuple[list[str], list[Sequence[str]]]:
    names: list[str] = []
    for r in results:
        for lv in r.levels:
            for p in lv.phases_us_per_request_step or {}:
                if p not in names:
                    names.append(p)
    names.sort(key=phase_key)
    rows: list[Sequence[str]] = []
    for r in results:
        for lv in r.levels:
            ph = lv.phases_us_per_request_step
            if not ph:
                continue
            batch = mean([e.streams for e in lv.per_engine]) if lv.per_engine else lv.streams
            total = sum(ph.values())
            rows.append((
                r.variant, str(lv.engines), str(lv.streams),
                *(f"{ph[p]:.1f}" if p in ph else "-" for p in names), f"{total:.1f}",
                f"{total * batch / 1e3:.2f}", f"{lv.step_ms_p50:.2f}",
            ))  # fmt: skip
    return names, rows


PHASE_HEADERS = {
    "schedule": "schedule", "update_from_output": "update", "runner_update_states": "states",
    "runner_prepare_inputs": "inputs", "runner_bookkeeping": "bookkeep", "serialize": "serialize",
}  # fmt: skip
"""Short column names of the phases (docs/benchmarks.md says what each holds)."""


def print_table(results: list[VariantResult], streams: list[int]) -> None:
    first = _reference(results)
    ref = _key(first) if first else "-"
    columns = ("variant", "K", "N", "p50 ms", "p99 ms", "p50 per engine", "p50/ref",
               "core ms/step", "GPU busy", "tokens/s", "tok/s/ref")  # fmt: skip
    title = "engine step against total streams N over K engines (closed loop, fixed length)"
    lines = [f"{_key(r)}: {r.status}: {r.reason}" for r in results if r.status != "ok"]
    rows = _rows(results, streams)
    out: list[Any] = [
        table(title, columns, rows, left=("variant",), no_wrap=True),
        f"ref: {ref}; p50/p99: the slowest engine's; core: each engine core's CPU per step, "
        "the engines' mean",
    ]
    names, phase_rows = _phase_rows(results)
    if phase_rows:
        headers = [PHASE_HEADERS.get(n, n) for n in names]
        out.append(
            table(
                "engine-core host time by phase, µs per request-step (engines' mean)",
                ("variant", "K", "N", *headers, "sum", "sum×N/K ms", "p50 ms"),
                phase_rows,
                left=("variant",),
                no_wrap=True,
            )
        )
    for r in results:
        if r.phase_timers:
            missing = r.phase_timers.rpartition("not in this vLLM: ")[2]
            out.append(f"{_key(r)} phase timers: methods not in this vLLM: {missing}")
    show(*out, *lines, min_width=150)


def plot(results: list[VariantResult], path: Path, title: str) -> None:
    plt = pyplot()

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 5), constrained_layout=True)
    markers = "os^DvPX*"
    for i, r in enumerate(x for x in results if x.levels):
        color = f"C{i}"  # a colour per (variant, K), a marker per K
        marker = "-" + markers[(r.engines - 1) % len(markers)]
        xs = [lv.streams for lv in r.levels]
        label = f"{r.variant}, K={r.engines}"
        ax.plot(xs, [lv.step_ms_p50 for lv in r.levels], marker, color=color,
                label=f"{label} p50")  # fmt: skip
        ax.plot(xs, [lv.step_ms_p99 for lv in r.levels], ":", color=color, alpha=0.6)
        ax2.plot(xs, [lv.tokens_per_s for lv in r.levels], marker, color=color, label=label)
    ax.axhline(REAL_TIME_STEP_MS, color="red", linestyle=":",
               label=f"real time ({REAL_TIME_STEP_MS} ms)")  # fmt: skip
    ax.set_xlabel("concurrent streams N (all engines)")
    ax.set_ylabel("step time t(N), ms (slowest engine; p99 dotted)")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax2.set_xlabel("concurrent streams N (all engines)")
    ax2.set_ylabel("tokens/s (all engines)")
    ax2.set_title("aggregate throughput")
    ax2.set_ylim(bottom=0)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    save(fig, path)
