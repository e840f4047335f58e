"""``python -m bench.compare.baseline --model DIR --codec-model DIR/snac --device cpu --port P``.

The engine settings come from orpheus-serve's own configuration loader (the same
defaults, CPU profile, ``--config`` file and ``--set`` overrides as ``orpheus-serve
serve``), so both servers of a comparison run the same engine.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from typing import Any

from aiohttp import web

from bench.compare.baseline.engine import build_engine, load_tokenizer
from bench.compare.baseline.server import BaselineServer
from bench.load.servers import add_model_arguments
from common.config import ServeConfig
from llm_worker.vllm_ext import tokens as T
from orchestrator.settings import ConfigError, load_config, set_overrides
from shm.records import CODEBOOK_SIZE

log = logging.getLogger("bench.compare.baseline")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.compare.baseline",
        description="The reference Orpheus-TTS serving approach (one process, per-request "
        "SNAC windows) on orpheus-serve's HTTP contract, for side-by-side benchmarks.",
    )
    add_model_arguments(p, device=None)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--config", help="orpheus-serve TOML configuration (its [llm] table is used)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a configuration key, as for `orpheus-serve serve`",
    )
    p.add_argument("--keep-zero-filter-bug", action="store_true",
                   help="drop code 0 without advancing the position, as the package does")  # fmt: skip
    return p


def serve_config(args: argparse.Namespace) -> ServeConfig:
    flags: dict[str, Any] = set_overrides(args.set)
    if args.device is not None:
        flags["device"] = args.device
    llm = flags.setdefault("llm", {})
    llm["model"] = args.model
    if args.tokenizer is not None:
        llm["tokenizer"] = args.tokenizer
    flags.setdefault("codec", {})["model"] = args.codec_model
    return load_config(args.config, flags)


async def serve(cfg: ServeConfig, args: argparse.Namespace) -> None:
    import torch

    from bench.compare.baseline.decoder import ReferenceStreamDecoder
    from codec_worker.snac_model import load_snac

    t0 = time.monotonic()
    if cfg.codec.threads > 0:
        torch.set_num_threads(cfg.codec.threads)  # the codec's thread budget, as ours has
    device = torch.device(cfg.device)
    # fuse=False: SNAC exactly as SNAC.from_pretrained builds it, as the package loads it.
    snac = load_snac(cfg.codec.model, device, fuse=False)
    warm = ReferenceStreamDecoder(snac, device)
    for i in range(28):  # one window, so the first request does not pay lazy initialisation
        warm.push(T.AUDIO_TOKEN_BASE + (i % 7) * CODEBOOK_SIZE + 1)
    engine = build_engine(cfg.llm, cfg.device)
    tokenizer = load_tokenizer(cfg.llm)
    server = BaselineServer(
        engine, tokenizer, snac, device, cfg.llm, keep_zero_filter_bug=args.keep_zero_filter_bug
    )
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    log.info(
        "baseline ready on http://%s:%d after %.1fs", args.host, args.port, time.monotonic() - t0
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("baseline stopping")
        await runner.cleanup()
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = serve_config(args)
    except ConfigError as exc:
        print(f"bench.compare.baseline: {exc}", file=sys.stderr)
        return 2
    log.info("engine settings: %s", cfg.llm)
    try:
        import uvloop

        run = uvloop.run
    except ImportError:
        run = asyncio.run
    run(serve(cfg, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
