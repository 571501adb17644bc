"""Tests for hisparse.model.tokenizer: the offline v15 Tekken file and its chat encoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mistral_common.exceptions import InvalidRequestException
from mistral_common.protocol.instruct.messages import (
    AssistantMessage,
    SystemMessage,
    TextChunk,
    ThinkChunk,
    ToolMessage,
    UserMessage,
)
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool, ToolCall
from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy, TokenizerVersion
from mistral_common.tokens.tokenizers.instruct import InstructTokenizerV15
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer

from hisparse.model.tokenizer import TOKENIZER_FILE, load_tokenizer, vocab_size, write_tekken

SPECIAL_NAMES = [
    "<s>", "</s>", "[THINK]", "[/THINK]", "[MODEL_SETTINGS]", "[/MODEL_SETTINGS]", "[TOOL_CALLS]", "[ARGS]",
    "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
]

WEATHER_TOOL = Tool(
    function=Function(
        name="get_weather",
        description="Current weather in a city.",
        parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    )
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    write_tekken(out)
    return out


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> MistralTokenizer:
    return load_tokenizer(model_dir)


def _ids(tok: MistralTokenizer, *names: str) -> list[int]:
    return [tok.instruct_tokenizer.tokenizer.get_special_token(n) for n in names]


def _subsequence(needle: list[int], haystack: list[int]) -> bool:
    it = iter(haystack)
    return all(x in it for x in needle)


def test_write_tekken_writes_v15_file(tmp_path: Path) -> None:
    path = write_tekken(tmp_path / "nested")
    assert path == tmp_path / "nested" / TOKENIZER_FILE
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["config"]["version"] == "v15"
    ranks = [t["rank"] for t in data["special_tokens"]]
    assert ranks == list(range(len(ranks)))
    assert all(t["is_control"] for t in data["special_tokens"])
    assert data["model_settings_builder"]["reasoning_effort"]["values"] == ["none", "high"]


def test_loads_as_v15_instruct_tokenizer(tok: MistralTokenizer) -> None:
    assert isinstance(tok.instruct_tokenizer, InstructTokenizerV15)
    assert tok.instruct_tokenizer.tokenizer.version == TokenizerVersion.v15
    assert tok.instruct_tokenizer.image_encoder is None


def test_vocab_size(model_dir: Path, tok: MistralTokenizer) -> None:
    assert vocab_size(model_dir) == 131072
    assert tok.instruct_tokenizer.tokenizer.n_words == 131072
    # Every id the tokenizer can emit must index an embedding row.
    ids = tok.instruct_tokenizer.tokenizer.encode("\U0001f600 zzzz \u4e2d\u6587", bos=True, eos=True)
    assert max(ids) < 131072


@pytest.mark.parametrize("name", SPECIAL_NAMES)
def test_special_token_is_single_control_id(tok: MistralTokenizer, name: str) -> None:
    inner = tok.instruct_tokenizer.tokenizer
    (token_id,) = _ids(tok, name)
    assert token_id < inner.num_special_tokens
    assert inner.is_special(token_id)
    assert inner.decode([token_id], special_token_policy=SpecialTokenPolicy.KEEP) == name
    # Plain text spelling the marker must not be able to inject the control id.
    assert token_id not in inner.encode(name, bos=False, eos=False)


def test_special_token_ids_are_distinct(tok: MistralTokenizer) -> None:
    ids = _ids(tok, *SPECIAL_NAMES)
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize(
    "text", ["Hello, world!", "  leading spaces\nand\ttabs\n", "caf\u00e9 \u4e2d\u6587 \U0001f600 1234"]
)
def test_text_round_trips(tok: MistralTokenizer, text: str) -> None:
    inner = tok.instruct_tokenizer.tokenizer
    ids = inner.encode(text, bos=True, eos=True)
    assert ids[0] == inner.bos_id and ids[-1] == inner.eos_id
    assert all(i >= inner.num_special_tokens for i in ids[1:-1])
    assert tok.decode(ids) == text


def test_chat_with_tools_encodes(tok: MistralTokenizer) -> None:
    call = ToolCall(
        id="call00001", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}')
    )
    request = ChatCompletionRequest(
        messages=[
            SystemMessage(content="Answer briefly."),
            UserMessage(content="Weather in Paris?"),
            AssistantMessage(tool_calls=[call]),
            ToolMessage(content='{"temp_c": 21}', tool_call_id="call00001"),
            AssistantMessage(content="21 C."),
            UserMessage(content="Thanks!"),
        ],
        tools=[WEATHER_TOOL],
    )
    tokens = tok.encode_chat_completion(request).tokens
    expected = _ids(
        tok, "<s>", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
        "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]", "</s>", "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
        "</s>", "[INST]", "[/INST]",
    )
    assert _subsequence(expected, tokens)
    assert tokens[0] == expected[0] and tokens[-1] == expected[-1]
    text = tok.decode(tokens, special_token_policy=SpecialTokenPolicy.KEEP)
    assert "[TOOL_CALLS]get_weather[ARGS]" in text
    assert '"name": "get_weather"' in text


def test_assistant_thinking_encodes(tok: MistralTokenizer) -> None:
    request = ChatCompletionRequest(
        messages=[
            UserMessage(content="2+2?"),
            AssistantMessage(content=[ThinkChunk(thinking="Simple sum."), TextChunk(text="4")]),
            UserMessage(content="And 3+3?"),
        ],
    )
    tokens = tok.encode_chat_completion(request).tokens
    assert _subsequence(_ids(tok, "[/INST]", "[THINK]", "[/THINK]", "</s>"), tokens)
    text = tok.decode(tokens, special_token_policy=SpecialTokenPolicy.KEEP)
    assert "[THINK]Simple sum.[/THINK]4" in text


@pytest.mark.parametrize(("effort", "encoded"), [("high", "high"), ("none", "none"), (None, "none")])
def test_reasoning_effort_in_model_settings(tok: MistralTokenizer, effort: str | None, encoded: str) -> None:
    request = ChatCompletionRequest(messages=[UserMessage(content="Hi")], reasoning_effort=effort)
    tokens = tok.encode_chat_completion(request).tokens
    begin, end, inst = _ids(tok, "[MODEL_SETTINGS]", "[/MODEL_SETTINGS]", "[INST]")
    assert tokens.count(begin) == 1 and tokens.count(end) == 1
    assert tokens.index(begin) < tokens.index(end) < tokens.index(inst)
    settings = tok.decode(tokens[tokens.index(begin) + 1 : tokens.index(end)])
    assert json.loads(settings) == {"reasoning_effort": encoded}


def test_unsupported_reasoning_effort_rejected(tok: MistralTokenizer) -> None:
    request = ChatCompletionRequest(messages=[UserMessage(content="Hi")], reasoning_effort="low")
    with pytest.raises(InvalidRequestException, match="reasoning_effort"):
        tok.encode_chat_completion(request)
