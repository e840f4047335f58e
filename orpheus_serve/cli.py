"""The ``orpheus-serve`` command: ``serve`` and ``cleanup`` (orchestrator/), ``say`` (the
``say`` and ``say_file`` clients), ``tiny-model`` and ``bench ...`` (bench/; ``rich`` and
``matplotlib`` come with the ``bench`` extra)."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from common.config import ServeConfig

BENCHES = {
    "codec": "bench.codec.cli",
    "penalties": "bench.llm.penalties",
    "codes": "bench.llm.codes",
    "engine": "bench.engine.cli",
    "gateway": "bench.gateway.cpu",
    "protocols": "bench.gateway.protocols",
    "load": "bench.load.cli",
    "compare": "bench.compare.cli",
    "soak": "bench.soak.cli",
    "overload": "bench.overload.cli",
    "voices": "bench.llm.voices",
    "jobs": "bench.gateway.jobs",
    "textnorm": "bench.gateway.textnorm",
    "ring": "bench.ring",
    "cache": "bench.cache.trace",
}


def tell(line: str) -> None:
    """One line on stderr. A full disk under a redirected log must not turn a clean exit
    code (0, 2, 78) into a traceback and exit 1: the line is lost, the code is kept."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def _serve_flags(args: argparse.Namespace) -> dict[str, Any]:
    from orchestrator.settings import set_overrides

    flags: dict[str, Any] = set_overrides(args.set or [])

    def put(section: str | None, key: str, value: Any) -> None:
        if value is None:
            return
        (flags.setdefault(section, {}) if section else flags)[key] = value

    put(None, "device", args.device)
    put(None, "log_format", args.log_format)
    put("llm", "model", args.model)
    put("llm", "tokenizer", args.tokenizer)
    put("codec", "model", args.codec_model)
    put("gateway", "host", args.host)
    put("gateway", "port", args.port)
    return flags


def _with_model_voices(cfg: ServeConfig) -> ServeConfig:
    """Resolve the voices and their languages once, from the model's directory, so that every
    process (the gateway's /v1/audio/voices and its requests' default language, the
    llm_worker's validation) sees the same."""
    import msgspec

    from llm_worker.model_info import load_model_info

    info = load_model_info(cfg.llm)
    # The config check compares LoRA voice names with ``llm.voices`` only when that is set; a
    # LoRA voice named like one of the model's own would be shadowed by it (the model's voices
    # are looked up first, common.voice_lookup.VoiceLookup), so it is refused here, once they
    # are known.
    shadowed = sorted(n for n in cfg.llm.lora_voices if n.strip().lower() in info.voices)
    if shadowed:
        raise ValueError(
            f"llm.lora_voices: {', '.join(map(repr, shadowed))} is also a voice of the model "
            f"({info.source}); fix: give the LoRA voice another name"
        )
    llm = msgspec.structs.replace(
        cfg.llm,
        voices=list(info.voices),
        zero_shot=info.zero_shot,
        default_voice=info.default_voice,
        languages=list(info.languages) or None,
        voice_languages=info.voice_languages,
    )
    return msgspec.structs.replace(cfg, llm=llm)


def _with_codec_from_model_dir(cfg: ServeConfig, explicit: bool) -> ServeConfig:
    """``--model DIR`` holding a SNAC checkpoint in ``DIR/snac`` (``orpheus-serve tiny-model``
    writes one) uses it, unless the codec was set explicitly (``--codec-model``, ``--set
    codec.model``, ``ORPHEUS_CODEC__MODEL`` or the TOML file)."""
    import logging

    import msgspec

    from orchestrator.failures import SNAC_FILES

    log = logging.getLogger("orchestrator")
    local = Path(cfg.llm.model).expanduser() / "snac"
    if not explicit and all((local / f).is_file() for f in SNAC_FILES):
        log.info("codec: SNAC from %s (found next to --model; --codec-model overrides)", local)
        codec = msgspec.structs.replace(cfg.codec, model=str(local))
        return msgspec.structs.replace(cfg, codec=codec)
    where = "set explicitly" if explicit else "the default"
    log.info("codec: SNAC from %s (%s)", cfg.codec.model, where)
    return cfg


