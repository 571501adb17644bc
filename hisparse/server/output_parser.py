"""Mistral output parsing on token ids: [THINK]...[/THINK] -> reasoning_content, [TOOL_CALLS]name[ARGS]{json}
-> tool_calls (the v11+ format that v15 tokenizers emit; shapes as vLLM's mistral reasoning and tool parsers).

The markers are control tokens, so they are recognised by id and can never be forged by plain text. The parser
is incremental: `push` returns what is new (for streaming), `message` the whole parsed assistant message.
"""

from __future__ import annotations

import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine.detokenizer import TextStream

ID_ALPHABET = string.ascii_letters + string.digits


def tool_call_id() -> str:
    """Mistral tool-call ids are 9 alphanumeric characters."""
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(9))


@dataclass
class ToolCall:
    id: str
    name: str = ""
    arguments: str = ""

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)   # OpenAI streaming tool-call deltas

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def merge(self, other: "ParsedDelta") -> "ParsedDelta":
        return ParsedDelta(self.reasoning + other.reasoning, self.content + other.content,
                           self.tool_calls + other.tool_calls)


@dataclass(frozen=True)
class MarkerIds:
    think: int
    end_think: int
    tool_calls: int
    args: int

    @classmethod
    def of(cls, special_id: Callable[[str], int]) -> "MarkerIds":
        """From the tokenizer's special-token lookup (Tekkenizer.get_special_token)."""
        return cls(special_id("[THINK]"), special_id("[/THINK]"), special_id("[TOOL_CALLS]"), special_id("[ARGS]"))


class OutputParser:
    """Routes output ids into sections (content, reasoning, tool name, tool arguments) by marker id."""

    def __init__(self, markers: MarkerIds, decode: Callable[[list[int]], str], stop: tuple[str, ...] = (),
                 min_tokens: int = 0):
        self.m, self.decode, self.stop, self.min_tokens = markers, decode, stop, min_tokens
        self.reasoning, self.content = "", ""
        self.calls: list[ToolCall] = []
        self.section = "content"
        self.seen = 0    # output ids pushed so far (stop strings count only after min_tokens of them)
        self.stream = TextStream(decode, stop, min_tokens)

    def push(self, ids: list[int]) -> ParsedDelta:
        out, run = ParsedDelta(), []
        for tok in ids:
            self.seen += 1
            nxt = self._transition(tok)
            if nxt is None:
                run.append(tok)
                continue
            out = out.merge(self._feed(run)).merge(self._close())
            run = []
            self._open(nxt)
        return out.merge(self._feed(run))

    def finish(self) -> ParsedDelta:
        return self._close()

    def _transition(self, tok: int) -> str | None:
        m = self.m
        if tok == m.think and self.section == "content":
            return "reasoning"
        if tok == m.end_think and self.section == "reasoning":
            return "content"
        if tok == m.tool_calls and self.section != "reasoning":
            return "tool_name"
        if tok == m.args and self.section == "tool_name":
            return "tool_args"
        return None

    def _open(self, section: str) -> None:
        self.section = section
        self.stream = TextStream(self.decode, self.stop if section in ("content", "reasoning") else (),
                                 max(0, self.min_tokens - self.seen))
        if section == "tool_name":
            self.calls.append(ToolCall(tool_call_id()))

    def _feed(self, ids: list[int]) -> ParsedDelta:
        return self._text(self.stream.push(ids)) if ids else ParsedDelta()

    def _close(self) -> ParsedDelta:
        """Flush the current section; a tool call is announced once its name is complete."""
        out = self._text(self.stream.flush())
        if self.section == "tool_name":
            call = self.calls[-1]
            call.name = call.name.strip()
            out.tool_calls.append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                   "function": {"name": call.name, "arguments": ""}})
        return out

    def _text(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        if self.section == "content":
            self.content += text
            return ParsedDelta(content=text)
        if self.section == "reasoning":
            self.reasoning += text
            return ParsedDelta(reasoning=text)
        call = self.calls[-1]
        if self.section == "tool_name":
            call.name += text
            return ParsedDelta()
        call.arguments += text
        return ParsedDelta(tool_calls=[{"index": len(self.calls) - 1, "function": {"arguments": text}}])

    def message(self) -> dict:
        """The assistant message (after `finish`): content, reasoning_content and tool_calls."""
        return {"role": "assistant", "content": self.content if (self.content or not self.calls) else None,
                "reasoning_content": self.reasoning or None,
                "tool_calls": [c.to_openai() for c in self.calls]}
