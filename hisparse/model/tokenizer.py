"""Tekken v15 tokenizer for hisparse checkpoints, built offline from data that ships with mistral-common.

The engine must never fetch a tokenizer from a hub, yet chat requests need the current (v15) Mistral instruct
format: [SYSTEM_PROMPT], [AVAILABLE_TOOLS], [TOOL_CALLS]/[ARGS], [THINK] and [MODEL_SETTINGS] as real special
tokens. `write_tekken` therefore takes the 131072-id Tekken vocabulary bundled in the mistral_common package,
declares every `SpecialTokens` name as a control token and adds the `model_settings_builder` section a v15
file must carry; `load_tokenizer` and `vocab_size` read that file back through mistral-common itself, so the
engine and mistral-common can never disagree on token ids.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from mistral_common.protocol.instruct.request import ReasoningEffort
from mistral_common.tokens.tokenizers.base import SpecialTokens, TokenizerVersion
from mistral_common.tokens.tokenizers.mistral import MistralTokenizer
from mistral_common.tokens.tokenizers.model_settings_builder import (
    ModelSettingsBuilder,
    ReasoningEffortEnumBuilder,
)

TOKENIZER_FILE = "tekken.json"
# The newest Tekken vocabulary bundled in mistral_common/data (config: 150000 BPE merges, of which the first
# 130072 are used, after 1000 special-token slots: 131072 ids in all).
BASE_TEKKEN = "tekken_240911.json"
TOKENIZER_VERSION = TokenizerVersion.v15
# Reasoning efforts a request may ask for; an unset request resolves to the default, which is then encoded
# in [MODEL_SETTINGS] like an explicit value (v15 always states the effort).
REASONING_EFFORTS = (ReasoningEffort.none, ReasoningEffort.high)
DEFAULT_REASONING_EFFORT = ReasoningEffort.none


def _model_settings_builder() -> dict[str, object]:
    """The `model_settings_builder` section, dumped from mistral-common's own model so it loads back."""
    builder = ModelSettingsBuilder(
        reasoning_effort=ReasoningEffortEnumBuilder(
            values=list(REASONING_EFFORTS), default=DEFAULT_REASONING_EFFORT
        ),
    )
    return builder.model_dump(mode="json", exclude_none=True)


def write_tekken(out_dir: str | Path, n_words: int | None = None) -> Path:
    """Write the v15 Tekken tokenizer to `out_dir/tekken.json` and return its path.

    Keeps the bundled vocabulary, BPE pattern and vocabulary size unchanged unless `n_words` truncates the
    vocabulary to the 1000 special slots plus the first n_words - 1000 ranks (1256: the 256 single bytes, a
    byte-level tokenizer for small trained models), sets `config.version` to v15,
    lists the `SpecialTokens` enum (in its declared order) as control tokens at ranks 0..N-1 (the rest of the
    1000 special slots become `<SPECIAL_i>` fillers on load) and drops the bundled image section, since the
    hisparse model is text-only.
    """
    base = resources.files("mistral_common").joinpath("data", BASE_TEKKEN)
    data = json.loads(base.read_text(encoding="utf-8"))
    data.pop("image", None)
    data["config"]["version"] = TOKENIZER_VERSION.value
    if n_words is not None:
        n_special = data["config"]["default_num_special_tokens"]
        if not n_special + 256 <= n_words <= data["config"]["default_vocab_size"]:
            raise ValueError(f"n_words: {n_words} must be in [{n_special + 256}, "
                             f"{data['config']['default_vocab_size']}] (special slots + at least every byte)")
        data["vocab"] = data["vocab"][: n_words - n_special]
        data["config"].update(default_vocab_size=n_words, num_vocab_tokens=n_words - n_special)
    data["special_tokens"] = [
        {"rank": rank, "token_str": token.value, "is_control": True}
        for rank, token in enumerate(SpecialTokens)
    ]
    data["model_settings_builder"] = _model_settings_builder()

    out_path = Path(out_dir) / TOKENIZER_FILE
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False)
    return out_path


def load_tokenizer(model_dir: str | Path) -> MistralTokenizer:
    """Load `model_dir/tekken.json` as a mistral-common tokenizer (chat encoding, special ids, decoding)."""
    return MistralTokenizer.from_file(Path(model_dir) / TOKENIZER_FILE)


def vocab_size(model_dir: str | Path) -> int:
    """Number of token ids the tokenizer in `model_dir` can produce: the embedding rows a checkpoint needs."""
    return load_tokenizer(model_dir).instruct_tokenizer.tokenizer.n_words
