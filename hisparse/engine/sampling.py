"""Batched token sampling: greedy, temperature, top-k, top-p, with a per-request generator for seeded requests.

Sampling is the exponential race (argmax of p / E with E ~ Exp(1), i.e. Gumbel-max), so a seeded request draws
exactly one noise vector [V] from its own `torch.Generator` per token: its samples depend only on its own seed
and logits, never on which other requests share the batch.

vLLM's extensions follow its v1 sampler, in its order, as whole-batch tensor ops: on fp32 logits, min_tokens
(stop ids and EOS to -inf) and logit_bias, then the repetition penalty (a token seen in the prompt or the output
has a positive logit divided by it, a negative one multiplied), the frequency penalty (minus penalty x output
count) and the presence penalty (minus penalty if in the output); greedy rows take the argmax here; then
temperature, min_p (tokens below min_p x the top probability to -inf), top-k and top-p. A step with none of
these (`SamplingBatch.processors` None, `min_p` None) runs exactly the original fast path. Logprobs are vLLM's
default `raw_logprobs` mode: log_softmax of the model's logits before any of the above (`token_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request, TokenLogprobs

# Temperatures below this sample greedily: 1 / t would overflow fp32 logits (1e-39 is a denormal), and the
# distribution is a point mass on the argmax anyway. vLLM uses the same threshold.
GREEDY_BELOW = 1e-5


@dataclass
class LogitsProcessors:
    """vLLM's non-argmax-invariant processors of one step's rows, as batch tensors (B rows, V tokens)."""
    rows: torch.Tensor                                 # [B] bool: rows with any processor (the others keep their logits)
    masked: tuple[torch.Tensor, torch.Tensor]          # (rows [M], ids [M]): min_tokens' stop ids -> -inf
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # (rows [K], ids [K], values [K] fp32): logit_bias
    seen: torch.Tensor                                 # [B, V] bool: in the prompt or the output (repetition)
    counts: torch.Tensor                               # [B, V] fp32: occurrences in the output
    repetition: torch.Tensor                           # [B] fp32, 1 = off
    frequency: torch.Tensor                            # [B] fp32
    presence: torch.Tensor                             # [B] fp32

    @classmethod
    def from_requests(cls, reqs: list[Request], vocab: int, eos_id: int | None, device: torch.device
                      ) -> "LogitsProcessors":
        ps = [r.params for r in reqs]
        masked = [(i, t) for i, (r, p) in enumerate(zip(reqs, ps)) if len(r.output) < p.min_tokens
                  for t in {*p.stop_token_ids, *(() if eos_id is None else (eos_id,))}]
        bias = [(i, t, min(100.0, max(-100.0, b))) for i, p in enumerate(ps) for t, b in p.logit_bias]
        penalized = [p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in ps]
        # outputs [B, L] padded with V (a column dropped after counting); rows without penalties count nothing
        outputs = torch.nn.utils.rnn.pad_sequence(
            [torch.tensor(r.output if k else [], dtype=torch.long) for r, k in zip(reqs, penalized)],
            batch_first=True, padding_value=vocab).to(device)
        counts = torch.zeros(len(reqs), vocab + 1, device=device).scatter_add_(
            1, outputs, torch.ones(outputs.shape, device=device))[:, :vocab]                 # [B, V]
        prompts = [r.prompt_mask(vocab).to(device) if p.repetition_penalty != 1.0 else None for r, p in zip(reqs, ps)]
        seen = torch.stack([m if m is not None else torch.zeros(vocab, dtype=torch.bool, device=device)
                            for m in prompts]) | (counts > 0)

        def col(xs: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(xs, dtype=dtype, device=device)
        return cls(
            rows=col([p.penalized for p in ps], torch.bool),
            masked=(col([i for i, _ in masked], torch.long), col([t for _, t in masked], torch.long)),
            bias=(col([i for i, _, _ in bias], torch.long), col([t for _, t, _ in bias], torch.long),
                  col([b for _, _, b in bias], torch.float32)),
            seen=seen, counts=counts,
            repetition=col([p.repetition_penalty for p in ps], torch.float32),
            frequency=col([p.frequency_penalty for p in ps], torch.float32),
            presence=col([p.presence_penalty for p in ps], torch.float32))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits [B, V] -> processed logits [B, V] (a new tensor)."""
        z = logits.to(torch.float32, copy=True)
        z.index_put_(self.masked, torch.tensor(float("-inf"), device=z.device))
        z.index_put_(self.bias[:2], self.bias[2], accumulate=True)
        penalty = torch.where(self.seen, self.repetition[:, None], 1.0)
        z *= torch.where(z > 0, 1.0 / penalty, penalty)
        z -= self.frequency[:, None] * self.counts
        z -= self.presence[:, None] * (self.counts > 0)
        return z


