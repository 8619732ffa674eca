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


def build(folder: Path, *, clip: bool = True, flan_t5: bool = True) -> Path:
    folder = Path(folder)
    if clip:
        build_clip(folder)
    if flan_t5:
        build_flan_t5(folder)
    return folder


# ----------------------------------------------------------------------------------------------------------- CLIP


def build_clip(folder: Path) -> None:
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer, CLIPTokenizerFast

    from featcal_experiments.worlds.clip_tokenizer import write_clip_tokenizer_files

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
    vocab, merges = write_clip_tokenizer_files(tokens)
    CLIPTokenizer(str(vocab), str(merges)).save_pretrained(tokens)
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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/hubmirror/standins.py FOLDER")
    print(build(Path(sys.argv[1])))
