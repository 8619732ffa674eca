"""A per-tensor merge computed lazily: Task Arithmetic, one tensor at a time, when a block's turn comes.

Task Arithmetic needs nothing beyond the same tensor of the base and of every expert, so the merged model can be a
lazy model (``models.lazy``) whose tensors are computed from the lazy base's and experts' checkpoints as they are
read: no model, merged or not, is ever whole in memory. The arithmetic is FusionBench's
(``fusion_bench/method/task_arithmetic/task_arithmetic.py``, ``TaskArithmeticAlgorithm.run``, with
``fusion_bench/utils/state_dict_arithmetic.py``'s ``state_dict_sub`` / ``state_dict_add`` / ``state_dict_mul``) in
its order and dtypes, so the result is the eager merge bit for bit.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Mapping

import torch
from torch import nn

from .lazy import is_lazy, lazy_like, tensors_of


class TaskArithmeticTensors:
    """``base + scaling * sum_i (expert_i - base)`` for the keys ``merged(key)`` selects; the base's tensor for the
    others (FusionBench's ``merge_backbone`` keeps embeddings and head from the base)."""

    def __init__(self, base, experts: List, scaling_factor: float, dtypes: List[torch.dtype],
                 merged: Callable[[str], bool] = lambda key: True):
        self.base, self.experts, self.scaling_factor, self.merged = base, experts, scaling_factor, merged
        self.base_dtype = dtypes[0]
        if set(dtypes) != {self.base_dtype}:  # FusionBench's state_dict_sub refuses them too (a "Dtype mismatch")
            raise ValueError(f"Task Arithmetic of models in different dtypes: {[str(d) for d in dtypes]}")
        self.folder = f"Task Arithmetic ({scaling_factor}) of {base.folder} and {len(experts)} expert(s)"

    def __contains__(self, key: str) -> bool:
        return key in self.base and (not self.merged(key) or all(key in e for e in self.experts))

    def read(self, keys: Iterable[str]) -> Dict[str, torch.Tensor]:
        return {key: self._merge(key) for key in keys}

    def _merge(self, key: str) -> torch.Tensor:
        """One tensor. Element by element FusionBench's ops, but in place and a slice at a time: at LLM scale an
        embedding is gigabytes, and the eager expression's temporaries (each model's tensor converted to the run's
        dtype, the difference, the scaled task vector, the sum) would be several of them at once. Every element
        still sees the very same operations (``b + t == t + b`` and ``s * t == t * s`` hold exactly in IEEE
        arithmetic), so the result is the same bit for bit (tested against FusionBench)."""
        dtype = self.base_dtype  # every model's (checked): the dtype each is loaded in, as the pool loads it
        base = self.base.read([key])[key]
        if not self.merged(key):
            return base.to(dtype)
        if not base.is_floating_point():
            return self._merge_whole(key, base.to(dtype))
        task_vector = torch.empty(base.shape, dtype=dtype)
        for number, tensors in enumerate(self.experts):
            expert = tensors.read([key])[key]
            self._check_shape(key, expert, base, tensors)
            for vector, e, b in zip(*(_slices(t) for t in (task_vector, expert, base))):
                difference = e.to(dtype) - b.to(dtype)
                vector.copy_(difference) if number == 0 else vector.add_(difference)
            del expert
        for vector, b in zip(_slices(task_vector), _slices(base)):
            vector.mul_(self.scaling_factor).add_(b.to(dtype))
        return task_vector

    def _merge_whole(self, key: str, base: torch.Tensor) -> torch.Tensor:
        """An integer tensor as FusionBench merges it, state_dict_mul's ``keep_dtype_when_zero`` included."""
        task_vector = None
        for tensors in self.experts:
            expert = tensors.read([key])[key].to(self.base_dtype)
            self._check_shape(key, expert, base, tensors)
            task_vector = expert - base if task_vector is None else task_vector + (expert - base)
        if self.scaling_factor == 0 or torch.all(task_vector == 0):
            return base + task_vector.clone()
        return base + self.scaling_factor * task_vector

    def _check_shape(self, key, expert, base, tensors) -> None:
        if expert.shape != base.shape:
            raise ValueError(f"Task Arithmetic: {key} is {tuple(expert.shape)} in {tensors.folder} and "
                             f"{tuple(base.shape)} in the base {self.base.folder}")


def _slices(tensor: torch.Tensor, size: int = 1 << 24) -> List[torch.Tensor]:
    """Views of consecutive elements: 64 MiB of float32 each."""
    return list(tensor.view(-1).split(size))


def lazy_task_arithmetic(base: nn.Module, experts: Mapping[str, nn.Module], scaling_factor: float,
                         merged: Callable[[str], bool] = lambda key: True) -> nn.Module:
    """A lazy merged model (the lazy base's skeleton) whose tensors are Task Arithmetic of the lazy ``base`` and
    ``experts``, in the experts' order (the order FusionBench adds their task vectors in)."""
    models = [base, *experts.values()]
    eager = [type(m).__name__ for m in models if not is_lazy(m)]
    if eager:
        raise TypeError(f"a lazy Task Arithmetic reads lazy models; got loaded {eager}")
    sources = [tensors_of(m) for m in models]
    tensors = TaskArithmeticTensors(sources[0][0], [t for t, _ in sources[1:]], scaling_factor,
                                    [dtype for _, dtype in sources], merged)
    return lazy_like(base, tensors)


__all__ = ["TaskArithmeticTensors", "lazy_task_arithmetic"]
