"""tbegen: fused embedding-table training kernels generated from small optimizer specs.

The public face is `tbegen.TableBatchedEmbeddingBags` (tbegen/module.py); the command line is
`tbegen` (tbegen/cli.py). See README.md.
"""

__version__ = "0.1.0"

__all__ = ["TableBatchedEmbeddingBags", "__version__"]


def __getattr__(name):
    # Imported lazily so that `tbegen render/check/list` never need torch (`validate` imports it
    # only to run the reference: tbegen/reference_check.py).
    if name == "TableBatchedEmbeddingBags":
        from .module import TableBatchedEmbeddingBags

        return TableBatchedEmbeddingBags
    if name == "SplitTableBatchedEmbeddingBagsCodegen":  # FBGEMM's interface: tbegen/fbgemm_compat.py
        from .fbgemm_compat import SplitTableBatchedEmbeddingBagsCodegen

        return SplitTableBatchedEmbeddingBagsCodegen
    raise AttributeError(f"module 'tbegen' has no attribute {name!r}")
