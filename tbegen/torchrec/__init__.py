"""tbegen inside TorchRec: a compute kernel and sharder for TorchRec's sharded EmbeddingBagCollection
(docs/torchrec.md). Needs torchrec (`pip install tbegen[torchrec]`); `tbegen` itself does not."""

from .kernel import (
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
