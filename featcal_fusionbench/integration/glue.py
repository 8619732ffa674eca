"""GLUE for FusionBench's FLAN-T5 runs, from the hub id GLUE has today.

FusionBench 0.2.33 loads GLUE as ``load_dataset("glue", name)``
(``fusion_bench/tasks/flan_t5_text_generation/glue_load_dataset.py``); the hub answers "not found" for the bare id
since the dataset moved to ``nyu-mll/glue`` (docs/compatibility.md). ``load_glue_dataset`` is FusionBench's
function with that id changed: the same prompt templates and preprocessors (FusionBench's own), the same tokenized
cache (``{cache_dir}/flan-t5/_load_{name}_dataset_cached``, shared with FusionBench's task pools), the same
arguments. Drop it once a FusionBench release loads ``nyu-mll/glue`` itself.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from datasets import load_dataset, load_from_disk
from fusion_bench.tasks.flan_t5_text_generation.glue_preprocessors import glue_processors
from fusion_bench.tasks.flan_t5_text_generation.glue_prompt_templates import glue_prompt_templates
from fusion_bench.utils import instantiate
from omegaconf import DictConfig

log = logging.getLogger(__name__)

GLUE_HUB_ID = "nyu-mll/glue"


def _tokenized_glue(name: str, tokenizer):
    if isinstance(tokenizer, (DictConfig, dict)):
        tokenizer = instantiate(tokenizer)
    dataset = load_dataset(GLUE_HUB_ID, name)
    preprocessor = glue_processors[name](
        template=glue_prompt_templates[name],
        tokenizer=tokenizer,
        tokenizer_kwargs={"padding": "max_length", "truncation": True, "return_tensors": "pt"},
    )
    return dataset.map(preprocessor, batched=True, remove_columns=dataset["train"].column_names, num_proc=1)


def load_glue_dataset(name: str, tokenizer, cache_dir: Optional[str] = "outputs/cache", split: Optional[str] = None):
    """One GLUE task (all splits, or ``split``) prompted and tokenized as FusionBench's FLAN-T5 experts were trained."""
    if name not in glue_processors:
        raise ValueError(f"GLUE task {name!r}: FusionBench has prompts for {sorted(glue_processors)}")
    if cache_dir is None:
        dataset = _tokenized_glue(name, tokenizer)
    else:
        cache_path = os.path.join(cache_dir, "flan-t5", f"_load_{name}_dataset_cached")
        if os.path.exists(cache_path):
            dataset = load_from_disk(cache_path)
        else:
            dataset = _tokenized_glue(name, tokenizer)
            log.info("saving GLUE %s to %s", name, cache_path)
            dataset.save_to_disk(cache_path)
    return dataset if split is None else dataset[split]
