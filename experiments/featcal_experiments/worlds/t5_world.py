"""The offline T5 world: a tiny FLAN-T5-shaped model on bytes, pretrained on real packaged text, full fine-tuned experts.

Build steps (each seeded):
  1. tasks from Debian's fortune files (``text_sources``), tokenized with ``ByT5Tokenizer`` into
     FusionBench's FLAN-T5 format (``input_ids``, ``attention_mask``, ``labels`` padded with -100) and saved with
     ``save_to_disk``;
  2. a tiny ``T5ForConditionalGeneration`` with FLAN-T5's layout (gated-GELU feed-forward, untied LM head,
     relative attention bias) pretrained on every packaged fortune that no task tests on: T5's span corruption
     on bytes, mixed FLAN-style with prompted tasks that are not evaluation tasks (missing word, which word occurs,
     is it a question, first word, line count), most with their answer options listed, and, as FLAN-T5's mixture
     held GLUE, with a small share of evaluation-task train examples (from a quarter of each train split): the base
     answers the tasks' prompts, clearly below the experts;
  3. one expert per task, all weights fine-tuned with a small learning rate (AdamW, warm-up then cosine);
  4. the world's regime figures, none involving FeatCal: base zero-shot, experts on their own and the other
     tasks, Task Arithmetic (0.3), task-vector norms, all scored with FusionBench's own FLAN-T5 evaluation
     functions (exact match of the generated answer; Spearman's rho for the regression task).
"""

from __future__ import annotations

import json
import math
import platform
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
from tqdm.auto import tqdm

from . import text_sources
from .text_sources import TaskSizes


# The pretraining mix's prompted tasks (see prompted_example); no "last word" task: on an attributed fortune it
# would be the author task.
PRETRAINING_TASKS = ["missing_word", "word_in_text", "question", "first_word", "line_count"]


@dataclass
class T5WorldSpec:
    name: str = "t5"
    tasks: List[str] = field(default_factory=lambda: list(text_sources.TASKS))
    sizes: Dict[str, TaskSizes] = field(default_factory=lambda: dict(text_sources.DEFAULT_SIZES))
    # the model: FLAN-T5's layout at a tiny size; ByT5's 384-token byte vocabulary
    d_model: int = 128
    d_kv: int = 32
    num_heads: int = 4
    d_ff: int = 512
    num_layers: int = 4
    num_decoder_layers: int = 4
    # pretraining: span corruption on bytes plus a share of prompted non-evaluation tasks
    pretrain_steps: int = 1200
    pretrain_batch: int = 32
    pretrain_lr: float = 1e-3
    pretrain_window: int = text_sources.MAX_TEXT_BYTES  # bytes of a fortune per span-corruption example
    noise_density: float = 0.15
    mean_noise_span: float = 4.0
    prompted_share: float = 0.4
    # FLAN-T5 was instruction-tuned on a mixture that holds GLUE's train sets before FusionBench's experts were
    # fine-tuned on them; likewise a share of the pretraining batches are evaluation-task train examples, from the
    # first ``instruction_fraction`` of each task's train split (never a test example).
    instruction_share: float = 0.1
    instruction_fraction: float = 0.25
    pretraining_tasks: List[str] = field(default_factory=lambda: list(PRETRAINING_TASKS))
    # experts: every weight fine-tuned, small steps
    finetune_steps: int = 300
    finetune_batch: int = 32
    finetune_lr: float = 3e-4
    finetune_weight_decay: float = 0.0
    # evaluation (FusionBench's generation settings)
    eval_batch: int = 64
    max_length: int = 10
    task_arithmetic_scaling: float = 0.3
    seed: int = 0


T5_WORLD = T5WorldSpec()


def t5_config(spec: T5WorldSpec):
    from transformers import T5Config

    return T5Config(
        vocab_size=384, d_model=spec.d_model, d_kv=spec.d_kv, d_ff=spec.d_ff, num_layers=spec.num_layers,
        num_decoder_layers=spec.num_decoder_layers, num_heads=spec.num_heads, relative_attention_num_buckets=32,
        relative_attention_max_distance=128, dropout_rate=0.0, feed_forward_proj="gated-gelu",
        tie_word_embeddings=False, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )


# ------------------------------------------------------------------------------------------ datasets

