"""How vLLM sees an ML4 checkpoint: a config parser for Mistral-native params.json and a per-architecture hook.

vLLM auto-detects a folder with consolidated*.safetensors + params.json as config format "mistral" and maps any
MoE params.json with shared experts to its own MistralLarge3 (DeepSeek-V3) model, which is not ML4. The parser
registered by the plugin answers for format "mistral": an ML4 params.json (it has the per-layer
`kv_source_layers` / `index_source_layers` lists) becomes a config whose architecture is hisparse's; anything
else goes to vLLM's own Mistral parser unchanged. No config.json is written or needed.

The hook (vLLM's `MODELS_CONFIG_MAP`, run once while the engine config is built, before any engine starts)
checks that the HiSparseConnector is configured with valid settings and turns vLLM's prefix caching off:
hisparse must compute every position itself, since the latent rows live in its own store, not vLLM's blocks.
On a CUDA device it also makes vLLM run eager (`enforce_eager`: no CUDA graph capture, no torch.compile) and
limits vLLM's own (dummy-layer) KV cache to the blocks max_num_seqs requests of max_model_len tokens need.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import PreTrainedConfig
from vllm.logger import init_logger
from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.transformers_utils.config import MistralConfigParser

from ..kv.settings import KVSettings
from ..core.config import ModelConfig
from .settings import HiSparseConfigError

ARCHITECTURE = "HiSparseML4ForCausalLM"
MODEL_TYPE = "hisparse_ml4"
CONNECTOR = "HiSparseConnector"
CONNECTOR_MODULE = "hisparse.connector"
MIN_CUDA_BLOCK = 16   # tokens per KV block: vLLM's CUDA default, the smallest its CUDA attention backends use

logger = init_logger(f"vllm.{__name__}")   # under vLLM's logger, which has its handler


def is_ml4_params(params: dict[str, Any]) -> bool:
    return "kv_source_layers" in params and "index_source_layers" in params


def hf_config(params: dict[str, Any]) -> PreTrainedConfig:
    """The HF-style config vLLM's ModelConfig reads (sizes, dtype, context) for an ML4 params.json."""
    cfg = ModelConfig.from_params(params)   # validates; errors name the params.json key
    return PreTrainedConfig.from_dict({
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": 1, "head_dim": cfg.latent_dim, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tied_embeddings,
        "dtype": "float32",    # hisparse's reference compute dtype; --dtype overrides
    })


class HiSparseConfigParser(MistralConfigParser):
    """Format "mistral": ML4 params.json -> hisparse's architecture; other Mistral checkpoints unchanged."""

    def parse(self, model: str | Path, trust_remote_code: bool, revision: str | None = None,
              code_revision: str | None = None, **kwargs) -> tuple[dict, PreTrainedConfig]:
        path = Path(model) / "params.json"
        params = json.loads(path.read_text()) if path.is_file() else {}
        if not is_ml4_params(params):
            return super().parse(model, trust_remote_code, revision, code_revision, **kwargs)
        return params, hf_config(params)


class HiSparseModelConfig(VerifyAndUpdateConfig):
    """vLLM per-architecture hook (`verify_and_update_config`), run while the engine config is built."""

    @staticmethod
    def verify_and_update_config(vllm_config) -> None:
        kvt = vllm_config.kv_transfer_config
        if kvt is None or kvt.kv_connector != CONNECTOR or kvt.kv_connector_module_path != CONNECTOR_MODULE:
            raise HiSparseConfigError(
                f"{ARCHITECTURE} runs its sparse attention through hisparse's KV store: start vLLM with "
                f"--kv-transfer-config '{{\"kv_connector\":\"{CONNECTOR}\",\"kv_connector_module_path\":"
                f"\"{CONNECTOR_MODULE}\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":"
                "{\"host_pool_gib\":8}}'")
        KVSettings.from_extra_config(kvt.kv_connector_extra_config)
        cuda = vllm_config.device_config.device_type == "cuda"
        if cuda and not vllm_config.model_config.enforce_eager:
            logger.info("hisparse: running eager (no CUDA graphs, no torch.compile): the plugin's forward does "
                        "host-side bookkeeping every step and returns zeros in vLLM's profile run, which a captured "
                        "graph would replay as wrong output")
            vllm_config.model_config.enforce_eager = True
        cc = vllm_config.cache_config
        if cuda and cc.num_gpu_blocks_override is None:
            # the dummy layer's blocks only identify requests: as few as max_num_seqs requests of max_model_len
            # tokens need, counted in the smallest CUDA block (any larger block size only adds room)
            cc.num_gpu_blocks_override = vllm_config.scheduler_config.max_num_seqs * -(
                -vllm_config.model_config.max_model_len // MIN_CUDA_BLOCK)
            logger.info("hisparse: vLLM's own KV cache (one dummy layer that holds no ML4 rows) limited to %d "
                        "blocks", cc.num_gpu_blocks_override)
        if vllm_config.cache_config.enable_prefix_caching:
            logger.info("hisparse: disabling vLLM's own prefix caching (the connector caches latent rows in the host "
                        "pool)")
            vllm_config.cache_config.enable_prefix_caching = False
