#!/usr/bin/env python3
"""Write the Orpheus-3B architecture with random weights, for GPU capacity benchmarks.

    python scripts/gpu/make_random_orpheus.py OUT [--device cuda] [--seed 0]
    python scripts/gpu/make_random_orpheus.py OUT --small --device cpu      # seconds, for tests
    python scripts/gpu/make_random_orpheus.py --dry-run                      # numbers only

OUT receives what a published checkpoint directory holds, in the layout vLLM and
transformers read:

- ``config.json``: ``LlamaForCausalLM`` with canopylabs/orpheus-3b-0.1-ft's shape (hidden
  3072, 28 layers, 24 query heads, 8 KV heads, head dim 128, MLP 8192, vocabulary 156,940,
  tied embeddings, rope theta 500000 with llama3 rope scaling, bf16). Everything except the
  shape is taken from the tiny test model's config (``testkit.tiny_model``): token ids,
  rope scaling, and the voices and emotion tags under its ``"orpheus"`` key, stored the same
  way, so that the server treats both models alike.
- ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``: bf16 weights drawn
  from normal(0, 0.02) (norm weights 1), generated directly on ``--device`` in chunks, one
  shard at a time, and copied to the host only to be written. On an H100 the 6.6 GB take
  seconds to draw; writing them is disk-bound.
- the tiny model's tokenizer files (``tokenizer.json`` ...) and ``generation_config.json``,
  byte for byte: the same Llama-3/Orpheus id layout.
- ``snac/``: the SNAC 24 kHz architecture with random weights (``codec_worker.snac_model``).

Random weights make noise, not speech. What this model is for is cost: the engine runs the
real 3B shapes, so step times, KV-cache capacity and memory bandwidth are the real model's.
The same seed gives the same weights on the same device type (CPU and CUDA draw differently).

The shape flags (``--layers``, ``--hidden`` ...) and ``--small`` exist so that tests can
exercise the whole path on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shm.records import CODEBOOK_SIZE, FRAME_CODES

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script from anywhere: import the repo's packages
    sys.path.insert(0, str(REPO))

ORPHEUS_3B: dict[str, Any] = {
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 156_940,
    "tie_word_embeddings": True,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
"""canopylabs/orpheus-3b-0.1-ft (docs/orpheus.md): a Llama-3.2-3B fine-tune."""

SHAPE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)

SMALL: dict[str, int] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
"""The tiny test model's shape (head dim 64: the CPU attention kernels reject smaller)."""

INIT_STD = 0.02
CODE_SIGNAL = 2000.0
"""Size of the slot signal written into the embeddings of a ``speaks_codes`` model (see
:func:`_speak_codes`): large against the ~450 that 28 random layers add to the residual."""
CHUNK_ELEMENTS = 1 << 26
"""Elements drawn per RNG call (128 MiB of bf16): bounds each call's work, not memory."""
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
DESCRIPTION = (
    "Orpheus-3B architecture (canopylabs/orpheus-3b-0.1-ft shape) with random weights, written "
    "by scripts/gpu/make_random_orpheus.py for capacity benchmarks: it makes noise, not speech"
)


# ----------------------------------------------------------------------------- numbers


def weight_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF ``LlamaForCausalLM`` parameter names and shapes, in checkpoint order (no lm_head:
    the embeddings are tied)."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings", True):
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def param_count(cfg: dict[str, Any]) -> int:
    """Parameters of the model ``cfg`` describes, computed without allocating anything."""
    return sum(math.prod(s) for s in weight_shapes(cfg).values())


def kv_bytes_per_token(cfg: dict[str, Any], dtype_bytes: int = 2) -> int:
    """K and V of every layer for one token (112 KiB for Orpheus-3B in bf16)."""
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * dtype_bytes


# ----------------------------------------------------------------------------- config


