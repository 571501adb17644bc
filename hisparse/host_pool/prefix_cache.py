"""The prefix cache's index: full pages found again by the content of the tokens that produced them.

A page's key chains the keys of every page before it (`page_keys`): the rows of positions [kP, (k+1)P) depend on
every token up to (k+1)P and on what computes and stores them (the chain's root, `salt`), so two requests whose
tokens agree up to a page boundary share the pages up to there. The index maps key <-> page for pages whose rows
are complete; the page table (`pages.PageTable`) counts the requests holding each page and parks a cached page no
request holds here, least recently used first, instead of freeing it. Parked pages are evicted (their page freed,
their key forgotten) only when an allocation or a reservation needs the room.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def salt_of(*parts: object) -> bytes:
    """The root of a key chain: a digest of everything besides the tokens that changes the stored rows."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def page_keys(tokens: Sequence[int], page_tokens: int, parent: bytes) -> list[bytes]:
    """Keys of the full pages of `tokens` (a request's tokens from a page boundary on), chained from `parent`
    (the key of the page before them, or the salt)."""
    keys = []
    for lo in range(0, len(tokens) - page_tokens + 1, page_tokens):
        parent = hashlib.blake2b(parent + array("q", tokens[lo:lo + page_tokens]).tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """key <-> page for cached pages, and the parked ones (cached, held by no request) in LRU order."""

    def __init__(self):
        self.page_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.parked: OrderedDict[int, None] = OrderedDict()   # oldest first

    def __len__(self) -> int:
        return len(self.key_of)

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of `keys`, from the first, that are cached."""
        pages = []
        for key in keys:
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def add(self, key: bytes, page: int) -> None:
        """Cache `page` (its rows now complete) under `key`; a key or page already cached keeps its entry (the
        same tokens computed twice at once: the later page stays private and is freed with its request)."""
        if key not in self.page_of and page not in self.key_of:
            self.page_of[key], self.key_of[page] = page, key

    def holds(self, page: int) -> bool:
        return page in self.key_of

    def park(self, page: int) -> None:
        """The last request holding a cached page let it go: it becomes the most recently used parked page."""
        self.parked[page] = None

    def unpark(self, page: int) -> None:
        self.parked.pop(page, None)

    def evict(self) -> int:
        """Forget the least recently used parked page; its id (free again)."""
        page, _ = self.parked.popitem(last=False)
        del self.page_of[self.key_of.pop(page)]
        return page

    def evict_key(self, key: bytes) -> int:
        """Forget the parked page of `key`; its id (free again). KeyError if no parked page has that key."""
        page = self.page_of[key]
        if page not in self.parked:
            raise KeyError(f"prefix cache: the page of key {key.hex()} is held by a request, it cannot be evicted")
        del self.parked[page], self.key_of[page], self.page_of[key]
        return page

    def forget_held(self) -> None:
        """Forget every cached page a request still holds (it is freed with its last holder)."""
        for page in [p for p in self.key_of if p not in self.parked]:
            del self.page_of[self.key_of.pop(page)]
