"""How finely a world's test labels rank a grid of calibrations (issue 61).

The study's oracle is the best of many points scored on the same test labels it is judged on, so its score is
biased upward by the test set's own noise, and a label-free rule is compared with that maximum. Measures that are
pure functions of per-example records (each task: a ``(points, examples)`` array; a point's score is the mean over
tasks of each task's score in percent, as FusionBench's CLIP and text task pools average them). A task's records
are booleans (correct or not: its score is the accuracy) or, for a task named in ``labels``, each example's parsed
numeric output, scored by Spearman's rho against ``labels[task]`` as FusionBench's ``evaluate_spearman_rho`` scores a
regression task (average ranks for ties, a Pearson correlation of the ranks); a rho that is undefined on a resample
(constant outputs) counts as 0, as the text world's own ``score`` counts it:

- ``oracle_bias``: the bootstrap estimate of the upward bias of the maximum (each task's test examples resampled
  with replacement; the mean of the resampled maxima minus the observed maximum);
- ``split_half``: each task's test examples cut into two random halves; the point a labelled sweep would take on
  one half (a validation set with labels), scored on the other, beside the other half's own best (the oracle at half
  the size) and each rule, every number read on the same half;
- ``paired``: one rule's lead over another on the test set, with the bootstrap's standard error of that lead (both
  read on the same resampled examples).
"""

from __future__ import annotations

import math
from typing import Dict, Mapping, Optional

import numpy as np
from scipy.stats import rankdata


Labels = Optional[Mapping[str, np.ndarray]]


