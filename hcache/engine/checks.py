"""What the engine refuses before it queues anything: malformed input, a session in use
or beyond repair, and a tenant's limits. Nothing here changes state."""

from __future__ import annotations

from collections.abc import Iterable

from hcache.engine.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from hcache.engine.sampler import SamplingParams
from hcache.engine.session import Session

MAX_STOPS, MAX_STOP_CHARS = 16, 256


def exactly_one(text: str, token_ids: list[int] | None, message: str) -> None:
    if bool(text) == bool(token_ids):
        raise InvalidArgument(message)


def sampling(params: SamplingParams, stops: list[str], max_position: int) -> None:
    try:
        params.validate()
    except ValueError as e:
        raise InvalidArgument(str(e)) from None
    if params.max_new_tokens > max_position:
        raise InvalidArgument(f"max_new_tokens {params.max_new_tokens} exceeds the model's context of {max_position}")
    if len(stops) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidArgument(f"at most {MAX_STOPS} stop strings of at most {MAX_STOP_CHARS} characters")


def history(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """A conversation to start a session from: system messages first, then user and assistant."""
    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant") or not isinstance(content, str):
            raise InvalidArgument(f"message {i}: a role of system, user or assistant and a text content")
        if role == "system" and any(o["role"] != "system" for o in out):
            raise InvalidArgument(f"message {i}: system messages come first")
        out.append({"role": role, "content": content})
    return out


def tokens(ids: list[int], vocab: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidArgument(f"token ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}")


def within_context(ids: list[int], max_position: int, what: str) -> None:
    if len(ids) > max_position:
        raise InvalidArgument(f"{what} of {len(ids)} tokens exceeds the model's context of {max_position}")


def not_busy(s: Session) -> None:
    if s.busy:
        raise FailedPrecondition(f"{s.kind} {s.id} is busy with another request")


def usable(s: Session) -> None:
    """Idle, and its stored state can be continued by this model."""
    not_busy(s)
    if s.error:
        raise FailedPrecondition(s.error)


def session_limit(owners: Iterable[Session], tenant: str | None, limit: int) -> None:
    if tenant is not None and limit:
        n = sum(1 for s in owners if s.tenant == tenant and s.kind == "session")
        if n >= limit:
            raise ResourceExhausted(f"this API key already has {n} sessions (the limit is {limit})")


def storage_quota(owners: Iterable[Session], tenant: str | None, more_tokens: int, per_token: int, limit: int) -> None:
    """Refuse work that could take a tenant's stored state past its quota."""
    if tenant is None or not limit:
        return
    used = sum(len(s.own_tokens) for s in owners if s.tenant == tenant)
    if (used + more_tokens) * per_token > limit:
        raise ResourceExhausted(
            f"this API key stores {used * per_token / 1e6:.1f} MB; this request could take it past "
            f"its {limit / 1e6:.1f} MB quota (delete sessions to make room)"
        )


def contexts_fit(contexts: list[Session], max_position: int, kv_tokens: int) -> None:
    """Contexts a session places before its first token: within the model's context, and
    within the KV memory, refused before any work."""
    for c in contexts:
        if c.error:
            raise FailedPrecondition(c.error)
    n = sum(len(c.tokens) for c in contexts)
    if n >= max_position:
        raise InvalidArgument(f"the contexts hold {n} tokens; the model's context is {max_position}")
    if n >= kv_tokens:
        raise ResourceExhausted(f"the contexts hold {n} tokens of KV; the KV budget holds {kv_tokens}")