@dataclass
class SamplingBatch:
    """Per-row settings of one step's sampled rows (B rows)."""
    temperature: torch.Tensor            # [B] fp32, 0 = greedy
    top_k: torch.Tensor                  # [B] long in [1, V], V when off
    top_p: torch.Tensor                  # [B] fp32, 1 = off
    forced: torch.Tensor                 # [B] long, -1 = sample (debug hook otherwise)
    generators: list[torch.Generator | None]
    processors: LogitsProcessors | None = None   # None: no row has min_tokens, logit_bias or a penalty
    min_p: torch.Tensor | None = None            # [B] fp32, 0 = off; None: no row has min_p

    @classmethod
    def from_requests(cls, reqs: list[Request], vocab: int, device: torch.device, eos_id: int | None = None
                      ) -> "SamplingBatch":
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
            generators=[r.generator for r in reqs],
            processors=LogitsProcessors.from_requests(reqs, vocab, eos_id, device)
            if any(p.penalized for p in ps) else None,
            min_p=torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=device)
            if any(p.min_p for p in ps) else None)


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


def filter_min_p(z: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit whose probability is below min_p x the row's top probability. z [B, V] -> [B, V]."""
    probs = z.softmax(-1)
    return z.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p[:, None], float("-inf"))


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (long).

    Processed rows are sampled from their fp32 processed logits; every other row from its own logits as given, so a
    row's token never depends on whether a neighbour in the batch has a processor (an fp32 cast could tie a greedy
    row's top two fp64 logits)."""
    out = logits.argmax(-1)
    if batch.processors is not None:
        logits = batch.processors.apply(logits)
        out = torch.where(batch.processors.rows, logits.argmax(-1), out)
    rand = (batch.temperature > 0).nonzero().squeeze(-1)
    if rand.numel():
        z = logits[rand].float() / batch.temperature[rand, None]
        if batch.min_p is not None:
            z = filter_min_p(z, batch.min_p[rand])
        top_k, top_p = batch.top_k[rand], batch.top_p[rand]
        if bool((top_k < z.shape[-1]).any() or (top_p < 1).any()):
            z = filter_top_k_top_p(z, top_k, top_p)
        noise = exponential_noise([batch.generators[i] for i in rand.tolist()], z.shape[-1], z.device)
        out[rand] = (z.log_softmax(-1) - noise.log()).argmax(-1)
    return torch.where(batch.forced >= 0, batch.forced, out)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """Log-probabilities (vLLM's raw_logprobs: log_softmax of the unprocessed logits in fp32) of `token_ids` [R]
    under logits [R, V], their ranks (1 = most likely) and row r's top-ks[r]; one batched pass over the rows,
    then one copy to the host."""
    lp = logits.log_softmax(-1, dtype=torch.float32)                             # [R, V]
    chosen = lp.gather(-1, token_ids[:, None])                                   # [R, 1]
    rank = (lp >= chosen).sum(-1)                                                # [R]
    top_lp, top_ids = lp.topk(max(ks), dim=-1)                                   # [R, k]
    rows = zip(token_ids.tolist(), chosen[:, 0].tolist(), rank.tolist(), top_ids.tolist(), top_lp.tolist(), ks)
    return [TokenLogprobs(t, c, r, tuple(i[:k]), tuple(v[:k])) for t, c, r, i, v, k in rows]