def encode_split(tokenizer, inputs: Sequence[str], targets: Sequence[str]) -> Dict[str, List[List[int]]]:
    """FusionBench's FLAN-T5 format: inputs padded with 0 to the split's longest, labels (ending with EOS)
    padded with -100."""
    enc = tokenizer(list(inputs))["input_ids"]
    lab = tokenizer(list(targets))["input_ids"]
    n_in, n_lab = max(map(len, enc)), max(map(len, lab))
    return {
        "input_ids": [ids + [tokenizer.pad_token_id] * (n_in - len(ids)) for ids in enc],
        "attention_mask": [[1] * len(ids) + [0] * (n_in - len(ids)) for ids in enc],
        "labels": [ids + [-100] * (n_lab - len(ids)) for ids in lab],
    }


def _tensors(columns: Dict[str, List[List[int]]]) -> Dict[str, torch.Tensor]:
    return {k: torch.tensor(v) for k, v in columns.items()}


def _trimmed(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Drop the columns that are padding in every row of the batch (same loss, less compute)."""
    n_in = int(batch["attention_mask"].sum(1).max())
    n_lab = int((batch["labels"] != -100).sum(1).max())
    return {"input_ids": batch["input_ids"][:, :n_in].contiguous(),
            "attention_mask": batch["attention_mask"][:, :n_in].contiguous(),
            "labels": batch["labels"][:, :n_lab].contiguous()}


# --------------------------------------------------------------------------------------- pretraining

def _random_segmentation(n_items: int, n_segments: int, rng: np.random.Generator) -> np.ndarray:
    cuts = np.sort(rng.choice(np.arange(1, n_items), n_segments - 1, replace=False)) if n_segments > 1 else np.array([], int)
    return np.diff(np.concatenate([[0], cuts, [n_items]]))


def span_corruption(ids: List[int], sentinels: List[int], eos: int, density: float, mean_span: float,
                    rng: np.random.Generator):
    """T5's span corruption (random_spans_noise_mask) on a list of byte ids: (input ids, target ids)."""
    length = len(ids)
    n_noise = min(max(int(round(length * density)), 1), length - 1)
    n_spans = max(1, min(int(round(n_noise / mean_span)), n_noise, length - n_noise, len(sentinels)))
    noise_lengths = _random_segmentation(n_noise, n_spans, rng)
    keep_lengths = _random_segmentation(length - n_noise, n_spans, rng)
    inputs, targets, pos = [], [], 0
    for s in range(n_spans):
        inputs += ids[pos : pos + keep_lengths[s]]
        pos += keep_lengths[s]
        inputs.append(sentinels[s])
        targets.append(sentinels[s])
        targets += ids[pos : pos + noise_lengths[s]]
        pos += noise_lengths[s]
    return inputs + [eos], targets + [eos]


_WORD = re.compile(r"[^\W\d_]+")


def prompted_example(text: str, rng: random.Random, other_words: Sequence[str] = (),
                     kinds: Sequence[str] = tuple(PRETRAINING_TASKS)):
    """One example of the pretraining mix's prompted tasks, FLAN-style (question, options, text): none is an
    evaluation task. Most list their options, drawn afresh for every example, and the answer is always one of them:
    the base learns to answer with one of a prompt's options. ``other_words`` come from other texts (distractors).
    Returns (source, answer), or None when the drawn task does not apply to the text."""
    prompt = text_sources.prompt
    words = _WORD.findall(text)
    short = sorted({w for w in words if len(w.encode("utf-8")) <= 9}, key=words.index)
    kind = rng.choice(list(kinds))
    if kind == "missing_word" and len(short) >= 4:
        options = rng.sample(short, rng.randint(3, 6) if len(short) >= 6 else 4)
        answer = options[0]
        rng.shuffle(options)
        return prompt("Which word is missing?", options) + re.sub(rf"\b{re.escape(answer)}\b", "___", text, count=1), answer
    if kind == "word_in_text" and short:
        distractors = sorted({w for w in other_words if w not in words and len(w.encode("utf-8")) <= 9})
        if len(distractors) >= 2:
            answer = rng.choice(short)
            options = rng.sample(distractors, min(len(distractors), rng.randint(2, 6))) + [answer]
            rng.shuffle(options)
            return prompt("Which of these words occurs in the text?", options) + text, answer
    if kind == "question":
        return prompt("Does this text ask a question?", ["yes", "no"]) + text, "yes" if "?" in text else "no"
    if kind == "first_word" and words and len(words[0].encode("utf-8")) <= 9:
        return prompt("What is the first word of this text?") + text, words[0]
    if kind == "line_count":
        return prompt("How many lines does this text have?") + text, str(len(text.split("\n")))
    return None


class PretrainingStream:
    """Seeded batches of span-corruption and prompted examples from the pretraining corpus."""

    def __init__(self, corpus: List[str], tokenizer, spec: T5WorldSpec,
                 instruction: Sequence[Tuple[List[int], List[int]]] = ()):
        self.instruction = list(instruction)  # (input ids, label ids) of evaluation-task train examples
        self.corpus = [t.encode("utf-8") for t in corpus]
        self.texts = corpus
        self.tokenizer = tokenizer
        self.spec = spec
        self.rng = np.random.default_rng(spec.seed + 11)
        self.py_rng = random.Random(spec.seed + 12)
        self.sentinels = tokenizer.convert_tokens_to_ids([f"<extra_id_{i}>" for i in range(100)])
        self.offset = tokenizer.offset if hasattr(tokenizer, "offset") else 3  # byte b -> id b + 3

    def _span_example(self):
        raw = self.corpus[self.rng.integers(len(self.corpus))]
        window = self.spec.pretrain_window
        start = int(self.rng.integers(0, max(1, len(raw) - window + 1)))
        ids = [b + self.offset for b in raw[start : start + window]]
        if len(ids) < 4:
            ids = ids + [self.tokenizer.eos_token_id] * (4 - len(ids))
        return span_corruption(ids, self.sentinels, self.tokenizer.eos_token_id, self.spec.noise_density,
                               self.spec.mean_noise_span, self.rng)

    def _prompted_example(self):
        while True:
            text = text_sources.truncate(self.texts[self.rng.integers(len(self.texts))])
            others = [w for i in self.rng.integers(len(self.texts), size=3) for w in _WORD.findall(self.texts[i][:200])]
            example = prompted_example(text, self.py_rng, others, self.spec.pretraining_tasks)
            if example:
                source, target = example
                return self.tokenizer(source)["input_ids"], self.tokenizer(target)["input_ids"]

    def batch(self, size: int) -> Dict[str, torch.Tensor]:
        pairs = []
        for _ in range(size):
            r = self.rng.random()
            if self.instruction and r < self.spec.instruction_share:
                pairs.append(self.instruction[self.rng.integers(len(self.instruction))])
            elif r < self.spec.instruction_share + self.spec.prompted_share:
                pairs.append(self._prompted_example())
            else:
                pairs.append(self._span_example())
        n_in, n_lab = max(len(a) for a, _ in pairs), max(len(b) for _, b in pairs)
        return {
            "input_ids": torch.tensor([a + [0] * (n_in - len(a)) for a, _ in pairs]),
            "attention_mask": torch.tensor([[1] * len(a) + [0] * (n_in - len(a)) for a, _ in pairs]),
            "labels": torch.tensor([b + [-100] * (n_lab - len(b)) for _, b in pairs]),
        }


def instruction_examples(train: Dict[str, Dict[str, torch.Tensor]], fraction: float):
    """(input ids, label ids) of the first ``fraction`` of every task's (shuffled) train split, unpadded."""
    pairs, counts = [], {}
    for name, columns in train.items():
        n = int(round(fraction * len(columns["input_ids"])))
        counts[name] = n
        for i in range(n):
            ids = columns["input_ids"][i][columns["attention_mask"][i].bool()].tolist()
            labels = [t for t in columns["labels"][i].tolist() if t != -100]
            pairs.append((ids, labels))
    return pairs, counts


def _optimizer(model, lr: float, steps: int, weight_decay: float):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=max(steps, 2), pct_start=0.1,
                                                   anneal_strategy="cos")
    return optimizer, schedule


