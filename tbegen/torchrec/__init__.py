"""tbegen inside TorchRec: a compute kernel and sharder for TorchRec's sharded EmbeddingBagCollection
(docs/torchrec.md). Needs torchrec (`pip install tbegen[torchrec]`); `tbegen` itself does not."""

try:
    import torchrec  # noqa: F401
except ImportError as e:  # say what to install instead of a bare traceback from deep inside
    raise ImportError(
        "tbegen.torchrec needs torchrec (pip install 'tbegen[torchrec]'; on a CPU-only machine then "
        "replace fbgemm_gpu by fbgemm-gpu-cpu matched to torch, see docs/torchrec.md)"
    ) from e

from .kernel import (  # noqa: E402
    SHARDING_TYPES,
    TbegenEmbeddingBag,
    TbegenEmbeddingBagCollectionSharder,
    TbegenFusedOptimizer,
    TbegenOptions,
    TbegenPooledEmbeddingsLookup,
    TbegenShardedEmbeddingBagCollection,
)

__all__ = [
    "SHARDING_TYPES",
    "TbegenEmbeddingBag",
    "TbegenEmbeddingBagCollectionSharder",
    "TbegenFusedOptimizer",
    "TbegenOptions",
    "TbegenPooledEmbeddingsLookup",
    "TbegenShardedEmbeddingBagCollection",
]
