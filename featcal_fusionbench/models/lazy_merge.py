"""Merges computed lazily, one tensor at a time, when a block's turn comes: Task Arithmetic and TIES.

Task Arithmetic needs nothing beyond the same tensor of the base and of every expert, so the merged model can be a
lazy model (``models.lazy``) whose tensors are computed from the lazy base's and experts' checkpoints as they are
read: no model, merged or not, is ever whole in memory. The arithmetic is FusionBench's
(``fusion_bench/method/task_arithmetic/task_arithmetic.py``, ``TaskArithmeticAlgorithm.run``, with
``fusion_bench/utils/state_dict_arithmetic.py``'s ``state_dict_sub`` / ``state_dict_add`` / ``state_dict_mul``) in
its order and dtypes, so the result is the eager merge bit for bit.

FusionBench's TIES (``fusion_bench/method/ties_merging/ties_merging.py``) is per element too, but for two numbers taken
over the whole flattened model: each task vector's trimming threshold (one ``kthvalue`` over every parameter, in
``ties_merging_utils.topk_values_mask``) and the majority sign that breaks ties of the elected sign
(``resolve_zero_signs``). Both are found first by passes over the checkpoints, a tensor at a time (the threshold
exactly, by a radix selection on the magnitudes' bits), then each tensor is merged when it is read.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Dict, Iterable, List, Mapping, Optional

import torch
from torch import nn

from .lazy import is_lazy, lazy_like, non_finite_message, tensors_of, tied_names


class _MergedTensors:
    """What a lazy model reads a merge's tensors from (``models.lazy.attach_tensors``): each tensor ``_merge``d from
    the base's and the experts' checkpoints when it is read, for the keys ``merged(key)`` selects; the base's tensor
    for the others (FusionBench's ``merge_backbone`` keeps embeddings and head from the base)."""

    def __init__(self, merger: str, base, experts: List, scaling_factor: float, dtypes: List[torch.dtype],
                 merged: Callable[[str], bool], names: Optional[List[str]] = None):
        self.merger, self.base, self.experts, self.merged = merger, base, experts, merged
        self.names = list(names) if names is not None else [f"expert {i + 1}" for i in range(len(experts))]
        self.scaling_factor = scaling_factor
        self.base_dtype = dtypes[0]
        if set(dtypes) != {self.base_dtype}:  # FusionBench refuses them too (state_dict_sub's "Dtype mismatch")
            raise ValueError(f"{merger} of models in different dtypes: {[str(d) for d in dtypes]}")

    def __contains__(self, key: str) -> bool:
        return key in self.base and (not self.merged(key) or all(key in e for e in self.experts))

    def read(self, keys: Iterable[str]) -> Dict[str, torch.Tensor]:
        return {key: self._merge(key) for key in keys}

    def _merge(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def non_finite_inputs(self, key: str) -> List[str]:
        """The input checkpoints whose ``key`` holds a NaN or an infinity, named (the base, or the expert of a task),
        for the message of a merged tensor that is not finite; read again, so only when one is found."""
        culprits = []
        inputs = [("the base", self.base)]
        if self.merged(key):  # else the merge is the base's tensor alone
            inputs += [(f"the expert {n!r}", t) for n, t in zip(self.names, self.experts)]
        for name, tensors in inputs:
            value = tensors.read([key])[key]
            if value.is_floating_point() and not all(bool(torch.isfinite(part).all()) for part in _slices(value)):
                culprits.append(f"{name} ({tensors.folder})")
        return culprits

    def _check_shape(self, key, expert, base, tensors) -> None:
        if expert.shape != base.shape:
            raise ValueError(f"{self.merger}: {key} is {tuple(expert.shape)} in {tensors.folder} and "
                             f"{tuple(base.shape)} in the base {self.base.folder}")


class TaskArithmeticTensors(_MergedTensors):
    """``base + scaling * sum_i (expert_i - base)``."""

    def __init__(self, base, experts: List, scaling_factor: float, dtypes: List[torch.dtype],
                 merged: Callable[[str], bool] = lambda key: True, names: Optional[List[str]] = None):
        super().__init__("Task Arithmetic", base, experts, scaling_factor, dtypes, merged, names)
        self.folder = f"Task Arithmetic ({scaling_factor}) of {base.folder} and {len(experts)} expert(s)"

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


def _slices(tensor: torch.Tensor, size: int = 1 << 24) -> List[torch.Tensor]:
    """Views of consecutive elements: 64 MiB of float32 each."""
    return list(tensor.reshape(-1).split(size))


# signed integer views of a float of each width: a non-negative float orders as its bits do
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_DIGIT = 16  # bits of the radix selection's digit: a 65,536-bin histogram a pass


class TiesMergingTensors(_MergedTensors):
    """FusionBench's TIES merge, ``base + scaling * disjoint_merge(trim(expert_i - base))``, for the keys ``merged``
    selects (the base's tensor for the others, as ``TiesMergingForCausalLM``'s ``merge_backbone`` does).

    ``keys`` are the checkpoint keys of the merged state-dict names, a tied tensor's once per name: FusionBench
    flattens the state dict, so a tied head counts twice in the threshold and the sign, and so it does here. The
    whole-model numbers are found when the merge is built (two or more reading passes, ``_thresholds`` and
    ``_majority_sign``); the base and every expert's copy of one tensor are held together while it is merged."""

    def __init__(self, base, experts: List, keys: List[str], scaling_factor: float, threshold: float,
                 merge_func: str, dtypes: List[torch.dtype], merged: Callable[[str], bool] = lambda key: True,
                 names: Optional[List[str]] = None):
        from fusion_bench.method.ties_merging.ties_merging_utils import disjoint_merge

        super().__init__("TIES merging", base, experts, scaling_factor, dtypes, merged, names)
        self.merge_func, self._disjoint_merge = merge_func, disjoint_merge
        if merge_func.split("-")[-1] not in ("sum", "mean", "max"):
            raise ValueError(f"TIES merging: merge_func {merge_func!r} is not sum, mean or max")
        self.folder = f"TIES ({scaling_factor}, top {threshold}) of {base.folder} and {len(experts)} expert(s)"
        self.uses = Counter(keys)
        # FusionBench's topk_values_mask: K in percent above 1, the k-th smallest magnitude kept with all above it
        fraction = threshold / 100 if threshold > 1 else threshold
        shapes = base.shapes()
        count = sum(uses * int(torch.Size(shapes[key]).numel()) for key, uses in self.uses.items())
        self.k = count - int(count * fraction)
        if not 1 <= self.k <= count:
            raise ValueError(f"TIES merging: threshold {threshold} keeps no element to trim at (k = {self.k})")
        self.kth = self._thresholds()
        self.majority = self._majority_sign()

    def _task_vectors(self, key: str):
        """The base's tensor and, a slice at a time, the experts' task vectors stacked ``[experts, elements]``."""
        base = self.base.read([key])[key]
        if not base.is_floating_point():
            raise TypeError(f"TIES merging out of core merges floating-point tensors; {key} is {base.dtype}")
        experts = []
        for tensors in self.experts:
            expert = tensors.read([key])[key]
            self._check_shape(key, expert, base, tensors)
            experts.append(expert)
        dtype = self.base_dtype
        slices = zip(_slices(base), *(_slices(e) for e in experts))
        return base, ((b, torch.stack([e.to(dtype) - b.to(dtype) for e in es])) for b, *es in slices)

    def _thresholds(self) -> torch.Tensor:
        """Each task vector's k-th smallest magnitude over every merged tensor, as ``torch.kthvalue`` finds it: the
        magnitudes' bits, a 16-bit digit at a time from the top, each pass a histogram of the next digit among the
        elements whose higher digits are the k-th's."""
        width = self.base_dtype.itemsize * 8
        bits_dtype = _BITS[self.base_dtype.itemsize]
        experts = len(self.experts)
        prefix = torch.zeros(experts, dtype=torch.int64)  # the k-th's digits found so far
        rank = torch.full((experts,), self.k, dtype=torch.int64)  # its rank among the elements with that prefix
        for done in range(0, width, _DIGIT):
            shift = width - done - _DIGIT
            histogram = torch.zeros(experts, 1 << _DIGIT, dtype=torch.int64)
            for key, uses in self.uses.items():
                _, vectors = self._task_vectors(key)
                for _, vector in vectors:
                    if not bool(torch.isfinite(vector).all()):
                        raise ValueError(non_finite_message(self, key))
                    bits = vector.abs().view(bits_dtype).to(torch.int64)
                    digits = (bits >> shift) & ((1 << _DIGIT) - 1)
                    for e in range(experts):
                        digit = digits[e][(bits[e] >> (shift + _DIGIT)) == prefix[e]] if done else digits[e]
                        histogram[e] += uses * torch.bincount(digit, minlength=1 << _DIGIT)
            below = torch.cat([torch.zeros(experts, 1, dtype=torch.int64), histogram.cumsum(dim=1)], dim=1)
            # the first digit whose count of elements at or below it reaches the rank
            chosen = torch.searchsorted(below[:, 1:].contiguous(), rank[:, None]).squeeze(1)
            rank -= below.gather(1, chosen[:, None]).squeeze(1)
            prefix = (prefix << _DIGIT) | chosen
        return prefix.to(bits_dtype).view(self.base_dtype)

    def _trimmed(self, vector: torch.Tensor) -> torch.Tensor:
        return vector * (vector.abs() >= self.kth[:, None])  # topk_values_mask's ``M * final_mask``

    def _majority_sign(self) -> torch.Tensor:
        """``resolve_zero_signs``' majority: the sign of the sum of the elected signs over every merged element,
        counted exactly here (FusionBench sums them in the model's dtype: the same sign unless the count is within
        that sum's rounding of zero)."""
        balance = 0
        for key, uses in self.uses.items():
            _, vectors = self._task_vectors(key)
            for _, vector in vectors:
                signs = torch.sign(self._trimmed(vector).sum(dim=0))
                balance += uses * (int((signs > 0).sum()) - int((signs < 0).sum()))
        return torch.tensor(float((balance > 0) - (balance < 0)), dtype=self.base_dtype)

    def _merge(self, key: str) -> torch.Tensor:
        if not self.merged(key):
            return self.base.read([key])[key].to(self.base_dtype)
        base, vectors = self._task_vectors(key)
        merged = torch.empty(base.shape, dtype=self.base_dtype)
        for out, (b, vector) in zip(_slices(merged), vectors):
            trimmed = self._trimmed(vector)
            signs = torch.sign(trimmed.sum(dim=0))  # resolve_sign
            signs[signs == 0] = self.majority
            merged_vector = self._disjoint_merge(trimmed, self.merge_func, signs)
            out.copy_(b.to(self.base_dtype) + self.scaling_factor * merged_vector)
        return merged


def lazy_task_arithmetic(base: nn.Module, experts: Mapping[str, nn.Module], scaling_factor: float,
                         merged: Callable[[str], bool] = lambda key: True) -> nn.Module:
    """A lazy merged model (the lazy base's skeleton) whose tensors are Task Arithmetic of the lazy ``base`` and
    ``experts``, in the experts' order (the order FusionBench adds their task vectors in)."""
    sources = _lazy_sources(base, experts)
    tensors = TaskArithmeticTensors(sources[0][0], [t for t, _ in sources[1:]], scaling_factor,
                                    [dtype for _, dtype in sources], merged, names=list(experts))
    return lazy_like(base, tensors)


def lazy_ties_merging(base: nn.Module, experts: Mapping[str, nn.Module], scaling_factor: float, threshold: float,
                      merge_func: str, merged: Callable[[str], bool] = lambda key: True) -> nn.Module:
    """A lazy merged model whose tensors are FusionBench's TIES merge of the lazy ``base`` and ``experts``; the
    whole-model threshold and sign are found here, by passes over the checkpoints."""
    sources = _lazy_sources(base, experts)
    aliases = tied_names(base)
    base_tensors = sources[0][0]
    keys = []
    for name in base.state_dict(keep_vars=True):
        if merged(name):
            key = next((k for k in (name, *aliases.get(name, ())) if k in base_tensors), None)
            if key is None:
                raise KeyError(f"{name} is not in the checkpoint {base_tensors.folder}")
            keys.append(key)
    tensors = TiesMergingTensors(base_tensors, [t for t, _ in sources[1:]], keys, scaling_factor, threshold,
                                 merge_func, [dtype for _, dtype in sources], merged, names=list(experts))
    return lazy_like(base, tensors)


def _lazy_sources(base: nn.Module, experts: Mapping[str, nn.Module]) -> List[tuple]:
    models = [base, *experts.values()]
    eager = [type(m).__name__ for m in models if not is_lazy(m)]
    if eager:
        raise TypeError(f"a lazy merge reads lazy models; got loaded {eager}")
    return [tensors_of(m) for m in models]


__all__ = ["TaskArithmeticTensors", "TiesMergingTensors", "lazy_task_arithmetic", "lazy_ties_merging"]
