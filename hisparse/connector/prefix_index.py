"""The vLLM scheduler's index of the workers' prefix caches: which cache units (by key) the workers hold, which
requests hold them and which are parked (cached, held by none), least recently used first.

Every decision is made here and replayed by every worker from the step plan (`state.StepPlan`): which units a
request starts from, which units of a request are cached once its rows are written, and which parked units are
evicted to make room. A worker never evicts on its own, so its cache holds exactly the units this index lists.
Only prompt tokens are cached (the scheduler knows them when the rows are written).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ..host_pool.prefix_cache import page_keys


class PrefixIndex:
    """Keys of `unit_tokens`-token units chained from `salt`."""

    def __init__(self, unit_tokens: int, salt: bytes):
        self.unit, self.salt = unit_tokens, salt
        self.holders: dict[bytes, int] = {}                  # held key -> requests holding it
        self.parked: OrderedDict[bytes, None] = OrderedDict()   # cached keys no request holds, oldest first
        self.held: dict[str, list[bytes]] = {}               # request -> the keys it holds
        self.chains: dict[str, list[bytes]] = {}             # request -> the keys of its prompt's full units

    def __len__(self) -> int:
        return len(self.holders) + len(self.parked)

    def chain(self, req_id: str, prompt: Sequence[int]) -> list[bytes]:
        """The keys of the full units of a request's prompt (computed once per request)."""
        if req_id not in self.chains:
            self.chains[req_id] = page_keys(prompt, self.unit, self.salt)
        return self.chains[req_id]

    def match(self, req_id: str, prompt: Sequence[int]) -> list[bytes]:
        """The longest run of cached units the request may start from (its last prompt token is always computed:
        its logits give the first output)."""
        out = []
        for key in self.chain(req_id, prompt)[:(len(prompt) - 1) // self.unit]:
            if key not in self.holders and key not in self.parked:
                break
            out.append(key)
        return out

    def hold(self, req_id: str, keys: Sequence[bytes]) -> None:
        """The request starts from these cached units."""
        for key in keys:
            self.holders[key] = self.holders.get(key, 0) + 1
            self.parked.pop(key, None)
        self.held.setdefault(req_id, []).extend(keys)

    def add(self, req_id: str, keys: Sequence[bytes]) -> None:
        """The request's next units are written: cache them, held by it (a key already cached stays as it is,
        and the request's copy stays private, as the workers' caches do)."""
        for key in keys:
            if key not in self.holders and key not in self.parked:
                self.holders[key] = 1
                self.held.setdefault(req_id, []).append(key)

    def release(self, req_id: str) -> None:
        """The request let go of its units: those nobody else holds are parked (most recently used)."""
        for key in self.held.pop(req_id, ()):
            if self.holders[key] > 1:
                self.holders[key] -= 1
            else:
                del self.holders[key]
                self.parked[key] = None
        self.chains.pop(req_id, None)

    def evict(self, n: int) -> list[bytes]:
        """Forget the n least recently used parked units (at most all of them); their keys."""
        return [self.parked.popitem(last=False)[0] for _ in range(min(n, len(self.parked)))]
