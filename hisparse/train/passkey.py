"""The passkey task: the needle prompt's text format and a seeded synthetic haystack.

One definition serves the trainer (`hisparse train-needle`) and the needle benchmark (`benchmarks/needle`), so the
trained model is measured on exactly the format it learned. `SyntheticHaystack` has the interface of the
benchmark's prose `Corpus` (`units(n)`, `sources()`, `cycles`): a deterministic stream of sentences built from a
small grammar, with paragraph breaks, no digits and none of the needle's words, so that the passkey is the only
number in a prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

INTRO = "There is a secret passkey hidden in the following text. Find it and remember it.\n\n"
QUESTION = "What is the secret passkey? Answer with the number only."
COMPLETION_CUE = "\nThe secret passkey is"   # completions API only: the text the answer continues
PASSKEY_DIGITS = 7


def needle_sentence(value: str) -> str:
    return f"The secret passkey is {value}."


def needle_text(value: str, paragraph: bool) -> str:
    """The needle as its own paragraph (after a paragraph end) or as a sentence inside one."""
    return needle_sentence(value) + "\n\n" if paragraph else " " + needle_sentence(value)


def content(api: str, haystack: str) -> str:
    """The user message (chat) or prompt text (completions) around a haystack (which ends a paragraph)."""
    return INTRO + haystack + QUESTION + (COMPLETION_CUE if api == "completions" else "")


def answer(value: str) -> str:
    """What a completion-API prompt's answer is: the cue continued with the number and a full stop."""
    return f" {value}."


def random_value(rng: random.Random) -> str:
    return str(rng.randint(10 ** (PASSKEY_DIGITS - 1), 10 ** PASSKEY_DIGITS - 1))


SUBJECTS = ("The old farmer", "A small bird", "The quiet river", "My neighbour", "The tall tree", "A grey cat",
            "The busy baker", "Our teacher", "The young sailor", "A brown horse", "The cold wind", "Her brother",
            "The red fox", "A patient monk", "The village choir", "His uncle")
VERBS = ("walks", "looks", "sings", "rests", "waits", "turns", "runs", "sleeps", "works", "plays", "drifts",
         "talks", "reads", "moves", "hides", "stays")
PLACES = ("by the lake", "near the hills", "in the garden", "under the bridge", "along the road",
          "behind the barn", "at the market", "in the morning", "after the rain", "before dinner",
          "across the field", "inside the house", "on the shore", "through the forest", "past the mill",
          "around the square")
TAILS = ("", "", " and smiles", " with great care", " without a sound", " for a while", " every day",
         " as usual", " once again", " all alone")


@dataclass
class SyntheticHaystack:
    """A seeded, endless stream of filler sentences (units: a leading space inside a paragraph, a blank line
    after the last sentence of one, as the benchmark's Corpus)."""
    seed: int = 0
    cycles: int = 0                          # never repeats (kept for the Corpus interface)
    _units: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(f"haystack:{self.seed}")
        self._left = 0                       # sentences left in the current paragraph

    def _next(self) -> str:
        r = self._rng
        first = self._left == 0
        if first:
            self._left = r.randint(2, 6)
        self._left -= 1
        sent = f"{r.choice(SUBJECTS)} {r.choice(VERBS)} {r.choice(PLACES)}{r.choice(TAILS)}."
        return ("" if first else " ") + sent + ("\n\n" if self._left == 0 else "")

    def units(self, n: int) -> list[str]:
        while len(self._units) < n:
            self._units.append(self._next())
        return self._units[:n]

    def sources(self) -> list[str]:
        return [f"synthetic haystack (seed {self.seed})"]


def haystack_units(stream: SyntheticHaystack, haystack_chars: int) -> list[str]:
    """The stream's first units, the last one cut so that they hold exactly `haystack_chars` characters (as the
    benchmark cuts its haystack) and end a paragraph."""
    parts, n = [], 0
    while n < haystack_chars:
        parts += stream.units(len(parts) + 1)[-1:]
        n += len(parts[-1])
    if parts:
        keep = len(parts[-1]) - (n - haystack_chars)
        parts[-1] = parts[-1] if keep == len(parts[-1]) and parts[-1].endswith("\n\n") else (
            parts[-1][:max(0, keep - 2)].rstrip(" ") + "\n\n")
    return parts


def sample_prompt(rng: random.Random, haystack_chars: int, depth: float, echoes: int = 0) -> tuple[str, str]:
    """A completions-API passkey prompt with exactly `haystack_chars` characters of fresh synthetic filler (the
    last sentence cut and closed with a blank line, as the benchmark does) and the needle at the sentence
    boundary nearest `depth`; returns (prompt text, value). `echoes` (training only) adds that many more copies of
    the same needle at random boundaries: every copy after the first is a copying exercise at its own distance,
    a denser signal than the one answer while the model has yet to learn to look back at all."""
    parts = haystack_units(SyntheticHaystack(rng.randrange(1 << 30)), haystack_chars)
    value = random_value(rng)
    at = [round(depth * len(parts))] + [rng.randint(0, len(parts)) for _ in range(echoes)]
    out = []
    for j in range(len(parts) + 1):
        for _ in range(at.count(j)):
            out.append(needle_text(value, j == 0 or parts[j - 1].endswith("\n\n") or out[-1].endswith("\n\n")))
        if j < len(parts):
            out.append(parts[j])
    return content("completions", "".join(out)), value
