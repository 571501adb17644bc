"""Peak host memory of streaming weight loading (and of a forward) on an FP8 checkpoint a few hundred MB large.

    python -m benchmarks.weights.load_memory [--dir DIR] [--experts 16] [--expert-hidden 2048] [--dtype bfloat16]

Writes (once) a checkpoint with the tiny preset's layer layout and wider MoE experts, FP8 e4m3 with 128 x 128
block scales (random bytes: the figures do not depend on the values), then loads it in a fresh subprocess per
dtype and reports, from /proc/self/status, the peak RSS above the pre-load baseline next to the bytes the model
holds: what loading costs beyond the loaded model itself is the streaming transient (one tensor region and its
cast), not a second copy of the model. `--forward` adds a 32-token forward and its peak.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

MIB = 1 << 20
RESULTS = Path(__file__).resolve().parents[1] / "results" / "weights" / "load_memory.json"


def write_checkpoint(out: Path, experts: int, expert_hidden: int, block: int = 128) -> Path:
    """params.json + consolidated.safetensors; linears FP8 (random non-NaN bytes, scales 2^-10), the rest bf16/fp32
    as a release stores them. Generated without building the model, so it takes seconds."""
    import torch
    from safetensors.torch import save_file

    from hisparse.core.config import ModelConfig, preset_params
    from hisparse.model.ml4 import ML4
    from hisparse.model.weights import NEVER_QUANTISED, QSCALE, checkpoint_dtype, to_checkpoint_name

    params = preset_params("tiny")
    params.update({"dim": 512, "hidden_dim": 2048, "kv_lora_rank": 128, "n_heads": 8, "n_kv_heads": 8,
                   "qk_nope_head_dim": 64, "v_head_dim": 64, "qk_rope_head_dim": 64, "index_head_dim": 128,
                   "quantization": {"qformat_weight": "fp8_e4m3", "qscheme_weight": "BLOCK",
                                    "weight_block_size": [block, block], "qscheme_act": "NO_SCALES"}})
    params["moe"] = dict(params["moe"], num_experts=experts, expert_hidden_dim=expert_hidden)
    params["mtp"] = dict(params["mtp"], hidden_dim=2048)
    cfg = ModelConfig.from_params(params)
    with torch.device("meta"):
        model = ML4(cfg)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save(out)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for pname, p in model.named_parameters():
        name = to_checkpoint_name(pname)
        if p.dim() == 2 and not NEVER_QUANTISED.search(name):
            mag = torch.randint(0, 0x7F, p.shape, generator=g, dtype=torch.uint8)        # 0x7F would be NaN
            sign = torch.randint(0, 2, p.shape, generator=g, dtype=torch.uint8) << 7
            tensors[name] = (mag | sign).view(torch.float8_e4m3fn)
            tensors[name + QSCALE] = torch.full((-(-p.shape[0] // block), -(-p.shape[1] // block)), 2.0 ** -10)
        else:
            tensors[name] = (torch.randn(p.shape, generator=g) * 0.02).to(checkpoint_dtype(name))
    save_file(tensors, str(out / "consolidated.safetensors"))
    return out


PROBE = r"""
import json, sys, torch
torch.set_num_threads(1)
from pathlib import Path
from hisparse.core.batch import Segment
from hisparse.core.config import ModelConfig
from hisparse.kv.resident import ResidentKV
from hisparse.model.ml4 import ML4
from hisparse.model.weights import load_model

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

ckpt, dtype, forward = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3] == "1"
with torch.device("meta"):   # warm-up: the first meta build imports ~150 MB of torch machinery, once per process
    ML4(ModelConfig.load(Path(ckpt)))
base = status("VmRSS:")
model = load_model(ckpt, dtype=dtype, progress=False)
out = {"baseline": base, "load_peak": status("VmHWM:") - base,
       "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
       "dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})}
if forward:
    ids = torch.arange(1, 33)
    model(ids, [Segment(0, 0, len(ids))], ResidentKV(model.cfg, layout=None, dtype=model.dtype))
    out["forward_peak"] = status("VmHWM:") - base
print(json.dumps(out))
"""


def probe(ckpt: Path, dtype: str, forward: bool) -> dict:
    """Load `ckpt` in a fresh process: peak RSS above the pre-load baseline, bytes of the loaded parameters."""
    proc = subprocess.run([sys.executable, "-c", PROBE, str(ckpt), dtype, "1" if forward else "0"],
                          capture_output=True, text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return json.loads(proc.stdout.splitlines()[-1])


def tensor_sizes(ckpt: Path) -> tuple[int, int]:
    """(checkpoint bytes, largest tensor bytes)."""
    from safetensors import safe_open
    with safe_open(ckpt / "consolidated.safetensors", "pt") as f:
        sizes = [f.get_slice(k).get_shape() for k in f.keys()]
        dtypes = [f.get_slice(k).get_dtype() for k in f.keys()]
    width = {"F8_E4M3": 1, "BF16": 2, "F32": 4}
    nbytes = [width[d] * _numel(s) for d, s in zip(dtypes, sizes)]
    return sum(nbytes), max(nbytes)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/hisparse-load-memory", help="checkpoint folder (default: %(default)s)")
    ap.add_argument("--experts", type=int, default=16, help="routed experts per MoE layer (default: %(default)s)")
    ap.add_argument("--expert-hidden", type=int, default=2048, help="expert hidden dim (default: %(default)s)")
    ap.add_argument("--dtypes", default="bfloat16,float32", help="compute dtypes to load in (default: %(default)s)")
    ap.add_argument("--forward", action="store_true", help="also run a 32-token forward and report its peak")
    ap.add_argument("--out", default=str(RESULTS), help="result JSON (default: %(default)s)")
    args = ap.parse_args()
    ckpt = Path(args.dir)
    if not (ckpt / "consolidated.safetensors").exists():
        write_checkpoint(ckpt, args.experts, args.expert_hidden)
    size, largest = tensor_sizes(ckpt)
    print(f"checkpoint {size / MIB:.1f} MiB, largest tensor {largest / MIB:.2f} MiB")
    result = {"checkpoint_bytes": size, "largest_tensor_bytes": largest, "experts": args.experts,
              "expert_hidden": args.expert_hidden, "dtypes": {}}
    for dtype in args.dtypes.split(","):
        r = result["dtypes"][dtype] = probe(ckpt, dtype, args.forward)
        line = (f"{dtype}: parameters {r['param_bytes'] / MIB:.1f} MiB {r['dtypes']}, load peak above baseline "
                f"{r['load_peak'] / MIB:.1f} MiB (beyond the parameters {(r['load_peak'] - r['param_bytes']) / MIB:.1f}"
                " MiB)")
        if "forward_peak" in r:
            line += f", forward peak {r['forward_peak'] / MIB:.1f} MiB"
        print(line)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
