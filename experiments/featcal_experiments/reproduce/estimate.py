"""How long a paper table takes, estimated from per-setting component times (``experiments/scripts/bench_rows.py``).

A table costs the sum over its distinct runs (an upstream merger runs once for all its calibrators, as the runner
does). A run costs its method's own stage plus one evaluation pass over the test sets it is scored on:

- ``pretrained``, ``finetuned/<task>``, Simple Averaging, Task Arithmetic: evaluation only (their merge is a few
  tensor additions);
- AdaMerging, WUDI: the bench's extrapolated test-time adaptation / 400 iterations, then evaluation;
- ``<upstream>+<calibrator>``: the calibrator's stage (FeatCal's whole run; Surgery's and ProbSurgery's 1000
  steps, extrapolated), then evaluation.

An evaluation pass moves ``TEST_IMAGES`` images at the slower of the GPU's forward rate and the data loader's
preprocessing rate (FusionBench's 8 workers times one worker's measured rate). Not included: loading checkpoints
and datasets from the hub or disk, image decoding, process start-up. Only CLIP settings have components.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Optional

from .catalog import Row, Run

# Test-split sizes of FusionBench's CLIP datasets (tanganke/* on the hub; the standard splits).
TEST_IMAGES = {
    "sun397": 19850, "stanford-cars": 8041, "resisc45": 6300, "eurosat": 2700, "svhn": 26032, "gtsrb": 12630,
    "mnist": 10000, "dtd": 1880, "oxford_flowers102": 6149, "pcam": 32768, "fer2013": 3589,
    "oxford-iiit-pet": 3669, "stl10": 8000, "cifar100": 10000, "cifar10": 10000, "food101": 25250,
    "fashion_mnist": 10000, "emnist_letters": 20800, "kmnist": 10000, "rendered-sst2": 1821,
}
LOADER_WORKERS = 8  # FusionBench's CLIP task pool (dataloader_kwargs.num_workers)
UPSTREAM_STAGE = {"adamerging": "adamerging", "wudi": "wudi"}


def eval_seconds(component: Mapping, tasks: Iterable[str]) -> float:
    rate = min(component["eval_images_per_second"],
               LOADER_WORKERS * component["preprocess_images_per_second_per_worker"])
    return sum(TEST_IMAGES[t] for t in tasks) / rate


def stage_seconds(component: Mapping, run: Run) -> float:
    """The run's own stage before evaluation."""
    if run.kind == "reference":
        return 0.0
    if run.kind == "upstream":
        stage = UPSTREAM_STAGE.get(run.method)
        return component[stage]["seconds_at_target"] if stage else 0.0
    calibrator = run.calibrator
    return component["featcal_seconds"] if calibrator == "featcal" else component[calibrator]["seconds_at_target"]


def run_seconds(component: Mapping, run: Run, tasks: Iterable[str]) -> float:
    return stage_seconds(component, run) + eval_seconds(component, [run.task] if run.task else tasks)


def table_estimate(rows: List[Row], components: Mapping[str, Mapping], tasks: Mapping[str, Iterable[str]],
                   dependencies) -> Dict:
    """``components``: bench results by setting key; ``tasks``: each setting's tasks; ``dependencies(run)``:
    the upstream runs a run reads (``Catalog.dependencies``). Returns seconds by run id, the total, and the
    settings with no components (their rows are left out of the total)."""
    runs: Dict[str, Run] = {}
    for row in rows:
        for run in row.runs:
            for dep in (*dependencies(run), run):
                runs.setdefault(dep.id, dep)
    seconds: Dict[str, float] = {}
    missing = set()
    for run_id, run in runs.items():
        component = components.get(run.setting)
        if component is None:
            missing.add(run.setting)
            continue
        seconds[run_id] = run_seconds(component, run, tasks[run.setting])
    return {"run_seconds": seconds, "total_seconds": sum(seconds.values()), "missing_settings": sorted(missing)}


def by_setting(bench: Mapping) -> Dict[str, Mapping]:
    """``experiments/scripts/bench_rows.py``'s JSON -> its results by setting key (``b32-8``, ...)."""
    return {result["setting"]: result for result in bench["results"]}


def format_hours(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"
