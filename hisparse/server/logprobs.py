"""Token log-probabilities in the response shapes of vLLM's OpenAI server (completions and chat)."""

from __future__ import annotations

from collections.abc import Callable

from ..engine.request import TokenLogprobs

FLOOR = -9999.0   # -inf is not JSON; OpenAI and vLLM send this instead


class CompletionLogprobs:
    """The `logprobs` object of one completion choice, built up chunk by chunk: tokens, token_logprobs,
    top_logprobs (the chosen token, then the top-k, keyed by text) and text_offset (running over token texts)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.offset = 0

    def chunk(self, ids: list[int], lps: list[TokenLogprobs | None]) -> dict:
        """ids [n] and their logprobs [n] (None: the first prompt token, which has none) -> the object for them."""
        out: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for tid, lp in zip(ids, lps):
            text = self.decode([tid])
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
            if lp is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(max(lp.logprob, FLOOR))
            top = {text: max(lp.logprob, FLOOR)}
            top.update((self.decode([i]), max(v, FLOOR)) for i, v in zip(lp.top_ids, lp.top_logprobs))
            out["top_logprobs"].append(top)
        return out


def chat_logprobs(lps: list[TokenLogprobs], decode: Callable[[list[int]], str]) -> dict:
    """The `logprobs` object of a chat choice (or of one streamed chunk): `content`, one entry per token."""
    def entry(tid: int, lp: float) -> dict:
        text = decode([tid])
        return {"token": text, "logprob": max(lp, FLOOR), "bytes": list(text.encode("utf-8", errors="replace"))}
    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]}
                        for lp in lps]}


def prompt_logprobs(lps: list[TokenLogprobs], decode: Callable[[list[int]], str]) -> list[dict | None]:
    """vLLM's `prompt_logprobs` field: None for the first prompt token, then per token {id: {logprob, rank,
    decoded_token}} for the token itself and its top-k."""
    def entry(lp: float, rank: int, tid: int) -> dict:
        return {"logprob": max(lp, FLOOR), "rank": rank, "decoded_token": decode([tid])}
    return [None] + [{lp.token_id: entry(lp.logprob, lp.rank, lp.token_id),
                      **{i: entry(v, r, i) for r, (i, v) in enumerate(zip(lp.top_ids, lp.top_logprobs), 1)
                         if i != lp.token_id}}
                     for lp in lps]
