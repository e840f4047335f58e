"""The deterministic tiny Orpheus model: same bytes per seed, loadable by transformers,
Llama-3/Orpheus special ids exactly, voices in its configuration, Orpheus-like output."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from common.config.llm import LLMConfig
from llm_worker.model_info import ENGLISH_VOICES, load_model_info
from llm_worker.prompt import PromptBuilder
from llm_worker.vllm_ext import tokens as T
from shm.records import CODEBOOK_SIZE
from testkit.tiny_model import write_tiny_model


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny") / "seed0"
    write_tiny_model(d, seed=0)
    return d


def test_same_seed_same_bytes_other_seed_other_weights(model_dir: Path, tmp_path: Path) -> None:
    write_tiny_model(tmp_path / "again", seed=0)
    write_tiny_model(tmp_path / "other", seed=1)
    first, again, other = (
        _digests(model_dir),
        _digests(tmp_path / "again"),
        _digests(tmp_path / "other"),
    )
    assert first == again
    assert other["model.safetensors"] != first["model.safetensors"]
    assert other["tokenizer.json"] == first["tokenizer.json"]


def test_config_shape(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["vocab_size"] == 156_940 and cfg["tie_word_embeddings"] is True
    assert cfg["head_dim"] == 64 and cfg["hidden_size"] == cfg["num_attention_heads"] * 64
    assert cfg["num_key_value_heads"] == 2 and cfg["rope_scaling"]["rope_type"] == "llama3"
    assert cfg["orpheus"]["voices"] == list(ENGLISH_VOICES)


def test_tokenizer_ids_match_llama3_and_orpheus(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert len(tok) == 156_940
    ids = tok.convert_tokens_to_ids
    assert ids("<|begin_of_text|>") == 128000 and ids("<|end_of_text|>") == 128001
    assert ids("<|start_header_id|>") == 128006 and ids("<|eot_id|>") == 128009
    assert ids("<|reserved_special_token_247|>") == 128255
    for n in (0, 1, 2, 3, 4, 5, 6, 7, 10, 28683):
        assert ids(f"<custom_token_{n}>") == 128256 + n
    enc = tok("tara: Hello there!")["input_ids"]
    assert enc[0] == T.BOS and tok.decode(enc[1:]) == "tara: Hello there!"


def test_voices_read_from_the_model_configuration(model_dir: Path) -> None:
    info = load_model_info(LLMConfig(model=str(model_dir)))
    assert info.voices == ENGLISH_VOICES and info.source.endswith("config.json")
    override = load_model_info(
        LLMConfig(model=str(model_dir), voices=["Anna"], default_voice="anna")
    )
    assert override.voices == ("anna",) and override.source == "config"
    with pytest.raises(ValueError, match="default_voice"):
        load_model_info(LLMConfig(model=str(model_dir), voices=["anna"]))


def test_transformers_loads_it_and_it_speaks_in_frames(model_dir: Path) -> None:
    """The planted circuit: greedy decoding after start-of-speech yields audio tokens in
    slot order (what Orpheus does), so the pipeline gets valid frames without help."""
    model = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    prompt = PromptBuilder.from_pretrained(str(model_dir)).build("tara", "Hello there.")
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(21):
            logits = model(ids).logits[0, -1]
            logits[T.END_OF_SPEECH] = -float("inf")  # keep going for the whole check
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    audio = ids[0, len(prompt) :]
    slots = (audio - T.AUDIO_TOKEN_BASE) // CODEBOOK_SIZE
    assert slots.tolist() == [i % 7 for i in range(21)]
