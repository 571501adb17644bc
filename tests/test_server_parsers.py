"""Output parsing on crafted token ids ([THINK], [TOOL_CALLS]/[ARGS] as control ids) and chat encoding through
mistral-common, without a server."""

from __future__ import annotations

import json

import pytest
from mistral_common.protocol.instruct.messages import AssistantMessage, SystemMessage, ToolMessage, UserMessage
from mistral_common.protocol.instruct.request import ChatCompletionRequest
from mistral_common.protocol.instruct.tool_calls import Function, FunctionCall, Tool, ToolCall

from hisparse.engine.request import RequestError
from hisparse.model.tokenizer import load_tokenizer, write_tekken
from hisparse.server.chat import ChatEncoder
from hisparse.server.output_parser import MarkerIds, OutputParser
from hisparse.server.protocol import ChatRequest


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory):
    d = tmp_path_factory.mktemp("tok")
    write_tekken(d)
    return load_tokenizer(d)


@pytest.fixture(scope="module")
def tok(mistral):
    return mistral.instruct_tokenizer.tokenizer


def crafted(tok, *parts: str) -> list[int]:
    """Token ids of parts, where a part that is a marker name becomes its control id."""
    ids = []
    for p in parts:
        ids += [tok.get_special_token(p)] if tok.is_special(p) \
            else tok.encode(p, bos=False, eos=False)
    return ids


def parse(tok, ids: list[int], one_by_one: bool, stop: tuple[str, ...] = ()):
    """Parse ids; returns the final message and the message re-assembled from the streamed deltas."""
    p = OutputParser(MarkerIds.of(tok.get_special_token), tok.decode, stop)
    deltas = [p.push([i]) for i in ids] if one_by_one else [p.push(ids)]
    deltas.append(p.finish())
    streamed = {"reasoning": "", "content": "", "calls": {}}
    for d in deltas:
        streamed["reasoning"] += d.reasoning
        streamed["content"] += d.content
        for tc in d.tool_calls:
            call = streamed["calls"].setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = tc.get("id", call["id"])
            call["name"] = tc["function"].get("name", call["name"])
            call["arguments"] += tc["function"].get("arguments", "")
    return p.message(), streamed


@pytest.mark.parametrize("one_by_one", [False, True])
def test_reasoning_content_and_two_tool_calls(tok, one_by_one: bool) -> None:
    args1, args2 = '{"city": "Paris", "unit": "\u00b0C"}', '{"q": [1, 2]}'
    ids = crafted(tok, "[THINK]", "The user wants weather.", "[/THINK]", "Checking.", "[TOOL_CALLS]", "get_weather",
                  "[ARGS]", args1, "[TOOL_CALLS]", "search", "[ARGS]", args2, "</s>")
    msg, streamed = parse(tok, ids, one_by_one)
    assert msg["reasoning_content"] == "The user wants weather."
    assert msg["content"] == "Checking."
    calls = msg["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "search"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [json.loads(args1), json.loads(args2)]
    assert all(c["type"] == "function" and len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    assert streamed["reasoning"] == msg["reasoning_content"] and streamed["content"] == msg["content"]
    assert [(c["id"], c["name"], c["arguments"]) for c in streamed["calls"].values()] == \
        [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_plain_text_markers_are_not_control_tokens(tok) -> None:
    ids = tok.encode("[THINK]not reasoning[/THINK] [TOOL_CALLS]x[ARGS]{}", bos=False, eos=False)
    msg, _ = parse(tok, ids, True)
    assert msg["content"] == "[THINK]not reasoning[/THINK] [TOOL_CALLS]x[ARGS]{}"
    assert msg["reasoning_content"] is None and msg["tool_calls"] == []


def test_unterminated_reasoning_and_stop_in_content(tok) -> None:
    msg, _ = parse(tok, crafted(tok, "[THINK]", "still thinking"), True)
    assert msg["reasoning_content"] == "still thinking" and msg["content"] == ""
    msg, streamed = parse(tok, crafted(tok, "[THINK]", "a", "[/THINK]", "alpha beta gamma"), True, stop=("beta",))
    assert msg["content"] == "alpha " and streamed["content"] == "alpha " and msg["reasoning_content"] == "a"


def test_chat_encoding_equals_mistral_common(mistral) -> None:
    """The server's OpenAI -> mistral-common conversion gives the tokens of the same conversation built directly."""
    weather = {"name": "get_weather", "description": "Weather in a city.",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
    body = ChatRequest(model="m", reasoning_effort="high", tools=[{"type": "function", "function": weather}],
                       messages=[{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "Weather in Paris?"},
                                 {"role": "assistant", "tool_calls": [{"id": "abcdefgh1", "type": "function",
                                  "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                                 {"role": "tool", "content": "21 C", "tool_call_id": "abcdefgh1"},
                                 {"role": "user", "content": [{"type": "text", "text": "Thanks"}]}])
    direct = ChatCompletionRequest(
        messages=[SystemMessage(content="Be brief."), UserMessage(content="Weather in Paris?"),
                  AssistantMessage(tool_calls=[ToolCall(id="abcdefgh1", function=FunctionCall(
                      name="get_weather", arguments='{"city": "Paris"}'))]),
                  ToolMessage(content="21 C", tool_call_id="abcdefgh1"), UserMessage(content="Thanks")],
        tools=[Tool(function=Function(**weather))], reasoning_effort="high")
    assert ChatEncoder(mistral).encode(body) == mistral.encode_chat_completion(direct).tokens
    with pytest.raises(RequestError) as e:
        ChatEncoder(mistral).encode(ChatRequest(model="m", reasoning_effort="low",
                                                messages=[{"role": "user", "content": "hi"}]))
    assert e.value.field == "reasoning_effort"
