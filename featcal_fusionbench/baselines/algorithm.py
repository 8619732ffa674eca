"""Surgery and ProbSurgery after any upstream merger, on FeatCal's calibration budget.

Both train small per-task maps on the merged model's feature at its family's feature site
(CLIP: the projected, normalised image feature) so that it matches the expert's (L1), one
Adam step per task per iteration,
as the original methods and FusionBench's Surgery do. Their calibration stream is
capped at ``num_calibration_examples`` per task (the paper's matched-budget protocol),
drawn from the train split (FeatCal's protocol) or the unlabeled test split (their
native test-time adaptation).
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any, Dict, Iterator, List, Mapping, Optional, Union

import torch
import torch.nn.functional as F
from fusion_bench import BaseAlgorithm, BaseModelPool, auto_register_config
from fusion_bench.mixins import LightningFabricMixin, SimpleProfilerMixin
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..families import checked_options, family_for, to_device
from ..families.base import batch_loader
from ..integration.data import SPLITS, calibration_source, select_calibration_data
from ..integration.hub_access import check_path_option
from ..integration.post_merging import PostMergingMixin, peak_memory
from .modules import ProbSurgeryModelWrapper, SurgeryModelWrapper, kl_to_standard_normal

log = logging.getLogger(__name__)

#: precompute_features' third value: the features computed once, then the streamed run's own batches replayed
REPLAY = "replay"
FEATURE_MODES = {False: "streamed", True: "precomputed", REPLAY: "replayed"}


def _check_int(name, value, minimum):
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@auto_register_config
class FeatureSurgeryAlgorithm(PostMergingMixin, LightningFabricMixin, SimpleProfilerMixin, BaseAlgorithm):
    """Shared loop; subclasses give the wrapper and the loss."""

    report_name = "surgery_report.json"

    def __init__(
        self,
        upstream: Optional[Any] = None,
        merged_model_path: Optional[str] = None,
        num_calibration_examples: int = 256,
        calibration_split: str = "train",
        max_steps: int = 1000,
        batch_size: int = 16,
        lr: float = 1e-3,
        seed: int = 42,
        precompute_features: Union[bool, str] = False,
        eval_iterations: Optional[int] = None,
        return_upstream: bool = False,
        calibration_datasets: Optional[Mapping[str, Any]] = None,
        family_options: Optional[Mapping[str, Any]] = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        check_path_option("method.merged_model_path", merged_model_path)
        checked_options(family_options)
        _check_int("num_calibration_examples", num_calibration_examples, 1)
        _check_int("max_steps", max_steps, 0)
        _check_int("batch_size", batch_size, 1)
        _check_int("seed", seed, 0)
        if eval_iterations is not None:
            _check_int("eval_iterations", eval_iterations, 1)
        if not isinstance(lr, (int, float)) or not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr!r}")
        if calibration_split not in SPLITS:
            raise ValueError(f"calibration_split must be one of {SPLITS}, got {calibration_split!r}")
        if not (isinstance(precompute_features, bool) or precompute_features == REPLAY):
            raise ValueError(f"precompute_features must be false, true or {REPLAY}, got {precompute_features!r}")

    # ---- what differs between the methods ------------------------------------------------------

    def build_wrapper(self, merged: nn.Module, tasks: List[str], projection_dim: int) -> nn.Module:
        raise NotImplementedError

    def loss(self, wrapper: nn.Module, features: Tensor, expert_features: Tensor, task: str) -> Tensor:
        raise NotImplementedError

    # ---- the shared loop -------------------------------------------------------------------------

    def feature_stream(self, family, site, modelpool, merged, expert, dataset, task_index: int) -> Iterator[tuple]:
        """(merged feature, expert feature) batches: streamed through both models every step (the
        originals' way; seeded shuffled batches of the capped calibration set, recycled), or with
        ``precompute_features`` computed once in one ordered pass and resampled (rows: images, or
        target tokens for T5), or (``replay``) computed once and served in the streamed run's batches, its
        order and composition, so that the maps train as streamed ones do, to float rounding."""
        device = self.fabric.device
        seed = self.seed + task_index

        def pair(inputs):
            inputs = to_device(inputs, device)
            with torch.no_grad():
                return site.features(merged, inputs), site.features(expert, inputs)

        def ordered_pass():
            return [pair(x) for x in family.batches(modelpool, dataset, self.batch_size, shuffle=False, seed=seed)]

        if not self.precompute_features:
            return (pair(x) for x in family.batches(modelpool, dataset, self.batch_size, shuffle=True, seed=seed))
        if self.precompute_features == REPLAY:
            # The ordered loader draws its base seed from the global generator, which streaming leaves to
            # ProbSurgery's noise: restored, so that the noise is the streamed run's too.
            with torch.random.fork_rng(devices=[]):
                merged_f, expert_f = (torch.cat(f) for f in zip(*ordered_pass()))
            if len(merged_f) != len(dataset):
                raise RuntimeError(f"{len(merged_f)} feature rows for {len(dataset)} examples: replay needs one per example")
            # The streamed loader's shuffling reads the generator by the dataset's length alone, so a loader of the
            # row indices draws the same batches, epoch after epoch.
            order = batch_loader(range(len(dataset)), self.batch_size, shuffle=True, seed=seed)
            return ((merged_f[idx.to(device)], expert_f[idx.to(device)]) for idx in order)
        merged_f, expert_f = (torch.cat(f) for f in zip(*ordered_pass()))
        generator = torch.Generator().manual_seed(seed)
        size = min(self.batch_size, len(merged_f))

        def resample():
            while True:
                idx = torch.randperm(len(merged_f), generator=generator)[:size].to(device)
                yield merged_f[idx], expert_f[idx]

        return resample()

    def train(
        self, wrapper: nn.Module, streams: Dict[str, Iterator[tuple]], deployed: Optional[nn.Module] = None
    ) -> Dict[str, List[float]]:
        """The calibration stage: ``max_steps`` iterations, one Adam step per task; returns losses.
        ``deployed`` is what ``eval_iterations`` evaluates (the wrapper as the task pool sees it)."""
        tasks = list(streams)
        optimizer = torch.optim.Adam(
            wrapper.collect_trainable_params(), lr=self.lr, betas=(0.9, 0.999), weight_decay=0.0
        )
        history: Dict[str, List[float]] = {t: [] for t in tasks}
        wrapper.train()
        wrapper.model.eval()
        for step in tqdm(range(self.max_steps), desc=f"{self.method_name} steps", dynamic_ncols=True):
            for task in tasks:
                merged_f, expert_f = next(streams[task])
                loss = self.loss(wrapper, merged_f, expert_f, task)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"{self.method_name}: non-finite loss at step {step} on task {task!r}")
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                history[task].append(loss.item())
            if step % 50 == 0:
                self.log_metrics({f"{self.method_name}/loss/{t}": history[t][-1] for t in tasks}, step)
            if self.eval_iterations and (step + 1) % self.eval_iterations == 0 and getattr(self, "_program", None):
                wrapper.eval()
                self._program.evaluate_merged_model(self._program.taskpool, deployed or wrapper)
                wrapper.train()
                wrapper.model.eval()
        wrapper.eval()
        return history

    def run(self, modelpool: BaseModelPool):
        if not isinstance(modelpool, BaseModelPool):
            modelpool = BaseModelPool(modelpool)
        tasks = self.check_pool(modelpool, self.calibration_split)
        # The data first: a dataset that is missing a field or too small fails before any model is loaded.
        with self.profile("load calibration data"):
            datasets = select_calibration_data(
                modelpool, tasks, self.num_calibration_examples, self.seed, self.calibration_split,
                self.calibration_datasets,
            )
        with self.profile("load models"):
            base = modelpool.load_pretrained_model()
            family = family_for(base, dict(self.family_options or {}))
            family.check_models(modelpool, base)
            site = family.feature_site(modelpool, base)  # a pool that cannot give it fails before the experts
            if self.precompute_features == REPLAY and not site.one_row_per_example:
                raise ValueError(f"precompute_features={REPLAY} serves one feature row per example, and the "
                                 f"{family.name} family's site has one per token: use true or false")
            experts = self.load_experts(modelpool, tasks, base)
        with self.profile("upstream merge"):
            merged, source = self.load_merged(modelpool, base, experts)
        del base
        upstream_model = copy.deepcopy(merged) if self.return_upstream else None

        device = self.fabric.device
        torch.manual_seed(self.seed)  # wrapper initialisation and ProbSurgery's noise
        wrapper = self.build_wrapper(merged, tasks, site.dim).to(device)
        deployed = site.deploy(wrapper)
        site.to(device)
        for expert in experts.values():
            expert.requires_grad_(False).eval().to(device)

        started = time.perf_counter()
        with self.profile("calibration"):
            streams = {
                task: self.feature_stream(family, site, modelpool, wrapper.model, experts[task], datasets[task], i)
                for i, task in enumerate(tasks)
            }
            history = self.train(wrapper, streams, deployed)
        seconds = time.perf_counter() - started
        report = {
            "method": self.method_name,
            "upstream": source,
            "calibration_split": self.calibration_split,
            "calibration_data": {
                t: calibration_source(t, self.calibration_split, self.calibration_datasets) for t in tasks
            },
            "features": FEATURE_MODES[self.precompute_features],
            "num_calibration_examples": self.num_calibration_examples,
            "max_steps": self.max_steps,
            "seconds": seconds,
            **peak_memory(device),
            "final_loss": {t: sum(h[-10:]) / max(len(h[-10:]), 1) for t, h in history.items()},
            "first_loss": {t: (h[0] if h else None) for t, h in history.items()},
        }
        self.save_report(self.report_name, report)
        self.print_profile_summary(f"{self.method_name} profile")
        for expert in experts.values():
            expert.to("cpu")
        key = self.method_name.lower()
        if self.return_upstream:
            return {"upstream": upstream_model, key: deployed, f"{key}_calibration": report}
        return deployed


@auto_register_config
class SurgeryAlgorithm(FeatureSurgeryAlgorithm):
    """Representation Surgery (Yang et al., ICML 2024) after any upstream merger.

    Per task: f' = f - up(ReLU(down(f))), down d -> rank (Kaiming), up rank -> d (zeros), no biases.
    """

    method_name = "Surgery"
    report_name = "surgery_report.json"

    def __init__(self, rank: int = 16, **kwargs):
        _check_int("rank", rank, 1)
        super().__init__(**kwargs)

    def build_wrapper(self, merged, tasks, projection_dim):
        return SurgeryModelWrapper(merged, tasks, projection_dim=projection_dim, hidden_dim=self.rank)

    def loss(self, wrapper, features, expert_features, task):
        mapped, _, _ = wrapper.compute_surgery_features(features, task)
        return F.l1_loss(mapped, expert_features)


@auto_register_config
class ProbSurgeryAlgorithm(FeatureSurgeryAlgorithm):
    """ProbSurgery (Wei et al., ICML 2025) after any upstream merger; evaluated with the mean."""

    method_name = "ProbSurgery"
    report_name = "probsurgery_report.json"

    def __init__(self, hidden_dim: int = 128, kl_weight: float = 1e-4, **kwargs):
        _check_int("hidden_dim", hidden_dim, 1)
        if not isinstance(kl_weight, (int, float)) or kl_weight < 0:
            raise ValueError(f"kl_weight must be >= 0, got {kl_weight!r}")
        super().__init__(**kwargs)

    def build_wrapper(self, merged, tasks, projection_dim):
        return ProbSurgeryModelWrapper(merged, tasks, projection_dim=projection_dim, hidden_dim=self.hidden_dim)

    def loss(self, wrapper, features, expert_features, task):
        mapped, mu, logvar = wrapper.sample(features, task)
        return F.l1_loss(mapped, expert_features) + self.kl_weight * kl_to_standard_normal(mu, logvar)
