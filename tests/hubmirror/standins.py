"""Tiny stand-ins of the paper's hub repositories, under their real ids, for the hub mirror (``server.py``).

``python tests/hubmirror/standins.py FOLDER`` writes them; ``build(FOLDER)`` does the same from a test. Each stand-in
keeps its repository's structure and schema: the file names the clients ask for, the model configs' classes and
fields (small widths and depths), the tokenizers' and processors' files, the datasets' configs, splits, columns,
feature types and class counts, with a few rows per split. Sources of each schema are in SOURCES below and in
docs/compatibility.md ("The hub mirror"). Weights are random; the models only have to run.
"""

from __future__ import annotations

import json
import zlib
import shutil
import sys
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch

# Where each stand-in's schema was read (2026-11-26).
SOURCES = {
    "openai/clip-vit-base-patch32": "hub file list and config.json (CLIPModel, vision patch 32 / image 224, "
                                    "projection_dim 512, text vocab 49408); FusionBench's CLIPVisionModelPool "
                                    "loads it with snapshot_download (fusion_bench/utils/modelscope.py)",
    "tanganke/clip-vit-base-patch32_<task>": "FusionBench's CLIPVisionModelPool/clip-vit-base-patch32_TA8.yaml: "
                                             "CLIPVisionModel checkpoints, one per task",
    "image datasets": "FusionBench's dataset/image_classification/{train,test}/*.yaml (ids, configs, splits); "
                      "columns image / label as its ImageClassificationDataset reads them; class counts from "
                      "fusion_bench.tasks.clip_classification.get_classnames_and_templates",
    "google/flan-t5-base, tanganke/flan-t5-base_glue-<task>": "FusionBench's model/flan-t5/*.yaml "
                                                              "(AutoModelForSeq2SeqLM, AutoTokenizer)",
    "nyu-mll/glue": "the hub dataset card's dataset_info (configs, splits, columns, ClassLabel names); "
                    "FusionBench's glue_preprocessors.py reads the same columns",
}

TA8 = ["sun397", "stanford-cars", "resisc45", "eurosat", "svhn", "gtsrb", "mnist", "dtd"]
# FusionBench task name -> (hub dataset id, config or None), after the renames of docs/compatibility.md
IMAGE_DATASETS = {
    "sun397": ("tanganke/sun397", None), "stanford-cars": ("tanganke/stanford_cars", None),
    "resisc45": ("tanganke/resisc45", None), "eurosat": ("tanganke/eurosat", None),
    "svhn": ("ufldl-stanford/svhn", "cropped_digits"), "gtsrb": ("tanganke/gtsrb", None),
    "mnist": ("ylecun/mnist", "mnist"), "dtd": ("tanganke/dtd", None),
}
IMAGE_SPLITS = {"train": 8, "test": 8}
# ufldl-stanford/svhn's cropped_digits also has `extra`; four tanganke datasets also hold corrupted test sets
CORRUPTIONS = ["contrast", "gaussian_noise", "impulse_noise", "jpeg_compression", "motion_blur", "pixelate", "spatter"]
EXTRA_SPLITS = {"svhn": {"extra": 4}, **{task: {c: 2 for c in CORRUPTIONS}
                                         for task in ("stanford-cars", "resisc45", "eurosat", "gtsrb")}}
# nyu-mll/glue: config -> (columns other than label / idx, label names or None for STS-B's float score, splits)
GLUE = {
    "cola": (["sentence"], ["unacceptable", "acceptable"], ["train", "validation", "test"]),
    "mnli": (["premise", "hypothesis"], ["entailment", "neutral", "contradiction"],
             ["train", "validation_matched", "validation_mismatched", "test_matched", "test_mismatched"]),
    "mrpc": (["sentence1", "sentence2"], ["not_equivalent", "equivalent"], ["train", "validation", "test"]),
    "qnli": (["question", "sentence"], ["entailment", "not_entailment"], ["train", "validation", "test"]),
    "qqp": (["question1", "question2"], ["not_duplicate", "duplicate"], ["train", "validation", "test"]),
    "rte": (["sentence1", "sentence2"], ["entailment", "not_entailment"], ["train", "validation", "test"]),
    "sst2": (["sentence"], ["negative", "positive"], ["train", "validation", "test"]),
    "stsb": (["sentence1", "sentence2"], None, ["train", "validation", "test"]),
}
GLUE_ROWS = {"train": 12, "test": 4}  # every other split: the validation count
GLUE_VALIDATION_ROWS = 6
# Weight formats for other frameworks that the real base repositories hold: the stand-ins hold placeholder bytes
# under those names, so that a run's fetch log shows whether a client downloads files it never loads.
UNLOADED_WEIGHT_FILES = ["tf_model.h5", "flax_model.msgpack"]