def _step(model, batch, optimizer, schedule) -> float:
    loss = model(**batch).loss
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    schedule.step()
    return float(loss.detach())


def pretrain(model, stream: PretrainingStream, spec: T5WorldSpec) -> List[float]:
    optimizer, schedule = _optimizer(model, spec.pretrain_lr, spec.pretrain_steps, 0.01)
    model.train()
    losses = []
    for _ in tqdm(range(spec.pretrain_steps), desc="pretraining (span corruption + prompted mix)"):
        losses.append(_step(model, stream.batch(spec.pretrain_batch), optimizer, schedule))
    model.eval()
    return losses


def finetune(model, train: Dict[str, torch.Tensor], spec: T5WorldSpec, generator: torch.Generator, desc: str) -> List[float]:
    """Full fine-tuning: every weight, AdamW with warm-up and cosine decay."""
    optimizer, schedule = _optimizer(model, spec.finetune_lr, spec.finetune_steps, spec.finetune_weight_decay)
    model.train()
    losses = []
    n = len(train["input_ids"])
    for _ in tqdm(range(spec.finetune_steps), desc=desc, leave=False):
        idx = torch.randint(n, (spec.finetune_batch,), generator=generator)
        losses.append(_step(model, _trimmed({k: v[idx] for k, v in train.items()}), optimizer, schedule))
    model.eval()
    return losses


