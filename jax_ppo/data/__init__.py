"""Data: prompt datasets with a deterministic, resumable order, SFT examples, and records read
from JSONL / Parquet files or local Hugging Face `datasets` folders, each checked by one path
(`jax_ppo.data.records`) however it arrives; and the seeded arithmetic task
(`jax_ppo.data.arithmetic`), problems and files with a verifiable answer."""

from jax_ppo.data.files import (
    check_data_path,
    iter_records,
    read_preference_records,
    read_prompt_records,
    read_prompts,
    read_records,
    read_sft_examples,
    read_sft_records,
)
from jax_ppo.data.preferences import explicit_preference
from jax_ppo.data.prompts import PromptDataset
from jax_ppo.data.records import Record, preference_record, prompt_record, sft_record

__all__ = [
    "PromptDataset",
    "Record",
    "check_data_path",
    "explicit_preference",
    "iter_records",
    "preference_record",
    "prompt_record",
    "read_preference_records",
    "read_prompt_records",
    "read_prompts",
    "read_records",
    "read_sft_examples",
    "read_sft_records",
    "sft_record",
]
