"""``orpheus-serve bench load``: offer load to a running server, report what users would feel.

Examples::

    orpheus-serve bench load --concurrency 1,8,32 --json runs/load.json --plot runs/load.png
    orpheus-serve bench load --open-rate 0.5,1,2 --duration 120
    orpheus-serve bench load --search --fixed-tokens 840 --json runs/capacity.json
    orpheus-serve bench load --recompute docs/results/h100_capacity_v2.json --json OUT.json

See docs/benchmarks.md for what each number means and how levels are trimmed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console

from bench.lib.environment import machine, versions
from bench.lib.report import now_iso, write_json
from bench.load.criteria import capacities_of, closed_levels
from bench.load.plot import plot_levels
from bench.load.recompute import RecomputeError, recompute
from bench.load.report import LoadReport, print_report
from bench.load.runner import LevelPlan
from bench.load.search import SearchResult
from bench.load.session import (
    LevelSpec,
    NotReady,
    SearchSpec,
    Target,
    run_levels,
    run_warmup_level,
    search_capacity,
)
from bench.load.summary import LevelResult, Slo
from bench.load.texts import Corpus, load_corpus


def parse_ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers")
    return values


def parse_floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers: {text!r}") from exc
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError("rates must be positive")
    return values


def _seconds(group: argparse._ArgumentGroup, flag: str, default: float | None, help: str) -> None:
    group.add_argument(flag, type=float, default=default, metavar="S", help=help)


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """What each level sends and how long it runs (shared with ``bench compare``)."""
    g = p.add_argument_group("workload")
    _seconds(
        g, "--duration", 60.0, "seconds per level during which measured requests are issued (60)"
    )
    g.add_argument(
        "--max-requests",
        type=int,
        default=None,
        metavar="N",
        help="at most N measured requests per level",
    )
    _seconds(g, "--warmup", None, "requests scheduled earlier are not measured (default: closed "
             "loop 0 plus its whole first wave; open loop 10%% of the duration)")  # fmt: skip
    _seconds(
        g, "--drain-timeout", 120.0, "after the duration, how long measured requests may run (120)"
    )
    g.add_argument(
        "--long-fraction",
        type=float,
        default=0.2,
        metavar="F",
        help="fraction of long paragraphs among the texts (0.2; the rest are 5-15 word replies)",
    )
    g.add_argument(
        "--fixed-tokens",
        type=int,
        default=None,
        metavar="N",
        help="send max_tokens=N with every request to fix the output length "
        "(random-weight models rarely stop by themselves)",
    )
    g.add_argument("--voice", default="tara")
    g.add_argument("--model-name", default="tts-1", help="the request's model field")
    g.add_argument("--seed", type=int, default=0, help="seed of texts and arrivals")
    _seconds(g, "--read-timeout", 60.0, "a stream silent this long counts as broken (60)")
    g.add_argument(
        "--use-cache",
        action="store_true",
        help="let the server's sentence audio cache answer repeated texts (default: every "
        "request sends Cache-Control: no-store, so that the bench measures synthesis)",
    )
    s = p.add_argument_group("targets")
    _seconds(s, "--ttfb-budget", 1.0, "p99 TTFB budget for pass/fail, goodput and capacity (1.0)")
    s.add_argument(
        "--ttfb-report",
        type=parse_floats,
        default=[0.5],
        metavar="S,...",
        help="further TTFB budgets reported alongside (0.5)",
    )
    _seconds(s, "--interactive-ttfb", 0.5, "p99 TTFB budget of the interactive criterion (0.5)")
    _seconds(
        s, "--jitter-buffer", 0.1, "player's buffer before playback starts, for underruns (0.1)"
    )


def add_search_arguments(p: argparse.ArgumentParser, help: str) -> None:
    """The bracketing capacity search (shared with ``bench compare``)."""
    p.add_argument("--search", action="store_true", help=help)
    p.add_argument("--search-start", type=int, default=8, metavar="N")
    p.add_argument("--search-max", type=int, default=1024, metavar="N")
    p.add_argument(
        "--search-resolution",
        type=float,
        default=0.1,
        metavar="F",
        help="stop bisecting when the bracket is within this fraction (0.1)",
    )


def add_output_arguments(p: argparse.ArgumentParser, *, progress: bool = True) -> None:
    """Where the report goes (shared with ``bench compare`` and ``bench soak``)."""
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the report here")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png", help="write a PNG here")
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no live progress display")


def plan_from_args(args: argparse.Namespace) -> LevelPlan:
    return LevelPlan(
        duration_s=args.duration,
        max_requests=args.max_requests,
        warmup_s=args.warmup,
        drain_timeout_s=args.drain_timeout,
        long_fraction=args.long_fraction,
        seed=args.seed,
        voice=args.voice,
        model=args.model_name,
        fixed_tokens=args.fixed_tokens,
    )


def slo_from_args(args: argparse.Namespace) -> Slo:
    return Slo(
        ttfb_s=args.ttfb_budget,
        ttfb_report_s=tuple(sorted({args.ttfb_budget, *args.ttfb_report})),
        jitter_buffer_s=args.jitter_buffer,
        interactive_ttfb_s=args.interactive_ttfb,
    )


def plan_config(plan: LevelPlan, extra: dict[str, Any]) -> dict[str, Any]:
    return {**msgspec.to_builtins(plan), **extra}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="orpheus-serve bench load",
        description="Closed- and open-loop load on a running server; TTFB from the scheduled "
        "send, RTF, underruns, throughput, capacity search.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--zmq", metavar="ENDPOINT", help="drive the gateway's ZeroMQ endpoint instead")
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--concurrency",
        type=parse_ints,
        default=None,
        metavar="N,...",
        help="closed-loop levels (default 1,8,32 unless --open-rate or --search)",
    )
    p.add_argument(
        "--open-rate",
        type=parse_floats,
        default=None,
        metavar="R,...",
        help="open-loop levels: Poisson arrivals per second",
    )
    add_search_arguments(p, "bracketing search for the capacity under each criterion")
    p.add_argument(
        "--warmup-level",
        type=parse_count,
        default=None,
        metavar="N",
        help="before the first measured level, a closed-loop level of N streams whose results "
        "are discarded (kept in the JSON as warmup_level, in no capacity). Default with "
        "--search: the search's start; 0: none",
    )
    _seconds(
        p, "--warmup-level-duration", None, "the warm-up level's --duration (default: --duration)"
    )  # fmt: skip
    p.add_argument(
        "--recompute",
        type=Path,
        default=None,
        metavar="FILE",
        help="measure nothing: read a stored bench load JSON and recompute its capacities "
        "under the three criteria from its levels (write them with --json, --plot)",
    )
    add_output_arguments(p)
    add_workload_arguments(p)
    return p


def parse_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected an integer: {text!r}") from exc
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def warmup_concurrency(args: argparse.Namespace) -> int:
    """The warm-up level's streams: --warmup-level, else with --search the search's start."""
    if args.warmup_level is not None:
        return int(args.warmup_level)
    return int(args.search_start) if args.search else 0


async def _run(
    args: argparse.Namespace, corpus: Corpus, console: Console | None
) -> tuple[LevelResult | None, list[LevelResult], SearchResult | None]:
    target = Target(
        url=args.url,
        zmq=args.zmq,
        api_key=args.api_key,
        read_timeout_s=args.read_timeout,
        use_cache=args.use_cache,
    )
    plan, slo = plan_from_args(args), slo_from_args(args)
    warmup = None
    if n := warmup_concurrency(args):
        duration = args.warmup_level_duration or plan.duration_s
        warmup = await run_warmup_level(target, n, plan, duration, corpus, slo, console)
    specs = [LevelSpec("closed", c) for c in args.concurrency or []]
    specs += [LevelSpec("open", r) for r in args.open_rate or []]
    levels = await run_levels(target, specs, plan, corpus, slo, console) if specs else []
    if not args.search:
        return warmup, levels, None
    probed, found = await search_capacity(
        target, search_spec(args), plan, corpus, slo, console, known=levels
    )
    return warmup, levels + probed, found


def search_spec(args: argparse.Namespace) -> SearchSpec:
    return SearchSpec(
        start=args.search_start, maximum=args.search_max, resolution=args.search_resolution
    )


def event_loop_runner() -> Any:
    try:
        import uvloop

        return uvloop.run
    except ImportError:
        return asyncio.run


def report_console() -> Console:
    """Standard output; wide enough for the table when it is a file or a pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


