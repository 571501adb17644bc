"""The node table: what the full ML4 costs per rank, from the real config, model and store code (no weights read).

Builds the `full` preset's ML4 on the meta device (model/config.py, model/ml4.py) and the KV stores the engine
uses (`ResidentKV`, `HiSparseKV` with its device arena) on the meta device too, and reports per rank:
  - weight bytes: FP8 as the checkpoint stores it (the loader's and `save_model`'s rule: 2-D tensors outside
    `NEVER_QUANTISED` are e4m3 + fp32 128 x 128 block scales, the rest bf16 / fp32), and all-bf16 (fp32 where the
    spec keeps fp32: router, SSMax, LeRoPE, indexer head weights);
  - device bytes per context token: without HiSparse (latent rows + indexer keys on the device) and with it
    (indexer keys only; the latent rows live in the host pool), for the fp8 (132-B record) and fp32 index caches;
  - HiSparse's fixed device working set per request (hot buffers + resident windows of the device arena);
  - the context one device of --device-gb GB holds after the weights;
at TP1 (one device) and at TP8 with DCP8 (one 8-device node: weights as `TensorParallel` shards them, rank 0's
share; each rank holds 1/8 of every context's latent rows and indexer keys), next to seed 000's published figures.

    python -m benchmarks.node_table [--device-gb 141] [--out benchmarks/results/node_table.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hisparse.kv.hisparse_kv import HiSparseKV
from hisparse.core.config import preset
from hisparse.kv.geometry import geometry
from hisparse.kv.index_cache import INDEX_CACHES
from hisparse.kv.resident import ResidentKV
from hisparse.model.ml4 import ML4
from hisparse.model.weights import NEVER_QUANTISED, held_dtype, to_checkpoint_name
from hisparse.parallel.tp import TensorParallel

GB, GIB = 10**9, 2**30
LAYOUT = "fp8_ds_mla"
NODE = 8   # devices per node: TP8, DCP8

# Seed 000 (vLLM's "Day 0 support for Mistral Large 4" blog), figures quoted as published
SEED_000 = {
    "fp8_checkpoint_bytes": "about 1,061 GB (about 1.1 TB of GPU memory on one 8-GPU node)",
    "fp8_weights_per_gpu_tp8": "about 128 GiB (NVFP4: about 76 GiB)",
    "fp8_routed_experts_per_gpu_tp8": "about 125 GiB",
    "kv_bytes_per_token": "47,136 = 41,328 MLA latent + 5,808 indexer",
    "kv_capacity_tp8_fp8": "2.38M tokens (DCP8: 18.88M)",
    "hisparse_capacity_gb300_tp4_nvfp4": "1.97M tokens on the GPU alone; 8.77M admitted / 11.25M steady state "
                                         "with a 440 GiB host pool",
}


def weight_bytes(cfg, tp: int = 1) -> dict:
    """Parameter count and bytes of the meta-built model (rank 0's share under tensor parallelism over `tp`
    ranks): FP8 as stored and all-bf16, split into routed experts, the DSpark drafter and the rest."""
    with torch.device("meta"):
        model = ML4(cfg)
    if tp > 1:
        TensorParallel(0, tp).shard(model)
    block = cfg.quantization.weight_block_size if cfg.quantization else (128, 128)
    out = {part: {"params": 0, "fp8_bytes": 0, "bf16_bytes": 0} for part in ("routed_experts", "drafter", "rest")}
    for pname, p in model.named_parameters():
        name = to_checkpoint_name(pname)
        part = "drafter" if name.startswith("mtp_dspark.") else "routed_experts" if ".experts." in name else "rest"
        n = p.numel()
        if p.dim() == 2 and not NEVER_QUANTISED.search(name):     # e4m3 + one fp32 scale per block
            fp8 = n + 4 * -(-p.shape[0] // block[0]) * -(-p.shape[1] // block[1])
        else:
            fp8 = n * (torch.float32.itemsize if held_dtype(name, torch.bfloat16) == torch.float32 else 2)
        out[part]["params"] += n
        out[part]["fp8_bytes"] += fp8
        out[part]["bf16_bytes"] += n * held_dtype(name, torch.bfloat16).itemsize
    out["total"] = {k: sum(v[k] for v in out.values()) for k in ("params", "fp8_bytes", "bf16_bytes")}
    return out


def per_token_bytes(cfg, index_cache: str) -> dict:
    """Device bytes per context token from the stores themselves (built on the meta device)."""
    resident = ResidentKV(cfg, LAYOUT, device="meta", page_tokens=64, index_cache=index_cache)
    hisparse = HiSparseKV(cfg, LAYOUT, device="meta", host_pool_gib=0.01, page_tokens=64,
                          index_cache=index_cache)
    P = resident.page_tokens
    index = resident.index_keys.bytes_per_page() // P
    assert hisparse.index_keys.bytes_per_page() // P == index       # both stores keep the same keys
    arena = hisparse.arena
    arena.fit(1, 0)                                                  # one request's slot, no step rows
    working_set = (arena.n_rows - 2) * arena.row_bytes               # its hot buffers + windows (less zero/scratch)
    return {"index_bytes_per_token_layer": resident.index_keys.bytes_per_token_layer(),
            "without_hisparse": resident.rows.bytes_per_page() // P + index,
            "with_hisparse": index,
            "hisparse_working_set_per_request": working_set}


def context_after_weights(device_bytes: int, weights: int, per_token: int, fixed: int = 0) -> dict:
    """Tokens of context one device holds once the weights (and a request's fixed working set) are in."""
    free = device_bytes - weights - fixed
    return {"tokens": max(0, int(free // per_token)), "free_bytes": free,
            "tokens_per_free_gib": int(GIB // per_token)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device-gb", type=float, default=141.0, help="device memory in GB (default: H200, 141)")
    ap.add_argument("--out", default="benchmarks/results/node_table.json")
    args = ap.parse_args()
    cfg = preset("full")
    device = int(args.device_gb * GB)
    w, w8 = weight_bytes(cfg), weight_bytes(cfg, NODE)
    g = geometry(cfg, LAYOUT)
    kv = {form: per_token_bytes(cfg, form) for form in INDEX_CACHES}
    tp1 = {"weights": w, "kv": kv, "context_after_fp8_weights": {
        form: {"without_hisparse": context_after_weights(device, w["total"]["fp8_bytes"],
                                                         kv[form]["without_hisparse"]),
               "with_hisparse_one_request": context_after_weights(
                   device, w["total"]["fp8_bytes"], kv[form]["with_hisparse"],
                   kv[form]["hisparse_working_set_per_request"])} for form in INDEX_CACHES}}
    # TP8 DCP8: a rank holds 1/8 of the context's rows and keys (rank 0 at most one token more per 8), and its own
    # HiSparse working set for its shard
    node = {form: {"without_hisparse": context_after_weights(device, w8["total"]["fp8_bytes"],
                                                             kv[form]["without_hisparse"] / NODE),
                   "with_hisparse_one_request": context_after_weights(
                       device, w8["total"]["fp8_bytes"], kv[form]["with_hisparse"] / NODE,
                       kv[form]["hisparse_working_set_per_request"])} for form in INDEX_CACHES}
    tp8 = {"weights": w8, "context_after_fp8_weights_dcp8": node,
           "ratio_node_context_hisparse_vs_resident": {
               form: node[form]["with_hisparse_one_request"]["tokens"] / node[form]["without_hisparse"]["tokens"]
               for form in INDEX_CACHES}}
    result = {"preset": "full", "layout": LAYOUT, "device_bytes": device,
              "params_json_layers": cfg.n_layers, "kv_owner_layers": g.kv_owner_layers,
              "index_owner_layers": g.index_owner_layers, "TP1": tp1, "TP8_DCP8": tp8, "seed_000": SEED_000,
              "ratio_tokens_per_device_byte_hisparse_vs_resident": {
                  form: kv[form]["without_hisparse"] / kv[form]["with_hisparse"] for form in INDEX_CACHES}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"wrote {args.out}")


def table(r: dict) -> str:
    """The node table in markdown."""
    w, kv, w8 = r["TP1"]["weights"], r["TP1"]["kv"], r["TP8_DCP8"]["weights"]
    gb = lambda b: f"{b / GB:,.1f} GB ({b / GIB:,.1f} GiB)"
    ctx, node = r["TP1"]["context_after_fp8_weights"], r["TP8_DCP8"]["context_after_fp8_weights_dcp8"]
    ratio = r["TP8_DCP8"]["ratio_node_context_hisparse_vs_resident"]

    def held(c: dict) -> str:
        if c["free_bytes"] <= 0:
            return f"0: the weights exceed the device by {-c['free_bytes'] / GB:,.0f} GB"
        return f"{c['tokens']:,} tokens"

    def per_token(x: float) -> str:
        return f"{x:,.0f}" if x == int(x) else f"{x:,.1f}"
    rows = [
        ("parameters", f"{w['total']['params'] / 1e9:,.1f} B (routed experts "
                       f"{w['routed_experts']['params'] / 1e9:,.1f} B, drafter {w['drafter']['params'] / 1e9:,.2f} B)",
         f"{w8['total']['params'] / 1e9:,.1f} B (routed experts {w8['routed_experts']['params'] / 1e9:,.1f} B)",
         "about 1T"),
        ("weights, FP8 as stored", gb(w["total"]["fp8_bytes"]), gb(w8["total"]["fp8_bytes"]),
         SEED_000["fp8_checkpoint_bytes"] + "; " + SEED_000["fp8_weights_per_gpu_tp8"] + " per GPU at TP8"),
        ("weights, bf16", gb(w["total"]["bf16_bytes"]), gb(w8["total"]["bf16_bytes"]), ""),
        ("device B / context token, all resident, fp8 index cache", f"{kv['fp8']['without_hisparse']:,}",
         per_token(kv["fp8"]["without_hisparse"] / NODE), SEED_000["kv_bytes_per_token"]),
        ("device B / context token, all resident, fp32 index cache", f"{kv['fp32']['without_hisparse']:,}",
         per_token(kv["fp32"]["without_hisparse"] / NODE), ""),
        ("device B / context token, HiSparse, fp8 index cache", f"{kv['fp8']['with_hisparse']:,}",
         per_token(kv["fp8"]["with_hisparse"] / NODE), "5,808 (the indexer part)"),
        ("device B / context token, HiSparse, fp32 index cache", f"{kv['fp32']['with_hisparse']:,}",
         per_token(kv["fp32"]["with_hisparse"] / NODE), ""),
        ("HiSparse device working set per request (hot buffers + windows)",
         f"{kv['fp8']['hisparse_working_set_per_request'] / 1e6:,.1f} MB",
         f"{kv['fp8']['hisparse_working_set_per_request'] / 1e6:,.1f} MB", ""),
        ("context tokens per device GiB, resident / HiSparse (fp8 index)",
         f"{ctx['fp8']['without_hisparse']['tokens_per_free_gib']:,} / "
         f"{ctx['fp8']['with_hisparse_one_request']['tokens_per_free_gib']:,} "
         f"({r['ratio_tokens_per_device_byte_hisparse_vs_resident']['fp8']:.2f}x)",
         f"{node['fp8']['without_hisparse']['tokens_per_free_gib']:,} / "
         f"{node['fp8']['with_hisparse_one_request']['tokens_per_free_gib']:,}", ""),
        (f"context one {r['device_bytes'] / GB:,.0f} GB device (TP1) / one {NODE}-device node (TP8 DCP8) holds "
         "after FP8 weights", held(ctx["fp8"]["without_hisparse"]), held(node["fp8"]["without_hisparse"]),
         SEED_000["kv_capacity_tp8_fp8"] + " at TP8"),
        ("the same with HiSparse (fp8 index cache, one request)", held(ctx["fp8"]["with_hisparse_one_request"]),
         f"{held(node['fp8']['with_hisparse_one_request'])} (**{ratio['fp8']:.2f}x**)",
         SEED_000["hisparse_capacity_gb300_tp4_nvfp4"] + " (GB300, TP4, NVFP4)"),
    ]
    lines = ["| per rank | TP1 | TP8 DCP8 | seed 000 |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
