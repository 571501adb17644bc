"""Completions and chat through a real `hisparse serve` process (HiSparse KV, small hot buffer), the official openai
client and raw HTTP: greedy output equals a lone reference, streamed equals whole, the default model, SSE framing,
max_completion_tokens, parsed reasoning and tool calls, stop strings and seeds."""

from __future__ import annotations

import json

import httpx
import pytest
from serving import Server, auth, reference, server, tok  # noqa: F401  (fixtures)


def test_completion_greedy_equals_reference(server: Server, tok, reference, seed: int) -> None:
    text_tok = tok.instruct_tokenizer.tokenizer
    prompt = "The capital of France is"
    ids = text_tok.encode(prompt, bos=True, eos=False)
    ref = reference(ids, 8)
    r = server.client().completions.create(model=server.name, prompt=prompt, max_tokens=8, temperature=0)
    assert r.choices[0].text == text_tok.decode(ref)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 8, len(ids) + 8)
    # streamed with usage in the final chunk: the same text
    chunks = list(server.client().completions.create(model=server.name, prompt=prompt, max_tokens=8, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_model_defaults_to_the_served_one(server: Server) -> None:
    """A request without `model` (or with null or "") is for the served model, as in vLLM; the reply names it."""
    C, H = "/v1/completions", "/v1/chat/completions"
    bodies = [(C, {"prompt": "hi"}), (C, {"model": None, "prompt": "hi"}), (C, {"model": "", "prompt": [5, 6]}),
              (H, {"messages": [{"role": "user", "content": "hi"}]})]
    with httpx.Client(timeout=60, headers=auth()) as http:
        for path, body in bodies:
            r = http.post(server.url + path, json={**body, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == server.name, (body, r.text)
            assert r.json()["usage"]["completion_tokens"] == 2
        with http.stream("POST", f"{server.url}{C}", json={"prompt": "hi", "max_tokens": 2, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert r.status_code == 200 and events and all(e["model"] == server.name for e in events)


def test_sse_ends_with_done(server: Server) -> None:
    body = {"model": server.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=auth(), timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)
    first = json.loads(events[0][6:])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"


def test_chat_streaming_equals_non_streaming(server: Server, tok, reference) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]
    client = server.client()
    r = client.chat.completions.create(model=server.name, messages=messages, max_tokens=6, temperature=0)
    from mistral_common.protocol.instruct.request import ChatCompletionRequest
    ids = tok.encode_chat_completion(ChatCompletionRequest.from_openai(messages)).tokens
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == tok.instruct_tokenizer.tokenizer.decode(reference(ids, 6))
    stream = client.chat.completions.create(model=server.name, messages=messages, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 6


@pytest.mark.parametrize("max_tokens, max_completion_tokens", [(7, 3), (3, 7), (5, None), (None, 5)])
def test_chat_max_completion_tokens_wins_over_max_tokens(server: Server, max_tokens: int | None,
                                                         max_completion_tokens: int | None) -> None:
    """As in OpenAI and vLLM, a chat request's `max_completion_tokens` caps the completion when both it and the
    deprecated `max_tokens` are given, whether it is the smaller or the larger; either alone caps it too (streamed or
    not)."""
    limits = {k: v for k, v in (("max_tokens", max_tokens), ("max_completion_tokens", max_completion_tokens))
              if v is not None}
    want = max_completion_tokens or max_tokens
    body = {"model": server.name, "messages": [{"role": "user", "content": "Count to one hundred."}],
            "temperature": 0, "ignore_eos": True, **limits}
    url = f"{server.url}/v1/chat/completions"
    with httpx.Client(timeout=60, headers=auth()) as http:
        r = http.post(url, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == want and r.json()["choices"][0]["finish_reason"] == "length"
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", url, json=stream) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert s.status_code == 200 and events[-1]["usage"]["completion_tokens"] == want
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"


def test_chat_reasoning_and_tool_calls_parsed(server: Server, tok) -> None:
    """The random model never emits markers, so the first output ids are forced (debug hook); the model still
    runs every step and the parsers see exactly these ids."""
    t = tok.instruct_tokenizer.tokenizer
    sp = t.get_special_token
    args = '{"city": "Paris"}'
    forced = ([sp("[THINK]")] + t.encode("Need weather.", bos=False, eos=False) + [sp("[/THINK]")] +
              [sp("[TOOL_CALLS]")] + t.encode("get_weather", bos=False, eos=False) + [sp("[ARGS]")] +
              t.encode(args, bos=False, eos=False) + [t.eos_id])
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    kw = dict(model=server.name, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
              reasoning_effort="high", max_tokens=len(forced) + 5, extra_body={"debug_forced_token_ids": forced})
    client = server.client()
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert msg.reasoning_content == "Need weather." and msg.content is None
    (call,) = msg.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert len(call.id) == 9 and r.usage.completion_tokens == len(forced)
    reasoning, calls, reasons = "", {}, []
    for c in client.chat.completions.create(**kw, stream=True):
        d = c.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or ""
            entry["arguments"] += tc.function.arguments or ""
        reasons.append(c.choices[0].finish_reason)
    assert reasoning == "Need weather." and calls == {0: {"name": "get_weather", "arguments": args}}
    assert reasons[-1] == "tool_calls"


def test_stop_string_cuts_text(server: Server, tok) -> None:
    t = tok.instruct_tokenizer.tokenizer
    forced = t.encode("alpha beta gamma delta", bos=False, eos=False)
    client = server.client()
    kw = dict(model=server.name, prompt="x", max_tokens=10, stop=["gamma"], extra_body={"debug_forced_token_ids": forced})
    r = client.completions.create(**kw)
    assert r.choices[0].text == "alpha beta " and r.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(**kw, stream=True)]
    assert "".join(pieces) == "alpha beta " and not any("gam" in p for p in pieces)


def test_seeded_sampling_reproducible(server: Server) -> None:
    client = server.client()

    def run(seed: int) -> str:
        return client.completions.create(model=server.name, prompt="Once upon a time", max_tokens=8,
                                         temperature=1.0, top_p=0.9, seed=seed).choices[0].text
    a = run(1234)
    assert run(1234) == a and run(4321) != a