def cmd_serve(args: argparse.Namespace) -> int:
    from orchestrator.failures import EXIT_PERMANENT, preflight
    from orchestrator.logs import protect_stdio, setup_logging
    from orchestrator.settings import ConfigError, describe, is_set, load_config

    try:
        flags = _serve_flags(args)
        cfg = load_config(args.config, flags)
    except ConfigError as exc:
        tell(f"orpheus-serve: {exc}")
        return 2
    protect_stdio()
    setup_logging(cfg.log_format, cfg.log_level)
    logging.getLogger("orchestrator").info("%s", describe(cfg, args.config))
    cfg = _with_codec_from_model_dir(cfg, is_set(args.config, flags, "codec", "model"))
    failure = preflight(cfg)
    if failure is not None:
        tell(f"orpheus-serve: {failure.line()}")
        return EXIT_PERMANENT
    try:
        cfg = _with_model_voices(cfg)
    except ValueError as exc:
        tell(f"orpheus-serve: {exc}")
        return 2
    from orchestrator.supervisor import Supervisor

    sup = Supervisor(cfg)
    code = sup.run()
    if sup.exit_failure is not None:
        # The one line that says why, last, where a person looks (after the workers' logs).
        tell(f"orpheus-serve: {sup.exit_failure.line()}")
    return code


def cmd_cleanup(args: argparse.Namespace) -> int:
    """Free what dead instances left in /dev/shm (``orchestrator.reclaim``; every start does
    the same first). Live instances are never touched, so it is safe beside running servers."""
    from orchestrator.reclaim import reclaim
    from orchestrator.settings import ConfigError, load_config, set_overrides

    try:
        cfg = load_config(args.config, set_overrides(args.set or []))
    except ConfigError as exc:
        tell(f"orpheus-serve: {exc}")
        return 2
    print(reclaim(cfg.shm.run_dir, dry_run=args.dry_run).describe(), flush=True)
    return 0


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from testkit.tiny_model import write_random_lora, write_random_snac, write_tiny_model

    out = Path(args.dir)
    write_tiny_model(out, seed=args.seed)
    write_random_snac(out / "snac", seed=args.seed)
    print(f"wrote the tiny Orpheus test model to {out} and a random-weight SNAC to {out / 'snac'}")
    for i, name in enumerate(args.lora or []):
        path = write_random_lora(out / "lora" / name, seed=args.seed * 1000 + i + 1)
        print(f"wrote a random LoRA adapter (a stand-in LoRA voice) to {path}")
    print("random weights: what they say is noise, not speech")
    return 0


