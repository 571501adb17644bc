"""Token counts as the server sees them: from the served checkpoint's tokenizer, or from the server's usage.

`LocalCounter` reads the checkpoint's tekken.json through `hisparse.model.tokenizer.load_tokenizer` and encodes
chat requests with mistral-common, exactly as `hisparse serve` (and vLLM's Mistral tokenizer mode) does, so its
counts are exact. `ServerCounter` needs nothing but the endpoint: it asks /v1/completions for `max_tokens=1`
and reads `usage.prompt_tokens`, one short request per sentence (several in flight); only the cut of the last
sentence is estimated, so its haystacks hit a length to within a few tokens (the results record the server's
own count of every prompt either way). Counting is slow on a slow server: pass the tokenizer where you can.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import openai

COUNT_CONCURRENCY = 8   # counting requests in flight


class TokenCounter(Protocol):
    exact: bool   # whether prompt() is the server's exact count

    def units(self, texts: list[str]) -> list[int]:
        """Tokens of each text on its own (no BOS, no template)."""

    def prompt(self, api: str, content: str) -> int:
        """Prompt tokens of a request whose user content (chat) or prompt text (completions) is `content`."""


class LocalCounter:
    exact = True

    def __init__(self, path: str | Path):
        from hisparse.model.tokenizer import TOKENIZER_FILE, load_tokenizer
        path = Path(path)
        folder = path.parent if path.name == TOKENIZER_FILE else path
        if not (folder / TOKENIZER_FILE).is_file():
            raise SystemExit(f"--tokenizer: no {TOKENIZER_FILE} in {folder}")
        self.mistral = load_tokenizer(folder)
        self.text = self.mistral.instruct_tokenizer.tokenizer

    def encode(self, api: str, content: str) -> list[int]:
        """The prompt ids the server builds for this request."""
        if api == "completions":
            return self.text.encode(content, bos=True, eos=False)
        from mistral_common.protocol.instruct.request import ChatCompletionRequest
        chat = ChatCompletionRequest.from_openai([{"role": "user", "content": content}])
        return self.mistral.encode_chat_completion(chat).tokens

    def units(self, texts: list[str]) -> list[int]:
        return [len(self.text.encode(t, bos=False, eos=False)) for t in texts]

    def prompt(self, api: str, content: str) -> int:
        return len(self.encode(api, content))


class ServerCounter:
    exact = False

    def __init__(self, client: openai.OpenAI, model: str):
        self.client, self.model = client, model
        self.bos = self._usage("completions", "The") - 1   # "The" is one token in any BPE vocabulary

    def _usage(self, api: str, content: str) -> int:
        if api == "completions":
            r = self.client.completions.create(model=self.model, prompt=content, max_tokens=1, temperature=0)
        else:
            r = self.client.chat.completions.create(model=self.model, max_tokens=1, temperature=0,
                                                    messages=[{"role": "user", "content": content}])
        return r.usage.prompt_tokens

    def units(self, texts: list[str]) -> list[int]:
        with ThreadPoolExecutor(COUNT_CONCURRENCY) as pool:
            return [n - self.bos for n in pool.map(lambda t: self._usage("completions", t), texts)]

    def prompt(self, api: str, content: str) -> int:
        return self._usage(api, content)
