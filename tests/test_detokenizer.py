"""`TextStream` against a reference that recomputes, after every push, what may be shown from the whole text so
far: ids are byte-level tokens of 1-3 bytes (so characters split across ids), stop strings span ids, and
`min_tokens` sits before, at and after the id that completes a stop string. Boundaries (a stop at the very first
character, a stop completed only by flush, the earliest of two stops, several ids in one push) are enumerated
rather than left to the seed."""

from __future__ import annotations

import random

import pytest

from hisparse.engine.detokenizer import TextStream


def byte_decoder(vocab: list[bytes]):
    """ids -> text for a byte-level vocabulary (id i is the bytes vocab[i]), broken characters as U+FFFD."""
    return lambda ids: b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")


BYTES = [bytes([b]) for b in range(256)]       # id = byte value
decode = byte_decoder(BYTES)


def reference(decode, chunks: list[list[int]], stop: tuple[str, ...], min_tokens: int) -> list[str]:
    """The whole text shown after each push (chunks of ids) and after flush. Ids commit to the text once they
    decode whole (or 4 ids hold no whole character). Shown: the text up to the first stop string that starts at or
    after the committed text of the first min_tokens ids, else the committed text less its longest unsent suffix
    that is a proper prefix of some stop string; nothing more once a stop string appeared."""
    text, shown, pending, out, pushed, floor = "", "", [], [], 0, 0
    longest = max(map(len, stop), default=0)
    for chunk in chunks:
        pending, pushed = pending + chunk, pushed + len(chunk)
        piece = decode(pending)
        if piece.endswith("\ufffd") and len(pending) < 4:
            out.append(shown)
            continue
        text, pending = text + piece, []
        if pushed <= min_tokens:
            floor = len(text)
        hits = [i for s in stop if (i := text.find(s, floor)) >= 0]
        if hits:
            out.append(text[:min(hits)])
            return out + [out[-1]] * (len(chunks) - len(out) + 1)
        held = max((k for k in range(1, min(longest - 1, len(text) - len(shown)) + 1)
                    if any(s.startswith(text[-k:]) for s in stop)), default=0)
        shown = text[:max(len(shown), len(text) - held)]
        out.append(shown)
    text += decode(pending) if pending else ""
    hits = [i for s in stop if (i := text.find(s, floor)) >= 0]
    return out + [text[:min(hits)] if hits else text]


def run(decode, chunks: list[list[int]], stop: tuple[str, ...], min_tokens: int) -> list[str]:
    """The whole text a TextStream has shown after each push and after flush."""
    stream, shown, out = TextStream(decode, stop, min_tokens), "", []
    for chunk in chunks:
        shown += stream.push(chunk)
        out.append(shown)
    return out + [shown + stream.flush()]


def tokenize(data: bytes, rng: random.Random) -> tuple[list[bytes], list[list[int]]]:
    """data as a vocabulary of 1-3 byte tokens (characters split across them) and the ids, pushed one or two at a
    time."""
    vocab, i = [], 0
    while i < len(data):
        n = rng.randint(1, 3)
        vocab.append(data[i:i + n])
        i += n
    chunks, i = [], 0
    while i < len(vocab):
        n = rng.choice((1, 1, 2))
        chunks.append(list(range(i, min(i + n, len(vocab)))))
        i += n
    return vocab, chunks


ALPHABET = "ab é€😀"


@pytest.mark.parametrize("trial", range(40))
def test_stream_shows_what_the_reference_allows(seed: int, trial: int) -> None:
    rng = random.Random(seed * 1000 + trial)
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 24)))
    starts = (rng.randint(0, len(text)) for _ in range(2))
    stops = tuple(sorted({text[a:a + rng.randint(1, 4)] or "zz" for a in starts}))
    stops = stops if trial % 4 else ()
    if trial % 3:
        vocab, chunks = tokenize(text.encode(), rng)
    else:       # one byte per id, one id per push
        vocab, chunks = BYTES, [[b] for b in text.encode()]
    ids = sum(map(len, chunks))
    for min_tokens in (0, 1, ids // 2, ids, ids + 1):
        want = reference(byte_decoder(vocab), chunks, stops, min_tokens)
        assert run(byte_decoder(vocab), chunks, stops, min_tokens) == want, (text, stops, chunks, min_tokens)


@pytest.mark.parametrize("min_tokens, shown", [(0, "x"), (1, "x"), (2, "xabq"), (3, "xabq")])
def test_min_tokens_boundary(min_tokens: int, shown: str) -> None:
    """'ab' starts in the second id: it counts while min_tokens leaves that id out (<= 1), not after."""
    chunks = [[ord("x")], [ord("a")], [ord("b")], [ord("q")]]
    assert run(decode, chunks, ("ab",), min_tokens)[-1] == shown
    assert reference(decode, chunks, ("ab",), min_tokens)[-1] == shown


def test_enumerated_boundaries() -> None:
    e = list("é".encode())
    assert run(decode, [[ord("s")], [ord("x")]], ("s",), 0) == ["", "", ""]                   # a stop at character 0
    assert run(decode, [[ord("s"), e[0]]], ("s",), 0) == ["", ""]                              # ... completed by flush
    assert run(decode, [[ord("s"), e[0]]], ("t",), 0) == ["", "s\ufffd"]
    assert run(decode, [list(b"xcdab")], ("ab", "cd"), 0) == ["x", "x"]                        # the earliest of two stops
    assert run(decode, [list(b"ab"), list(b"c")], ("abcd",), 0) == ["", "", "abc"]             # held, then flushed
    assert run(decode, [list(b"ab"), list(b"cx")], ("abcd",), 0) == ["", "abcx", "abcx"]
    assert run(decode, [[0xF0]] * 4, (), 0) == ["", "", "", "\ufffd" * 4, "\ufffd" * 4]   # 4 ids, no character
    assert run(decode, [list("😀".encode()[:3]), list("😀".encode()[3:])], (), 0) == ["", "😀", "😀"]
    stream = TextStream(decode, ("b",))
    assert stream.push([ord("b")]) == "" and stream.stopped and stream.push([ord("c")]) == "" and stream.flush() == ""
