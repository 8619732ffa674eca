"""Label-free choice of lambda, rho and alpha (issues 27, 61): options, candidate grids and the criteria, as plain
data. No module, hook or device here: ``policy`` and ``search`` do the model plumbing, ``core`` holds the math (the
held-out objective, the meters, the folds).

Four criteria score a candidate on calibration examples that its solve did not see (no label is read):

- ``objective`` (lower is better): the per-block quadratic objective that the closed form minimises, with the
  expert's own features as the target (alpha = 1) and no ridge term, so that candidates with different rho and
  lambda are scored against the same thing; cross-fitted over ``folds`` parts of each task's examples and chosen
  per block (``policy``): one calibration's forwards serve every candidate. It cannot choose alpha (its target
  would favour the largest): alpha stays the method's unless a grid of alphas is given.
- ``drift`` (higher is better): mean cosine similarity of the calibrated model's last-block output to the task
  expert's, over held-out tokens (a ``heldout_fraction`` of each task's examples).
- ``agreement`` (higher is better): how often the calibrated model's prediction (argmax of the family's head) equals
  the task expert's on held-out tokens; families without a head (CLIP vision towers: the zero-shot head lives in the
  task pool) fall back to ``drift`` and the report says so.
- ``site`` (higher is better; image families and T5): the mean cosine of the calibrated model's held-out features
  at the family's feature site (the projected image embedding that CLIP's and OpenCLIP's zero-shot heads read) to
  the task expert's (on T5, whose feature site has a row per token: the expert's probability of the model's greedy
  output, what the text task pool scores), one (lambda, alpha) for the model: by default ``SITE_LAMBDAS`` x the
  method's alpha and those of ``ALPHA_CANDIDATES`` above it, at the method's rho. The alpha the site prefers follows the lambda it is scored at
  (docs/featcal.md), so the two are chosen together, and the final calibration runs that point in every block.

``alpha_criterion: drift`` chooses alpha for ``objective`` (which cannot): one alpha for the whole model, the one
whose calibration on a fit part of each task's examples leaves the last block's output on the held-out part closest
to the experts' (``drift``'s score), the method's alpha kept unless beaten by more than ``noise_z`` standard errors.
``alpha_criterion: site`` scores at the family's feature site instead (one row per example: the projected image
embedding that CLIP's and OpenCLIP's zero-shot heads read; on T5 the expert's probability of the greedy output),
for those families only, the method's alpha and those above it, each after a calibration of the fit part at the least shrinkage (no per-block search in the stage; up
to ``FEW_EXAMPLES`` examples per task each quarter is held out in turn, a calibration per alpha and quarter).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..core.hparams import FeatCalHParams
from ..core.sampling import check_fold_sizes, check_split_sizes

#: criterion -> whether a higher score is better
CRITERIA: Dict[str, bool] = {"objective": False, "drift": True, "agreement": True, "site": True}
#: how criterion objective's alpha is chosen: ``none`` keeps the method's (or searches ``grid.alpha`` per block on
#: the objective, which favours the largest); ``drift``: one alpha for the model, by held-out end-of-model drift;
#: ``site``: the same, by the held-out cosine at the family's feature site (image families; on T5 the experts'
#: probability of the held-out generations)
ALPHA_CRITERIA = ("none", "drift", "site")
#: alpha_criterion drift's candidates (with the method's own): the paper's 0.15 (LLMs), 0.3 (CLIP), 0.6 (FLAN-T5)
#: and the 0.45 between, where the offline CLIP worlds' test labels peak at 256 examples per task
ALPHA_CANDIDATES: Tuple[float, ...] = (0.15, 0.3, 0.45, 0.6)
#: the hyperparameters a grid may vary; the last is a family option (CLIP families only)
PATCH_WEIGHT = "last_block_patch_token_weight"
GRID_KEYS = ("lambda_", "rho", "alpha", PATCH_WEIGHT)
SEARCHES = ("coordinate", "grid")

# Defaults. lambda is already a ratio to the data term (each task's omega-weighted Gram has unit Frobenius norm,
# Eq. 14), so one log grid serves every setting; it spans the paper's own choices (1e-5 .. 3) with a decade of margin.
DEFAULT_GRID: Dict[str, Tuple[float, ...]] = {
    "lambda_": tuple(10.0**k for k in range(-6, 2)),  # 1e-6 .. 10
    "rho": (0.5, 1.0, 1.5, 2.0, 2.5),  # the paper's values: 0.5 (LLMs), 2.0 (CLIP, FLAN-T5), 2.2 (demo)
    "alpha": (0.15, 0.3, 0.6),  # the paper's values: 0.15 (LLMs), 0.3 (CLIP), 0.6 (FLAN-T5); 0.25 (demo)
    PATCH_WEIGHT: (1.0, 0.01),  # the paper's uniform weights and the authors' demo
}
#: ``folds: auto``: eight parts from eight (one example each) up to this many calibration examples per task, four
#: otherwise. A part's solve sees
#: (K - 1) / K of the examples; with few examples the held-out part holds inputs its fit parts lack more often than the
#: final solve's test inputs do, which pulls the choice toward more shrinkage (docs/featcal.md, "How many folds").
#: Above it both give the same choices where measured, and eight would only double the per-part sums' memory.
FEW_EXAMPLES = 64
#: criterion objective's lambdas: five decades, widened a decade at a time past a winning edge (down to the moments'
#: rounding, up to 1e4), so its reach is the whole range at the cost of the values that win or border a winner
OBJECTIVE_LAMBDAS: Tuple[float, ...] = tuple(10.0**k for k in range(-6, -1))  # 1e-6 .. 1e-2
#: criterion site's lambdas: the least shrinkage the per-block objective mostly takes on the CLIP worlds and two
#: decades above it, the pair at which the site's alpha probes were read (docs/featcal.md)
SITE_LAMBDAS: Tuple[float, ...] = (1e-6, 1e-4)
#: the fewest calibration examples per task at which criterion site was measured to beat criterion objective, per
#: measure, and the run says so below it (docs/featcal.md). The image site's cosine: at 8 (two per task held out) it
#: fell below objective on five builds of seven. The experts' probability of the generated text (FLAN-T5): measured
#: at 32 and 256 only, and at 32 it lay farther from the test-label oracle than objective on average (0.91 / 0.67)
SITE_FEWEST_MEASURED = 32
GENERATION_FEWEST_MEASURED = 256
#: ``few_examples``: what criterion site runs below those numbers. ``objective`` by default: at 8 examples per task
#: the image site fell below criterion objective on six builds of eight, on the eighth (an AMD build made after the
#: rule) 3.9 below the oracle on average and 0.36 below the paper's values with one seed, and on a ninth made after
#: this option too (docs/featcal.md)
FEW_EXAMPLES_RULES = ("objective", "site")


@dataclass(frozen=True)
class SelectionOptions:
    """``method.auto_select``: checked at construction, before any model or data is loaded.

    ``grid`` entries replace the defaults key by key (a one-value list fixes that hyperparameter). ``search``:
    ``coordinate`` tries lambda, then rho x alpha at the chosen lambda (then the patch weight: ``drift`` /
    ``agreement``); ``grid`` tries every combination. Criterion ``objective``: ``folds`` parts of each task's
    examples, each held out once (``auto``: 8 from 8 to ``FEW_EXAMPLES`` examples per task, else 4); ``widen`` extends
    lambda past a grid edge that wins, down to the numerical floor of the moments' dtype (up to 1e4); ``noise_z``:
    the method's own values are kept unless the best beats them by more than this many standard errors (of the
    per-fold differences; 0 takes the best); ``least_shrinkage``: the smallest lambda whose score is within
    ``noise_z`` standard errors of the best lambda's is taken; ``alpha_criterion``: ``drift`` or ``site`` chooses one
    alpha among ``grid.alpha`` (default ``ALPHA_CANDIDATES``) and the method's (``site``: those at or above the
    method's), before the per-block search, on a ``heldout_fraction`` split. Criteria ``drift`` / ``agreement`` /
    ``site``: ``heldout_fraction`` of each task's examples is held out; ``site_parts`` (criterion or alpha_criterion
    ``site``): ``auto`` holds out each such part in turn up to ``FEW_EXAMPLES`` examples per task, ``all`` at any
    number (a calibration per part: four times the stage's at the default quarter), ``1`` one part,
    null the criterion's default (``site_folds``); ``keep_method_lambda`` (criterion ``site``): the method's lambda,
    at the best point's alpha and rho, is scored and taken unless the best point beats it by more than ``noise_z``
    standard errors, paired per held-out example (do no harm on lambda; alpha is the best point's: a noise rule on
    alpha was measured and set aside, docs/featcal.md); ``few_examples`` (criterion ``site``): below the fewest
    examples per task at which the family's site measure was measured to beat criterion ``objective``
    (``SITE_FEWEST_MEASURED``, ``GENERATION_FEWEST_MEASURED``), ``objective`` runs criterion objective with its
    defaults instead (``fallback``), ``site`` runs criterion site anyway. ``seed``: the folds' or the split's (null:
    the method's ``seed``).
    """

    criterion: str = "objective"
    folds: Union[int, str] = "auto"
    noise_z: float = 2.0
    widen: bool = True
    least_shrinkage: bool = True
    alpha_criterion: str = "none"
    heldout_fraction: float = 0.25
    site_parts: Union[int, str, None] = None
    keep_method_lambda: bool = False
    few_examples: str = "objective"
    search: str = "coordinate"
    seed: Optional[int] = None
    grid: Mapping[str, Tuple[float, ...]] = field(default_factory=dict)

    def __post_init__(self):
        problems = []
        if self.criterion not in CRITERIA:
            problems.append(f"criterion must be one of {sorted(CRITERIA)}, got {self.criterion!r}")
        f = self.heldout_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 < f < 1.0:
            problems.append(f"heldout_fraction must lie strictly between 0 and 1, got {f!r}")
        if self.folds != "auto" and (isinstance(self.folds, bool) or not isinstance(self.folds, int) or self.folds < 2):
            problems.append(f"folds must be auto or an integer >= 2 (each part is held out once), got {self.folds!r}")
        z = self.noise_z
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not math.isfinite(z) or z < 0:
            problems.append(f"noise_z must be a number >= 0, got {z!r}")
        if not isinstance(self.widen, bool):
            problems.append(f"widen must be true or false, got {self.widen!r}")
        if not isinstance(self.least_shrinkage, bool):
            problems.append(f"least_shrinkage must be true or false, got {self.least_shrinkage!r}")
        if self.site_parts not in (None, "auto", "all", 1) or isinstance(self.site_parts, bool):
            problems.append(f"site_parts must be null (the criterion's default), auto (each part held out in turn up "
                            f"to {FEW_EXAMPLES} examples per task), all (each part in turn at any number) or 1 (one "
                            f"held-out part), got {self.site_parts!r}")
        if self.site_parts is not None and "site" not in (self.criterion, self.alpha_criterion):
            problems.append(f"site_parts is given ({self.site_parts!r}) but neither criterion nor alpha_criterion is "
                            f"'site', which alone read it")
        if not isinstance(self.keep_method_lambda, bool):
            problems.append(f"keep_method_lambda must be true or false, got {self.keep_method_lambda!r}")
        elif self.keep_method_lambda and self.criterion != "site":
            problems.append(f"keep_method_lambda is a rule of criterion 'site' (criterion 'objective' keeps the "
                            f"method's values within noise_z itself), but criterion is {self.criterion!r}")
        if self.few_examples not in FEW_EXAMPLES_RULES:
            problems.append(f"few_examples must be one of {list(FEW_EXAMPLES_RULES)}, got {self.few_examples!r}")
        elif self.few_examples == "site" and self.criterion != "site":
            problems.append(f"few_examples 'site' is a rule of criterion 'site' (run it below the examples per task "
                            f"where it was measured), but criterion is {self.criterion!r}")
        if self.alpha_criterion not in ALPHA_CRITERIA:
            problems.append(f"alpha_criterion must be one of {list(ALPHA_CRITERIA)}, got {self.alpha_criterion!r}")
        elif self.alpha_criterion != "none" and self.criterion != "objective":
            problems.append(f"alpha_criterion {self.alpha_criterion!r} chooses alpha for criterion 'objective'; "
                            f"criterion {self.criterion!r} searches grid.alpha itself")
        if self.search not in SEARCHES:
            problems.append(f"search must be one of {list(SEARCHES)}, got {self.search!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            problems.append(f"seed must be an integer or null, got {self.seed!r}")
        if not isinstance(self.grid, Mapping):
            problems.append(f"grid must map hyperparameter names to lists of values, got {self.grid!r}")
        else:
            for key, values in self.grid.items():
                problems += _grid_problems(key, values)
        if self.criterion == "objective" and isinstance(self.grid, Mapping) and len(self.grid.get(PATCH_WEIGHT, (1,))) > 1:
            problems.append(
                f"criterion 'objective' chooses per block from one set of moments and cannot vary {PATCH_WEIGHT} "
                f"(it changes the moments); fix it to one value or use criterion drift / agreement"
            )
        if problems:
            raise ValueError("invalid method.auto_select: " + "; ".join(problems))
        object.__setattr__(self, "grid", {k: tuple(float(v) for v in vs) for k, vs in dict(self.grid).items()})

    @classmethod
    def parse(cls, value: Any) -> Optional["SelectionOptions"]:
        """``method.auto_select``: false / null (off), true (defaults) or a mapping of options."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if not isinstance(value, Mapping):
            raise ValueError(f"invalid method.auto_select: expected true, false or a mapping of options, got {value!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"invalid method.auto_select: unknown option(s) {unknown}; known: {sorted(known)}")
        options = dict(value)
        if isinstance(options.get("grid"), Mapping):  # OmegaConf containers as plain ones
            options["grid"] = {k: v if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__") else list(v)
                               for k, v in options["grid"].items()}
        return cls(**options)

    def fallback(self) -> "SelectionOptions":
        """What criterion site runs below the examples per task where it was measured to beat criterion objective
        (``few_examples: objective``): criterion objective with its defaults, as ``featcal/auto_clip_ta`` and
        ``featcal/auto_flan_t5_ta`` run it, on the same seed. The site's grid is not carried over: scored against the
        expert's own features, objective would take the largest alpha of it (docs/featcal.md)."""
        return SelectionOptions(criterion="objective", seed=self.seed)

    def folds_for(self, num_examples: int) -> int:
        """The number of parts for ``num_examples`` calibration examples per task (``folds``, or ``auto``'s)."""
        if self.folds != "auto":
            return self.folds
        return 8 if 8 <= num_examples <= FEW_EXAMPLES else 4

    def site_folds(self, num_examples: int) -> int:
        """How many held-out parts the feature site scores. ``site_parts: auto`` (alpha_criterion site's default): up
        to ``FEW_EXAMPLES`` examples per task each of ``1 / heldout_fraction`` parts in turn (every example scored
        once), above one ``heldout_fraction``; ``all``: each part in turn at every n; ``1`` (criterion site's
        default): one ``heldout_fraction`` at every n.
        Why the defaults differ: alpha_criterion site scores a calibration per alpha, criterion site one per point
        of its grid, and each part in turn met issue 61's targets for criterion site on no more of the Xeon builds
        (at 8 and 32 examples per task) at four times the cost (docs/featcal.md)."""
        parts = self.site_parts if self.site_parts is not None else 1 if self.criterion == "site" else "auto"
        if parts == 1 or (parts == "auto" and num_examples > FEW_EXAMPLES):
            return 1
        return max(2, round(1.0 / self.heldout_fraction))

    def check_site_sizes(self, num_examples: int, world_size: int, tasks: Sequence[str]) -> None:
        """Fail before any model work where alpha_criterion site's held-out parts would leave one empty, or a fit
        part a device without examples."""
        folds = self.site_folds(num_examples)
        if folds == 1:
            check_split_sizes(num_examples, world_size, self.heldout_fraction, tasks)
        elif num_examples // folds < max(world_size, 1):  # fold_of's parts differ in size by one at most
            raise ValueError(
                f"auto_select {'criterion' if self.criterion == 'site' else 'alpha_criterion'} 'site' holds out each "
                f"of {folds} parts of a task's examples in turn "
                f"(up to {FEW_EXAMPLES} per task): {num_examples} example(s) leave a part of {num_examples // folds}, "
                f"fewer than one per device ({world_size}); raise num_calibration_examples to "
                f"{folds * max(world_size, 1)} or more, or auto_select.heldout_fraction")

    def check_fold_sizes(self, num_examples: int, world_size: int, tasks: Sequence[str]) -> None:
        """Fail before any model work when the parts cannot give every device an example of each; where ``auto``
        chose eight, the error says so."""
        folds = self.folds_for(num_examples)
        try:
            check_fold_sizes(num_examples, world_size, folds, tasks)
        except ValueError as error:
            if self.folds != "auto" or folds == 4:
                raise
            raise ValueError(f"{error} (auto_select.folds is auto: 8 parts from 8 to {FEW_EXAMPLES} examples per "
                             f"task; auto_select.folds=4 makes them twice the size)") from None

    @property
    def reads_site(self) -> bool:
        """Whether the search scores at the family's feature site (criterion or alpha_criterion ``site``), which is
        then built from the pool before the merge (``search.alpha_site``)."""
        return "site" in (self.criterion, self.alpha_criterion)

    @property
    def higher_is_better(self) -> bool:
        return CRITERIA[self.criterion]

    def grid_for(self, family_options: Mapping[str, Any], hparams: FeatCalHParams) -> Dict[str, Tuple[float, ...]]:
        """The grid actually searched: defaults, replaced by ``grid``. Criterion ``objective`` scores against the
        expert's features (alpha = 1), so it would favour the largest alpha: by default it keeps the method's alpha
        (and the patch weight, which changes the moments) and searches lambda and rho. Criterion ``site``: by default
        ``SITE_LAMBDAS`` x the method's alpha and the ``ALPHA_CANDIDATES`` above it, at the method's rho and patch
        weight. The patch weight is searched only for a family with that option (else it must not be given)."""
        objective = self.criterion == "objective"
        if self.criterion == "site":  # one point for the model; its defaults are the probes' (docs/featcal.md)
            above = {a for a in ALPHA_CANDIDATES if a > hparams.alpha}
            grid = {"lambda_": self.grid.get("lambda_", SITE_LAMBDAS), "rho": self.grid.get("rho", (hparams.rho,)),
                    "alpha": self.grid.get("alpha", tuple(sorted({hparams.alpha, *above})))}
        else:
            grid = {k: self.grid.get(k, DEFAULT_GRID[k]) for k in ("lambda_", "rho")}
            if objective and "lambda_" not in self.grid:
                grid["lambda_"] = OBJECTIVE_LAMBDAS
            if objective and self.alpha_criterion != "none":  # the alpha stage's candidates, the method's among them
                grid["alpha"] = tuple(sorted({*self.grid.get("alpha", ALPHA_CANDIDATES), hparams.alpha}))
            else:
                grid["alpha"] = self.grid.get("alpha", (hparams.alpha,) if objective else DEFAULT_GRID["alpha"])
        if PATCH_WEIGHT in family_options:
            own = objective or self.criterion == "site"
            default = (float(family_options[PATCH_WEIGHT]),) if own else DEFAULT_GRID[PATCH_WEIGHT]
            grid[PATCH_WEIGHT] = self.grid.get(PATCH_WEIGHT, default)
        elif PATCH_WEIGHT in self.grid:
            raise ValueError(f"auto_select.grid.{PATCH_WEIGHT} is given but the model's family has no such option")
        return grid


def _grid_problems(key: str, values: Any) -> List[str]:
    if key not in GRID_KEYS:
        return [f"grid has unknown key {key!r}; known: {list(GRID_KEYS)}"]
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        return [f"grid.{key} must be a list of numbers, got {values!r}"]
    values = list(values)
    if not values:
        return [f"grid.{key} is empty"]
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)]
    if bad:
        return [f"grid.{key} holds non-numbers or non-finite values {bad}"]
    if key == "lambda_" and min(values) <= 0:
        return [f"grid.lambda_ values must be > 0, got {values}"]
    if key == "alpha" and not all(0.0 <= v <= 1.0 for v in values):
        return [f"grid.alpha values must lie in [0, 1], got {values}"]
    if key == PATCH_WEIGHT and min(values) < 0:
        return [f"grid.{PATCH_WEIGHT} values must be >= 0, got {values}"]
    if len(set(values)) != len(values):
        return [f"grid.{key} repeats a value: {values}"]
    return []


# ---- candidates --------------------------------------------------------------------------------------------------


Candidate = Dict[str, float]


def candidate_key(candidate: Candidate) -> str:
    """A stable name for reports: ``lambda_=0.01,rho=2,alpha=0.3``."""
    return ",".join(f"{k}={candidate[k]:g}" for k in GRID_KEYS if k in candidate)


def all_candidates(grid: Mapping[str, Sequence[float]]) -> List[Candidate]:
    keys = [k for k in GRID_KEYS if k in grid]
    return [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]


def coordinate_stages(grid: Mapping[str, Sequence[float]]) -> List[List[str]]:
    """The coordinate search's stages: which keys each varies (the others held at the best so far).
    lambda first (it spans decades; the paper's sweeps are flattest in rho and alpha), then rho x alpha together
    (they interact: both move the target of the same solve), then the patch weight."""
    stages = [["lambda_"], ["rho", "alpha"], [PATCH_WEIGHT]]
    return [[k for k in stage if k in grid] for stage in stages if any(k in grid for k in stage)]


def stage_candidates(grid: Mapping[str, Sequence[float]], keys: Sequence[str], best: Candidate) -> List[Candidate]:
    return [{**best, **dict(zip(keys, values))} for values in itertools.product(*(grid[k] for k in keys))]


def with_candidate(hparams: FeatCalHParams, candidate: Candidate) -> FeatCalHParams:
    return replace(hparams, **{k: v for k, v in candidate.items() if k in FeatCalHParams.__dataclass_fields__})


def best_of(scores: Mapping[str, float], higher_is_better: bool) -> str:
    """The best candidate key; ties go to the first listed (the grid's order), so a seeded run repeats its choice.
    NaN never wins."""
    finite = {k: v for k, v in scores.items() if not math.isnan(v)}
    if not finite:
        raise ValueError("every candidate scored NaN; no choice is possible")
    sign = -1.0 if higher_is_better else 1.0
    return min(finite, key=lambda k: (sign * finite[k], list(scores).index(k)))


# ---- criteria (a) and (b) on held-out outputs ---------------------------------------------------------------------


def mean_over_tasks(per_task: Mapping[str, float]) -> float:
    """Tasks count equally (as in the paper's averages), whatever their token counts."""
    values = list(per_task.values())
    return float(sum(values) / len(values)) if values else float("nan")