def build(folder: Path, *, clip: bool = True, flan_t5: bool = True, llm: bool = True) -> Path:
    folder = Path(folder)
    if clip:
        build_clip(folder)
    if flan_t5:
        build_flan_t5(folder)
    if llm:
        build_llm(folder)
    return folder


# ----------------------------------------------------------------------------------------------------------- CLIP


def build_clip(folder: Path) -> None:
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizerFast

    from featcal_fusionbench.models.openclip_convert import clip_tokenizer

    repo = folder / "models" / "openai" / "clip-vit-base-patch32"
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                     "vocab_size": 49408, "max_position_embeddings": 77, "projection_dim": 16},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 224, "patch_size": 32, "projection_dim": 16},
        projection_dim=16,
    )
    model = CLIPModel(config).eval()
    repo.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(repo)
    # main holds the weights as pytorch_model.bin, tf_model.h5 and flax_model.msgpack (model.safetensors is only on a
    # pull-request branch)
    torch.save(model.state_dict(), repo / "pytorch_model.bin")
    _placeholders(repo)
    tokens = folder / "_clip_tokenizer"
    clip_tokenizer(tokens).save_pretrained(tokens)
    vocab, merges = tokens / "vocab.json", tokens / "merges.txt"
    CLIPTokenizerFast.from_pretrained(tokens).save_pretrained(repo)  # tokenizer.json, tokenizer_config, special tokens
    shutil.copy(vocab, repo / "vocab.json")
    shutil.copy(merges, repo / "merges.txt")
    shutil.rmtree(tokens)
    # the real file, in the feature-extractor form it has on the hub
    (repo / "preprocessor_config.json").write_text(json.dumps({
        "crop_size": 224, "do_center_crop": True, "do_normalize": True, "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "resample": 3, "size": 224}, indent=2))
    _card(repo)

    vision = model.vision_model.state_dict()
    for i, task in enumerate(TA8):
        expert = _clip_vision_expert(config, vision, seed=100 + i)
        expert_repo = folder / "models" / "tanganke" / f"clip-vit-base-patch32_{task}"
        expert.save_pretrained(expert_repo)  # config.json and model.safetensors, as on the hub
        _card(expert_repo)
    for task, (repo_id, config_name) in IMAGE_DATASETS.items():
        _image_dataset(folder / "datasets" / repo_id, task, config_name)


def _placeholders(repo: Path) -> None:
    for name in UNLOADED_WEIGHT_FILES:
        (repo / name).write_bytes(b"stand-in: a torch run never loads this file\n")


def _card(repo: Path) -> None:
    (repo / "README.md").write_text("# Stand-in for the hub mirror (tests/hubmirror)\n")


def _clip_vision_expert(config, vision_state: Dict[str, torch.Tensor], seed: int):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    vision_config = CLIPVisionConfig(**config.vision_config.to_dict())
    expert = CLIPVisionModel(vision_config)
    generator = torch.Generator().manual_seed(seed)
    state = {k: v + 0.02 * torch.randn(v.shape, generator=generator) for k, v in vision_state.items()}
    expert.vision_model.load_state_dict(state)
    return expert


def _image_dataset(repo: Path, task: str, config_name: Optional[str]) -> None:
    from datasets import ClassLabel, Dataset, Features, Image

    from fusion_bench.tasks.clip_classification import get_classnames_and_templates

    classnames, _ = get_classnames_and_templates(task)
    features = Features({"image": Image(), "label": ClassLabel(names=list(classnames))})
    rng = np.random.default_rng(zlib.crc32(task.encode()))
    data_dir = repo / config_name if config_name else repo / "data"
    splits = {}
    from PIL import Image as PILImage

    for split, rows in {**IMAGE_SPLITS, **EXTRA_SPLITS.get(task, {})}.items():
        images = [PILImage.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(rows)]
        labels = [int(k % len(classnames)) for k in range(rows)]
        dataset = Dataset.from_dict({"image": images, "label": labels}, features=features)
        name = f"{split}-00000-of-00001.parquet"
        data_dir.mkdir(parents=True, exist_ok=True)
        dataset.to_parquet(str(data_dir / name))
        splits[split] = (data_dir.relative_to(repo) / name).as_posix(), rows
    _dataset_card(repo, config_name or "default", features, splits)


def _dataset_card(repo: Path, config_name: str, features, splits: Dict[str, tuple], more: str = "") -> None:
    """README.md with the hub's YAML header (configs -> data_files, dataset_info -> features and splits)."""
    import yaml

    info = {"config_name": config_name, "features": _features_yaml(features),
            "splits": [{"name": s, "num_examples": n} for s, (_, n) in splits.items()]}
    config = {"config_name": config_name, "data_files": [{"split": s, "path": p} for s, (p, _) in splits.items()]}
    existing = repo / "README.md"
    header = {"configs": [], "dataset_info": []}
    if existing.exists():
        header = yaml.safe_load(existing.read_text().split("---")[1])
    header["configs"].append(config)
    header["dataset_info"].append(info)
    existing.write_text("---\n" + yaml.safe_dump(header, sort_keys=False) + "---\n# Stand-in for the hub mirror\n")


def _features_yaml(features) -> List[dict]:
    from datasets import ClassLabel, Image, Value

    out = []
    for name, feature in features.items():
        if isinstance(feature, ClassLabel):
            out.append({"name": name, "dtype": {"class_label": {"names": {str(i): n for i, n in
                                                                          enumerate(feature.names)}}}})
        elif isinstance(feature, Image):
            out.append({"name": name, "dtype": "image"})
        elif isinstance(feature, Value):
            out.append({"name": name, "dtype": feature.dtype})
    return out


# ------------------------------------------------------------------------------------------------------- FLAN-T5


def build_flan_t5(folder: Path) -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    tokenizer = _t5_tokenizer()
    base_repo = folder / "models" / "google" / "flan-t5-base"
    torch.manual_seed(0)
    config = T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                      num_heads=4, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                      decoder_start_token_id=tokenizer.pad_token_id, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id)
    base = T5ForConditionalGeneration(config).eval()
    base.save_pretrained(base_repo)  # config, generation_config, model.safetensors
    torch.save(base.state_dict(), base_repo / "pytorch_model.bin")
    _placeholders(base_repo)
    tokenizer.save_pretrained(base_repo)
    _card(base_repo)
    for i, task in enumerate(GLUE):
        generator = torch.Generator().manual_seed(200 + i)
        expert = T5ForConditionalGeneration(config)
        expert.load_state_dict({k: v + 0.02 * torch.randn(v.shape, generator=generator)
                                for k, v in base.state_dict().items()})
        expert_repo = folder / "models" / "tanganke" / f"flan-t5-base_glue-{task}"
        expert.save_pretrained(expert_repo)  # config, generation_config, model.safetensors; no tokenizer, as on the hub
        _card(expert_repo)
    for i, (name, spec) in enumerate(GLUE.items()):
        _glue_config(folder / "datasets" / "nyu-mll" / "glue", name, *spec, seed=i)


_T5_WORDS = ("the a sentence question premise hypothesis yes no true false not equivalent entailment duplicate "
             "acceptable unacceptable positive negative neutral contradiction is it what which one two three four "
             "five grammatical cat dog runs sits on mat movie good bad").split()


def _t5_tokenizer():
    """A unigram (SentencePiece-style) T5TokenizerFast with T5's special tokens and 100 sentinel ids, written as
    tokenizer.json (the real repository also holds spiece.model, which the fast tokenizer does not need)."""
    from tokenizers import SentencePieceUnigramTokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import T5TokenizerFast

    corpus = [" ".join(_T5_WORDS[k:] + _T5_WORDS[:k]) for k in range(len(_T5_WORDS))]
    corpus += ["".join(chr(c) for c in range(32, 127)), "0 1 2 3 4 5 6 7 8 9 . , : ? !"]
    backend = SentencePieceUnigramTokenizer()
    backend.train_from_iterator(corpus, vocab_size=200, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>")
    backend.post_processor = TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>",
                                                special_tokens=[("</s>", 1)])
    return T5TokenizerFast(tokenizer_object=backend, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
                           extra_ids=100, model_max_length=512)


def _glue_config(repo: Path, name: str, columns: List[str], labels: Optional[List[str]], splits: List[str],
                 seed: int) -> None:
    from datasets import ClassLabel, Dataset, Features, Value

    rng = np.random.default_rng(seed)
    label = ClassLabel(names=labels) if labels else Value("float32")
    features = Features({**{c: Value("string") for c in columns}, "label": label, "idx": Value("int32")})
    written = {}
    for split in splits:
        rows = GLUE_ROWS.get(split, GLUE_VALIDATION_ROWS)
        words = lambda: " ".join(rng.choice(_T5_WORDS, size=6))  # noqa: E731
        data = {c: [words() for _ in range(rows)] for c in columns}
        if split.startswith("test"):  # GLUE's test labels are hidden: -1 (and STS-B's -1.0)
            data["label"] = [-1] * rows if labels else [-1.0] * rows
        else:
            data["label"] = ([int(k % len(labels)) for k in range(rows)] if labels
                             else [float(rng.uniform(0, 5)) for _ in range(rows)])
        data["idx"] = list(range(rows))
        path = repo / name / f"{split}-00000-of-00001.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        Dataset.from_dict(data, features=features).to_parquet(str(path))
        written[split] = (f"{name}/{path.name}", rows)
    _dataset_card(repo, name, features, written)


# ----------------------------------------------------------------------------------------------------------- LLM

LLAMA = "meta-llama/Llama-3.2-3B-Instruct"
MERGEBENCH_DOMAINS = ("instruction", "math", "coding")
# Llama 3's special tokens (ids 128000 on in the real vocabulary; here after the stand-in's own tokens)
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
                  "<|eot_id|>"]
# Llama 3.2 Instruct's chat layout without tools, as its tokenizer_config.json's template renders it (seen in
# copies of that template on GitHub, e.g. in LLM fine-tuning scripts): <|begin_of_text|>, then ALWAYS a system turn that
# opens with "Cutting Knowledge Date: December 2023" and "Today Date: <strftime_now('%d %b %Y'), else 26 Jul 2024>"
# and holds the (trimmed) system message if the first message is one, then each turn (header, trimmed content,
# <|eot_id|>) and the assistant header. Written here for that case only (the real one also places tools).
LLAMA_CHAT = (
    "{{- bos_token }}"
    "{%- if date_string is not defined %}{%- if strftime_now is defined %}"
    "{%- set date_string = strftime_now('%d %b %Y') %}{%- else %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCutting Knowledge Date: December 2023\\nToday Date: '"
    " + date_string + '\\n\\n' + system_message + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def build_llm(folder: Path) -> None:
    """The Table 4 setting: a tiny Llama under ``meta-llama/Llama-3.2-3B-Instruct`` (gated), MergeBench's three
    experts, MergeBench's ``_val`` calibration sets and the six evaluation datasets, with their real layouts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _llama_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")],
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    base = LlamaForCausalLM(config).eval()
    repos = {LLAMA: base}
    for i, domain in enumerate(MERGEBENCH_DOMAINS):
        generator = torch.Generator().manual_seed(300 + i)
        expert = LlamaForCausalLM(config)
        expert.load_state_dict({k: v + 0.02 * torch.randn(v.shape, generator=generator)
                                for k, v in base.state_dict().items()})
        repos[f"MergeBench/Llama-3.2-3B-Instruct_{domain}"] = expert
    for repo_id, model in repos.items():
        repo = folder / "models" / repo_id
        # two shards and their index, as the real repositories hold them
        model.to(torch.bfloat16).save_pretrained(repo, max_shard_size="60KB")
        tokenizer.save_pretrained(repo)
        _card(repo)
    (folder / "gated.json").write_text(json.dumps(sorted(set(_gated(folder)) | {f"models/{LLAMA}"})))
    _mergebench_val(folder / "datasets" / "MergeBench")
    _evaluation_datasets(folder / "datasets")


def _gated(folder: Path) -> List[str]:
    path = folder / "gated.json"
    return json.loads(path.read_text()) if path.exists() else []


def _llama_tokenizer():
    """A byte-level BPE tokenizer with Llama 3's special tokens, bos added by the post-processor, and the chat
    layout (the real 128,256-token vocabulary is not to be had offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = [" ".join(_T5_WORDS), "def return import print for in if else while assert 0 1 2 3 4 5 6 7 8 9",
              "The best answer is A B C D. Please reason step by step \\boxed{} $ + - * / = ( ) [ ] { } : ,"]
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=LLAMA_SPECIALS,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = backend.token_to_id("<|begin_of_text|>")
    backend.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                                           special_tokens=[("<|begin_of_text|>", bos)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>",
                                        eos_token="<|eot_id|>", model_max_length=131072)
    tokenizer.chat_template = LLAMA_CHAT
    return tokenizer


def _parquet(path: Path, rows: Dict[str, list], features=None) -> None:
    from datasets import Dataset

    path.parent.mkdir(parents=True, exist_ok=True)
    Dataset.from_dict(rows, features=features).to_parquet(str(path))


def _jsonl(path: Path, rows: List[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _mergebench_val(root: Path) -> None:
    """MergeBench's ``<domain>_val`` sets (split ``train``; fields as MergeBench's merging/taskloader.py reads them).
    ``instruction_val`` has no ``input`` column here: whether the real one has it is not known, and MergeBench's code
    reads it only where present."""
    n = 6
    sets = {
        "instruction_val": {"instruction": [f"Write one sentence about the number {k}." for k in range(n)],
                            "output": [f"The number {k} is small." for k in range(n)]},
        "math_val": {"query": [f"What is {k} plus {k}?" for k in range(n)],
                     "response": [f"{k} plus {k} is {2 * k}. The answer is {2 * k}." for k in range(n)]},
        "coding_val": {"instruction": [f"Write a function that returns {k}." for k in range(n)],
                       "response": [f"def f():\n    return {k}\n" for k in range(n)]},
    }
    for name, rows in sets.items():
        _parquet(root / name / "data" / "train-00000-of-00001.parquet", rows)
        _dataset_card_configs(root / name, {"default": {"train": "data/train-*"}})


def _evaluation_datasets(root: Path) -> None:
    from datasets import Features, Sequence, Value

    _jsonl(root / "HuggingFaceH4" / "MATH-500" / "test.jsonl", [
        {"problem": f"What is ${k} + {k}$?", "solution": f"We add: ${k} + {k} = \\boxed{{{2 * k}}}$.",
         "answer": str(2 * k), "subject": "Prealgebra", "level": 1, "unique_id": f"test/prealgebra/{k}.json"}
        for k in range(4)])
    gsm8k = {"question": [f"Tom has {k} apples and buys {k} more. How many apples does he have?" for k in range(4)],
             "answer": [f"He has {k} + {k} = <<{k}+{k}={2 * k}>>{2 * k} apples.\n#### {2 * k}" for k in range(4)]}
    for config in ("main", "socratic"):
        for split in ("train", "test"):
            _parquet(root / "openai" / "gsm8k" / config / f"{split}-00000-of-00001.parquet", gsm8k)
    _dataset_card_configs(root / "openai" / "gsm8k", {c: {s: f"{c}/{s}-*" for s in ("train", "test")}
                                                       for c in ("main", "socratic")})
    _parquet(root / "evalplus" / "humanevalplus" / "data" / "test-00000-of-00001-5973903632b82d40.parquet", {
        "task_id": ["HumanEval/0", "HumanEval/1"],
        "prompt": [f'def add_{k}(x: int) -> int:\n    """Return x plus {k}."""\n' for k in (1, 2)],
        "canonical_solution": [f"    return x + {k}\n" for k in (1, 2)],
        "entry_point": ["add_1", "add_2"],
        "test": [EVALPLUS_ASSERTION + f"\n\ndef check(candidate):\n    inputs = [[0], [5]]\n    results = [{k}, {5 + k}]\n"
                 "    for i, (inp, exp) in enumerate(zip(inputs, results)):\n        assertion(candidate(*inp), exp, 0)\n"
                 for k in (1, 2)]})
    _dataset_card_configs(root / "evalplus" / "humanevalplus", {"default": {"test": "data/test-*"}})
    _parquet(root / "evalplus" / "mbppplus" / "data" / "test-00000-of-00001-d5781c9c51e02795.parquet", {
        "task_id": [2, 3], "code": [f"def twice_{k}(x):\n    return {k} * x\n" for k in (2, 3)],
        "prompt": [f"Write a function to multiply a number by {k}." for k in (2, 3)],
        "source_file": ["Benchmark Questions Verification V2.ipynb"] * 2, "test_imports": [[], []],
        "test_list": [[f"assert twice_{k}(1) == {k}", f"assert twice_{k}(2) == {2 * k}", f"assert twice_{k}(0) == 0"]
                      for k in (2, 3)],
        "test": [EVALPLUS_ASSERTION + f"\n\ninputs = [[1], [4]]\nresults = [{k}, {4 * k}]\n"
                 f"for i, (inp, exp) in enumerate(zip(inputs, results)):\n    assertion(twice_{k}(*inp), exp, 0)\n"
                 for k in (2, 3)]}, Features({
        "task_id": Value("int64"), "code": Value("string"), "prompt": Value("string"), "source_file": Value("string"),
        "test_imports": Sequence(Value("string")), "test_list": Sequence(Value("string")), "test": Value("string")}))
    _dataset_card_configs(root / "evalplus" / "mbppplus", {"default": {"test": "data/test-*"}})
    _jsonl(root / "google" / "IFEval" / "ifeval_input_data.jsonl", [
        {"key": 1000 + k, "prompt": f"Write a short note about the number {k}. Do not use any commas.",
         "instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words"],
         "kwargs": [{}, {"relation": "at least", "num_words": 3}]} for k in range(3)])
    arc = {"id": [f"Mercury_{k}" for k in range(4)],
           "question": [f"Which number is {k}?" for k in range(4)],
           "choices": [{"text": ["zero", "one", "two", "three"], "label": ["A", "B", "C", "D"]} for _ in range(4)],
           "answerKey": ["ABCD"[k] for k in range(4)]}
    arc_features = Features({"id": Value("string"), "question": Value("string"),
                             "choices": Sequence({"text": Value("string"), "label": Value("string")}),
                             "answerKey": Value("string")})
    for split in ("train", "validation", "test"):
        _parquet(root / "allenai" / "ai2_arc" / "ARC-Challenge" / f"{split}-00000-of-00001.parquet", arc, arc_features)
    _dataset_card_configs(root / "allenai" / "ai2_arc",
                          {"ARC-Challenge": {s: f"ARC-Challenge/{s}-*" for s in ("train", "validation", "test")}})


# EvalPlus's test helpers (evalplus tools/humaneval/to_original_fmt.py): the tests need numpy
EVALPLUS_ASSERTION = """
import numpy as np

def is_floats(x) -> bool:
    if isinstance(x, float):
        return True
    if isinstance(x, (list, tuple)):
        return all(isinstance(i, float) for i in x)
    if isinstance(x, np.ndarray):
        return x.dtype == np.float64 or x.dtype == np.float32
    return False

def assertion(out, exp, atol):
    exact_match = out == exp
    if atol == 0 and is_floats(exp):
        atol = 1e-6
    if not exact_match and atol != 0:
        np.testing.assert_allclose(out, exp, atol=atol)
    else:
        assert exact_match
"""


def _dataset_card_configs(repo: Path, configs: Dict[str, Dict[str, str]]) -> None:
    """README.md whose YAML header maps each config's splits to its files, as the hub's parquet repositories do."""
    import yaml

    header = {"configs": [{"config_name": name, "data_files": [{"split": s, "path": p} for s, p in splits.items()]}
                          for name, splits in configs.items()]}
    repo.mkdir(parents=True, exist_ok=True)
    (repo / "README.md").write_text("---\n" + yaml.safe_dump(header, sort_keys=False) + "---\n# Stand-in\n")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/hubmirror/standins.py FOLDER")
    print(build(Path(sys.argv[1])))
