"""FeatCal's hyperparameters, checked before any model or data is touched.

Their defaults are written here once; ``FeatCalAlgorithm`` takes its defaults from ``DEFAULTS``, and
options that belong to one model family live in the family (``method.family_options``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

import torch

ACCUMULATION_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclass(frozen=True)
class FeatCalHParams:
    lambda_: float = 0.05
    rho: float = 2.0
    alpha: float = 0.3
    eps: float = 1e-8
    num_calibration_examples: int = 256
    batch_size: int = 16
    seed: int = 42
    calibrate_bias: bool = True
    calibrate_layernorm: bool = True
    module_regex: Optional[str] = None
    accumulation_dtype: str = "float32"

    def __post_init__(self):
        problems = []

        def finite(name):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                problems.append(f"{name} must be a finite number, got {value!r}")
                return False
            return True

        if finite("lambda_") and self.lambda_ <= 0:
            problems.append(f"lambda_ must be > 0 (the ridge keeps each solve well posed), got {self.lambda_}")
        if finite("alpha") and not 0.0 <= self.alpha <= 1.0:
            problems.append(f"alpha must lie in [0, 1] (Eq. 10 interpolates features), got {self.alpha}")
        finite("rho")
        if finite("eps") and self.eps <= 0:
            problems.append(f"eps must be > 0, got {self.eps}")
        for name in ("num_calibration_examples", "batch_size", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                problems.append(f"{name} must be an integer, got {value!r}")
        if isinstance(self.num_calibration_examples, int) and self.num_calibration_examples < 1:
            problems.append(f"num_calibration_examples must be >= 1, got {self.num_calibration_examples}")
        if isinstance(self.batch_size, int) and self.batch_size < 1:
            problems.append(f"batch_size must be >= 1, got {self.batch_size}")
        if self.accumulation_dtype not in ACCUMULATION_DTYPES:
            problems.append(
                f"accumulation_dtype must be one of {sorted(ACCUMULATION_DTYPES)}, got {self.accumulation_dtype!r}"
            )
        if self.module_regex is not None:
            try:
                re.compile(self.module_regex)
            except re.error as err:
                problems.append(f"module_regex {self.module_regex!r} is not a valid regular expression: {err}")
        if problems:
            raise ValueError("invalid FeatCal configuration: " + "; ".join(problems))

    @property
    def torch_accumulation_dtype(self) -> torch.dtype:
        return ACCUMULATION_DTYPES[self.accumulation_dtype]


DEFAULTS = FeatCalHParams()
