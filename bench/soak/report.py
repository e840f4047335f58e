"""A soak's report from its streams and samples, its table and its PNG."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from bench.lib.environment import machine, versions
from bench.lib.plot import pyplot, save
from bench.soak.clients import Soak
from bench.soak.growth import GrowthCheck, check_growth, default_warmup_s
from bench.soak.probe_growth import print_probe, summarize
from bench.soak.results import EXPECTED, OUTCOMES, SCENARIOS, Sample, SoakReport


def build_report(soak: Soak, start: Sample, end: Sample) -> SoakReport:
    table: dict[str, dict[str, int]] = {}
    for name in [*SCENARIOS, "flood"]:
        counts = Counter(s.outcome for s in soak.streams if s.scenario == name)
        table[name] = {o: counts.get(o, 0) for o in OUTCOMES}
    failures = [
        f"{s.scenario} at {s.started:.0f}s: {s.outcome} {s.status} {s.detail}"
        for s in soak.streams
        if s.outcome not in EXPECTED[s.scenario]
    ][:50]
    a = soak.args
    warmup = a.warmup if a.warmup is not None else default_warmup_s(a.duration)
    return SoakReport(
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        duration_s=a.duration,
        users=a.users,
        flood_size=a.flood_size,
        flood_every_s=a.flood_every,
        hang_s=a.hang_s,
        url=soak.url,
        outcomes=table,
        hung=sum(1 for s in soak.streams if s.outcome == "hung"),
        streams=len(soak.streams),
        samples=soak.samples,
        start=start,
        end=end,
        growth={
            "rss_mb": round((end.rss_bytes - start.rss_bytes) / 1e6, 1),
            "fds": float(end.fds - start.fds),
            "shm_mb": round((end.shm_bytes - start.shm_bytes) / 1e6, 2),
        },
        failures=failures,
        after_warmup=check_growth(
            [start, *soak.samples, end],
            warmup,
            bound_pct=a.growth_bound_pct,
            floor_mb=a.growth_floor_mb,
            floors_mb=dict(a.growth_floor),
        ),
        probe=(
            summarize(a.profile_memory, soak.started_at + warmup)
            if a.profile_memory is not None
            else None
        ),
        machine=machine(),
        versions=versions(),
    )


def print_growth(g: GrowthCheck) -> None:
    print(f"\nprivate RSS (RSS less shared ring pages) after the warm-up ({g.warmup_s:.0f} s), over "
          f"the last {g.window_s:.0f} s: the lowest in the first {g.level_window_s:.0f} s against "
          f"the lowest in the last {g.level_window_s:.0f} s; bound: {g.bound_pct:g}% of the "
          f"first, at least {g.floor_mb:g} MB"
          + "".join(f", {name}: {mb:g} MB" for name, mb in g.floors_mb.items()))  # fmt: skip
    print(f"{'process':28s} {'at warm-up MB':>14s} {'end MB':>8s} {'peak MB':>8s} "
          f"{'growth MB':>10s} {'%':>6s} {'MB/h':>8s} {'bound MB':>9s}")  # fmt: skip
    for p in g.processes:
        flag = "" if p.ok else "  <- over"
        print(f"{p.name:28s} {p.base_mb:14.1f} {p.end_mb:8.1f} {p.peak_mb:8.1f} "
              f"{p.growth_mb:+10.1f} {p.growth_pct:+6.1f} {p.slope_mb_per_h:+8.1f} "
              f"{p.bound_mb:9.1f}{flag}")  # fmt: skip
    print(f"fds {g.fds_growth:+d}; /dev/shm {g.shm_segments_growth:+d} segments, "
          f"{g.shm_size_growth_mb:+.1f} MB")  # fmt: skip
    if g.passed:
        print("growth: PASS (every process within its bound; fds and /dev/shm flat)")
    for line in g.problems:
        print(f"growth: FAIL: {line}")


def _by_name(sample: Sample) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for p in sample.processes:
        rss, fds = out.get(p.name, (0, 0))
        out[p.name] = (rss + p.rss_bytes, fds + p.fds)
    return out


def print_report(r: SoakReport) -> None:
    print(f"\nsoak: {r.duration_s:.0f}s, {r.users} users, flood of {r.flood_size} every "
          f"{r.flood_every_s:.0f}s; {r.streams} streams; hung: {r.hung}")  # fmt: skip
    print(f"{'scenario':12s}" + "".join(f"{o:>13s}" for o in OUTCOMES))
    for name, counts in r.outcomes.items():
        print(f"{name:12s}" + "".join(f"{counts[o]:13d}" for o in OUTCOMES))
    print(f"\n{'process':28s} {'RSS start MB':>13s} {'RSS end MB':>11s} {'fds start':>10s} "
          f"{'fds end':>8s}")  # fmt: skip
    s, e = _by_name(r.start), _by_name(r.end)
    for name in sorted(set(s) | set(e)):
        rs, fs = s.get(name, (0, 0))
        re_, fe = e.get(name, (0, 0))
        print(f"{name:28s} {rs / 1e6:13.0f} {re_ / 1e6:11.0f} {fs:10d} {fe:8d}")
    print(f"{'total':28s} {r.start.rss_bytes / 1e6:13.0f} {r.end.rss_bytes / 1e6:11.0f} "
          f"{r.start.fds:10d} {r.end.fds:8d}")  # fmt: skip
    print(f"/dev/shm (instance): {r.start.shm_bytes / 1e6:.1f} MB -> {r.end.shm_bytes / 1e6:.1f} MB;"
          f" machine-wide {r.start.shm_total_bytes / 1e6:.1f} -> {r.end.shm_total_bytes / 1e6:.1f} MB")  # fmt: skip
    print("\np99 TTFB over time:")
    for smp in r.samples:
        p99 = f"{smp.ttfb_p99_s * 1000:.0f} ms" if smp.ttfb_p99_s is not None else "-"
        print(f"  t={smp.t_s:5.0f}s  {smp.streams:4d} streams  p99 {p99}")
    if r.after_warmup is not None:
        print_growth(r.after_warmup)
    if r.probe is not None:
        print_probe(r.probe)
    if r.failures:
        print(f"\nunexpected outcomes ({len(r.failures)} shown):")
        for f in r.failures[:10]:
            print(f"  {f}")


def plot_report(r: SoakReport, path: Path) -> None:
    plt = pyplot()

    samples = [r.start, *r.samples, r.end]
    t = [s.t_s for s in samples]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.4), constrained_layout=True)
    ax = axes[0]
    pts = [(s.t_s, s.ttfb_p99_s * 1000) for s in r.samples if s.ttfb_p99_s is not None]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="p99")
    pts50 = [(s.t_s, s.ttfb_p50_s * 1000) for s in r.samples if s.ttfb_p50_s is not None]
    if pts50:
        ax.plot([p[0] for p in pts50], [p[1] for p in pts50], "s--", label="p50")
    ax.set(title="TTFB per interval", xlabel="time (s)", ylabel="ms")
    ax.legend()
    ax = axes[1]
    names = sorted({p.name for s in samples for p in s.processes})
    for name in names:
        ax.plot(t, [_by_name(s).get(name, (0, 0))[0] / 1e6 for s in samples], label=name)
    ax.plot(t, [s.rss_bytes / 1e6 for s in samples], "k-", lw=2, label="total")
    if r.after_warmup is not None:
        ax.axvline(r.after_warmup.warmup_s, color="grey", ls=":", label="end of warm-up")
    ax.set(title="RSS by process", xlabel="time (s)", ylabel="MB")
    ax.legend(fontsize=7)
    ax = axes[2]
    ax.plot(t, [s.fds for s in samples], "b-", label="open fds")
    ax.set(title="open fds and /dev/shm", xlabel="time (s)", ylabel="fds")
    ax2 = ax.twinx()
    ax2.plot(t, [s.shm_bytes / 1e6 for s in samples], "r-", label="/dev/shm MB (instance)")
    ax2.set_ylabel("MB")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    fig.suptitle(f"soak {r.duration_s:.0f}s: {r.streams} streams, hung {r.hung} (random weights)")
    save(fig, path)
