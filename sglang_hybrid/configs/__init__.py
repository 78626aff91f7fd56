from sglang_hybrid.configs.hybrid_linear_sparse import (
    ARCHITECTURE,
    MODEL_TYPE,
    ConfigError,
    HybridLinearSparseConfig,
)

__all__ = ["ARCHITECTURE", "MODEL_TYPE", "ConfigError", "HybridLinearSparseConfig"]