def cmd_say(args: argparse.Namespace) -> int:
    if args.file or args.resume:  # a long text: a job of the server (/v1/audio/jobs)
        from orpheus_serve.say_file import say_file

        return say_file(args)
    if args.text is None:
        tell("orpheus-serve say: give TEXT, --file PATH or --resume ID")
        return 2
    from orpheus_serve.say import say

    return say(args)


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    module = importlib.import_module(BENCHES[args.which])
    return int(module.main(rest))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="orpheus-serve",
        description="Streaming Orpheus-TTS server: vLLM worker, batched SNAC codec worker and "
        "HTTP/WebSocket/ZeroMQ gateway joined by shared-memory rings.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the server (all processes) until SIGINT/SIGTERM")
    s.add_argument("--model", help="Orpheus checkpoint: HF name or local path (llm.model)")
    s.add_argument("--tokenizer", help="tokenizer name or path if not with the model")
    s.add_argument("--codec-model", help="SNAC 24 kHz: HF name or local dir (codec.model)")
    s.add_argument("--host", help="listen address (gateway.host, default 127.0.0.1)")
    s.add_argument("--port", type=int, help="listen port (gateway.port, default 8000)")
    s.add_argument("--device", choices=["cpu", "cuda"], help="cpu (dev profile) or cuda")
    s.add_argument("--config", help="TOML configuration file (see docs/configuration.md)")
    s.add_argument("--log-format", choices=["text", "json"], help="log lines as text or JSON")
    s.add_argument(
        "--set", action="append", metavar="SECTION.KEY=VALUE",
        help="override any configuration key, e.g. --set codec.max_batch=32 (repeatable)",
    )  # fmt: skip

    k = sub.add_parser(
        "cleanup",
        help="after a crash of the whole server: free what dead instances left in /dev/shm "
        "(every start does it too; live instances are never touched)",
    )
    k.add_argument("--config", help="TOML configuration file (its shm.run_dir)")
    k.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="as for serve")
    k.add_argument("--dry-run", action="store_true", help="only say what would be freed")

    t = sub.add_parser("tiny-model", help="write the deterministic tiny test model + random SNAC")
    t.add_argument("dir")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--lora", action="append", metavar="NAME",
        help="also write a random LoRA adapter to DIR/lora/NAME (repeatable)",
    )  # fmt: skip

    c = sub.add_parser(
        "say",
        help="synthesize TEXT to a WAV file through a running server; --file: a long text as a "
        "job (progress, resumable), to any format",
    )
    c.add_argument("text", nargs="?")
    c.add_argument("--file", help="a text file of any length, spoken as a job of the server")
    c.add_argument("--resume", metavar="ID", help="follow job ID (after a Ctrl-C) and write it")
    c.add_argument(
        "--format", choices=["mp3", "wav", "flac", "opus", "aac", "pcm"],
        help="the job's file format (default: from -o's extension)",
    )  # fmt: skip
    c.add_argument("--voice", default="tara")
    c.add_argument("-o", "--output", default="out.wav")
    c.add_argument("--url", default="http://127.0.0.1:8000")
    c.add_argument("--zmq", metavar="ENDPOINT", help="use the ZeroMQ direct protocol instead")
    c.add_argument("--api-key", default=None)
    c.add_argument("--max-tokens", type=int, default=None)
    c.add_argument("--seed", type=int, default=None)

    w = sub.add_parser("watermark", help="read the watermark of audio files (detect)")
    wsub = w.add_subparsers(dest="watermark_command", required=True)
    d = wsub.add_parser(
        "detect",
        help="print whether each file (any format FFmpeg reads) carries the server's watermark; "
        "exit 0: all marked, 1: one or more unmarked, 2: one or more unreadable",
    )
    d.add_argument("files", nargs="+", metavar="FILE")
    d.add_argument("--device", default="cpu", help="torch device of the detector (cpu, cuda)")
    d.add_argument("--json", action="store_true", help="one JSON object per file")
    d.add_argument(
        "--trust-anchors",
        metavar="PEM",
        help="certificates (PEM) a file's C2PA signer must chain to; without it a manifest "
        "is checked for its signature and hashes only",
    )

    # add_help=False: `bench load --help` reaches the benchmark's own parser.
    b = sub.add_parser(
        "bench", help="benchmarks (each prints a table and writes JSON)", add_help=False
    )
    b.add_argument("which", choices=sorted(BENCHES))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if argv[:1] == ["bench"]:
        args, rest = parser.parse_known_args(argv)
        return cmd_bench(args, rest)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "cleanup":
        return cmd_cleanup(args)
    if args.command == "tiny-model":
        return cmd_tiny_model(args)
    if args.command == "say":
        return cmd_say(args)
    if args.command == "watermark":
        from orpheus_serve.watermark_detect import detect

        anchors = None
        if args.trust_anchors:
            with open(args.trust_anchors, encoding="ascii") as f:
                anchors = f.read()
        return detect(args.files, args.device, args.json, anchors)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
