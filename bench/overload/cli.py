"""``orpheus-serve bench overload``: closed-loop levels past capacity against two admission
modes in one run, and what each leaves its users (docs/benchmarks.md, *Overload*).

For each arm (a set of ``--set`` overrides) it starts ``orpheus-serve serve`` on loopback,
runs a discarded warm-up level, then each level of N closed-loop clients speaking one
utterance after another (``--scenario levels``), and/or one key flooding while another
speaks one request at a time (``--scenario fairness``), scraping ``/metrics`` all along;
then stops the server (SIGTERM) and starts the next arm's. Examples::

    orpheus-serve bench overload --model tiny-model --device cpu --concurrency 1,2,3,4,8,16 \\
        --json runs/overload.json --plot runs/overload.png
    orpheus-serve bench overload --model tiny-model --device cpu --scenario fairness \\
        --arm learned --arm-set learned:gateway.admission=learned \\
        --arm-set learned:gateway.max_streams_per_key=4
    orpheus-serve bench overload --model tiny-model --device cpu --scenario fairness \
        --arm learned --fairness-clients 16,1 --fairness-clients 16,1,1 --duration 60
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import sys
import time
from pathlib import Path

import msgspec
from rich.console import Console

from bench.lib.environment import machine, versions
from bench.lib.report import now_iso, write_json
from bench.load.cli import (
    add_output_arguments,
    add_workload_arguments,
    event_loop_runner,
    parse_ints,
    plan_config,
    plan_from_args,
    report_console,
    slo_from_args,
)
from bench.load.progress import LevelProgress
from bench.load.runner import LevelPlan, run_closed
from bench.load.servers import ServerFailed, ServerProcess, orpheus_serve_argv, recorded_argv
from bench.load.session import LevelSpec, NotReady, Target, check_ready, offer_level
from bench.load.summary import LevelRun, Slo
from bench.load.texts import Corpus, load_corpus
from bench.overload.classify import OverloadLevel, aggregate, verdict
from bench.overload.cpu import cores, process_tree_cpu_s
from bench.overload.plot import plot_report
from bench.overload.report import (
    ArmResult,
    OverloadReport,
    Phase,
    Scenario,
    Timeline,
    arm_lines,
    arm_table,
    print_report,
    shares_table,
)
from bench.overload.shares import KeyShare, key_shares, weights_of
from bench.overload.timeline import MetricsScraper, lead_series, ticks
from testkit.local_server import free_port

DEFAULT_KEYS = ("bench-key-flood", "bench-key-single", "bench-key-single-2", "bench-key-single-3")

DEFAULT_ARMS: dict[str, list[str]] = {
    "fixed": ["gateway.admission=fixed"],
    "learned": ["gateway.admission=learned"],
}
"""Today's fixed count (``gateway.max_active_streams`` is the operating point) against the
limit learned from measured headroom."""


class Arm(msgspec.Struct, frozen=True):
    name: str
    overrides: list[str]


class ArmError(ValueError):
    pass


class Fairness(msgspec.Struct):
    """The fairness scenario's phases of one arm."""

    mixed: list[OverloadLevel] = []
    solo: list[OverloadLevel] = []
    shares: list[KeyShare] = []


