"""A deterministic tiny Orpheus-shaped Llama for tests, demos and CPU benchmarks.

``write_tiny_model(dir)`` writes, with no download:

- ``config.json`` + ``model.safetensors``: an HF ``LlamaForCausalLM`` with the Orpheus
  vocabulary (156,940), tied embeddings, llama3 rope scaling, and the smallest shape the
  CPU attention kernels accept (head dim 64): hidden 256, 4 query heads, 2 KV heads,
  2 layers. Weights are random (seeded) plus a small planted circuit that makes it emit,
  like Orpheus, audio tokens of the right slot and end of speech at frame boundaries
  (:func:`_plant_slot_circuit`). Its audio codes are still random: noise, not speech.
- ``tokenizer.json`` (+ ``tokenizer_config.json``, ``special_tokens_map.json``): a byte-level
  BPE trained locally on a small embedded English text with the Llama-3 pre-tokenizer,
  padded so that every special id matches Llama-3/Orpheus exactly: ``<|begin_of_text|>``
  128000 ... ``<|eot_id|>`` 128009 ... ``<|reserved_special_token_247|>`` 128255, then
  ``<custom_token_N>`` = 128256 + N up to 156939 (start/end of speech 128257/128258, ...).
  ``transformers.AutoTokenizer.from_pretrained(dir)`` loads it.
- The model's voices and emotion tags, under the ``"orpheus"`` key of ``config.json``
  (see :mod:`llm_worker.model_info`): voices belong to the model's configuration.

The same seed gives the same bytes in every file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from snac import SNAC
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from codec_worker.snac_model import CONFIG_FILE, SNAC_24KHZ, WEIGHTS_FILE
from llm_worker.model_info import EMOTION_TAGS, ENGLISH_VOICES
from llm_worker.vllm_ext import tokens as T
from shm.records import CODEBOOK_SIZE, FRAME_CODES

VOCAB_SIZE = 156_940
TEXT_VOCAB_SIZE = 128_000  # Llama-3's ordinary (BPE) tokens: ids 0..127999
BPE_TRAINED_SIZE = 2_048  # what the embedded text supports; the rest is unreachable padding

HIDDEN = 256
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
LAYERS = 2
INTERMEDIATE = 512
INIT_STD = 0.02


# Llama-3's pre-tokenizer split pattern.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. Hello there! How are you doing today? I am doing well, thank you for asking.
Speech synthesis turns written text into spoken words, one sound at a time. The weather is
lovely this morning, with a light breeze and a few clouds drifting over the hills. She sells
sea shells by the sea shore, and the shells she sells are surely sea shells. We will meet at
the station at half past seven; please do not be late. Numbers like 1, 2, 3, 42, 100 and
2025 appear in text too, as do prices such as $9.99 and times such as 10:30. Could you tell
me the way to the library? It's just around the corner, next to the old bakery. They've
already left, but we'll catch up with them later. What a wonderful idea! Let's try it now.
Voice assistants read messages, answer questions and tell stories to people all day long.
The river flows quietly through the valley, past farms, forests and small villages. When
the music started, everyone stood up and began to dance. Good morning, good afternoon and
good evening. Thank you very much, and have a nice day. I'm sorry, I didn't catch that;
could you say it again, please? Reading aloud is a skill that improves with practice.
"""


def _llama3_special_tokens() -> list[str]:
    """Names of ids 128000..128255, in id order, as in Llama-3.1/3.2."""
    names = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|reserved_special_token_0|>",
        "<|reserved_special_token_1|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_2|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eom_id|>",
        "<|eot_id|>",
        "<|python_tag|>",
    ]
    names += [f"<|reserved_special_token_{i}|>" for i in range(3, 3 + 256 - len(names))]
    assert len(names) == 256
    return names


def build_tokenizer() -> Tokenizer:
    """Byte-level BPE with Llama-3's pre-tokenization and Orpheus's id layout."""
    tok = Tokenizer(models.BPE(byte_fallback=False, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_TRAINED_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)

    # Pad the ordinary vocabulary to 128,000 with entries no merge can reach, so that the
    # special tokens land on Llama-3's ids.
    vocab = tok.get_vocab()
    merges_src = json.loads(tok.to_str())["model"]["merges"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges_src]
    if len(vocab) > TEXT_VOCAB_SIZE:
        raise AssertionError("trained vocabulary larger than Llama-3's text vocabulary")
    for i in range(len(vocab), TEXT_VOCAB_SIZE):
        vocab[f"<|unused_text_{i}|>"] = i
    padded = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False))
    padded.pre_tokenizer = tok.pre_tokenizer
    padded.decoder = tok.decoder

    specials = _llama3_special_tokens()
    specials += [f"<custom_token_{n}>" for n in range(VOCAB_SIZE - T.CUSTOM_TOKEN_BASE)]
    added = padded.add_special_tokens(specials)
    assert added == len(specials)
    bos = specials[0]
    padded.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A",
        pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, T.BOS)],
    )
    assert padded.token_to_id("<|eot_id|>") == T.END_OF_TEXT
    assert padded.token_to_id("<custom_token_2>") == T.END_OF_SPEECH
    assert padded.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    return padded