# ---------------------------------------------------------------------------------------- evaluation

def score(model, dataset, tokenizer, regression: bool, batch_size: int) -> float:
    """FusionBench's FLAN-T5 scores: exact-match accuracy of ``generate(max_length=10)``, or Spearman's rho of the
    generated numbers. An undefined rho (constant predictions) counts as 0."""
    from torch.utils.data import DataLoader
    from transformers import default_data_collator

    from fusion_bench.tasks.flan_t5_text_generation.glue_evaluation import evaluate_accuracy, evaluate_spearman_rho

    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=default_data_collator)
    value = (evaluate_spearman_rho if regression else evaluate_accuracy)(model, loader, tokenizer)
    value = float(value)
    return 0.0 if math.isnan(value) else value


def _state(model) -> Dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _flat(state: Dict[str, torch.Tensor]) -> torch.Tensor:
    # encoder/decoder embed_tokens are the shared embedding: count each tensor once
    return torch.cat([v.flatten().float() for k, v in state.items() if not k.endswith("embed_tokens.weight")])


def _fmt(scores: Dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in scores.items())


def build_t5_world(root: Path, spec: T5WorldSpec = T5_WORLD) -> dict:
    """Build the world under ``root``; write ``world.json`` with the regime figures and return its content."""
    from datasets import Dataset, load_from_disk
    from datasets.utils.logging import disable_progress_bar
    from transformers import ByT5Tokenizer, T5ForConditionalGeneration

    root = Path(root).resolve()
    disable_progress_bar()
    started = time.perf_counter()
    torch.manual_seed(spec.seed)
    generator = torch.Generator().manual_seed(spec.seed)

    tasks = text_sources.build_tasks(spec.tasks, spec.sizes, spec.seed)
    tokenizer = ByT5Tokenizer()
    pretrained_dir = root / "pretrained"
    tokenizer.save_pretrained(pretrained_dir)

    train_tensors, test_sets = {}, {}
    for name, task in tasks.items():
        for split in ("train", "test"):
            columns = encode_split(tokenizer, task.inputs(split), task.targets(split))
            Dataset.from_dict(columns).save_to_disk(str(root / "data" / name / split))
            if split == "train":
                train_tensors[name] = _tensors(columns)
        test_sets[name] = load_from_disk(str(root / "data" / name / "test"))
    data_seconds = time.perf_counter() - started

    held_out = text_sources.held_out_entries(tasks.values())
    corpus = text_sources.pretraining_corpus(held_out, spec.seed)
    model = T5ForConditionalGeneration(t5_config(spec))
    pretrain_started = time.perf_counter()
    instruction, instruction_counts = instruction_examples(train_tensors, spec.instruction_fraction)
    stream = PretrainingStream(corpus, tokenizer, spec, instruction)
    pretrain_losses = pretrain(model, stream, spec)
    pretrain_seconds = time.perf_counter() - pretrain_started
    model.save_pretrained(pretrained_dir)
    base_state = _state(model)
    regression = {n: tasks[n].regression for n in tasks}

    def evaluate(m, names) -> Dict[str, float]:
        return {n: score(m, test_sets[n], tokenizer, regression[n], spec.eval_batch) for n in names}

    figures: Dict[str, object] = {"pretrain_loss_first_last": [pretrain_losses[0], float(np.mean(pretrain_losses[-50:]))]}
    figures["zero_shot"] = evaluate(model, tasks)
    tqdm.write(f"base zero-shot: {_fmt(figures['zero_shot'])}")

    expert_states, finetune_losses = {}, {}
    figures["expert_matrix"] = {}
    finetune_started = time.perf_counter()
    for name in tqdm(list(tasks), desc="fine-tuning experts"):
        expert = T5ForConditionalGeneration.from_pretrained(pretrained_dir)
        losses = finetune(expert, train_tensors[name], spec, generator, desc=f"expert {name}")
        finetune_losses[name] = [losses[0], float(np.mean(losses[-20:]))]
        expert.save_pretrained(root / "experts" / name)
        expert_states[name] = _state(expert)
        figures["expert_matrix"][name] = evaluate(expert, tasks)  # the expert on every task, its own included
        tqdm.write(f"expert {name}: {_fmt(figures['expert_matrix'][name])}")
    finetune_seconds = time.perf_counter() - finetune_started
    figures["expert"] = {n: figures["expert_matrix"][n][n] for n in tasks}
    figures["finetune_loss_first_last"] = finetune_losses

    # Task Arithmetic (0.3) as the regime check; FeatCal is never part of choosing the world.
    def task_arithmetic(members) -> T5ForConditionalGeneration:
        merged = T5ForConditionalGeneration.from_pretrained(pretrained_dir)
        lam = spec.task_arithmetic_scaling
        merged.load_state_dict({k: v + lam * sum(expert_states[m][k] - v for m in members) for k, v in base_state.items()})
        return merged.eval()

    figures["task_arithmetic"] = evaluate(task_arithmetic(list(tasks)), tasks)
    tqdm.write(f"task arithmetic ({spec.task_arithmetic_scaling}): {_fmt(figures['task_arithmetic'])}")
    # Interference: the other tasks' vectors alone (0.3 each) added to the base, on each task.
    figures["others_only_task_arithmetic"] = {
        n: evaluate(task_arithmetic([m for m in tasks if m != n]), [n])[n] for n in tasks
    } if len(tasks) > 1 else {}
    base_flat = _flat(base_state)
    deltas = {n: _flat(s) - base_flat for n, s in expert_states.items()}
    figures["relative_task_vector_norm"] = {n: float(d.norm() / base_flat.norm()) for n, d in deltas.items()}
    names = list(tasks)
    figures["task_vector_cosine"] = {
        f"{a}+{b}": float(torch.nn.functional.cosine_similarity(deltas[a], deltas[b], dim=0))
        for i, a in enumerate(names) for b in names[i + 1 :]
    }
    for key in ("zero_shot", "expert", "task_arithmetic", "others_only_task_arithmetic"):
        if figures[key]:
            figures[f"{key}_average"] = float(np.mean(list(figures[key].values())))
    figures["timings_seconds"] = {
        "data": data_seconds, "pretraining": pretrain_seconds, "finetuning_and_expert_evaluation": finetune_seconds,
    }
    figures["build_seconds"] = time.perf_counter() - started

    spec_dict = asdict(spec)
    meta = {
        "spec": spec_dict,
        "tasks": names,
        "regression_tasks": [n for n in names if regression[n]],
        "labels": {n: t.labels for n, t in tasks.items()},
        "prompts": {n: t.prompt for n, t in tasks.items()},
        "sources": {n: t.source for n, t in tasks.items()},
        "counts": {n: t.counts() for n, t in tasks.items()},
        "pretraining_corpus_entries": len(corpus),
        "instruction_examples_in_pretraining": instruction_counts,
        "parameters": sum(p.numel() for p in model.parameters()),
        "build_seconds": figures["build_seconds"],
        "machine": {"processor": platform.processor() or platform.machine(), "torch_threads": torch.get_num_threads()},
        "figures": figures,
    }
    (root / "world.json").write_text(json.dumps(meta, indent=2))
    return meta


