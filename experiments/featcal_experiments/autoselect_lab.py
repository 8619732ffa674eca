"""In-process lab for ``method.auto_select``: one world's pools, models and calibration data loaded once, then
any number of calibrations (fixed values, a per-block policy, ``auto_select``) each scored by the world's own task
pool, as ``fusion_bench`` would score it (issue 61).

The study (``scripts/autoselect_study.py``) runs every number it checks in through ``fusion_bench``; the lab is for
the questions in between (a 200-point oracle grid, a criterion's per-block scores against the test accuracy of its
choice), where a process per point would cost most of the time. ``Lab.check_against`` compares a lab result with
the same command's ``fusion_bench`` run.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Mapping, Optional, Sequence

import lightning as L
import numpy as np
import torch
from omegaconf import OmegaConf

log = logging.getLogger(__name__)


class Lab:
    """``args``: the ``fusion_bench`` arguments of a FeatCal run (method, its options, pools), as the study's
    catalog writes them (``path.log_dir`` left out). The merged model is read once (``method.merged_model_path``)."""

    def __init__(self, args: Sequence[str]):
        from fusion_bench.utils import instantiate

        from featcal_experiments.worlds.registry import compose_cli

        self.args = [a for a in args if not a.startswith("path.log_dir=")]
        self.cfg = compose_cli(self.args)
        self.fabric = L.Fabric(accelerator="cpu", devices=1)
        self.modelpool = instantiate(self.cfg.modelpool)
        self.taskpool = instantiate(self.cfg.taskpool)
        self.taskpool._fabric_instance = self.fabric
        # what FusionBench's program gives every pool it builds (fabric_fusion_program.py: `obj._program = self`):
        # an lm-eval task pool reads the model pool's tokenizer through it (a merged model's folder has none)
        self.taskpool._program = SimpleNamespace(modelpool=self.modelpool, fabric=self.fabric)
        self._prepared: Dict[tuple, Any] = {}
        self._batches: Dict[Any, list] = {}
        self._fast_eval = None
        self._text_eval = None

    def algorithm(self, **overrides):
        """The method as the config composes it, with ``overrides`` (``method.<key>``) applied."""
        from fusion_bench.utils import instantiate

        method = OmegaConf.merge(self.cfg.method, OmegaConf.create(overrides))
        algorithm = instantiate(method)
        algorithm._fabric_instance = self.fabric
        return algorithm

    def prepare(self, n: int, seed: int):
        """(algorithm, datasets, base, experts, family, merged) for n examples per task and a seed, cached."""
        key = (n, seed)
        if key not in self._prepared:
            algorithm = self.algorithm(num_calibration_examples=n, seed=seed)
            algorithm.in_memory = "all"
            tasks = algorithm.check_pool(self.modelpool)
            datasets = algorithm._calibration_data(self.modelpool, tasks)
            base, experts, family = algorithm._models(self.modelpool, tasks)
            merged, _ = algorithm._source(self.modelpool, base, experts)
            self._prepared = {key: (algorithm, datasets, base, experts, family, merged)}
        return self._prepared[key]

    def calibrate(self, n: int, seed: int, policy=None, auto_select=None, **hparams):
        """A calibrated copy of the merged model and the engine's report. ``hparams``: lambda_ / rho / alpha and the
        like over the method's; ``policy``: an ``engine.policy.HParamPolicy`` (held-out batches are given when it
        needs them, split as ``auto_select`` splits them); ``auto_select``: the method's option, as a mapping."""
        from dataclasses import replace

        from featcal_fusionbench.autoselect.options import SelectionOptions
        from featcal_fusionbench.autoselect.search import alpha_site, auto_calibrate, split_datasets
        from featcal_fusionbench.engine.loop import FeatCalEngine
        from featcal_fusionbench.families import family_for

        algorithm, datasets, base, experts, family, merged = self.prepare(n, seed)
        hp = replace(algorithm.featcal_hparams, **hparams)
        model = copy.deepcopy(merged)

        def batches_of(dataset):  # the same examples give the same batches: made once per lab
            key = _examples_key(dataset)
            if key is None:
                return family.batches(self.modelpool, dataset, hp.batch_size)
            if key not in self._batches:
                self._batches[key] = list(family.batches(self.modelpool, dataset, hp.batch_size))
            return list(self._batches[key])

        def make_engine(hparams, engine_family, search=False, **kwargs):
            return FeatCalEngine(engine_family, hparams, self.fabric.device, progress=False, **kwargs)

        started = time.perf_counter()
        if auto_select is not None:
            options = SelectionOptions.parse(auto_select)
            site = alpha_site(family, self.modelpool, base) if options.reads_site else None
            report = auto_calibrate(make_engine, lambda extra: family_for(base, {**algorithm.family_options, **extra}),
                                    options, hp, model, base, experts, datasets, batches_of, self.fabric.device,
                                    site=site)
        elif policy is not None and getattr(policy, "folds", None):  # the lab's cross-fitting variants
            from featcal_experiments.autoselect_variants import PerSiteSelection, per_site_engine

            parts = {t: kfold(d, policy.folds, hp.seed, t) for t, d in datasets.items()}
            if isinstance(policy, PerSiteSelection):
                engine = per_site_engine(FeatCalEngine)(family, hp, self.fabric.device, progress=False, policy=policy)
            else:
                engine = make_engine(hp, family, policy=policy)
            report = self._run_parts(engine, model, base, experts, parts, batches_of)
        elif policy is not None and policy.needs_parts:  # the rule before issue 61: a fit and a held-out part
            fit, held, _ = split_datasets(datasets, SelectionOptions(), hp.seed)
            parts = {t: [fit[t], held[t]] for t in datasets}
            report = self._run_parts(make_engine(hp, family, policy=policy), model, base, experts, parts, batches_of)
        else:
            report = make_engine(hp, family, policy=policy).run(
                model, base, experts, {t: batches_of(d) for t, d in datasets.items()})
        report["lab_seconds"] = time.perf_counter() - started
        return model, report

    @staticmethod
    def _run_parts(engine, model, base, experts, parts, batches_of):
        batches = {t: [list(batches_of(p)) for p in ps] for t, ps in parts.items()}
        return engine.run(model, base, experts, {t: [b for bs in parts_ for b in bs] for t, parts_ in batches.items()},
                          {t: [len(bs) for bs in parts_] for t, parts_ in batches.items()})

    def evaluate(self, model, exact: bool = False) -> Dict[str, float]:
        """Task -> score in percent, and ``average``, as the study's tables read a program report. CLIP task pools
        are scored from cached test batches and zero-shot heads (``ClipEvaluation``, checked equal to the task
        pool's own evaluation by ``check_fast_evaluation``); ``exact``: the task pool's ``evaluate`` itself."""
        from featcal_experiments.reproduce.render import scores

        if not exact and self._clip_pool():
            return self.zero_shot_heads()(model)
        report = self.taskpool.evaluate(model)
        return scores(json.loads(json.dumps(report, default=float)))

    def zero_shot_heads(self) -> "ClipEvaluation":
        if self._fast_eval is None:
            self._fast_eval = ClipEvaluation(self.taskpool)
        return self._fast_eval

    def _clip_pool(self) -> bool:
        from fusion_bench.taskpool import CLIPVisionModelTaskPool

        return isinstance(self.taskpool, CLIPVisionModelTaskPool)

    def per_example(self):
        """The world's per-test-example records (``ClipEvaluation`` or ``TextEvaluation``), None for other pools."""
        from featcal_fusionbench.evaluation.text_taskpool import TextGenerationTaskPool

        if self._clip_pool():
            return self.zero_shot_heads()
        if isinstance(self.taskpool, TextGenerationTaskPool):
            if self._text_eval is None:
                self._text_eval = TextEvaluation(self.taskpool)
            return self._text_eval
        return None

    def check_fast_evaluation(self, model) -> None:
        fast, exact = self.evaluate(model), self.evaluate(model, exact=True)
        if any(abs(fast[k] - exact[k]) > 1e-4 for k in exact):  # torchmetrics divides in float32
            raise AssertionError(f"the lab's CLIP evaluation {fast} differs from the task pool's {exact}")

    def score(self, n: int, seed: int, **kwargs) -> Dict[str, Any]:
        model, report = self.calibrate(n, seed, **kwargs)
        result = self.evaluate(model)
        return {"scores": result, "average": result["average"], "report": report}


