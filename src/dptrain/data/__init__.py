"""Data loading for private training: Poisson-sampled logical batches.

``PoissonBatchSampler`` draws the batches the subsampled-Gaussian accountants
assume (each record independently with probability q; empty batches kept);
``DPDataLoader`` collates them into physical chunks; ``split_physical`` does
the chunking.
"""

from dptrain.data.poisson import DPDataLoader, LogicalBatch, PoissonBatchSampler, split_physical

__all__ = ["DPDataLoader", "LogicalBatch", "PoissonBatchSampler", "split_physical"]
