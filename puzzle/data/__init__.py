"""Tokenizers and prompt data: ``build_tokenizer`` (ByteLevelTokenizer | HuggingFaceTokenizer),
``load_prompt_dataset`` (local JSONL / Parquet / Arrow through HF datasets) and ``PromptLoader``
(deterministic, resumable, DP-sharded). ``bundled_prompts_path()``: a tiny English prompt set."""

from puzzle.data.prompts import (PromptBatch, PromptDataError, PromptDataset, PromptLoader, PromptStats,
                                 bundled_prompts_path, load_prompt_dataset)
from puzzle.data.tokenizers import ByteTokenizer, HFTokenizer, build_tokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "build_tokenizer", "PromptBatch", "PromptDataError",
           "PromptDataset", "PromptLoader", "PromptStats", "bundled_prompts_path", "load_prompt_dataset"]