def alpha_probe(lab: Lab, n: int, seed: int, alphas: Sequence[float], test: bool = True, test_fit: bool = False,
                **hparams) -> List[Dict[str, Any]]:
    """Per alpha at fixed ``hparams`` (lambda_, rho): the end-of-model criteria after a calibration on the fit part
    of ``auto_select``'s split (the last block's mean cosine to the experts' on the held-out part, all tokens and the
    family's feature site, the head's argmax agreement where the family has a head; for a generating family the
    greedy output's agreement with the expert's, the expert's probability of it, criterion ``site``'s measure (the
    probability, or a number-writing task's rank agreement with the expert's numbers) and each task's own metric
    with the expert's outputs for labels), and (``test``) the test score of the calibration on all
    examples: does a label-free end-of-model criterion rank alpha as the test labels do? ``test_fit``: also the test
    score of the very copy the criteria read (calibrated on the fit part), which tells a criterion's error from the
    gap between the fit part's size and all examples'."""
    from dataclasses import replace

    import torch.nn.functional as F

    from featcal_fusionbench.autoselect.options import SelectionOptions
    from featcal_fusionbench.autoselect.search import (AlphaSite, ExpertProbability, HeldoutReference, pool_tokenizer,
                                                       split_datasets)
    from featcal_fusionbench.engine.loop import FeatCalEngine

    algorithm, datasets, base, experts, family, merged = lab.prepare(n, seed)
    hp = replace(algorithm.featcal_hparams, **hparams)
    device = lab.fabric.device
    fit, held, _ = split_datasets(datasets, SelectionOptions(), hp.seed)
    cache: Dict[int, list] = {}

    def batches_of(dataset):
        if id(dataset) not in cache:
            cache[id(dataset)] = list(family.batches(lab.modelpool, dataset, hp.batch_size))
        return list(cache[id(dataset)])

    def held_batches(task):
        return batches_of(held[task])

    site = AlphaSite(family.feature_site(lab.modelpool, merged)).hold_out(family, experts, held_batches, device)
    heads = lab.zero_shot_heads() if lab._clip_pool() else None
    expert_logits = {t: heads.logits(e, t, held_batches(t)) for t, e in experts.items()} if heads else None
    output = family.output_site()  # a generating family: what its task pool scores, and the expert's probability
    if output is not None:
        probability = ExpertProbability(output).hold_out(family, experts, held_batches, device)
        # criterion site's measure as the product reads it: with the pool's tokenizer, number tasks by rank
        measure = ExpertProbability(family.output_site(pool_tokenizer(lab.modelpool))).hold_out(
            family, experts, held_batches, device)
        decode = lab.taskpool.tokenizer.batch_decode

        def generated(model, task):
            return [text for b in held_batches(task) for text in decode(output.generate(model, b),
                                                                        skip_special_tokens=True)]

        expert_texts = {t: generated(e, t) for t, e in experts.items()}
    drift = HeldoutReference(family, experts, held_batches, device, "drift")
    agreement = HeldoutReference(family, experts, held_batches, device, "agreement")

    def calibrated(data, alpha):
        model = copy.deepcopy(merged)
        FeatCalEngine(family, replace(hp, alpha=alpha), device, progress=False).run(
            model, base, experts, {t: batches_of(d) for t, d in data.items()})
        return model

    out = []
    for alpha in alphas:
        model = calibrated(fit, alpha)
        per_task = {"drift": drift.score(family, model, held_batches),
                    "site": {t: float(c.mean()) for t, c in site.example_scores(family, model, held_batches).items()}}
        if agreement.criterion == "agreement":
            per_task["agreement"] = agreement.score(family, model, held_batches)
        if heads:  # the task's zero-shot head (class names, no example's label) read on the held-out images
            logits = {t: heads.logits(model, t, held_batches(t)) for t in experts}
            per_task["head_agreement"] = {t: float((logits[t].argmax(-1) == expert_logits[t].argmax(-1)).float().mean())
                                          for t in experts}
            per_task["head_expert_probability"] = {
                t: float(expert_logits[t].softmax(-1).gather(-1, logits[t].argmax(-1, keepdim=True)).mean())
                for t in experts}
            per_task["head_kl"] = {t: float(F.kl_div(logits[t].log_softmax(-1), expert_logits[t].log_softmax(-1),
                                                     log_target=True, reduction="batchmean")) for t in experts}
        if output is not None:  # greedy generation as the task pool generates, on the held-out inputs
            texts = {t: generated(model, t) for t in experts}
            per_task["generation_agreement"] = {
                t: float(np.mean([a == b for a, b in zip(texts[t], expert_texts[t])])) for t in experts}
            per_task["expert_probability"] = {t: float(c.mean()) for t, c in probability.example_scores(
                family, model, held_batches).items()}
            per_task["site_measure"] = {t: float(c.mean()) for t, c in measure.example_scores(
                family, model, held_batches).items()}
            # each task scored by its own metric, the expert's generations standing in for the labels
            per_task["expert_referenced_metric"] = {t: referenced_metric(lab.taskpool, t, texts[t], expert_texts[t])
                                                    for t in experts}
        row = {"alpha": alpha, **{k: sum(v.values()) / len(v) for k, v in per_task.items()}, "per_task": per_task}
        if test_fit:
            scored = lab.evaluate(model)
            row.update(test_fit=scored["average"], test_fit_per_task=scored)
        del model
        if test:
            scored = lab.evaluate(calibrated(datasets, alpha))
            row.update(test=scored["average"], test_per_task=scored)
        out.append(row)
    return out


