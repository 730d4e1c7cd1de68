"""A single-sequence generation loop (prefill, then one token per step) and a
multi-turn chat session on top of it. The batched engine replaces the loop;
the chat session is what the demo uses to drop and restore KV between turns."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hcache.engine.sampler import Sampler, SamplingParams
from hcache.model.base import DecoderModel
from hcache.model.cache import KVCache
from hcache.model.tokenizer import Tokenizer
from hcache.restore.executor import RestoreReport, restore
from hcache.restore.plan import Plan
from hcache.restore.state import MemoryState, Recorder, StateSource
from hcache.storage.prefixes import common_prefix


def generate(
    model: DecoderModel,
    cache: KVCache,
    prompt: list[int],
    params: SamplingParams,
    stop_ids: set[int],
    state: Recorder | None = None,
) -> Iterator[int]:
    """Yield new tokens after `prompt`, which continues what `cache` holds.

    Every token fed to the model is appended to `state` with its hidden states and K/V; the
    last sampled token is not fed, so `state` always matches `cache`."""
    if not prompt:
        raise ValueError("nothing to prefill")
    sampler = Sampler(params)
    ids, dev = prompt, model.device
    for step in range(params.max_new_tokens):
        pos = cache.length
        if pos + len(ids) > model.cfg.max_position:
            raise ValueError(f"context of {pos + len(ids)} tokens exceeds the model's {model.cfg.max_position}")
        slot = state.hidden_slot(len(ids)) if state is not None else None
        alone = model.last_row_alone(len(ids), cache.dtype)
        h = model(
            torch.tensor(ids, device=dev), torch.arange(pos, pos + len(ids), device=dev), cache, slot, last_only=alone
        )
        if state is not None:
            state.append(ids, cache)
        token = sampler(model.logits(h[-1]))
        yield token
        if token in stop_ids or step == params.max_new_tokens - 1:
            return
        ids = [token]


class ChatSession:
    """A conversation whose model state (tokens, hidden states, K/V) is kept as it runs.

    Each turn renders the whole conversation with the chat template and prefills only what
    the session has not seen: the longest common prefix with the processed tokens stays."""

    def __init__(
        self,
        model: DecoderModel,
        tokenizer: Tokenizer,
        system_prompt: str | None = None,
        recorder: Recorder | None = None,
        kv_dtype: torch.dtype | None = None,
    ):
        self.model, self.tok = model, tokenizer
        self.messages: list[dict[str, str]] = []
        self.state: Recorder = recorder or MemoryState(model.cfg, model.dtype, model.device)
        self.cache: KVCache | None = KVCache(model.cfg, kv_dtype or model.dtype, model.device)
        if system_prompt is not None:
            self.messages.append({"role": "system", "content": system_prompt})
            self._prefill(self.tok.encode_chat(self.messages, add_generation_prompt=False))

    def _prefill(self, ids: list[int]) -> None:
        for _ in generate(self.model, self._live(), ids, SamplingParams(max_new_tokens=1), set(), self.state):
            pass
        self.state.end_turn()

    def _live(self) -> KVCache:
        if self.cache is None:
            raise RuntimeError("the session's KV cache was dropped; restore it first")
        return self.cache

    def reply(self, message: str, params: SamplingParams) -> tuple[str, list[int]]:
        cache = self._live()
        ids = self.tok.encode_chat([*self.messages, {"role": "user", "content": message}])
        keep = common_prefix(self.state.tokens, ids)
        if keep == len(ids):
            keep -= 1  # always feed at least one token
        self.state.truncate(keep)
        cache.truncate(keep)
        out = list(generate(self.model, cache, ids[keep:], params, self.tok.stop_ids, self.state))
        self.state.end_turn()
        text = self.tok.decode(out)
        self.messages += [{"role": "user", "content": message}, {"role": "assistant", "content": text}]
        return text, out

    def drop_kv(self) -> None:
        self.cache = None

    def restore(self, plan: Plan, source: StateSource | None = None) -> RestoreReport:
        """Bring the KV back from `source` (default: this session's own recorded state)."""
        src = source if source is not None else self.state
        if not isinstance(src, StateSource):
            raise TypeError("this session's recorder is not a restore source; pass one")
        self.cache, report = restore(self.model, plan, src)
        return report

    def fork(self) -> ChatSession:
        """A copy sharing nothing mutable: the demo runs each restore path on its own fork."""
        if not isinstance(self.state, MemoryState):
            raise TypeError("only an in-memory session can be forked")
        other = object.__new__(ChatSession)
        other.model, other.tok, other.messages = self.model, self.tok, list(self.messages)
        other.state = self.state.copy()
        other.cache = None
        return other
