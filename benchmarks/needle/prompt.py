"""Needle prompts: a haystack of corpus sentences cut to a token length, the needle at a depth, the question.

The request's prompt (chat template or BOS included) has `target` tokens: the filler is the first sentences of
the corpus stream plus a prefix of the next one, sized from per-unit token counts (additive, see
corpus.Corpus) and then checked against a full encode of the request, correcting the tail until the count is
exact (with a LocalCounter; a ServerCounter's estimate is used as is). The needle goes between two sentences at
the boundary nearest `depth` of the filler's tokens: 0 = before the first sentence, 100 = after the last.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from itertools import accumulate

from hisparse.train.passkey import SyntheticHaystack, content, needle_text

from .corpus import Corpus, digest
from .tokens import TokenCounter

MAX_FIXES = 4    # full-encode checks of one prompt per start
MAX_STARTS = 4   # first units of the stream tried as the haystack's start
WORD = re.compile(r" ?\S+")


@dataclass
class NeedlePrompt:
    api: str
    content: str
    value: str
    target: int            # requested prompt tokens
    tokens: int            # prompt tokens as counted (exact with a LocalCounter)
    needle_depth: float    # filler tokens before the needle / filler tokens
    haystack_digest: str

    def request(self) -> dict:
        """Keyword arguments of the openai call that carry the prompt."""
        if self.api == "completions":
            return {"prompt": self.content}
        return {"messages": [{"role": "user", "content": self.content}]}


class PromptBuilder:
    def __init__(self, corpus: "Corpus | SyntheticHaystack", counter: TokenCounter, api: str):
        if api not in ("chat", "completions"):
            raise ValueError(f"api: {api!r} is neither 'chat' nor 'completions'")
        self.corpus, self.counter, self.api = corpus, counter, api
        self.units: list[str] = []
        self.cum: list[int] = [0]     # cum[i] = tokens of units[:i]

    def _cover(self, tokens: int) -> None:
        """Count units until they hold more than `tokens` tokens."""
        while self.cum[-1] <= tokens:
            n = len(self.units) + max(64, (tokens - self.cum[-1]) // 16)
            new = self.corpus.units(n)[len(self.units):]
            self.units += new
            self.cum += list(accumulate(self.counter.units(new), initial=self.cum[-1]))[1:]

    def _closing(self, i: int, room: int) -> tuple[str, int] | None:
        """The longest prefix of unit i that, closed with a blank line, takes at most `room` tokens, and its
        count. With an exact counter prefixes end after any character, so that every count can be met (a blank
        line is free after punctuation but a token after a letter or a space); otherwise they end after a word
        and their counts are the unit's, pro rata by characters, plus one."""
        text = self.units[i].rstrip("\n")
        if self.counter.exact:
            cuts = list(range(1, len(text) + 1))
            counts = self.counter.units([text[:c] + "\n\n" for c in cuts])
        else:
            cuts = [m.end() for m in WORD.finditer(text)]
            counts = [round((self.cum[i + 1] - self.cum[i]) * c / len(text)) + 1 for c in cuts]
        fits = [(n, c) for c, n in zip(cuts, counts) if n <= room]
        if not fits:
            return None
        n, c = max(fits)
        return text[:c] + "\n\n", n

    def _filler(self, tokens: int, start: int) -> tuple[list[str], list[int]]:
        """Sentences from unit `start` on holding at most `tokens` tokens: whole units, then a prefix of the next
        one closed with a blank line, so that the haystack ends a paragraph. Returns the parts and their
        cumulative counts."""
        end = self.cum[start] + tokens
        self._cover(end)
        for i in range(bisect.bisect_right(self.cum, end) - 1, start - 1, -1):
            closing = self._closing(i, end - self.cum[i])
            if closing is not None:
                cum = [c - self.cum[start] for c in self.cum[start:i + 1]]
                return self.units[start:i] + [closing[0]], cum + [cum[-1] + closing[1]]
        return [], [0]

    def _assemble(self, parts: list[str], cum: list[int], depth: float, value: str) -> tuple[str, float, bool]:
        """The haystack with the needle at the sentence boundary nearest depth (a fraction of the filler
        tokens), the needle's actual depth, and whether it is a paragraph of its own."""
        total = cum[-1]
        j = min(range(len(cum)), key=lambda i: abs(cum[i] - depth * total))
        paragraph = j == 0 or parts[j - 1].endswith("\n\n")
        haystack = "".join(parts[:j]) + needle_text(value, paragraph) + "".join(parts[j:])
        return haystack, cum[j] / total if total else 0.0, paragraph

    def build(self, target: int, depth: float, value: str) -> NeedlePrompt:
        """A prompt of `target` tokens (exactly, with an exact counter; else as estimated) with the needle
        `value` at `depth` in [0, 1].

        Some counts cannot be met by cutting a given sentence (a closing blank line is free after punctuation
        but a token after a letter), so if the haystack starting at the stream's first unit misses by a token,
        it starts at the next unit instead."""
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth: {depth} is outside [0, 1]")
        base = self.counter.prompt(self.api, content(self.api, needle_text(value, True)))
        if target - base < 1:
            raise ValueError(f"length: {target} tokens leave no room for a haystack (the question and needle "
                             f"alone take {base})")
        inline, para = self.counter.units([needle_text(value, False), needle_text(value, True)])
        best = None
        for start in range(MAX_STARTS):
            budget, tried = target - base, set()
            while budget not in tried and len(tried) < MAX_FIXES:
                tried.add(budget)
                parts, cum = self._filler(budget, start)
                haystack, where, paragraph = self._assemble(parts, cum, depth, value)
                text = content(self.api, haystack)
                estimate = base + cum[-1] + (0 if paragraph else inline - para)
                n = self.counter.prompt(self.api, text) if self.counter.exact else estimate
                if n <= target and (best is None or n > best.tokens):
                    best = NeedlePrompt(self.api, text, value, target, n, where, digest(haystack))
                if n == target or not self.counter.exact:
                    return best
                budget += target - n
        if best is None:
            raise RuntimeError(f"length: no haystack fits {target} tokens")
        return best