def referenced_metric(taskpool, task: str, outputs: Sequence[str], references: Sequence[str]) -> float:
    """``task``'s metric as ``taskpool`` scores it (exact match, or Spearman's rho of ``float()``-parsed texts, 0 for
    text that does not parse, as FusionBench's ``evaluate_spearman_rho``), against ``references`` for labels."""
    from scipy.stats import spearmanr

    from featcal_fusionbench.evaluation.text_taskpool import SPEARMAN

    if taskpool.metric(task) != SPEARMAN:
        return float(np.mean([a == b for a, b in zip(outputs, references)]))

    def number(text):
        try:
            return float(text)
        except ValueError:
            return 0.0

    rho = spearmanr([number(a) for a in outputs], [number(b) for b in references])[0]
    return 0.0 if math.isnan(rho) else float(rho)


def kfold(dataset, folds: int, seed: int, task: str):
    """``folds`` disjoint parts of a task's calibration examples covering it, seeded by (seed, task)."""
    import zlib

    import numpy as np

    from featcal_fusionbench.core.sampling import subset

    order = np.random.default_rng([seed, zlib.crc32(task.encode()), zlib.crc32(b"folds")]).permutation(len(dataset))
    return [subset(dataset, sorted(order[f::folds].tolist())) for f in range(folds)]


