"""Incremental detokenization of one output stream, with stop strings.

Byte-level BPE tokens can end in the middle of a UTF-8 character, so ids are committed to text only once they
decode without a trailing replacement character (or after MAX_PENDING tokens, when the bytes are simply invalid).
Text that could be the start of a stop string is held back until it is known not to be one, so a streamed
response never shows part of a stop string.
"""

from __future__ import annotations

from collections.abc import Callable

MAX_PENDING = 4   # a UTF-8 character has at most 4 bytes and every token at least one


class TextStream:
    """ids in (push), text deltas out; `stopped` once a stop string appeared (text is cut before it). A stop
    string counts only where it starts after the text of the first `min_tokens` ids (vLLM's min_tokens)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = (), min_tokens: int = 0):
        self.decode, self.stop, self.min_tokens = decode, stop, min_tokens
        self.pending: list[int] = []
        self.pushed = 0
        self.text = ""
        self.check_from = 0     # stop strings may start at this character or later
        self.sent = 0
        self.stopped = False
        self.longest_stop = max((len(s) for s in stop), default=0)

    def push(self, ids: list[int]) -> str:
        """Add output ids; returns the text now safe to show."""
        if self.stopped:
            return ""
        self.pending += ids
        self.pushed += len(ids)
        piece = self.decode(self.pending)
        if piece.endswith("\ufffd") and len(self.pending) < MAX_PENDING:
            return ""
        checked = len(self.text)
        self.text += piece
        self.pending = []
        if self.pushed <= self.min_tokens:
            self.check_from = len(self.text)
        if self._cut_at_stop(max(0, checked - self.longest_stop + 1)):
            return self._emit(len(self.text))
        return self._emit(len(self.text) - self._holdback())

    def flush(self) -> str:
        """The request finished: commit everything still pending or held back."""
        if self.pending and not self.stopped:
            self.text += self.decode(self.pending)
            self.pending = []
            self._cut_at_stop(0)
        return self._emit(len(self.text))

    def _cut_at_stop(self, start: int) -> bool:
        hits = [i for i in (self.text.find(s, max(start, self.check_from)) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[:min(hits)], True
        return bool(hits)

    def _holdback(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        for k in range(min(self.longest_stop - 1, len(self.text) - self.sent), 0, -1):
            if any(s.startswith(self.text[-k:]) for s in self.stop):
                return k
        return 0

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out, self.sent = self.text[self.sent:upto], upto
        return out
