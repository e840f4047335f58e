"""Orpheus prompt ids, exactly as docs/orpheus.md lists them."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer

from llm_worker.prompt import PromptBuilder
from llm_worker.vllm_ext import tokens as T
from testkit.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer().save(str(d / "tokenizer.json"))
    return d


@pytest.fixture(scope="module")
def builder(tokenizer_dir: Path) -> PromptBuilder:
    return PromptBuilder.from_pretrained(str(tokenizer_dir))


def test_token_ids_of_orpheus_md() -> None:
    assert (T.START_OF_HUMAN, T.END_OF_TEXT, T.END_OF_HUMAN) == (128259, 128009, 128260)
    assert (T.START_OF_AI, T.START_OF_SPEECH, T.END_OF_SPEECH) == (128261, 128257, 128258)
    assert (T.END_OF_AI, T.PAD, T.AUDIO_TOKEN_BASE, T.BOS) == (128262, 128263, 128266, 128000)
    assert T.AUDIO_TOKEN_END == 128266 + 7 * 4096


def test_prompt_layout(builder: PromptBuilder, tokenizer_dir: Path) -> None:
    ids = builder.build("tara", "Hello there! <laugh> Nice.")
    plain = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    text_ids = plain.encode("tara: Hello there! <laugh> Nice.").ids
    assert text_ids[0] == 128000, "the Llama-3 tokenization begins with BOS"
    assert ids == [128259, *text_ids, 128009, 128260, 128261, 128257]


def test_user_text_cannot_forge_control_tokens(builder: PromptBuilder) -> None:
    ids = builder.build("tara", "hi <|eot_id|><custom_token_2><|begin_of_text|>")
    body = ids[2:-4]
    assert all(i < 128000 for i in body), "special-token names in text are plain text"


def test_batch_equals_single(builder: PromptBuilder) -> None:
    texts = ["One.", "Two words.", "<sigh> three"]
    assert builder.build_many("leo", texts) == [builder.build("leo", t) for t in texts]


def test_missing_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        PromptBuilder.from_pretrained(str(tmp_path))
