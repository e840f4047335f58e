"""``orpheus-serve bench compare``: the reference approach and orpheus-serve, side by side.

Starts the baseline (``python -m bench.compare.baseline``), offers it the load levels, stops
it (with ``--against-set KEY=VALUE``, the baseline side is orpheus-serve itself with those
overrides: two configurations side by side, e.g. one vLLM engine against two); starts ``orpheus-serve serve`` on the same model, codec, corpus and levels, stops it
(SIGTERM); and reports the ratios: audio seconds per wall second at equal concurrency,
and capacity. With ``--rounds N`` the two alternate (baseline first in odd rounds, ours
first in even ones) and the ratio is the median of the rounds' ratios, so a drift of a
shared machine does not favour either side. Loopback only; bounded by the level plan and
the readiness timeout.

    orpheus-serve bench compare --model tiny-model --codec-model tiny-model/snac --device cpu \\
        --concurrency 8,32 --json runs/compare.json --plot runs/compare.png
    orpheus-serve bench compare --model tiny-model --codec-model tiny-model/snac --device cpu \\
        --against-set llm.engines=1 --serve-arg=--set=llm.engines=2 --concurrency 8,16
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console

from bench.compare.comparison import (
    NAMES,
    SHORT_NAMES,
    CompareReport,
    Variant,
    VariantRun,
    compare_capacity,
    compare_levels,
    comparison_table,
)
from bench.lib.environment import machine, versions
from bench.lib.report import now_iso, write_json
from bench.load.cli import (
    add_output_arguments,
    add_search_arguments,
    add_workload_arguments,
    event_loop_runner,
    parse_ints,
    plan_config,
    plan_from_args,
    report_console,
    search_spec,
    slo_from_args,
)
from bench.load.plot import plot_levels
from bench.load.report import levels_table
from bench.load.runner import LevelPlan
from bench.load.search import SearchResult
from bench.load.servers import (
    ServerFailed,
    ServerProcess,
    add_model_arguments,
    baseline_argv,
    orpheus_serve_argv,
)
from bench.load.session import LevelSpec, Target, run_levels, search_capacity
from bench.load.summary import LevelResult, Slo
from bench.load.texts import Corpus, load_corpus
from testkit.local_server import free_port


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="orpheus-serve bench compare",
        description="The reference serving approach (baseline) and orpheus-serve on the same "
        "model, corpus and load levels, one after the other; reports their ratios.",
    )
    add_model_arguments(p, device="cuda")
    p.add_argument(
        "--concurrency",
        type=parse_ints,
        default=[8, 32],
        metavar="N,...",
        help="closed-loop levels compared at equal concurrency (8,32)",
    )
    add_search_arguments(p, "also search each server's capacity (bracketing, closed loop)")
    p.add_argument("--rounds", type=int, default=1, help="alternate the two this many times (1)")
    p.add_argument(
        "--only",
        choices=["baseline", "ours"],
        default=None,
        help="run one side only (for debugging a side; no ratio)",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=900.0,
        metavar="S",
        help="how long a server may take to become ready (900)",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="orpheus-serve TOML configuration, given to both servers",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="configuration override given to both servers (repeatable)",
    )
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for `orpheus-serve serve` only (repeatable), e.g. "
        "--serve-arg=--set=codec.max_batch=32",
    )
    p.add_argument(
        "--against-set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="run orpheus-serve with this override (repeatable) as the baseline side instead "
        "of the reference approach: two configurations side by side",
    )
    p.add_argument(
        "--baseline-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the baseline (repeatable)",
    )
    p.add_argument(
        "--log-dir",
        type=Path,
        default=Path("runs/compare-logs"),
        help="server logs go here (runs/compare-logs)",
    )
    add_output_arguments(p)
    add_workload_arguments(p)
    # On CPU nothing is real time and the baseline can stay silent for minutes while its
    # event loop decodes other streams' windows; a client that gave up would throw away its
    # work and understate its throughput. --read-timeout 60 restores an impatient client.
    p.set_defaults(duration=120.0, drain_timeout=60.0, read_timeout=600.0)
    return p


def side_names(args: argparse.Namespace) -> dict[Variant, str]:
    """The two sides' short names: with ``--against-set`` both are orpheus-serve, named by
    what each overrides."""
    if not args.against_set:
        return dict(SHORT_NAMES)
    ours = [a.removeprefix("--set=") for a in args.serve_arg] or ["default"]
    return {
        "baseline": f"orpheus-serve ({', '.join(args.against_set)})",
        "ours": f"orpheus-serve ({', '.join(ours)})",
    }


def server_for(variant: Variant, args: argparse.Namespace, rnd: int) -> ServerProcess:
    port = free_port()
    shared = [f"--set={kv}" for kv in args.set]
    if variant != "baseline" or args.against_set:
        # Both sides serve every stream of a level (a fixed count), unless asked otherwise:
        # the comparison is of speed at a concurrency; refusing is ``bench overload``'s.
        if not any(kv.startswith("gateway.admission=") for kv in args.set):
            shared.insert(0, "--set=gateway.admission=fixed")
    if args.config is not None:
        shared += ["--config", args.config]
    if variant == "baseline" and args.against_set:
        extra = shared + [f"--set={kv}" for kv in args.against_set]
        argv = orpheus_serve_argv(args.model, args.codec_model, args.device, port, extra)
    elif variant == "baseline":
        extra = shared + args.baseline_arg
        argv = baseline_argv(args.model, args.codec_model, args.device, port, extra)
    else:
        extra = shared + args.serve_arg
        argv = orpheus_serve_argv(args.model, args.codec_model, args.device, port, extra)
    log = args.log_dir / f"{variant}-round{rnd}.log"
    name = side_names(args)[variant] if args.against_set else NAMES[variant]
    return ServerProcess(name, argv, f"http://127.0.0.1:{port}", log)


async def _measure(
    target: Target,
    args: argparse.Namespace,
    plan: LevelPlan,
    corpus: Corpus,
    slo: Slo,
    console: Console | None,
) -> tuple[list[LevelResult], SearchResult | None]:
    specs = [LevelSpec("closed", c) for c in args.concurrency]
    levels = await run_levels(target, specs, plan, corpus, slo, console)
    if not args.search:
        return levels, None
    probed, found = await search_capacity(
        target, search_spec(args), plan, corpus, slo, console, known=levels
    )
    return levels + probed, found


def run_variant(
    variant: Variant,
    rnd: int,
    args: argparse.Namespace,
    corpus: Corpus,
    console: Console,
    progress: Console | None,
) -> VariantRun:
    server = server_for(variant, args, rnd)
    console.print(f"[bold]round {rnd}: {server.name}[/bold]: {' '.join(server.argv)}")
    with server:
        server.wait_ready(args.ready_timeout)
        console.print(f"ready after {server.ready_after_s:.0f}s")
        target = Target(url=server.url, read_timeout_s=args.read_timeout, use_cache=args.use_cache)
        coro = _measure(target, args, plan_from_args(args), corpus, slo_from_args(args), progress)
        levels, found = event_loop_runner()(coro)
    return VariantRun(
        variant=variant,
        round=rnd,
        ready_after_s=server.ready_after_s,
        levels=levels,
        search=found,
        log=str(server.log_path),
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 1:
        print("orpheus-serve bench compare: --rounds must be at least 1", file=sys.stderr)
        return 2
    console = report_console()
    progress = None if args.no_progress else Console(stderr=True)
    corpus = load_corpus()
    slo = slo_from_args(args)
    env_machine, env_versions = machine(), versions()
    runs: list[VariantRun] = []
    order: list[Variant] = ["baseline", "ours"]
    try:
        for rnd in range(1, args.rounds + 1):
            for variant in order if rnd % 2 else order[::-1]:
                if args.only is not None and variant != args.only:
                    continue
                run = run_variant(variant, rnd, args, corpus, console, progress)
                runs.append(run)
                name = side_names(args)[variant]
                console.print(levels_table(f"{name}, round {rnd}", run.levels, slo))
    except ServerFailed as exc:
        print(f"orpheus-serve bench compare: {exc}", file=sys.stderr)
        return 1
    if args.only is not None:
        return 0
    comparisons = compare_levels(runs, args.concurrency)
    capacity = compare_capacity(runs, slo)
    head = max(comparisons, key=lambda c: c.concurrency)
    report = CompareReport(
        created=now_iso(),
        machine=env_machine,
        versions=env_versions,
        model=args.model,
        codec_model=args.codec_model,
        device=args.device,
        config=plan_config(
            plan_from_args(args),
            {
                "concurrency": args.concurrency,
                "rounds": args.rounds,
                "search": args.search,
                "config_file": args.config,
                "set": args.set,
                "serve_args": args.serve_arg,
                "baseline_args": args.baseline_arg,
                "against_set": args.against_set,
            },
        ),
        corpus=corpus.describe(args.long_fraction),
        slo=slo,
        concurrency=head.concurrency,
        baseline_audio_s_per_s=head.baseline_audio_s_per_s,
        ours_audio_s_per_s=head.ours_audio_s_per_s,
        ratio=head.ratio,
        comparisons=comparisons,
        capacity=capacity,
        runs=runs,
        names=dict(side_names(args)) if args.against_set else None,
    )
    console.print(comparison_table(comparisons, capacity, side_names(args)))
    if args.json is not None:
        write_json(report, args.json)
        console.print(f"wrote {args.json}")
    if args.plot is not None:
        last = {v: [r for r in runs if r.variant == v][-1].levels for v in order}
        plot_levels(
            {side_names(args)[v]: last[v] for v in order},
            slo,
            args.plot,
            title=f"{side_names(args)['baseline']} vs {side_names(args)['ours']}: "
            f"{args.model} on {args.device}",
        )
        console.print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