def write_plot(report: LoadReport, path: Path) -> None:
    plot_levels(
        {"server": report.levels},
        report.slo,
        path,
        title=f"load: {report.target}",
        capacities=report.capacities,
    )


def main_recompute(args: argparse.Namespace) -> int:
    out = report_console()
    try:
        report, data = recompute(args.recompute)
    except RecomputeError as exc:
        print(f"orpheus-serve bench load: {exc}", file=sys.stderr)
        return 1
    print_report(out, report)
    if args.json is not None:
        write_json(data, args.json)
        out.print(f"wrote {args.json}")
    if args.plot is not None and report.levels:
        write_plot(report, args.plot)
        out.print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.recompute is not None:
        return main_recompute(args)
    if args.concurrency is None and args.open_rate is None and not args.search:
        args.concurrency = [1, 8, 32]
    out = report_console()
    progress_console = None if args.no_progress else Console(stderr=True)
    corpus = load_corpus()
    env_machine, env_versions = machine(), versions()
    try:
        warmup, levels, found = event_loop_runner()(_run(args, corpus, progress_console))
    except NotReady as exc:
        print(f"orpheus-serve bench load: {exc}", file=sys.stderr)
        return 1
    slo = slo_from_args(args)
    plan = plan_from_args(args)
    report = LoadReport(
        created=now_iso(),
        target=args.zmq or args.url,
        machine=env_machine,
        versions=env_versions,
        config=plan_config(
            plan,
            {
                "transport": "zmq" if args.zmq else "http",
                "concurrency": args.concurrency,
                "open_rate": args.open_rate,
                "search": args.search,
                "search_start": args.search_start,
                "search_max": args.search_max,
                "search_resolution": args.search_resolution,
                "warmup_level": warmup.concurrency if warmup is not None else 0,
                "warmup_level_duration_s": args.warmup_level_duration or plan.duration_s,
            },
        ),
        corpus=corpus.describe(plan.long_fraction),
        slo=slo,
        levels=levels,
        search=found,
        capacities=capacities_of(levels, slo) if closed_levels(levels) else [],
        warmup_level=warmup,
    )
    print_report(out, report)
    if args.json is not None:
        write_json(report, args.json)
        out.print(f"wrote {args.json}")
    if args.plot is not None and levels:
        write_plot(report, args.plot)
        out.print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
