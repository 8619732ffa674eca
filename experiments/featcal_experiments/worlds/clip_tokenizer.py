"""The real CLIP BPE tokenizer, written from the vocabulary that ships inside open_clip's wheel."""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

from open_clip.tokenizer import bytes_to_unicode

# Same cut as CLIP's and open_clip's tokenizers: 49,152 - 256 - 2 merges, then the
# byte alphabet, its '</w>' forms, the merges, and the two special tokens = 49,408 ids.
_NUM_MERGES = 49152 - 256 - 2
START, END = "<|startoftext|>", "<|endoftext|>"


def write_clip_tokenizer_files(directory: Path) -> tuple[Path, Path]:
    """Write vocab.json and merges.txt for transformers' (slow) ``CLIPTokenizer``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bpe = resources.files("open_clip").joinpath("bpe_simple_vocab_16e6.txt.gz").read_bytes()
    lines = gzip.decompress(bpe).decode("utf-8").split("\n")[1 : _NUM_MERGES + 1]
    merges = [tuple(line.split()) for line in lines]
    vocab = list(bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab]
    vocab += ["".join(m) for m in merges]
    vocab += [START, END]
    vocab_path = directory / "vocab.json"
    merges_path = directory / "merges.txt"
    vocab_path.write_text(json.dumps({token: i for i, token in enumerate(vocab)}))
    merges_path.write_text("#version: 0.2\n" + "\n".join(" ".join(m) for m in merges) + "\n")
    return vocab_path, merges_path


def clip_tokenizer(directory: Path):
    """A slow ``CLIPTokenizer`` (the fast one does not match open_clip's ids)."""
    from transformers import CLIPTokenizer

    vocab_path, merges_path = write_clip_tokenizer_files(directory)
    return CLIPTokenizer(str(vocab_path), str(merges_path))
