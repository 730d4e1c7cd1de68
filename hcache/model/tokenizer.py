"""Tokenizer and chat template, from the same source as the weights: a GGUF
header (vocabulary, merges, template) or a Hugging Face folder (tokenizer.json,
tokenizer_config.json / chat_template.jinja). Built on `tokenizers` and rendered
with jinja2's sandbox, the way transformers renders chat templates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4
# Pre-tokenizer regexes of the BPE vocabularies llama.cpp names in `tokenizer.ggml.pre`.
_SPLIT_RE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|DIGITS| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_RE = _SPLIT_RE.replace("DIGITS", r"\p{N}{1,3}")  # numbers in groups of up to three digits
_QWEN2_RE = _SPLIT_RE.replace("DIGITS", r"\p{N}")  # one digit at a time


def _byte_level_pre(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in ("gpt2", "default", "gpt-2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    regex = {"llama-bpe": _LLAMA3_RE, "llama3": _LLAMA3_RE, "qwen2": _QWEN2_RE}.get(pre)
    if regex is None:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; load the model from a Hugging Face folder instead")
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


class Tokenizer:
    def __init__(
        self,
        backend: Backend,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        add_bos: bool = False,
        stop_ids: set[int] | None = None,
    ):
        self.backend = backend
        self.chat_template = chat_template
        self.bos_token, self.eos_token, self.add_bos = bos_token, eos_token, add_bos
        self.bos_id = backend.token_to_id(bos_token) if bos_token else None
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        self.stop_ids = set(stop_ids or ()) | ({eos_id} if eos_id is not None else set())
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Plain text to ids. Special-token strings in `text` become their ids."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True, **extra: Any) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send token ids or plain text instead")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        # The template writes BOS itself where the model wants it.
        return self.encode(self.render_chat(messages, add_generation_prompt), add_bos=False)

    @classmethod
    def from_gguf(cls, fields: dict[str, Any]) -> Tokenizer:
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE only); "
                "load the model from a Hugging Face folder instead"
            )
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        types: list[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend = Backend(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
        backend.pre_tokenizer = _byte_level_pre(fields.get("tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [
                AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, types, strict=True)
                if ty in (GGUF_CONTROL, GGUF_USER_DEFINED)
            ]
        )

        def tok(key: str) -> str | None:
            i = fields.get(f"tokenizer.ggml.{key}_token_id")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        stop = {fields[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in fields}
        return cls(
            backend,
            fields.get("tokenizer.chat_template"),
            tok("bos"),
            tok("eos"),
            add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            stop_ids=stop,
        )

    @classmethod
    def from_hf_folder(cls, folder: Path, stop_ids: set[int] | None = None) -> Tokenizer:
        path = folder / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{folder} has no tokenizer.json")
        backend = Backend.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja = folder / "chat_template.jinja"
        if template is None and jinja.exists():
            template = jinja.read_text()
        return cls(
            backend,
            template,
            _token_str(cfg.get("bos_token")),
            _token_str(cfg.get("eos_token")),
            add_bos=bool(cfg.get("add_bos_token", False)),
            stop_ids=stop_ids,
        )


def _token_str(tok: str | dict[str, Any] | None) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


def _raise(message: str) -> None:
    raise ValueError(f"chat template: {message}")
