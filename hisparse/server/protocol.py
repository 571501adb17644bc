"""OpenAI request and response bodies (the subset hisparse serves), validated with pydantic.

Unknown fields are rejected. vLLM's sampling extensions are implemented with its semantics; fields OpenAI or vLLM
define that hisparse does not act on are accepted with any value when they change nothing it returns
(IGNORED_FIELDS, logged) and otherwise only at their neutral value, so a client never silently gets different
semantics than it asked for.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..engine.request import SamplingParams

log = logging.getLogger("hisparse.server")


class Strict(BaseModel):
    """No unknown fields and no type coercion ("16" is not an integer, "yes" not a boolean), as OpenAI answers."""
    model_config = ConfigDict(extra="forbid", strict=True)


TOKEN_ID = re.compile(r"-?[0-9]+")


def has_surrogate(text: str) -> bool:
    """Whether `text` holds a lone surrogate: the one code point UTF-8 cannot encode, so the C encoder finds it
    (a million-token prompt in milliseconds; validation runs on the event loop, which must not wait)."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def surrogate_at(value: Any, path: str) -> str | None:
    """The path of the first string in `value` holding a lone surrogate (JSON's \\ud800 escapes decode to one;
    it is not Unicode and can be neither tokenized faithfully nor sent back), or None."""
    if isinstance(value, str):
        return path if has_surrogate(value) else None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list) and value and isinstance(value[0], (str, list, dict)):
        items = enumerate(value)
    else:     # numbers, and lists of them (token ids): nothing to check
        return None
    for k, v in items:
        if isinstance(k, str) and has_surrogate(k):
            return f"{path}.{ascii(k)}" if path else ascii(k)
        found = surrogate_at(v, f"{path}.{k}" if path else str(k))
        if found:
            return found
    return None


class TextChecked(Strict):
    """A request body whose strings must be valid Unicode: a lone surrogate anywhere is a 400 naming the
    top-level field it is in."""

    @model_validator(mode="before")
    @classmethod
    def _no_surrogates(cls, data: Any) -> Any:
        where = surrogate_at(data, "") if isinstance(data, dict) else None
        if where:
            raise ValueError(f"{where.split('.')[0]}: a lone UTF-16 surrogate (at {where}) is not valid Unicode")
        return data


class ResponseFormat(Strict):
    type: Literal["text"] = "text"


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


MAX_N = 128   # choices per request (each is its own engine request)


class VLLMFields(Strict):
    """Fields vLLM's OpenAI server accepts beyond OpenAI's. Those in IGNORED_FIELDS change nothing hisparse
    returns and are accepted with any value (a log line says so); the rest of this class are accepted only at
    the value that means "off" (what hisparse does anyway), so a request never silently gets other semantics."""
    use_beam_search: Literal[False] = False
    allowed_token_ids: None = None
    bad_words: list[str] = Field(default_factory=list, max_length=0)
    structured_outputs: None = None
    truncate_prompt_tokens: None = None
    logprob_token_ids: None = None
    include_stop_str_in_output: Literal[False] = False
    return_tokens_as_token_ids: Literal[False] | None = None
    prompt_embeds: None = None
    repetition_detection: None = None
    thinking_token_budget: Literal[-1] | None = None
    watermarking: Literal[False] | None = None
    # IGNORED_FIELDS: no effect on what hisparse returns
    request_id: str | None = None
    session_id: str | None = None
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    stream_interval: int | None = Field(default=None, ge=1)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    length_penalty: float = 1.0
    truncation_side: Literal["left", "right"] | None = None
    routed_experts_prompt_start: int = Field(default=0, ge=0)
    return_token_offsets: bool | None = None
    mm_payload: str | None = None
    return_mm_kwargs: bool | None = None


IGNORED_FIELDS = frozenset({
    "request_id", "session_id", "priority", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
    "stream_interval", "skip_special_tokens", "spaces_between_special_tokens", "length_penalty", "truncation_side",
    "routed_experts_prompt_start", "return_token_offsets", "mm_payload", "return_mm_kwargs", "user",
    "media_io_kwargs", "mm_processor_kwargs", "return_prompt_text"})


