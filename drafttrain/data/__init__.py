"""Data: conversation/prompt sources, chat template -> input_ids + loss_mask, tokenized SFT datasets."""

from drafttrain.data.dataset import build_sft_dataset, split_heldout
from drafttrain.data.sources import (
    LoadStats,
    iter_json_array_records,
    load_conversations_jsonl,
    load_eval_prompts,
    load_gsm8k,
    load_mt_bench,
    load_sharegpt,
)
from drafttrain.data.template import TemplateError, prompt_ids, tokenize_conversation

__all__ = [
    "LoadStats",
    "TemplateError",
    "build_sft_dataset",
    "iter_json_array_records",
    "load_conversations_jsonl",
    "load_eval_prompts",
    "load_gsm8k",
    "load_mt_bench",
    "load_sharegpt",
    "prompt_ids",
    "split_heldout",
    "tokenize_conversation",
]