def spearman_rows(outputs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Per row of ``outputs`` (rows, examples): Spearman's rho with ``labels`` (examples,); 0 where undefined."""
    ranked = rankdata(outputs, axis=1)
    ranked = ranked - ranked.mean(axis=1, keepdims=True)
    truth = rankdata(labels)
    truth = truth - truth.mean()
    scale = np.sqrt((ranked**2).sum(axis=1) * (truth**2).sum())
    with np.errstate(invalid="ignore", divide="ignore"):
        rho = ranked @ truth / scale
    return np.where(scale > 0, rho, 0.0)


def task_scores(records: np.ndarray, labels: Optional[np.ndarray] = None) -> np.ndarray:
    """Per row: the task's score in [0, 1], accuracy of boolean records or Spearman's rho against ``labels``."""
    return records.mean(axis=1) if labels is None else spearman_rows(records, labels)


def averages(correct: Mapping[str, np.ndarray], index: Optional[Mapping[str, np.ndarray]] = None,
             labels: Labels = None) -> np.ndarray:
    """Per row: the mean over tasks of the task's score in percent on the examples ``index`` names (all if None)."""
    labels = labels or {}
    scores = []
    for t, c in sorted(correct.items()):
        take = slice(None) if index is None else index[t]
        scores.append(task_scores(c[:, take], None if t not in labels else labels[t][take]))
    return 100.0 * np.mean(scores, axis=0)


def _resample(correct: Mapping[str, np.ndarray], rng) -> Dict[str, np.ndarray]:
    return {t: rng.integers(0, c.shape[1], c.shape[1]) for t, c in correct.items()}


def oracle_bias(correct: Mapping[str, np.ndarray], draws: int, seed: int, labels: Labels = None) -> Dict[str, float]:
    """The observed best row's score, and the bootstrap's estimate of how far the best of the rows lies above what
    the best would score on new test examples (``bias``, with the standard error of its ``draws``)."""
    rng = np.random.default_rng(seed)
    observed = float(averages(correct, labels=labels).max())
    maxima = np.array([averages(correct, _resample(correct, rng), labels).max() for _ in range(draws)])
    return {"oracle": observed, "bias": float(maxima.mean() - observed),
            "bias_se": float(maxima.std(ddof=1) / np.sqrt(draws))}


def split_half(correct: Mapping[str, np.ndarray], rules: Mapping[str, Mapping[str, np.ndarray]], splits: int,
               seed: int, labels: Labels = None) -> Dict[str, Dict[str, float]]:
    """Means over ``2 * splits`` halves (each split read both ways) of: ``sweep``, the grid's best row by the other
    half's labels; ``half_oracle``, the half's own best row; and each rule (``rules[name][task]``: one row of records over
    that task's examples), all scored on the half. Each entry: ``mean`` and ``sd`` over the halves."""
    rng = np.random.default_rng(seed)
    rows = {name: {t: r[None, :] for t, r in rule.items()} for name, rule in rules.items()}
    seen: Dict[str, list] = {"sweep": [], "half_oracle": [], **{name: [] for name in rules}}
    for _ in range(splits):
        cut = {t: rng.permutation(c.shape[1]) for t, c in correct.items()}
        halves = ({t: p[: len(p) // 2] for t, p in cut.items()}, {t: p[len(p) // 2:] for t, p in cut.items()})
        for chosen_on, read_on in (halves, halves[::-1]):
            read = averages(correct, read_on, labels)
            seen["sweep"].append(read[int(np.argmax(averages(correct, chosen_on, labels)))])
            seen["half_oracle"].append(read.max())
            for name, rule in rows.items():
                seen[name].append(float(averages(rule, read_on, labels)[0]))
    return {name: {"mean": float(np.mean(v)), "sd": float(np.std(v, ddof=1))} for name, v in seen.items()}


def paired(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray], draws: int, seed: int,
           labels: Labels = None) -> Dict[str, float]:
    """``a``'s score minus ``b``'s (each task: one row's records over its examples) on the test set, and the
    standard deviation of that difference over ``draws`` bootstrap resamples of each task's examples, both rules
    read on the same resample."""
    both = {t: np.stack([a[t], b[t]]) for t in a}
    rng = np.random.default_rng(seed)
    observed = averages(both, labels=labels)
    leads = np.array([np.subtract(*averages(both, _resample(both, rng), labels)) for _ in range(draws)])
    return {"difference": float(observed[0] - observed[1]), "se": float(leads.std(ddof=1))}


def check_against(records: Mapping[str, np.ndarray], labels: Labels, scores: Mapping[str, float]) -> None:
    """Raises unless each task's score read from one model's ``records`` equals the task pool's ``scores`` (percent)
    of that model, to 1e-4 (torchmetrics divides in float32); a rho the pool reports undefined (NaN) must read 0."""
    for t, r in records.items():
        read = float(averages({t: np.asarray(r)[None]}, labels=labels)[0])
        if not (abs(read - scores[t]) <= 1e-4 or (math.isnan(scores[t]) and read == 0.0)):
            raise AssertionError(f"{t}: {read} from the per-example records, {scores[t]} from the task pool")


def pack(correct: np.ndarray) -> str:
    """A boolean array as hex (numpy's bit packing), for the results file."""
    return np.packbits(np.asarray(correct, dtype=bool)).tobytes().hex()


def unpack(text: str, size: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(bytes.fromhex(text), dtype=np.uint8))[:size].astype(bool)


def stored(records: np.ndarray, regression: bool):
    """A task's records for the results file: packed bits, or the numeric outputs as a list."""
    return [float(v) for v in records] if regression else pack(records)


def restored(value, size: int) -> np.ndarray:
    """``stored``'s inverse."""
    return np.asarray(value, dtype=np.float64) if isinstance(value, list) else unpack(value, size)


def file_records(data: Mapping, entries) -> tuple:
    """From a lab resolution file's content: per task, the (entries, examples) records of its grid points or rules
    ``entries`` (each with its ``correct``), and the regression tasks' labels."""
    labels = {t: np.asarray(v) for t, v in data.get("labels", {}).items()}
    return {t: np.stack([restored(e["correct"][t], n) for e in entries]) for t, n in data["sizes"].items()}, labels
