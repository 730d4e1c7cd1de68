"""Tokenizer and chat template from the GGUF file agree with transformers' reading of it."""

from __future__ import annotations

import pytest

from hcache.model.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\n\nnewlines  ",
    "Numbers 1234567 and 3.14159, dates 2026-11-22.",
    "Unicode: café, naïve, 東京, emoji 🙂, Ελληνικά",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "don't you'll I'm we've",
]


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_matches_transformers(default_model, hf_default_tokenizer, text: str) -> None:
    ours = default_model.tokenizer
    ids = ours.encode(text)
    assert ids == hf_default_tokenizer.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special=False) == text


def test_chat_template_matches_transformers(default_model, hf_default_tokenizer) -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    for gen in (True, False):
        want = hf_default_tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
        assert default_model.tokenizer.render_chat(msgs, gen) == want
    assert default_model.tokenizer.stop_ids == {2}
    assert default_model.tokenizer.decode([2, 30]) == "."


def test_hf_folder_tokenizer(default_model, hf_default_tokenizer, tmp_path) -> None:
    hf_default_tokenizer.save_pretrained(tmp_path)
    tok = Tokenizer.from_hf_folder(tmp_path)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    msgs = [{"role": "user", "content": "Name 3 colours."}]
    assert tok.encode_chat(msgs) == default_model.tokenizer.encode_chat(msgs)


def test_missing_chat_template_is_a_clear_error(default_model) -> None:
    tok = Tokenizer(default_model.tokenizer.backend, None, None, None)
    with pytest.raises(ValueError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "x"}])
