"""Data for private training.

- Poisson-sampled logical batches: ``PoissonBatchSampler`` draws the batches the
  subsampled-Gaussian accountants assume (each record independently with
  probability q; empty batches kept); ``DPDataLoader`` collates them into
  physical chunks; ``split_physical`` does the chunking.
- Sequences for next-item prediction (:class:`SequenceData`): MovieLens-100k or
  any interaction file preprocessed as in SASRec (one record per user), and
  next-word prediction on the packaged news corpus (one record per text chunk).
"""

from dptrain.data.news import load_news, news_articles_path, read_news_articles, tokenize
from dptrain.data.poisson import DPDataLoader, LogicalBatch, PoissonBatchSampler, split_physical
from dptrain.data.sequences import (
    SequenceData,
    load_interaction_file,
    load_movielens_100k,
    movielens_100k_path,
    preprocess_sasrec,
    read_interactions,
)

__all__ = [
    "DPDataLoader",
    "LogicalBatch",
    "PoissonBatchSampler",
    "SequenceData",
    "load_interaction_file",
    "load_movielens_100k",
    "load_news",
    "movielens_100k_path",
    "news_articles_path",
    "preprocess_sasrec",
    "read_interactions",
    "read_news_articles",
    "split_physical",
    "tokenize",
]