def base_files(workdir: Path) -> dict[str, Any]:
    """Write the tiny test model's tokenizer files into ``workdir`` and return its config.

    ``testkit.tiny_model`` writes the tokenizer only as part of ``write_tiny_model``, so
    this calls that (the tiny weights are a few tens of MB and take a second) and keeps the
    tokenizer and generation files and the config, whose token ids, rope settings and
    ``"orpheus"`` voices table the 3B config inherits. A ``write_tokenizer(dir)`` function,
    if tiny_model grows one, is used instead of writing the tiny weights.
    """
    from testkit import tiny_model

    writer = getattr(tiny_model, "write_tokenizer", None)
    if writer is not None and hasattr(tiny_model, "_model_config"):
        writer(workdir)
        cfg = tiny_model._model_config()
    else:
        tiny_model.write_tiny_model(workdir, seed=0)
        cfg = json.loads((workdir / "config.json").read_text())
        for f in workdir.glob("*.safetensors"):
            f.unlink()
    return cfg


def orpheus_config(
    base: dict[str, Any], *, speaks_codes: bool = False, **shape: int
) -> dict[str, Any]:
    """The 3B config on ``base`` (the tiny model's), with shape overrides for tests.
    ``speaks_codes``: untied LM head and the slot signal of :func:`_speak_codes`."""
    unknown = set(shape) - set(SHAPE_KEYS)
    if unknown:
        raise ValueError(f"not shape keys: {sorted(unknown)}")
    cfg = dict(base)
    cfg.update(json.loads(json.dumps(ORPHEUS_3B)))  # deep copy of the nested rope table
    cfg.update({k: int(v) for k, v in shape.items() if v is not None})
    cfg["initializer_range"] = INIT_STD
    cfg.pop("rope_parameters", None)  # the legacy keys above are what vLLM and HF both read
    orpheus = dict(cfg.get("orpheus") or {})
    orpheus["description"] = DESCRIPTION
    if any(cfg[k] != ORPHEUS_3B[k] for k in SHAPE_KEYS):
        orpheus["description"] += " (reduced shape for tests)"
    if speaks_codes:
        cfg["tie_word_embeddings"] = False
        orpheus["speaks_codes"] = True
        orpheus["description"] += "; weights arranged to emit valid audio codes unconstrained"
    cfg["orpheus"] = orpheus
    return cfg


# ----------------------------------------------------------------------------- weights


def _speak_codes(name: str, t: Any) -> None:
    """Make a random model emit valid Orpheus audio codes without any sampling constraint.

    A random model samples from the whole vocabulary, so without the audio-token
    constraint almost every frame holds an invalid token and is dropped: a run of the
    V2 runner on vLLM 0.25 (no custom processors there) would produce no audio, and the
    two sampling paths could not be compared. Here every weight stays random except a
    signal along 7 hidden directions (coordinates 0..6): the embedding of an audio token of
    slot j (and start-of-speech, as "slot 6") carries ``CODE_SIGNAL`` on coordinate j, which
    the residual stream carries to the last layer; the (untied) LM head row of every token
    of slot j+1 reads coordinate j. The next token is then in the next slot's range, picked
    among its 4096 codes by the random part of the logits. Shapes, and so the cost of every
    step, are the real model's; only the lm_head is a separate matrix (+0.96 GB of weights).
    """
    from llm_worker.vllm_ext import tokens as T

    n = CODEBOOK_SIZE
    if name == "model.embed_tokens.weight":
        for j in range(FRAME_CODES):
            lo = T.AUDIO_TOKEN_BASE + j * n
            t[lo : lo + n, j] += CODE_SIGNAL
        t[T.START_OF_SPEECH, FRAME_CODES - 1] += CODE_SIGNAL
    elif name == "lm_head.weight":
        for j in range(FRAME_CODES):
            lo = T.AUDIO_TOKEN_BASE + j * n
            t[lo : lo + n, (j - 1) % FRAME_CODES] += 1.0