def _examples_key(dataset):
    """What identifies a calibration subset's examples (None: unknown, batches made each time)."""
    from torch.utils.data import Subset

    if isinstance(dataset, Subset):
        return id(dataset.dataset), tuple(dataset.indices)
    fingerprint = getattr(dataset, "_fingerprint", None)
    return None if fingerprint is None else ("hf", fingerprint)


class ClipEvaluation:
    """FusionBench's CLIP task pool evaluation (``CLIPVisionModelTaskPool.evaluate``: the zero-shot head of each
    task, argmax accuracy over its test loader's batches) with the test batches and heads computed once."""

    def __init__(self, taskpool):
        from fusion_bench.models.hf_clip import HFCLIPClassifier
        from fusion_bench.tasks.clip_classification import get_classnames_and_templates

        if not taskpool._is_setup:
            taskpool.setup()
        self.taskpool = taskpool
        self.classifier = HFCLIPClassifier(taskpool.clip_model, processor=taskpool.processor)
        self.tasks = {}
        for task, loader in taskpool.test_dataloaders.items():
            classnames, templates = get_classnames_and_templates(task)
            self.classifier.set_classification_task(classnames, templates)
            batches = [(inputs.clone(), targets.clone()) for inputs, targets in loader]
            self.tasks[task] = (self.classifier.zeroshot_weights.clone(), batches)

    @torch.no_grad()
    def logits(self, model, task: str, images) -> torch.Tensor:
        """``model``'s zero-shot logits of ``task``'s classes on batches of pixel values (float32, on the CPU)."""
        self.classifier.clip_model.vision_model = model
        self.classifier.zeroshot_weights = self.tasks[task][0]
        return torch.cat([self.classifier(pixel_values).float().cpu() for pixel_values in images])

    def correct(self, model) -> Dict[str, torch.Tensor]:
        """Per task: whether the argmax of each test example's logits is its label, in the test loader's order."""
        out = {}
        for task, (_weights, batches) in self.tasks.items():
            logits = self.logits(model, task, [inputs for inputs, _targets in batches])
            out[task] = logits.argmax(-1) == torch.cat([targets for _inputs, targets in batches])
        return out

    def __call__(self, model) -> Dict[str, float]:
        out = {task: 100.0 * int(hits.sum()) / len(hits) for task, hits in self.correct(model).items()}
        out["average"] = sum(out.values()) / len(out)
        return out

    labels: Dict[str, Any] = {}  # no task is scored by Spearman's rho