def regime_table(meta: dict) -> str:
    """The regime figures of a built world (its ``world.json``) as a Markdown table: one row per model, one column
    per task (accuracy; Spearman's rho for regression tasks), then the average."""
    figures, tasks = meta["figures"], meta["tasks"]
    rows = [("pretrained (zero-shot)", figures["zero_shot"]), ("experts (each on its own task)", figures["expert"]),
            (f"Task Arithmetic ({meta['spec']['task_arithmetic_scaling']})", figures["task_arithmetic"])]
    if figures.get("others_only_task_arithmetic"):
        rows.append(("the other tasks' vectors only (0.3 each)", figures["others_only_task_arithmetic"]))
    head = [f"{t} (rho)" if t in meta["regression_tasks"] else t for t in tasks]
    lines = ["| model | " + " | ".join(head) + " | average |", "|---" * (len(tasks) + 2) + "|"]
    for label, scores in rows:
        values = [100 * scores[t] for t in tasks]
        lines.append(f"| {label} | " + " | ".join(f"{v:.1f}" for v in values) + f" | {np.mean(values):.1f} |")
    lines.append("| relative task-vector norm (%) | " + " | ".join(
        f"{100 * figures['relative_task_vector_norm'][t]:.2f}" for t in tasks) + " | |")
    return "\n".join(lines)


def expert_matrix_table(meta: dict) -> str:
    """Each expert (rows) on every task (columns): how distinct the tasks are."""
    matrix, tasks = meta["figures"]["expert_matrix"], meta["tasks"]
    lines = ["| expert \\ task | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
    for e in tasks:
        lines.append(f"| {e} | " + " | ".join(f"{100 * matrix[e][t]:.1f}" for t in tasks) + " |")
    return "\n".join(lines)
