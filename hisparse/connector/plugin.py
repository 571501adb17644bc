"""The `vllm.general_plugins` entry point: teaches vLLM the ML4 architecture (run in every vLLM process)."""

from __future__ import annotations


def register() -> None:
    """Register the model class (lazily, by name), the params.json parser and the architecture's config hook.

    vLLM may call plugins several times per process; every step here is idempotent."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.transformers_utils.config import register_config_parser

    from .vllm_config import ARCHITECTURE, HiSparseConfigParser, HiSparseModelConfig

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, "hisparse.connector.model:HiSparseML4ForCausalLM")
    # Replaces vLLM's "mistral" parser by a subclass that only intercepts ML4 params.json (see vllm_config).
    register_config_parser("mistral")(HiSparseConfigParser)
    MODELS_CONFIG_MAP[ARCHITECTURE] = HiSparseModelConfig
    _unreserve_connector_name()


def _unreserve_connector_name() -> None:
    """vLLM 0.32 treats any connector *named* HiSparseConnector as its own in-tree HiSparse (CUDA-only, V2
    runner, its sparse-MLA kernels), whatever `kv_connector_module_path` says: VllmConfig asks
    `KVTransferConfig.has_connector("HiSparseConnector")`. Answer False for ours (module hisparse.connector),
    so that vLLM loads it as the out-of-tree connector it is; every other query is unchanged."""
    from vllm.config.kv_transfer import KVTransferConfig

    from .vllm_config import CONNECTOR, CONNECTOR_MODULE

    original = KVTransferConfig.has_connector
    if getattr(original, "hisparse_patched", False):
        return

    def has_connector(self, connector_name: str) -> bool:
        if connector_name == CONNECTOR and self.kv_connector_module_path == CONNECTOR_MODULE:
            return False
        return original(self, connector_name)

    has_connector.hisparse_patched = True
    KVTransferConfig.has_connector = has_connector
