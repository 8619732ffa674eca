"""A built world's task vectors, and models moved along them (FusionBench's state-dict arithmetic)."""

from __future__ import annotations

import copy
from typing import Dict, Mapping, Sequence

from torch import Tensor, nn


def scaled_task_vector_sum(
    base_state: Mapping[str, Tensor], expert_states: Sequence[Mapping[str, Tensor]], scale: float
) -> Dict[str, Tensor]:
    """``scale`` x the sum over experts of (expert - base), per parameter: Task Arithmetic's update."""
    from fusion_bench.utils.state_dict_arithmetic import state_dict_mul, state_dict_sub, state_dict_sum

    return state_dict_mul(state_dict_sum([state_dict_sub(e, base_state) for e in expert_states]), scale)


def moved(model: nn.Module, delta: Mapping[str, Tensor]) -> nn.Module:
    """A copy of ``model`` with ``delta`` added to the parameters it names; the others stay as they are."""
    out = copy.deepcopy(model)
    out.load_state_dict({k: v + delta[k] if k in delta else v for k, v in model.state_dict().items()})
    return out