def _tensors(cfg: dict[str, Any], device: Any, seed: int) -> Iterator[tuple[str, Any]]:
    """(name, bf16 tensor on ``device``), drawn one tensor at a time in chunks."""
    import torch

    speaks = bool(cfg.get("orpheus", {}).get("speaks_codes"))

    gen = torch.Generator(device=device)
    for index, (name, shape) in enumerate(weight_shapes(cfg).items()):
        if len(shape) == 1:  # RMSNorm weights
            yield name, torch.ones(shape, dtype=torch.bfloat16, device=device)
            continue
        gen.manual_seed(seed * 1_000_003 + index)  # per tensor: order- and shard-independent
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        rows = max(1, CHUNK_ELEMENTS // shape[1])
        for r in range(0, shape[0], rows):
            t[r : r + rows].normal_(0.0, INIT_STD, generator=gen)
        if speaks:
            _speak_codes(name, t)
        yield name, t


def _shard_plan(cfg: dict[str, Any], shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in weight_shapes(cfg).items():
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_weights(
    out: Path, cfg: dict[str, Any], device: str, seed: int, shard_bytes: int
) -> dict[str, float]:
    """Draw the weights on ``device`` and write them as HF-style safetensors shards."""
    import torch
    from safetensors.torch import save_file

    plan = _shard_plan(cfg, shard_bytes)
    n = len(plan)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    shard_of = {t: names[i] for i, shard in enumerate(plan) for t in shard}
    timings = {"draw_s": 0.0, "to_host_s": 0.0, "write_s": 0.0}
    total = 0
    pending: dict[str, torch.Tensor] = {}
    current = 0

    def flush() -> None:
        nonlocal pending, current
        t0 = time.perf_counter()
        host = {k: v.to("cpu") for k, v in pending.items()}
        timings["to_host_s"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        save_file(host, str(out / names[current]), metadata={"format": "pt"})
        timings["write_s"] += time.perf_counter() - t0
        pending = {}
        current += 1

    t_draw = time.perf_counter()
    for name, tensor in _tensors(cfg, torch.device(device), seed):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        timings["draw_s"] += time.perf_counter() - t_draw
        if shard_of[name] != names[current]:
            flush()
        pending[name] = tensor
        total += tensor.numel() * tensor.element_size()
        t_draw = time.perf_counter()
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": shard_of}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    timings["bytes"] = float(total)
    timings["shards"] = float(n)
    return timings


# ----------------------------------------------------------------------------- main


def write_random_orpheus(
    out: str | Path,
    *,
    device: str = "cpu",
    seed: int = 0,
    shard_gib: float = 2.0,
    snac: bool = True,
    speaks_codes: bool = False,
    **shape: int,
) -> dict[str, Any]:
    """Write the model (and ``out/snac`` unless ``snac=False``); return a summary dict."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # a rerun with another shard size leaves no strays
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="orpheus-tok-") as tmp:
        base = base_files(Path(tmp))
        for f in TOKENIZER_FILES:
            if (Path(tmp) / f).exists():
                shutil.copyfile(Path(tmp) / f, out / f)
    cfg = orpheus_config(base, speaks_codes=speaks_codes, **shape)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    t_tok = time.perf_counter() - t0
    timings = write_weights(out, cfg, device, seed, int(shard_gib * (1 << 30)))
    t_snac = 0.0
    if snac:
        from testkit.tiny_model import write_random_snac

        t1 = time.perf_counter()
        write_random_snac(out / "snac", seed=seed)
        t_snac = time.perf_counter() - t1
    summary = {
        "dir": str(out),
        "device": device,
        "params": param_count(cfg),
        "kv_bytes_per_token_bf16": kv_bytes_per_token(cfg),
        "shape": {k: cfg[k] for k in SHAPE_KEYS},
        "tokenizer_s": round(t_tok, 2),
        "snac_s": round(t_snac, 2),
        **{k: (round(v, 2) if k.endswith("_s") else int(v)) for k, v in timings.items()},
        "total_s": round(time.perf_counter() - t0, 2),
    }
    (out / "RANDOM_WEIGHTS.txt").write_text(
        "Random weights: this model makes noise, not speech.\n"
        + json.dumps(summary, indent=2)
        + "\n"
    )
    return summary


def check_codes(model: str | Path, device: str = "cpu", tokens: int = 28) -> dict[str, Any]:
    """Sample ``tokens`` tokens after an Orpheus prompt with transformers (temperature 0.6,
    no constraint) and count how many lie in their slot's audio range: all of them for a
    ``speaks_codes`` model, about 2.6 % for a plain random one."""
    import torch
    from transformers import AutoModelForCausalLM

    from llm_worker.vllm_ext import tokens as T

    m = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.bfloat16).to(device)
    ids = torch.tensor([[*T.PROMPT_PREFIX, T.BOS, 1000, 2000, *T.PROMPT_SUFFIX]], device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    valid = 0
    past = None
    step = ids
    with torch.inference_mode():
        for p in range(tokens):
            out = m(step, past_key_values=past, use_cache=True)
            past = out.past_key_values
            probs = torch.softmax(out.logits[0, -1].float() / 0.6, -1)
            tok = torch.multinomial(probs, 1, generator=gen)
            code = int(tok) - T.AUDIO_TOKEN_BASE - (p % FRAME_CODES) * CODEBOOK_SIZE
            valid += 0 <= code < CODEBOOK_SIZE
            step = tok[None]
    return {"model": str(model), "device": device, "tokens": tokens, "valid": valid}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="make_random_orpheus.py",
        description="Orpheus-3B architecture with random bf16 weights (+ random SNAC).",
    )
    p.add_argument("out", nargs="?", help="output directory")
    p.add_argument("--device", default="auto", help="where to draw the weights: auto|cuda|cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-gib", type=float, default=2.0, help="safetensors shard size (2 GiB)")
    p.add_argument("--no-snac", action="store_true", help="skip the random SNAC (out/snac)")
    p.add_argument(
        "--small", action="store_true", help="the tiny test model's shape (CPU, seconds)"
    )
    p.add_argument(
        "--speaks-codes",
        action="store_true",
        help="arrange the random weights so that the model emits valid audio codes without "
        "a sampling constraint (untied LM head): lets the V2 runner be measured on vLLM 0.25",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="sample from the model in OUT (transformers) and count valid audio codes",
    )
    p.add_argument("--dry-run", action="store_true", help="print the config numbers; write nothing")
    for key, flag in (
        ("num_hidden_layers", "--layers"),
        ("hidden_size", "--hidden"),
        ("num_attention_heads", "--heads"),
        ("num_key_value_heads", "--kv-heads"),
        ("head_dim", "--head-dim"),
        ("intermediate_size", "--intermediate"),
    ):
        p.add_argument(flag, dest=key, type=int, default=None, help=f"override {key}")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shape = dict(SMALL) if args.small else {}
    shape.update({k: getattr(args, k) for k in SHAPE_KEYS if getattr(args, k) is not None})
    if args.dry_run:
        cfg = {**ORPHEUS_3B, **shape}
        print(json.dumps({
            "shape": {k: cfg[k] for k in SHAPE_KEYS},
            "params": param_count(cfg),
            "bf16_bytes": 2 * param_count(cfg),
            "kv_bytes_per_token_bf16": kv_bytes_per_token(cfg),
        }, indent=2))  # fmt: skip
        return 0
    if not args.out:
        build_parser().error("out is required (or --dry-run)")
    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.check:
        result = check_codes(args.out, device)
        print(json.dumps(result))
        return 0 if result["valid"] == result["tokens"] else 1
    summary = write_random_orpheus(
        args.out,
        device=device,
        seed=args.seed,
        shard_gib=args.shard_gib,
        snac=not args.no_snac,
        speaks_codes=args.speaks_codes,
        **shape,
    )
    print(json.dumps(summary, indent=2))
    print("random weights: what this model says is noise, not speech")
    return 0


if __name__ == "__main__":
    sys.exit(main())
