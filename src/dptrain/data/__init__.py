"""Data for private training.

- Poisson-sampled logical batches: ``PoissonBatchSampler`` draws the batches the
  subsampled-Gaussian accountants assume (each record independently with
  probability q; empty batches kept); ``DPDataLoader`` collates them into
  physical chunks; ``split_physical`` does the chunking.
- Sequences for next-item prediction (:class:`SequenceData`): MovieLens-100k or
  any interaction file preprocessed as in SASRec (one record per user), and
  next-word prediction on the packaged news corpus (one record per text chunk).
- Text classification (:class:`TextClassificationData`): Rotten Tomatoes,
  Women's Clothing reviews or any CSV/TSV/JSONL/Parquet, with seeded
  stratified splits; the packaged MiniLM encoder's path and tokenizer.
- Language modelling: E2E table-to-text pairs split by table (:func:`load_e2e`),
  masked-LM chunks of the news corpus with BERT masking (:func:`load_mlm_data`,
  :func:`mask_tokens`), and BPE / WordPiece tokenizers trained on the training
  split (:func:`train_tokenizer`).
- Fine-tuning a causal LM on the user's records (:mod:`dptrain.data.lm_records`):
  prompt/completion, text or chat records from JSONL/CSV/Parquet
  (:func:`read_lm_records`), tokenized with the loss on the completion or the
  assistant turns only (:func:`tokenize_lm_records`), split by record or user
  (:func:`split_lm_records`) and padded into chunks (:func:`collate_lm`).
"""

from dptrain.data.e2e import E2ESplits, load_e2e, read_table_text
from dptrain.data.lm_records import (
    LMExamples,
    LMRecords,
    collate_lm,
    read_lm_records,
    split_lm_records,
    tokenize_lm_records,
)
from dptrain.data.mlm import MLMData, load_mlm_data, mask_tokens
from dptrain.data.news import load_news, news_articles_path, read_news_articles, tokenize
from dptrain.data.poisson import (
    ChunkUnits,
    DPDataLoader,
    LogicalBatch,
    PoissonBatchSampler,
    order_for_chunks,
    pack_units,
    split_physical,
)
from dptrain.data.sequences import (
    SequenceData,
    load_interaction_file,
    load_movielens_100k,
    movielens_100k_path,
    preprocess_sasrec,
    read_interactions,
)
from dptrain.data.text_classification import (
    TextClassificationData,
    load_minilm_tokenizer,
    load_rotten_tomatoes,
    load_text_file,
    load_womens_clothing,
    minilm_path,
    tokenize_texts,
)
from dptrain.data.tokenizer import load_tokenizer, train_tokenizer

__all__ = [
    "ChunkUnits",
    "DPDataLoader",
    "E2ESplits",
    "LMExamples",
    "LMRecords",
    "LogicalBatch",
    "MLMData",
    "PoissonBatchSampler",
    "SequenceData",
    "TextClassificationData",
    "collate_lm",
    "load_e2e",
    "load_interaction_file",
    "load_minilm_tokenizer",
    "load_mlm_data",
    "load_movielens_100k",
    "load_news",
    "load_rotten_tomatoes",
    "load_text_file",
    "load_tokenizer",
    "load_womens_clothing",
    "mask_tokens",
    "minilm_path",
    "movielens_100k_path",
    "news_articles_path",
    "order_for_chunks",
    "pack_units",
    "preprocess_sasrec",
    "read_interactions",
    "read_lm_records",
    "read_news_articles",
    "read_table_text",
    "split_lm_records",
    "split_physical",
    "tokenize",
    "tokenize_lm_records",
    "tokenize_texts",
    "train_tokenizer",
]
