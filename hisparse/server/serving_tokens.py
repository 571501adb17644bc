"""vLLM's /tokenize (a prompt, or a chat's messages as the chat endpoint formats them) and /detokenize."""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from .errors import APIError
from .protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from .render import render
from .serving_base import ServingBase


class ServingTokens(ServingBase):
    """The /tokenize and /detokenize endpoints."""

    async def tokenize(self, body: dict[str, Any]) -> Response:
        """The ids (and with return_token_strs their pieces) of a prompt, or of a chat when the body has messages
        (vLLM's union), validated as the routes' bodies are."""
        try:
            req = (TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest).model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        self.check_model(req.model)
        return await self.offload(self._tokenize, req)

    def _tokenize(self, req: TokenizeChatRequest | TokenizeCompletionRequest) -> Response:
        tokens = self.codec.chat.encode(req) if isinstance(req, TokenizeChatRequest) else \
            self.codec.encode(req.prompt, req.add_special_tokens)
        strs = [self.codec.text.id_to_piece(t) for t in tokens] if req.return_token_strs else None
        return render({"count": len(tokens), "max_model_len": self.cfg.max_model_len, "tokens": tokens,
                       "token_strs": strs})

    async def detokenize(self, req: DetokenizeRequest) -> Response:
        """The text of token ids, all within the vocabulary."""
        self.check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self.engine.vocab]
        if bad:
            raise APIError(400, f"tokens: ids {bad[:8]} outside the vocabulary [0, {self.engine.vocab})", "tokens")
        return await self.offload(self._detokenize, req.tokens)

    def _detokenize(self, tokens: list[int]) -> Response:
        return render({"prompt": self.codec.text.decode(tokens)})
