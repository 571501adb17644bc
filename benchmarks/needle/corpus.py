"""An offline haystack: English prose that ships with the installed software, as a deterministic stream of
sentences.

No downloads: the text comes from the Python environment running the benchmark and the OS, in this order
(each source sorted by path, so the stream is the same on every run of one machine): the long descriptions and
licence files of installed distributions (`*.dist-info/METADATA`, `LICENSE*`, `COPYING*`), the OS's licence
texts (`/usr/share/common-licenses`), the Python language reference that `help()` shows (`pydoc_data.topics`),
the docstrings of the standard library, and Debian's per-package `/usr/share/doc/*/copyright` files. Only
paragraphs that read as prose are kept (no code, markup, URLs or lists), each once: about 290k tokens on this
project's machine. The stream repeats from the start if a haystack needs more text than there is
(`Corpus.cycles` says how often that happened).
"""

from __future__ import annotations

import ast
import hashlib
import re
import site
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

COMMON_LICENSES = Path("/usr/share/common-licenses")
DEBIAN_COPYRIGHTS = Path("/usr/share/doc")
LICENSE_NAMES = ("LICENSE*", "LICENCE*", "COPYING*")
MIN_CHARS, MIN_WORDS = 80, 12
BANNED = re.compile(r"https?:|www\.|[`{}|<>\[\]\\#*=~^@$]|>>>|::|\.\.\.|__")
PROSE_CHARS = re.compile(r"[A-Za-z0-9 ,.;:'\"()\-!?/%]")
SENTENCE_END = re.compile(r"(?<=[a-z0-9)][.!?])\s+(?=[A-Z])")


def is_prose(par: str) -> bool:
    """A paragraph of running English text: long enough, starts with a capital, ends a sentence, and
    nearly all of its characters are letters, spaces and ordinary punctuation."""
    if len(par) < MIN_CHARS or len(par.split()) < MIN_WORDS or not par[0].isupper() or par[-1] not in ".!?":
        return False
    if BANNED.search(par):
        return False
    return len(PROSE_CHARS.findall(par)) >= 0.97 * len(par)


def paragraphs(text: str) -> Iterator[str]:
    """Blank-line separated paragraphs with their lines joined and whitespace collapsed."""
    for block in re.split(r"\n\s*\n", text):
        par = " ".join(block.split())
        if par:
            yield par


def metadata_body(path: Path) -> str:
    """The long description of a METADATA file (after the header block)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return text.split("\n\n", 1)[1] if "\n\n" in text else ""


def docstrings(path: Path) -> Iterator[str]:
    """Module, class and function docstrings of one Python source file."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield doc


def source_texts() -> Iterator[tuple[str, str]]:
    """(source path, text) of every document, in stream order."""
    for root in sorted(site.getsitepackages()):
        for dist in sorted(Path(root).glob("*.dist-info")):
            if (dist / "METADATA").is_file():
                yield str(dist / "METADATA"), metadata_body(dist / "METADATA")
            for pattern in LICENSE_NAMES:
                for lic in sorted(dist.rglob(pattern)):
                    if lic.is_file():
                        yield str(lic), lic.read_text(encoding="utf-8", errors="replace")
    if COMMON_LICENSES.is_dir():
        for lic in sorted(COMMON_LICENSES.iterdir()):
            if lic.is_file() and not lic.is_symlink():
                yield str(lic), lic.read_text(encoding="utf-8", errors="replace")
    try:
        from pydoc_data.topics import topics   # the Python language reference, as `help()` shows it
        for name in sorted(topics):
            yield f"pydoc_data.topics[{name!r}]", topics[name]
    except ImportError:
        pass
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for py in sorted(stdlib.rglob("*.py")):
        if not {"test", "tests", "site-packages", "idlelib"} & set(py.relative_to(stdlib).parts):
            yield str(py), "\n\n".join(docstrings(py))
    for cp in sorted(DEBIAN_COPYRIGHTS.glob("*/copyright")):
        if cp.is_file():
            yield str(cp), cp.read_text(encoding="utf-8", errors="replace")


@dataclass
class Corpus:
    """The sentence stream, materialised lazily: `units(n)` returns the first n units.

    A unit is one sentence with its whitespace: a leading space inside a paragraph, a trailing blank line at a
    paragraph's end. Units concatenate to the haystack text, and since Tekken's (tiktoken's) pre-tokenizer
    attaches a leading space to the word after it and trailing newlines to the punctuation before them, no
    token spans two units: a concatenation's token count is the sum of its units' counts."""
    _units: list[str] = field(default_factory=list)
    _sources: list[str] = field(default_factory=list)
    _stream: Iterator[tuple[str, str]] | None = None
    _unique: int | None = None     # units in the whole stream, once it has run out
    cycles: int = 0                # times the stream was repeated

    def _generate(self) -> Iterator[tuple[str, str]]:
        seen: set[str] = set()
        for path, text in source_texts():
            for par in paragraphs(text):
                if par in seen or not is_prose(par):
                    continue
                seen.add(par)
                sents = SENTENCE_END.split(par)
                for i, sent in enumerate(sents):
                    yield path, (" " if i else "") + sent + ("\n\n" if i == len(sents) - 1 else "")

    def units(self, n: int) -> list[str]:
        """The first n units of the stream (repeating it when the machine has less text)."""
        if self._stream is None:
            self._stream = self._generate()
        while len(self._units) < n and self._unique is None:
            nxt = next(self._stream, None)
            if nxt is None:
                if not self._units:
                    raise RuntimeError("no prose found in site-packages, /usr/share/common-licenses or the stdlib")
                self._unique = len(self._units)
                break
            path, unit = nxt
            if not self._sources or self._sources[-1] != path:
                self._sources.append(path)
            self._units.append(unit)
        while len(self._units) < n:
            self._units.extend(self._units[:self._unique])
        if self._unique is not None:
            self.cycles = max(self.cycles, -(-n // self._unique) - 1)
        return self._units[:n]

    def sources(self) -> list[str]:
        """The documents the stream has read so far."""
        return list(self._sources)


def digest(text: str) -> str:
    """Short content hash of a haystack, to compare runs on different machines."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]
