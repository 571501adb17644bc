"""DSpark drafter (spec §5.2): tapped target hidden states -> sliding-window MLA draft layers; the block
[anchor, mask_1, .., mask_{N-1}] runs non-causally in one forward; a gated-RNN Markov head emits the N drafts.

`DSpark` holds the `mtp_dspark.*` weights (it sits at `ML4.mtp_dspark`, so checkpoint names are the module's
names). `DSparkDrafter` binds it to the target (token embedding, output head, global LeRoPE frequencies) and to
a per-request bf16 `DraftWindowCache`. Draft layers are §3 MLA with RoPE on every head, no indexer (dense over the
window), no SSMax unless the checkpoint has `mtp_dspark.layers.J.attention.ssmax_scaling`, tau = (dN + dR)^-1/2.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from ..kv.base import sparse_mla
from ..core.config import ConfigError, ModelConfig
from .indexer import ssmax_gain
from .linear import Linear
from .moe import SwiGLU
from .norm import RMSNorm
from .rope import apply_rope, rope_cos_sin, rope_frequencies

# (capped logits [B, V]) -> (tokens [B], the distribution they were drawn from [B, V], or None for argmax)
DraftSampler = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


class DraftWindowCache:
    """Per request, the newest `window` context latent rows (c || k_rope) of every draft layer, stored in
    `dtype` (bf16: 1,152 B per row and layer at full size, ~7 MB per request).

    A ring buffer: position p lives in slot p mod window, and each slot records the position it holds (-1 when
    empty), so an overwritten or rolled-back position is never read back as another position's row."""

    def __init__(self, n_layers: int, window: int, width: int, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu"):
        self.n_layers, self.window, self.width = n_layers, window, width
        self.dtype, self.device = dtype, torch.device(device)
        self.rows: dict[Hashable, torch.Tensor] = {}   # req -> [L, W, width]
        self.pos: dict[Hashable, torch.Tensor] = {}    # req -> [W] long, -1 = empty

    @classmethod
    def for_config(cls, cfg: ModelConfig, device: torch.device | str = "cpu") -> "DraftWindowCache":
        mtp = cfg.mtp
        return cls(mtp.n_layers, mtp.sliding_window, cfg.latent_dim, getattr(torch, mtp.kv_cache_dtype), device)

    @property
    def row_bytes(self) -> int:
        return self.width * self.dtype.itemsize

    @property
    def bytes_per_request(self) -> int:
        return self.n_layers * self.window * self.row_bytes

    def _buffers(self, req: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        if req not in self.rows:
            self.rows[req] = torch.zeros(self.n_layers, self.window, self.width, dtype=self.dtype, device=self.device)
            self.pos[req] = torch.full((self.window,), -1, dtype=torch.long, device=self.device)
        return self.rows[req], self.pos[req]

    def write(self, req: Hashable, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """positions [T] ascending and consecutive, rows [L, T, width]; only the newest `window` are kept."""
        buf, pos = self._buffers(req)
        positions, rows = positions[-self.window:].to(self.device), rows[:, -self.window:]
        slots = positions % self.window
        buf[:, slots] = rows.to(self.dtype)
        pos[slots] = positions

    def read(self, req: Hashable) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [L, W, width] in the cache dtype, their positions [W], -1 where empty)."""
        return self._buffers(req)

    def truncate(self, req: Hashable, length: int) -> None:
        """Forget positions >= length (speculative rollback): their slots become empty and zeroed."""
        if req in self.pos:
            stale = self.pos[req] >= length
            self.rows[req][:, stale] = 0
            self.pos[req][stale] = -1

    def release(self, req: Hashable) -> None:
        self.rows.pop(req, None)
        self.pos.pop(req, None)

    def nbytes(self, req: Hashable | None = None) -> int:
        return sum(b.numel() * b.element_size() for r, b in self.rows.items() if req is None or r == req)


class DraftAttention(nn.Module):
    """`mtp_dspark.layers.J.attention.*`: RoPE MLA over the window's context rows plus every block row."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, r, dN, dR, dV = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.wq = Linear(cfg.dim, H * (dN + dR), bias=False)
        self.wkv_a_with_mqa = Linear(cfg.dim, r + dR, bias=False)
        self.kv_a_norm = RMSNorm(r, cfg.norm_eps)
        self.wkv_b = Linear(r, H * (dN + dV), bias=False)
        self.wo = Linear(H * dV, cfg.dim, bias=False)
        self.ssmax_scaling: nn.Parameter | None = None
        self.scale = (dN + dR) ** -0.5

    def enable_ssmax(self) -> None:
        """The checkpoint carries this layer's `ssmax_scaling` [H, 2]: apply SSMax (§3.4) to its queries."""
        norm = self.kv_a_norm.weight   # the model's plain dtype and device (wq may hold FP8)
        self.ssmax_scaling = nn.Parameter(torch.zeros(self.cfg.n_heads, 2, dtype=norm.dtype, device=norm.device))

    def latents(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> rows [T, r + dR]: c = RMSNorm(a[:r]; kv_a_norm), k_rope = R(p) a[r:]."""
        r = self.cfg.kv_lora_rank
        a = self.wkv_a_with_mqa(x)
        return torch.cat((self.kv_a_norm(a[:, :r]), apply_rope(a[:, r:], cos, sin)), dim=-1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: torch.Tensor, ctx_valid: torch.Tensor) -> torch.Tensor:
        """x [B, N, D] block at positions [B, N] (cos/sin [B*N, dR/2]); ctx [B, S, r + dR] context rows,
        ctx_valid [B, N, S] which of them each block query may read. Every block query reads all N block rows
        (non-causal). Returns [B, N, D]."""
        cfg = self.cfg
        B, N, D = x.shape
        H, dN, r = cfg.n_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        flat = x.reshape(B * N, D)
        q = self.wq(flat).view(B * N, H, -1)
        q_nope, q_rope = q[..., :dN], apply_rope(q[..., dN:], cos, sin)
        if self.ssmax_scaling is not None:
            g = ssmax_gain(self.ssmax_scaling, positions.flatten(), x.dtype)[..., None]    # [B*N, H, 1]
            q_nope, q_rope = q_nope * g, q_rope * g
        keys = torch.cat((ctx.to(x.dtype), self.latents(flat, cos, sin).view(B, N, -1)), dim=1)   # [B, S+N, w]
        valid = torch.cat((ctx_valid, ctx_valid.new_ones(B, N, N)), dim=2)                        # [B, N, S+N]
        w_kvb = self.wkv_b.dequantized(x.dtype).view(H, dN + cfg.v_head_dim, r)
        q_lat = torch.einsum("thd,hdc->thc", q_nope, w_kvb[:, :dN])                               # [B*N, H, r]
        rows = keys[:, None].expand(B, N, *keys.shape[1:]).reshape(B * N, keys.shape[1], -1)
        olat, _ = sparse_mla(q_lat, q_rope, rows, valid.reshape(B * N, -1), self.scale, r)
        o = torch.einsum("thc,hvc->thv", olat, w_kvb[:, dN:])                                     # [B*N, H, dV]
        return self.wo(o.flatten(1)).view(B, N, D)


class DraftLayer(nn.Module):
    """`mtp_dspark.layers.J.*`: pre-norm MLA + dense SwiGLU."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = DraftAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = SwiGLU(cfg.dim, cfg.mtp.hidden_dim)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                ctx: torch.Tensor, ctx_valid: torch.Tensor) -> torch.Tensor:
        h = h + self.attention(self.attention_norm(h), positions, cos, sin, ctx, ctx_valid)
        return h + self.feed_forward(self.ffn_norm(h))


class MarkovHead(nn.Module):
    """`mtp_dspark.markov.*`: gated recurrent state s_i = z ⊙ s_{i-1} + (1 - z) ⊙ Em[y_{i-1}], bias Wm s_i."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        R = cfg.mtp.markov_rank
        self.embed = nn.Embedding(cfg.vocab_size, R)
        self.gate = Linear(2 * R, R, bias=True)
        self.proj = Linear(R, cfg.vocab_size, bias=False)

    def forward(self, y_prev: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """y_prev [B] previous token, s [B, R] state -> (new state [B, R], logit bias [B, V])."""
        e = self.embed(y_prev)
        z = torch.sigmoid(self.gate(torch.cat((e, s), dim=-1)))
        s = z * s + (1 - z) * e
        return s, self.proj(s)


class DSpark(nn.Module):
    """The drafter's weights and math (`mtp_dspark.*`); caches and the target's shared tensors come from outside."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        mtp = cfg.mtp
        checks = (("method", mtp.method == "dspark"), ("markov_head_type", mtp.markov_head_type == "gated_rnn"),
                  ("sample_from_anchor", mtp.sample_from_anchor), ("block_size", mtp.block_size >= 1),
                  ("n_layers", mtp.n_layers >= 1), ("sliding_window", mtp.sliding_window >= 1),
                  ("kv_cache_dtype", isinstance(getattr(torch, mtp.kv_cache_dtype, None), torch.dtype)))
        for key, ok in checks:
            if not ok:
                raise ConfigError(f"params.json: 'mtp.{key}' = {getattr(mtp, key)!r} is not supported "
                                  "(DSpark: method 'dspark', gated_rnn Markov head, sample_from_anchor true)")
        self.cfg = cfg
        self.context_proj = Linear(len(mtp.target_layer_ids) * cfg.dim, cfg.dim, bias=False)
        self.context_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mask_embeddings = nn.Parameter(torch.zeros(mtp.block_size - 1, cfg.dim))
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(mtp.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.markov = MarkovHead(cfg)

    def context_rows(self, taps: dict[int, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Context path: taps {target layer: [T, D]} at positions with rotary cos/sin [T, dR/2] ->
        each draft layer's latent rows [L, T, r + dR] (no attention_norm on this path)."""
        h = torch.cat([taps[l] for l in self.cfg.mtp.target_layer_ids], dim=-1)        # [T, 5D]
        u = self.context_norm(self.context_proj(h))                                      # [T, D]
        return torch.stack([layer.attention.latents(u, cos, sin) for layer in self.layers])

    def block(self, x0: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              ctx: torch.Tensor, ctx_pos: torch.Tensor) -> torch.Tensor:
        """Block path: x0 [B, N, D] at positions [B, N] (P..P+N-1), context rows ctx [B, L, S, r + dR] at
        ctx_pos [B, S] (-1 = empty) -> G = RMSNorm(X; norm) [B, N, D]. Query t reads the context positions
        max(0, t - W + 1) .. P - 1 (spec §8 A14) and every block row."""
        W = self.cfg.mtp.sliding_window
        s, t = ctx_pos[:, None, :], positions[:, :, None]                               # [B, 1, S], [B, N, 1]
        valid = (s >= 0) & (s < positions[:, :1, None]) & (s > t - W)                    # [B, N, S]
        h = x0
        for j, layer in enumerate(self.layers):
            h = layer(h, positions, cos, sin, ctx[:, j], valid)
        return self.norm(h)

    def block_logits(self, target: nn.Module, anchors: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, ctx: torch.Tensor, ctx_pos: torch.Tensor) -> torch.Tensor:
        """The block [anchor, mask_1..mask_{n-1}] through the draft layers and the target's output head:
        anchors [B] at positions [B, n], context rows ctx [B, L, S, r + dR] at ctx_pos [B, S] ->
        uncapped logits U [B, n, V] (fp32, or fp64 in tests). Inference and training both run this."""
        B, n = positions.shape
        x0 = torch.cat((target.tok_embeddings(anchors)[:, None],
                        self.mask_embeddings[: n - 1].expand(B, -1, -1)), dim=1)            # [B, n, D]
        g = self.block(x0, positions, cos, sin, ctx, ctx_pos)                               # [B, n, D]
        u = F.linear(g, target.tok_embeddings.weight) if target.output is None else target.output(g)
        return u.float() if u.dtype != torch.float64 else u

    def _slot(self, u: torch.Tensor, y_prev: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft slot: uncapped logits u [B, V], previous token [B], state [B, R] -> (state, capped logits)."""
        s, bias = self.markov(y_prev, s)
        z, cap = u + bias, self.cfg.logit_softcap
        return s, (cap * torch.tanh(z / cap) if cap else z)

    def draft(self, logits: torch.Tensor, anchor: torch.Tensor, sample: DraftSampler
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Markov head, in sequence: logits U [B, N, V] (uncapped head outputs), anchor [B] ->
        drafts [B, N] and, for a sampled drafter, the distributions q [B, N, V] they were drawn from."""
        B, N, _ = logits.shape
        s = logits.new_zeros(B, self.cfg.mtp.markov_rank, dtype=self.markov.embed.weight.dtype)   # the head's dtype
        y, drafts, dists = anchor, [], []
        for i in range(N):   # sequential by definition: slot i's logits depend on the drafts before it
            s, z = self._slot(logits[:, i], y, s)
            y, q = sample(z)
            drafts.append(y)
            dists.append(q)
        return torch.stack(drafts, 1), (None if dists[0] is None else torch.stack(dists, 1))

    def forced_logits(self, logits: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Markov head with given inputs (training): logits U [B, N, V], prev [B, N] (the anchor, then the token
        before each later slot) -> the capped logits [B, N, V] that `draft` samples from when it drafts those."""
        s = logits.new_zeros(logits.shape[0], self.cfg.mtp.markov_rank, dtype=self.markov.embed.weight.dtype)
        out = []
        for i in range(logits.shape[1]):
            s, z = self._slot(logits[:, i], prev[:, i], s)
            out.append(z)
        return torch.stack(out, 1)


class DSparkDrafter:
    """Runs `ML4.mtp_dspark` for the target's requests: context path from the target's taps into the window
    cache, and the block + Markov head to propose drafts."""

    def __init__(self, target: nn.Module):
        if getattr(target, "mtp_dspark", None) is None:
            raise ConfigError("speculative method 'dspark': the checkpoint has no drafter "
                              "(params.json has no 'mtp' block)")
        self.target, self.model, self.cfg = target, target.mtp_dspark, target.cfg
        self.cache = DraftWindowCache.for_config(self.cfg, target.device)
        self.omega = rope_frequencies(self.cfg, target.lerope.alpha)

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.cfg.mtp.target_layer_ids

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.omega, positions.flatten(), self.target.dtype)

    @torch.no_grad()
    def observe(self, req: Hashable, taps: dict[int, torch.Tensor], positions: torch.Tensor) -> None:
        """Context path for target positions [T] (ascending) whose tokens are accepted: taps {layer: [T, D]}."""
        W = self.cfg.mtp.sliding_window
        self.observe_batch([req], {l: taps[l][-W:] for l in self.tap_layers}, positions[-W:],
                           [min(W, positions.numel())])

    @torch.no_grad()
    def observe_batch(self, reqs: list[Hashable], taps: dict[int, torch.Tensor], positions: torch.Tensor,
                      counts: list[int]) -> None:
        """The context path of several requests in one pass: taps {layer: [T, D]} at positions [T], where the
        next counts[i] rows (ascending positions) belong to reqs[i]. Only a request's newest `sliding_window`
        rows are ever read, so callers pass at most that many."""
        rows = self.model.context_rows({l: taps[l] for l in self.tap_layers}, *self._rope(positions))   # [L, T, w]
        for req, pos, r in zip(reqs, positions.split(counts), rows.split(counts, dim=1)):
            self.cache.write(req, pos, r)

    @torch.no_grad()
    def propose(self, req: Hashable, anchor: int, pos: int, n: int, sample: DraftSampler
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """n drafts (1 <= n <= block_size) after `anchor` at position `pos`: tokens [n] and q [n, V] (or None)."""
        dev = self.target.device
        drafts, q = self.propose_batch([req], torch.tensor([anchor], device=dev), torch.tensor([pos], device=dev),
                                       n, sample)
        return drafts[0], (None if q is None else q[0])

    @torch.no_grad()
    def propose_batch(self, reqs: list[Hashable], anchors: torch.Tensor, pos: torch.Tensor, n: int,
                      sample: DraftSampler) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One block forward for B requests: anchors [B] at positions pos [B] -> drafts [B, n] and q [B, n, V]
        (or None); `sample` sees the B rows of each draft slot at once."""
        if not 1 <= n <= self.cfg.mtp.block_size:
            raise ValueError(f"num_speculative_tokens: {n} drafts, the drafter's block_size allows "
                             f"1..{self.cfg.mtp.block_size}")
        dev = self.target.device
        anchors = anchors.to(dev)
        positions = pos.to(dev)[:, None] + torch.arange(n, device=dev)                      # [B, n]
        ctx, ctx_pos = zip(*(self.cache.read(r) for r in reqs))
        u = self.model.block_logits(self.target, anchors, positions, *self._rope(positions), torch.stack(ctx),
                                    torch.stack(ctx_pos))                                   # [B, n, V]
        return self.model.draft(u, anchors, sample)

    def truncate(self, req: Hashable, length: int) -> None:
        self.cache.truncate(req, length)

    def release(self, req: Hashable) -> None:
        self.cache.release(req)
