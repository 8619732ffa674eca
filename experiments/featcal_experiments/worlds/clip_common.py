"""What every offline CLIP world shares: zero-shot heads, expert fine-tuning, FusionBench configs."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
import yaml
from tqdm.auto import tqdm


def zero_shot_head(clip_model, tokenizer, classnames: List[str], templates: List[str]) -> torch.Tensor:
    """FusionBench's zero-shot head: per class, the normalised mean of normalised template embeddings."""
    rows = []
    with torch.no_grad():
        for name in classnames:
            tokens = tokenizer([t.format(name) for t in templates], padding=True, return_tensors="pt")
            emb = F.normalize(clip_model.get_text_features(**tokens), dim=-1).mean(0)
            rows.append(F.normalize(emb, dim=0))
    return torch.stack(rows)


def finetune_vision_tower(
    clip_model, vision_model, head, pixels, labels, steps: int, batch_size: int, lr: float, generator,
    weight_decay: float = 0.0, cosine: bool = False,
) -> None:
    """Fine-tune the vision tower against a frozen zero-shot head (FusionBench's expert protocol). ``cosine`` with
    ``weight_decay`` is the task-arithmetic experts' recipe (AdamW, warm-up then cosine decay)."""
    train_vision_tower(clip_model, vision_model, [(head, pixels, labels)], steps, batch_size, lr, generator,
                       weight_decay=weight_decay, cosine=cosine)


def train_vision_tower(
    clip_model, vision_model, tasks: Sequence[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]], steps: int,
    batch_size: int, lr: float, generator, weight_decay: float = 0.0, cosine: bool = False, progress: str | None = None,
) -> None:
    """``finetune_vision_tower`` over several (head, pixels, labels) tasks: step s draws its batch from task s mod N,
    scored against that task's frozen head (one tower for every task: multi-task learning). ``progress`` names a
    per-step progress bar (the expert build has its own bar over experts, so it passes none)."""
    optimizer = torch.optim.AdamW(vision_model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = (
        torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=steps, pct_start=0.1, anneal_strategy="cos")
        if cosine
        else None
    )
    scale = clip_model.logit_scale.exp().detach()
    vision_model.train()
    for step in tqdm(range(steps), desc=progress, mininterval=10, disable=progress is None):
        head, pixels, labels = tasks[step % len(tasks)]
        idx = torch.randint(len(labels), (batch_size,), generator=generator)
        feats = clip_model.visual_projection(vision_model(pixel_values=pixels[idx]).pooler_output)
        loss = F.cross_entropy(scale * F.normalize(feats, dim=-1) @ head.T, labels[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if schedule is not None:
            schedule.step()
    vision_model.eval()


def write_fusion_bench_configs(
    root: Path,
    name: str,
    pretrained_dir: Path,
    expert_dirs: Dict[str, str],
    data_paths: Dict[str, Dict[str, str]],
    classnames: Dict[str, List[str]],
    templates: List[str],
    eval_batch_size: int,
) -> Dict[str, str]:
    """A CLIPVisionModelPool and a LocalCLIPVisionModelTaskPool over the world's local files."""

    def entry(task, split):
        return {"_target_": "datasets.load_from_disk", "dataset_path": data_paths[task][split]}

    tasks = list(expert_dirs)
    pool = {
        "_target_": "fusion_bench.modelpool.CLIPVisionModelPool",
        "_recursive_": False,
        "processor": str(pretrained_dir),
        "models": {"_pretrained_": str(pretrained_dir), **expert_dirs},
        "train_datasets": {t: entry(t, "train") for t in tasks},
        "test_datasets": {t: entry(t, "test") for t in tasks},
    }
    taskpool = {
        "_target_": "featcal_fusionbench.evaluation.clip_taskpool.LocalCLIPVisionModelTaskPool",
        "_recursive_": False,
        "test_datasets": {t: entry(t, "test") for t in tasks},
        "processor": str(pretrained_dir),
        "clip_model": str(pretrained_dir),
        "dataloader_kwargs": {"batch_size": eval_batch_size, "num_workers": 0, "shuffle": False},
        "classnames": classnames,
        "templates": templates,
    }
    config_root = Path(root) / "config"
    paths = {
        "modelpool": config_root / "modelpool" / "CLIPVisionModelPool" / f"{name}.yaml",
        "taskpool": config_root / "taskpool" / "CLIPVisionModelTaskPool" / f"{name}.yaml",
    }
    for key, content in (("modelpool", pool), ("taskpool", taskpool)):
        paths[key].parent.mkdir(parents=True, exist_ok=True)
        paths[key].write_text(yaml.safe_dump(content, sort_keys=False))
    return {"config_dir": str(config_root), **{k: str(v) for k, v in paths.items()}}