def arms_from_args(names: list[str], sets: list[str]) -> list[Arm]:
    """``--arm NAME`` (in order; none: DEFAULT_ARMS) and ``--arm-set NAME:KEY=VALUE``."""
    if not names:
        if sets:
            raise ArmError("--arm-set needs the arms named with --arm")
        return [Arm(name, list(overrides)) for name, overrides in DEFAULT_ARMS.items()]
    if len(set(names)) != len(names):
        raise ArmError(f"an arm is named twice: {names}")
    overrides: dict[str, list[str]] = {name: [] for name in names}
    for item in sets:
        name, sep, setting = item.partition(":")
        if not sep or "=" not in setting:
            raise ArmError(f"--arm-set takes NAME:SECTION.KEY=VALUE, got {item!r}")
        if name not in overrides:
            raise ArmError(f"--arm-set {item!r}: no arm {name!r} (named with --arm: {names})")
        overrides[name].append(setting)
    return [Arm(name, overrides[name]) for name in names]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="orpheus-serve bench overload",
        description="Closed-loop levels past capacity against each admission arm in turn: "
        "answered, real-time, refused and refusal latency per level, the server's limit "
        "over time; or a fairness scenario between two API keys.",
    )
    p.add_argument("--model", required=True, help="Orpheus checkpoint (HF name or directory)")
    p.add_argument(
        "--codec-model", default=None, help="SNAC checkpoint (default: the server finds MODEL/snac)"
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument(
        "--scenario",
        choices=["levels", "fairness", "both"],
        default="levels",
        help="levels: --concurrency closed-loop levels; fairness: --flood-clients on one key "
        "and --single-clients on another at once; both: one after the other on each server",
    )
    p.add_argument(
        "--concurrency",
        type=parse_ints,
        default=[1, 2, 3, 4, 8, 16],
        metavar="N,...",
        help="closed-loop levels (1,2,3,4,8,16)",
    )
    p.add_argument(
        "--arm",
        action="append",
        default=[],
        metavar="NAME",
        help="an arm, in order (repeatable; default: fixed with gateway.admission=fixed, "
        "then learned with gateway.admission=learned)",
    )
    p.add_argument(
        "--arm-set",
        action="append",
        default=[],
        metavar="NAME:SECTION.KEY=VALUE",
        help="a configuration override of arm NAME (repeatable), after the shared --set",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="configuration override given to every arm (repeatable)",
    )
    p.add_argument("--config", default=None, metavar="FILE", help="TOML configuration, every arm")
    p.add_argument(
        "--warmup-level",
        type=int,
        default=2,
        metavar="N",
        help="clients of the discarded warm-up level run first on each server (2; 0: none)",
    )
    p.add_argument(
        "--warmup-level-duration", type=float, default=10.0, metavar="S",
        help="the warm-up level's --duration (10)",
    )  # fmt: skip
    p.add_argument(
        "--flood-clients", type=int, default=16, metavar="N",
        help="fairness: closed-loop clients of the flooding key (16)",
    )  # fmt: skip
    p.add_argument(
        "--single-clients", type=int, default=1, metavar="N",
        help="fairness: closed-loop clients of the other key (1)",
    )  # fmt: skip
    p.add_argument(
        "--fairness-clients",
        action="append",
        type=parse_ints,
        default=[],
        metavar="N,N,...",
        help="fairness: one mixed phase's clients per key, the flooding key first (repeatable: "
        "one phase each; default: --flood-clients,--single-clients)",
    )
    p.add_argument(
        "--solo-duration", type=float, default=30.0, metavar="S",
        help="fairness: each light key alone for this long before each mixed phase, its solo "
        "rate (30; 0: none)",
    )  # fmt: skip
    p.add_argument(
        "--keys",
        default=",".join(DEFAULT_KEYS),
        metavar="A,B,...",
        help="fairness: the API keys, the flooding key first (the server gets "
        "gateway.api_keys=[A, B, ...] before the overrides; the levels run with A)",
    )
    p.add_argument(
        "--retry-backoff", type=float, default=0.5, metavar="S",
        help="a client waits this long after a refused or failed request (0.5)",
    )  # fmt: skip
    p.add_argument(
        "--scrape-interval", type=float, default=0.5, metavar="S",
        help="GET /metrics and sample the streams' lead this often (0.5)",
    )  # fmt: skip
    p.add_argument(
        "--ready-timeout", type=float, default=900.0, metavar="S",
        help="how long a server may take to become ready (900)",
    )  # fmt: skip
    p.add_argument(
        "--log-dir", type=Path, default=Path("runs/overload-logs"),
        help="server logs go here (runs/overload-logs)",
    )  # fmt: skip
    add_output_arguments(p)
    add_workload_arguments(p)
    p.set_defaults(duration=30.0, drain_timeout=60.0)
    return p


def fairness_cases(args: argparse.Namespace) -> list[list[int]]:
    """The mixed phases' clients per key (the flooding key first)."""
    return args.fairness_clients or [[args.flood_clients, args.single_clients]]


def fairness_keys(args: argparse.Namespace) -> list[str] | None:
    if args.scenario == "levels":
        return None
    keys = [k.strip() for k in args.keys.split(",")]
    most = max(len(case) for case in fairness_cases(args))
    if len(keys) < max(2, most) or not all(keys) or len(set(keys)) != len(keys):
        raise ArmError(
            f"--keys takes {max(2, most)} or more different keys A,B,..., got {args.keys!r}"
        )
    if any(len(case) < 2 or min(case) < 1 for case in fairness_cases(args)):
        raise ArmError("--fairness-clients takes two or more client counts >= 1")
    return keys


def server_argv(arm: Arm, args: argparse.Namespace, port: int) -> list[str]:
    """Shared settings first, then the fairness keys, then the arm's own (the last wins)."""
    settings = list(args.set)
    if (keys := fairness_keys(args)) is not None:
        quoted = ", ".join(f'"{k}"' for k in keys)
        settings.append(f"gateway.api_keys=[{quoted}]")
    settings += arm.overrides
    extra = [f"--set={kv}" for kv in settings]
    if args.config is not None:
        extra += ["--config", args.config]
    return orpheus_serve_argv(args.model, args.codec_model, args.device, port, extra)


class ArmRunner:
    """The levels and the fairness scenario against one running server, the metrics scraped
    all along."""

    def __init__(
        self,
        url: str,
        args: argparse.Namespace,
        corpus: Corpus,
        progress: Console | None,
        console: Console,
    ) -> None:
        self.url = url
        self.args = args
        self.corpus = corpus
        self.progress = progress
        self.console = console
        self.plan: LevelPlan = msgspec.structs.replace(
            plan_from_args(args), retry_backoff_s=args.retry_backoff
        )
        self.slo: Slo = slo_from_args(args)
        self.keys = fairness_keys(args)
        self.weights: dict[str, float] = {}
        """The keys' weights the server was given (``gateway.key_weights``)."""
        self.runs: list[LevelRun] = []
        self.phases: list[Phase] = []
        self.t0 = time.perf_counter()
        self.server_pid: int | None = None
        """The server's process, whose tree's CPU each phase reads (``bench.overload.cpu``)."""
        self._cpu_at: tuple[float, dict[str, float]] = (self.t0, {})

    def target(self, key: str | None) -> Target:
        return Target(
            url=self.url,
            api_key=key,
            read_timeout_s=self.args.read_timeout,
            use_cache=self.args.use_cache,
        )

    def _cpu_start(self) -> None:
        self._cpu_at = (time.perf_counter(), process_tree_cpu_s(self.server_pid))

    def _phase(self, label: str, clients: int, runs: list[LevelRun]) -> None:
        self.runs += runs
        start = min(r.started for r in runs) - self.t0
        end = max(r.finished for r in runs) - self.t0
        t0, cpu0 = self._cpu_at
        used = cores(cpu0, process_tree_cpu_s(self.server_pid), time.perf_counter() - t0)
        self.phases.append(
            Phase(label=label, clients=clients, start=start, end=end, cpu_cores=used)
        )

    async def level(
        self, clients: int, plan: LevelPlan, label: str, key: str | None = None
    ) -> OverloadLevel:
        if key is None and self.keys is not None:
            key = self.keys[0]
        client = self.target(key).client()
        self._cpu_start()
        try:
            run = await offer_level(
                client, LevelSpec("closed", clients), plan, self.corpus, self.progress
            )
        finally:
            await client.aclose()
        self._phase(label, clients, [run])
        result = aggregate(run, self.slo, label=label, key=key)
        self.console.print(
            f"{label}: {result.answered} answered, {result.realtime} real-time, "
            f"{result.refused} refused, {result.failed} failed"
        )
        return result

    async def fairness(
        self, case: list[int]
    ) -> tuple[list[OverloadLevel], list[OverloadLevel], list[KeyShare]]:
        """Each light key alone (its solo rate), then every key at once: the flooding key's
        clients retry after ``--retry-backoff``, the light keys' after the refusal's
        Retry-After. Returns the mixed phase's levels, the solo levels and the shares."""
        assert self.keys is not None
        keys = self.keys[: len(case)]
        light = msgspec.structs.replace(self.plan, honour_retry_after=True)
        solo: list[OverloadLevel] = []
        solo_rates: dict[str, float] = {}
        if self.args.solo_duration > 0:
            plan = msgspec.structs.replace(light, duration_s=self.args.solo_duration)
            for name, key, n in zip("BCDEFGH", keys[1:], case[1:], strict=False):
                await asyncio.sleep(1.0)
                lv = await self.level(n, plan, f"solo key {name} c={n}", key=key)
                solo.append(lv)
                if not math.isnan(lv.realtime_per_s):
                    solo_rates[key] = lv.realtime_per_s
        await asyncio.sleep(1.0)
        clients = [self.target(k).client() for k in keys]
        label = "fairness " + "+".join(str(n) for n in case)
        progress = LevelProgress(self.progress, label, None) if self.progress else None
        on_issue = progress.on_issue if progress is not None else None
        on_done = progress.on_done if progress is not None else None
        plans = [self.plan] + [light] * (len(case) - 1)
        self._cpu_start()
        try:
            with progress if progress is not None else contextlib.nullcontext():
                runs = await asyncio.gather(
                    *(
                        run_closed(client, n, plan, self.corpus, on_issue=on_issue, on_done=on_done)
                        for client, n, plan in zip(clients, case, plans, strict=True)
                    )
                )
        finally:
            for c in clients:
                await c.aclose()
        self._phase(label, sum(case), list(runs))
        mixed = [
            aggregate(run, self.slo, label=f"key {name} c={n}", key=key)
            for run, name, n, key in zip(runs, "ABCDEFGH", case, keys, strict=False)
        ]
        return mixed, solo, key_shares(label, mixed, solo_rates, self.weights)

    async def run(self) -> tuple[OverloadLevel | None, list[OverloadLevel], Fairness, Timeline]:
        await check_ready(self.url)
        args = self.args
        warmup: OverloadLevel | None = None
        levels: list[OverloadLevel] = []
        fairness = Fairness()
        async with MetricsScraper(self.url, interval_s=args.scrape_interval) as scraper:
            self.t0 = time.perf_counter()
            if args.warmup_level > 0:
                plan = msgspec.structs.replace(self.plan, duration_s=args.warmup_level_duration)
                warmup = await self.level(args.warmup_level, plan, f"warm-up c={args.warmup_level}")
            if args.scenario in ("levels", "both"):
                for c in args.concurrency:
                    await asyncio.sleep(1.0)  # one level's cancelled fillers leave first
                    levels.append(await self.level(c, self.plan, f"c={c}"))
            if args.scenario in ("fairness", "both"):
                for case in fairness_cases(args):
                    mixed, solo, shares = await self.fairness(case)
                    fairness.mixed += mixed
                    fairness.solo += solo
                    fairness.shares += shares
        end = time.perf_counter()
        traces = [t for run in self.runs for t in run.traces]
        timeline = Timeline(
            interval_s=args.scrape_interval,
            gauges=scraper.series(self.t0),
            scrape_errors=scraper.errors,
            lead=[
                msgspec.structs.replace(s, t=s.t - self.t0)
                for s in lead_series(
                    traces, ticks(self.t0, end, args.scrape_interval), self.slo.jitter_buffer_s
                )
            ],
            phases=self.phases,
        )
        return warmup, levels, fairness, timeline


def run_arm(
    arm: Arm, args: argparse.Namespace, corpus: Corpus, console: Console, progress: Console | None
) -> ArmResult:
    port = free_port()
    argv = server_argv(arm, args, port)
    server = ServerProcess(
        arm.name, argv, f"http://127.0.0.1:{port}", args.log_dir / f"{arm.name}.log"
    )
    console.print(f"[bold]arm {arm.name}[/bold]: {' '.join(argv)}")
    with server:
        server.wait_ready(args.ready_timeout)
        console.print(f"ready after {server.ready_after_s:.0f}s")
        runner = ArmRunner(server.url, args, corpus, progress, console)
        runner.server_pid = server.pid
        runner.weights = weights_of([*args.set, *arm.overrides])
        warmup, levels, fairness, timeline = event_loop_runner()(runner.run())
    return ArmResult(
        name=arm.name,
        overrides=arm.overrides,
        argv=recorded_argv(argv),
        log=str(server.log_path),
        ready_after_s=server.ready_after_s,
        warmup_level=warmup,
        levels=levels,
        verdict=verdict(levels),
        fairness=fairness.mixed,
        solo=fairness.solo,
        shares=fairness.shares,
        timeline=timeline,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        arms = arms_from_args(args.arm, args.arm_set)
        fairness_keys(args)
    except ArmError as exc:
        print(f"orpheus-serve bench overload: {exc}", file=sys.stderr)
        return 2
    console = report_console()
    progress = None if args.no_progress else Console(stderr=True)
    corpus = load_corpus()
    env_machine, env_versions = machine(), versions()
    results: list[ArmResult] = []
    try:
        for arm in arms:
            result = run_arm(arm, args, corpus, console, progress)
            results.append(result)
            console.print(arm_table(result))
            if result.shares:
                console.print(shares_table(result))
            for line in arm_lines(result):
                console.print(line)
    except (ServerFailed, NotReady) as exc:
        print(f"orpheus-serve bench overload: {exc}", file=sys.stderr)
        return 1
    scenario: Scenario = args.scenario
    report = OverloadReport(
        created=now_iso(),
        machine=env_machine,
        versions=env_versions,
        config=plan_config(
            plan_from_args(args),
            {
                "concurrency": args.concurrency if scenario != "fairness" else [],
                "arms": {arm.name: arm.overrides for arm in arms},
                "set": args.set,
                "config_file": args.config,
                "warmup_level": args.warmup_level,
                "warmup_level_duration_s": args.warmup_level_duration,
                "flood_clients": args.flood_clients,
                "single_clients": args.single_clients,
                "fairness_clients": fairness_cases(args) if scenario != "levels" else [],
                "solo_duration_s": args.solo_duration,
                "retry_backoff_s": args.retry_backoff,
                "scrape_interval_s": args.scrape_interval,
            },
        ),
        corpus=corpus.describe(args.long_fraction),
        slo=slo_from_args(args),
        model=args.model,
        device=args.device,
        scenario=scenario,
        arms=results,
    )
    console.rule("overload: all arms")
    print_report(console, report)
    if args.json is not None:
        write_json(report, args.json)
        console.print(f"wrote {args.json}")
    if args.plot is not None:
        plot_report(report, args.plot)
        console.print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