def parsed_number(text: str) -> float:
    """A generated or label text as FusionBench's ``evaluate_spearman_rho`` parses it (its inner ``parse_flost``:
    ``float(text)``, 0.0 where that fails; fusion_bench/tasks/flan_t5_text_generation/glue_evaluation.py)."""
    try:
        return float(text)
    except Exception:
        return 0.0


class TextEvaluation:
    """Per test example, what ``TextGenerationTaskPool`` scores (FusionBench's ``evaluate_accuracy`` /
    ``evaluate_spearman_rho``: ``generate(input_ids, max_length)``, the decoded output against the decoded label with
    special tokens removed): for an accuracy task whether the two texts are equal, for a regression task the parsed
    output; ``labels``: the regression tasks' parsed labels. Test batches are made once, in the pool's order."""

    def __init__(self, taskpool):
        from fusion_bench.tasks.flan_t5_text_generation.glue_evaluation import remove_special_tokens
        from torch.utils.data import DataLoader
        from transformers import default_data_collator

        self.taskpool = taskpool
        tokenizer = taskpool.tokenizer
        self.tasks, self.labels = {}, {}
        for task in taskpool.task_names:
            loader = DataLoader(taskpool.load_test_dataset(task), batch_size=taskpool.batch_size, shuffle=False,
                                collate_fn=default_data_collator)
            batches, texts = [], []
            for batch in loader:
                batches.append(batch["input_ids"])
                texts += tokenizer.batch_decode([remove_special_tokens(tokenizer, label) for label in batch["labels"]],
                                                skip_special_tokens=True)
            self.tasks[task] = (batches, texts)
            if taskpool.metric(task) != "accuracy":
                self.labels[task] = np.array([parsed_number(t) for t in texts])

    @torch.no_grad()
    def correct(self, model) -> Dict[str, np.ndarray]:
        model = model.eval()
        tokenizer = self.taskpool.tokenizer
        out = {}
        for task, (batches, texts) in self.tasks.items():
            outputs = [text for input_ids in batches for text in tokenizer.batch_decode(
                model.generate(input_ids, max_length=self.taskpool.max_length), skip_special_tokens=True)]
            out[task] = (np.array([parsed_number(o) for o in outputs]) if task in self.labels
                         else np.array([o == t for o, t in zip(outputs, texts)]))
        return out