def _model_config() -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": T.BOS,
        "eos_token_id": T.END_OF_TEXT,
        "pad_token_id": T.PAD,
        "torch_dtype": "bfloat16",
        "initializer_range": INIT_STD,
        "use_cache": True,
        # Any transformers_version keeps transformers 5.x from probing the hub for a Mistral
        # tokenizer; the real checkpoint was written by a 4.x release.
        "transformers_version": "4.50.0",
        "orpheus": {
            "voices": list(ENGLISH_VOICES),
            "emotion_tags": list(EMOTION_TAGS),
            "zero_shot": True,
            "description": "tiny random-weight test model: it makes noise, not speech",
        },
    }


def _weights(seed: int) -> dict[str, torch.Tensor]:
    """Random weights in a fixed order from one seeded generator (HF Llama names), plus the
    planted slot circuit (see :func:`_plant_slot_circuit`)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * INIT_STD

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.float32)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(VOCAB_SIZE, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones(HIDDEN)
        w[p + "self_attn.q_proj.weight"] = normal(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * HEAD_DIM)
        w[p + "post_attention_layernorm.weight"] = ones(HIDDEN)
        w[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        w[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
        w[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
    w["model.norm.weight"] = ones(HIDDEN)
    _plant_slot_circuit(w)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in w.items()}


# Feature dimensions of the planted circuit (the other hidden dimensions stay random).
_SLOT_DIMS = list(range(FRAME_CODES))  # "the current token is in slot s"
_EOS_DIM = 7  # "end of speech is welcome here" (read by the END_OF_SPEECH embedding)
_BIAS_DIM = 8  # constant in every embedding: opens the circuit's MLP gates
_START_DIM = 9  # "the current token is START_OF_SPEECH": the next one is slot 0
_FEATURE = 1.0  # embedding value of a feature
_GATE = 1.0  # gate weight on the bias dimension
_MOVE = 0.05  # down weight of a move: overshoots on purpose, so the source slot goes negative
_SLOT_GAIN = 1.0  # final-norm gain of the slot dims: sets the right slot's logit margin
_EOS_GAIN = 1.42  # final-norm gain of the end-of-speech dim: chance of stopping per frame


def _plant_slot_circuit(w: dict[str, torch.Tensor]) -> None:
    """Make the random model behave like Orpheus at the token level.

    Every audio token's embedding carries a one-hot "slot" feature; the last layer's MLP
    moves slot s to slot s+1 (mod 7), START_OF_SPEECH to slot 0, and after slot 6 also
    raises an end-of-speech feature. Through the tied embeddings, the next token is then
    an audio token of the right slot with high probability (the remaining random weights
    still make the choice within the slot pure noise), and END_OF_SPEECH becomes likely only
    at a frame boundary, so short texts end on their own. Sampling at a high temperature
    still draws the odd invalid token, which exercises the frame-dropping path.
    """
    emb = w["model.embed_tokens.weight"]
    emb[:, _BIAS_DIM] = _FEATURE
    for s in range(FRAME_CODES):
        lo = T.AUDIO_TOKEN_BASE + s * CODEBOOK_SIZE
        emb[lo : lo + CODEBOOK_SIZE, _SLOT_DIMS[s]] = _FEATURE
    emb[T.START_OF_SPEECH, _START_DIM] = _FEATURE
    emb[T.END_OF_SPEECH, _EOS_DIM] = _FEATURE

    p = f"model.layers.{LAYERS - 1}.mlp."
    gate, up, down = w[p + "gate_proj.weight"], w[p + "up_proj.weight"], w[p + "down_proj.weight"]
    # Units 0..6 move slot s to s+1; unit 7 moves START to slot 0. Each unit computes
    # silu(gate . x) * (up . x) on the normalised residual; the bias dim keeps its gate open.
    moves = [(_SLOT_DIMS[s], _SLOT_DIMS[(s + 1) % FRAME_CODES]) for s in range(FRAME_CODES)]
    moves.append((_START_DIM, _SLOT_DIMS[0]))
    circuit_dims = [*_SLOT_DIMS, _EOS_DIM, _BIAS_DIM, _START_DIM]
    n = len(moves)
    gate[:n] = 0.0
    up[:n] = 0.0
    down[:, :n] = 0.0
    for unit, (src, dst) in enumerate(moves):
        gate[unit, _BIAS_DIM] = _GATE
        up[unit, src] = 1.0
        down[dst, unit] = _MOVE
        down[src, unit] = -_MOVE
    down[_EOS_DIM, FRAME_CODES - 1] = _MOVE  # after slot 6: end of speech is welcome
    # Random units and attention outputs leave the feature dims alone.
    for i in range(LAYERS):
        w[f"model.layers.{i}.self_attn.o_proj.weight"][circuit_dims] = 0.0
        w[f"model.layers.{i}.mlp.down_proj.weight"][circuit_dims, n if i == LAYERS - 1 else 0 :] = (
            0.0
        )
    norm = w["model.norm.weight"]
    norm[_SLOT_DIMS] = _SLOT_GAIN
    norm[_EOS_DIM] = _EOS_GAIN
    norm[[_BIAS_DIM, _START_DIM]] = 0.0


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LORA_SHAPES = {  # (in, out) of each target module of the tiny model
    "q_proj": (HIDDEN, HEADS * HEAD_DIM),
    "k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "v_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "o_proj": (HEADS * HEAD_DIM, HIDDEN),
    "gate_proj": (HIDDEN, INTERMEDIATE),
    "up_proj": (HIDDEN, INTERMEDIATE),
    "down_proj": (INTERMEDIATE, HIDDEN),
}
_LORA_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip


def write_random_lora(dir: Path, seed: int = 1, rank: int = 8, scale: float = 0.5) -> Path:
    """A PEFT LoRA adapter for the tiny model with random A and B (both non-zero, unlike a
    fresh PEFT adapter whose B is zero): a stand-in for a fine-tuned voice whose outputs
    differ from the base model's and from another seed's. ``scale`` sets the size of the
    change (std of B). Loads with vLLM's multi-LoRA (and with PEFT)."""
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(LAYERS):
        for name in LORA_TARGETS:
            fan_in, fan_out = _LORA_SHAPES[name]
            prefix = f"base_model.model.model.layers.{layer}.{_LORA_MODULE[name]}.{name}"
            a = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=g) * scale
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    _write_json(
        dir / "adapter_config.json",
        {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": "orpheus-tiny",
            "r": rank,
            "lora_alpha": rank,
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": list(LORA_TARGETS),
            "fan_in_fan_out": False,
            "inference_mode": True,
            "modules_to_save": None,
        },
    )
    (dir / "README.txt").write_text(
        f"Random LoRA adapter (seed {seed}, rank {rank}) for the tiny Orpheus test model, "
        "written by orpheus-serve tiny-model --lora: a stand-in for a fine-tuned voice.\n"
    )
    return dir


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def write_tiny_model(dir: Path, seed: int = 0) -> None:
    """Write the tiny model, its tokenizer and its voices to ``dir`` (created if missing)."""
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    _write_json(dir / "config.json", _model_config())
    _write_json(
        dir / "generation_config.json",
        {"bos_token_id": T.BOS, "eos_token_id": T.END_OF_TEXT, "pad_token_id": T.PAD},
    )
    save_file(_weights(seed), str(dir / "model.safetensors"), metadata={"format": "pt"})

    tok = build_tokenizer()
    tok.save(str(dir / "tokenizer.json"), pretty=False)
    specials = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": f"<custom_token_{T.PAD - T.CUSTOM_TOKEN_BASE}>",
    }
    _write_json(dir / "special_tokens_map.json", specials)
    _write_json(
        dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 131072,
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
            **specials,
        },
    )


def random_snac(seed: int, config: dict[str, Any] | None = None) -> SNAC:
    """SNAC's architecture with deterministic random weights (PyTorch's default init)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SNAC(**(config or SNAC_24KHZ))
    return model.float().eval().requires_grad_(False)


def write_random_snac(
    directory: str | os.PathLike[str], seed: int = 0, config: dict[str, Any] | None = None
) -> Path:
    """Write the real 24 kHz architecture (or ``config``) with random weights in the
    checkpoint layout. The result loads with ``load_snac(directory)`` and with
    ``SNAC.from_pretrained``.
    """
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    config = config or SNAC_24KHZ
    model = random_snac(seed, config)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    torch.save(model.state_dict(), out / WEIGHTS_FILE)
    (out / "README.txt").write_text(
        "SNAC 24 kHz architecture with random weights (seed "
        f"{seed}), written by orpheus-serve for tests and the demo.\n"
        "Random weights: it decodes to noise, not speech.\n"
    )
    return out
