"""Chat requests -> prompt token ids through mistral-common only (Tekken v15 instruct format, tools,
reasoning effort); no hand-written template."""

from __future__ import annotations

from mistral_common.exceptions import MistralCommonException
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from pydantic import ValidationError

from ..engine.request import RequestError
from .protocol import ChatRequest

# mistral-common error text -> the request field it is about (first match wins)
FIELD_HINTS = ("reasoning_effort", "tool_choice", "tool_call_id", "tool_calls", "tools")


def _param(message: str) -> str:
    return next((f for f in FIELD_HINTS if f in message), "messages")


def _message(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
    return str(e)


class ChatEncoder:
    def __init__(self, tokenizer: MistralTokenizer):
        self.tok = tokenizer

    def encode(self, req: ChatRequest) -> list[int]:
        """The prompt ids for a chat request; RequestError (HTTP 400, naming the field) if it is invalid."""
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        extra = {}
        if req.tool_choice is not None:
            extra["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else \
                req.tool_choice.model_dump()
        if req.parallel_tool_calls is not None:
            extra["parallel_tool_calls"] = req.parallel_tool_calls
        if req.reasoning_effort is not None:
            extra["reasoning_effort"] = req.reasoning_effort
        try:
            chat = ChatCompletionRequest.from_openai(messages, tools, **extra)
            return self.tok.encode_chat_completion(chat).tokens
        except (MistralCommonException, ValidationError, ValueError, KeyError, TypeError,
                AssertionError) as e:   # mistral-common asserts on unsupported content (images)
            msg = _message(e)
            raise RequestError(f"invalid chat request: {msg}", _param(msg)) from None
