"""How finely a world's test labels rank a grid of calibrations (issue 61).

The study's oracle is the best of many points scored on the same test labels it is judged on, so its score is
biased upward by the test set's own noise, and a label-free rule is compared with that maximum. Two measures,
pure functions of per-example correctness (each task: a ``(points, examples)`` boolean array; a point's score is the
mean over tasks of each task's accuracy in percent, as FusionBench's CLIP task pool averages it):

- ``oracle_bias``: the bootstrap estimate of the upward bias of the maximum (each task's test examples resampled
  with replacement; the mean of the resampled maxima minus the observed maximum);
- ``split_half``: each task's test examples cut into two random halves; the point a labelled sweep would take on
  one half (a validation set with labels), scored on the other, beside the other half's own best (the oracle at half
  the size) and each rule, every number read on the same half.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

import numpy as np


def averages(correct: Mapping[str, np.ndarray], index: Optional[Mapping[str, np.ndarray]] = None) -> np.ndarray:
    """Per row: the mean over tasks of the task's accuracy in percent on the examples ``index`` names (all if None)."""
    return 100.0 * np.mean([(c if index is None else c[:, index[t]]).mean(axis=1) for t, c in sorted(correct.items())],
                           axis=0)


def oracle_bias(correct: Mapping[str, np.ndarray], draws: int, seed: int) -> Dict[str, float]:
    """The observed best row's score, and the bootstrap's estimate of how far the best of the rows lies above what
    the best would score on new test examples (``bias``, with the standard error of its ``draws``)."""
    rng = np.random.default_rng(seed)
    observed = float(averages(correct).max())
    maxima = np.array([averages(correct, {t: rng.integers(0, c.shape[1], c.shape[1]) for t, c in correct.items()}).max()
                       for _ in range(draws)])
    return {"oracle": observed, "bias": float(maxima.mean() - observed),
            "bias_se": float(maxima.std(ddof=1) / np.sqrt(draws))}


def split_half(correct: Mapping[str, np.ndarray], rules: Mapping[str, Mapping[str, np.ndarray]], splits: int,
               seed: int) -> Dict[str, Dict[str, float]]:
    """Means over ``2 * splits`` halves (each split read both ways) of: ``sweep``, the grid's best row by the other
    half's labels; ``half_oracle``, the half's own best row; and each rule (``rules[name][task]``: a boolean array over
    that task's examples), all scored on the half. Each entry: ``mean`` and ``sd`` over the halves."""
    rng = np.random.default_rng(seed)
    rows = {name: {t: r[None, :] for t, r in rule.items()} for name, rule in rules.items()}
    seen: Dict[str, list] = {"sweep": [], "half_oracle": [], **{name: [] for name in rules}}
    for _ in range(splits):
        cut = {t: rng.permutation(c.shape[1]) for t, c in correct.items()}
        halves = ({t: p[: len(p) // 2] for t, p in cut.items()}, {t: p[len(p) // 2:] for t, p in cut.items()})
        for chosen_on, read_on in (halves, halves[::-1]):
            read = averages(correct, read_on)
            seen["sweep"].append(read[int(np.argmax(averages(correct, chosen_on)))])
            seen["half_oracle"].append(read.max())
            for name, rule in rows.items():
                seen[name].append(float(averages(rule, read_on)[0]))
    return {name: {"mean": float(np.mean(v)), "sd": float(np.std(v, ddof=1))} for name, v in seen.items()}


def pack(correct: np.ndarray) -> str:
    """A boolean array as hex (numpy's bit packing), for the results file."""
    return np.packbits(np.asarray(correct, dtype=bool)).tobytes().hex()


def unpack(text: str, size: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(bytes.fromhex(text), dtype=np.uint8))[:size].astype(bool)
