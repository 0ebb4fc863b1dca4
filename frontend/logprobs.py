"""Logprobs as the HTTP dialects show them: chat's `logprobs.content` entries and vLLM's `prompt_logprobs`."""
from __future__ import annotations

from typing import Any

from frontend.backend_client import TokenLogprob
from kvyard.tokenizer import TextTokenizer


def token_name(tokenizer: TextTokenizer, token_id: int, as_id: bool = False) -> str:
    """A token as text, or "token_id:<id>" (vLLM's return_tokens_as_token_ids: ids survive any decoding)."""
    return f"token_id:{token_id}" if as_id else tokenizer.decode([token_id])


def logprob_entries(items: list[TokenLogprob], tokenizer: TextTokenizer, as_ids: bool = False) -> list[dict[str, Any]]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": token_name(tokenizer, token_id, as_ids), "logprob": logprob,
                "bytes": token_bytes(tokenizer, token_id)}
    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in items]


def token_bytes(tokenizer: TextTokenizer, token_id: int) -> list[int]:
    """The token's own bytes: one of several tokens of a character is not valid UTF-8 by itself, and
    that is what OpenAI's `bytes` field is for (its `token` text shows U+FFFD then)."""
    raw = tokenizer.token_bytes(token_id)
    return list(raw if raw is not None else tokenizer.decode([token_id]).encode("utf-8"))


def prompt_logprob_entries(items: list[TokenLogprob | None], tokenizer: TextTokenizer
                           ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's shape: per prompt token None (the first) or {"<id>": {logprob, rank, decoded_token}} for the
    token itself and each alternative. rank is 1 for the most likely; the prompt's own token carries its rank
    only when it is among the alternatives asked for (kvyard's score call does not rank the rest)."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for lp in items:
        if lp is None:
            out.append(None)
            continue
        ranks = {t: r for r, (t, _) in enumerate(lp.top, 1)}
        entry = {str(t): {"logprob": v, "rank": r, "decoded_token": tokenizer.decode([t])}
                 for r, (t, v) in enumerate(lp.top, 1)}
        own: dict[str, Any] = {"logprob": lp.logprob, "decoded_token": tokenizer.decode([lp.token_id])}
        if lp.token_id in ranks:
            own["rank"] = ranks[lp.token_id]
        entry[str(lp.token_id)] = own
        out.append(entry)
    return out
