"""Batched token sampling: greedy, temperature, top-k, top-p, with a per-request generator for seeded requests.

Sampling is the exponential race (argmax of p / E with E ~ Exp(1), i.e. Gumbel-max), so a seeded request draws
exactly one noise vector [V] from its own `torch.Generator` per token: its samples depend only on its own seed
and logits, never on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request

# Temperatures below this sample greedily: 1 / t would overflow fp32 logits (1e-39 is a denormal), and the
# distribution is a point mass on the argmax anyway. vLLM uses the same threshold.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingBatch:
    """Per-row settings of one step's sampled rows (B rows)."""
    temperature: torch.Tensor            # [B] fp32, 0 = greedy
    top_k: torch.Tensor                  # [B] long in [1, V], V when off
    top_p: torch.Tensor                  # [B] fp32, 1 = off
    forced: torch.Tensor                 # [B] long, -1 = sample (debug hook otherwise)
    generators: list[torch.Generator | None]

    @classmethod
    def from_requests(cls, reqs: list[Request], vocab: int, device: torch.device) -> "SamplingBatch":
        ps = [r.params for r in reqs]
        forced = [p.forced_token_ids[len(r.output)] if len(r.output) < len(p.forced_token_ids) else -1
                  for r, p in zip(reqs, ps)]
        return cls(
            temperature=torch.tensor([p.temperature if p.temperature >= GREEDY_BELOW else 0.0 for p in ps],
                                     dtype=torch.float32, device=device),
            top_k=torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in ps], dtype=torch.long,
                               device=device),
            top_p=torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=device),
            forced=torch.tensor(forced, dtype=torch.long, device=device),
            generators=[r.generator for r in reqs])


def filter_top_k_top_p(z: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and top-p nucleus (the top token always stays, also when
    top_p rounds to 0 in fp32). z [B, V] -> [B, V]."""
    sz, idx = z.sort(dim=-1, descending=True)                                    # [B, V]
    rank = torch.arange(z.shape[-1], device=z.device)
    sz = sz.masked_fill(rank[None] >= top_k[:, None], float("-inf"))
    probs = sz.softmax(-1)
    before = probs.cumsum(-1) - probs                                            # mass ranked above each token
    sz = sz.masked_fill((before >= top_p[:, None]) & (rank[None] > 0), float("-inf"))
    return torch.full_like(z, float("-inf")).scatter(-1, idx, sz)


def exponential_noise(generators: list[torch.Generator | None], vocab: int, device: torch.device) -> torch.Tensor:
    """E [B, V] ~ Exp(1): seeded rows from their own generator, the rest in one draw from the global RNG."""
    noise = torch.empty(len(generators), vocab, device=device).exponential_()
    for row, g in enumerate(generators):
        if g is not None:
            noise[row].exponential_(generator=g)
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (long)."""
    out = logits.argmax(-1)
    rand = (batch.temperature > 0).nonzero().squeeze(-1)
    if rand.numel():
        z = logits[rand].float() / batch.temperature[rand, None]
        top_k, top_p = batch.top_k[rand], batch.top_p[rand]
        if bool((top_k < z.shape[-1]).any() or (top_p < 1).any()):
            z = filter_top_k_top_p(z, top_k, top_p)
        noise = exponential_noise([batch.generators[i] for i in rand.tolist()], z.shape[-1], z.device)
        out[rand] = (z.log_softmax(-1) - noise.log()).argmax(-1)
    return torch.where(batch.forced >= 0, batch.forced, out)
