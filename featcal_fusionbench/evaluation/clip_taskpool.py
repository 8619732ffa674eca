"""A CLIP task pool for tasks that FusionBench does not know by name (local or offline data)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Dict, List, Optional

from fusion_bench.taskpool import CLIPVisionModelTaskPool
from fusion_bench.tasks.clip_classification import CLIPTemplateFactory
from omegaconf import DictConfig

DEFAULT_TEMPLATES = ["a photo of a {}."]


def register_clip_task(name: str, classnames: List[str], templates: Optional[List[str]] = None) -> None:
    """Register class names and prompt templates (``"... {} ..."`` strings) for a task name.

    Sets the mapping directly: ``CLIPTemplateFactory.register_dataset`` in 0.2.33
    stores its templates under a misspelt key.
    """
    templates = templates or DEFAULT_TEMPLATES
    for template in templates:
        if "{}" not in template:
            raise ValueError(f"template {template!r} of task {name!r} has no '{{}}' for the class name")
    CLIPTemplateFactory._dataset_mapping[name] = {
        "classnames": list(classnames),
        "templates": [lambda c, t=t: t.format(c) for t in templates],
    }


class LocalCLIPVisionModelTaskPool(CLIPVisionModelTaskPool):
    """FusionBench's CLIP task pool, plus ``classnames`` / ``templates`` for its tasks.

    Args:
        classnames: task name -> list of class names.
        templates: prompt templates shared by all tasks, or task name -> templates.
    """

    def __init__(self, test_datasets, *, classnames: Dict[str, List[str]], templates=None, **kwargs):
        super().__init__(test_datasets, **kwargs)
        for task in test_datasets:
            if task not in classnames:
                raise ValueError(f"no class names given for task {task!r}")
            task_templates = templates.get(task) if isinstance(templates, (Mapping, DictConfig)) else templates
            register_clip_task(task, classnames[task], task_templates)