class SamplingFields(VLLMFields, TextChecked):
    """Fields shared by /v1/completions and /v1/chat/completions. Optional vLLM sampling fields left out or null
    take vLLM's defaults."""
    model: str | None = None     # missing, null or "": the served model (as vLLM)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = Field(default=None, validate_default=True)   # -> list[str]
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    logit_bias: dict[str, Annotated[float, Field(allow_inf_nan=False)]] | None = None   # finite biases
    prompt_logprobs: int | None = Field(default=None, ge=0)
    user: str | None = None
    debug_forced_token_ids: list[int] | None = None   # only with `serve --debug-hooks`: forces the first outputs

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        bad = [k for k in v or () if not TOKEN_ID.fullmatch(k.strip())]
        if bad:
            raise ValueError(f"keys must be token ids, got {bad[:4]}")
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        if self.prompt_logprobs and self.stream:
            raise ValueError("prompt_logprobs: not available when stream is true")
        ignored = sorted(self.model_fields_set & IGNORED_FIELDS)
        if ignored:
            log.info("request fields accepted and ignored: %s", ", ".join(ignored))
        return self

    def sampling_params(self, max_tokens: int, logprobs: int | None = None, prompt_logprobs: int | None = None,
                        seed: int | None = None) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=seed, stop=tuple(self.stop), stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos, forced_token_ids=tuple(self.debug_forced_token_ids or ()),
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            min_p=self.min_p or 0.0, min_tokens=self.min_tokens,
            logit_bias=tuple((int(k), b) for k, b in (self.logit_bias or {}).items()),
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs)

    def choice_seeds(self) -> list[int | None]:
        """Per choice: vLLM's seed + index (mod 2**64), so each choice is reproducible alone and they differ."""
        return [None if self.seed is None else (self.seed + i) % 2**64 for i in range(self.n)]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]    # one prompt, or a batch (each gets n choices)
    max_tokens: int | None = Field(default=None, ge=0)   # 0 only with echo: the prompt's logprobs alone
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)
    suffix: None = None
    best_of: int | None = None
    add_special_tokens: Literal[True] = True
    response_format: ResponseFormat | None = None
    return_token_ids: bool | None = None    # vLLM's: token_ids (and prompt_token_ids, first) in each choice

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: str | list[int] | list[str] | list[list[int]]) -> str | list[int] | list[str] | list[list[int]]:
        if isinstance(v, list) and not v:
            raise ValueError("prompt token list must not be empty")
        batch = v if isinstance(v, list) and isinstance(v[0], (str, list)) else [v]
        if any(isinstance(p, list) and not p for p in batch):
            raise ValueError("prompt token lists must not be empty")
        if len(batch) > MAX_N:
            raise ValueError(f"at most {MAX_N} prompts per request, got {len(batch)}")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts (one for a single prompt)."""
        v = self.prompt
        return v if isinstance(v, list) and isinstance(v[0], (str, list)) else [v]

    @model_validator(mode="after")
    def _completion(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: must be >= 1 (0 only with echo)")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: only best_of == n ({self.n}) is supported, got {self.best_of}")
        return self


# ---- chat ----

class FunctionCallIn(Strict):
    name: str
    arguments: str


class ToolCallIn(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _shape(self):
        if self.role in ("system", "user", "tool") and self.content is None:
            raise ValueError(f"a {self.role} message needs 'content'")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs 'tool_call_id'")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs 'content' or 'tool_calls'")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages may carry 'tool_calls'")
        return self


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)
    strict: bool = False


class ToolDef(Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required", "any"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=0, ge=0)
    response_format: ResponseFormat | None = None
    # vLLM's chat extras: neutral values only, or ignored (IGNORED_FIELDS)
    echo: Literal[False] = False
    return_token_ids: Literal[False] | None = None
    add_generation_prompt: Literal[True] = True
    continue_final_message: Literal[False] = False
    add_special_tokens: Literal[False] = False
    include_reasoning: Literal[True] = True
    documents: None = None
    chat_template: None = None
    chat_template_kwargs: None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    return_prompt_text: bool | None = None

    @model_validator(mode="after")
    def _logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs set to true")
        return self

    @model_validator(mode="after")
    def _tool_choice(self):
        names = {t.function.name for t in self.tools or ()}
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice: names the function {choice.function.name!r}, which is not in tools "
                             f"({sorted(names)})")
        if choice in ("required", "any") and not names:
            raise ValueError(f"tool_choice: {choice!r} needs at least one tool in tools")
        return self


# ---- tokenizer routes (vLLM's shapes) ----

class TokenizeCompletionRequest(TextChecked):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(TextChecked):
    """The chat form of /tokenize: the prompt ids a chat request with these messages and tools would run."""
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required", "any"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    add_generation_prompt: Literal[True] = True
    continue_final_message: Literal[False] = False
    add_special_tokens: Literal[False] = False
    return_token_strs: bool | None = False


class DetokenizeRequest(TextChecked):
    model: str | None = None
    tokens: list[int]


# ---- responses ----

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt: int, completion: int) -> "Usage":
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def now() -> int:
    return int(time.time())


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
