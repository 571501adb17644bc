"""The HTTP server's settings (from `hisparse serve`'s flags): the served model's name and length limit, the API
key, and the limits that keep one client's request from hurting the others."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.request import MAX_LOGPROBS


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    max_model_len: int
    api_key: str | None = None
    debug_hooks: bool = False   # accept `debug_forced_token_ids` (tests of the output parsers)
    max_request_bytes: int | None = None   # request body limit; None: sized from max_model_len
    read_timeout_s: float = 30.0           # a request body must arrive within this (headers: connection.py)
    max_batch_fanout: int = 256            # engine requests per API request (prompts x n)
    max_logit_bias: int = 1024             # logit_bias entries per request
    max_logprobs: int = MAX_LOGPROBS       # alternatives per token (logprobs, top_logprobs, prompt_logprobs)
    max_header_bytes: int = 16384          # request line and headers
    enable_docs: bool = False              # /docs, /redoc, /openapi.json
    cpu_workers: int = 4                   # threads for CPU-heavy request work (tokenizing, formatting)

    @property
    def body_limit(self) -> int:
        """The request body limit: 1 MiB plus 16 bytes per token of max_model_len (a JSON token-id list takes
        at most ~8 bytes per token, text a few bytes per token)."""
        return self.max_request_bytes if self.max_request_bytes is not None else (1 << 20) + 16 * self.max_model_len
