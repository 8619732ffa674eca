"""FeatCal's per-block memory at a Llama shape, as a formula in the widths, the dtypes and the tokens (issue 62).

The statistics follow the engine's accounting (``engine/step.py``'s ``peak_bytes``: one task's moments and the
block's sums, at the fold of a task after the first), term by term:

- a task's moments, per input group (``core/moments.py``'s ``LinearInputMoments``): the Gram d_in^2 and either
  the cross moment E[x_exp x_cal^T] (d_in^2) or, where the group's outputs are narrower than its input (``down_proj``:
  d < m), the projected form (sum of out x d_in); plus the vectors. A Llama block's groups: q/k/v (input d), o (d),
  gate/up (d), down (m), so 6 d^2 + m^2 + d m;
- the block's omega-weighted sums (``core/block_sums.py``): a Gram per group (3 d^2 + m^2) and a target per module
  (q, o: d^2; k, v: d_kv d; gate, up, down: m d), so 5 d^2 + 2 d_kv d + m^2 + 3 d m; and the RMSNorms' vectors
  (float64, the solve's dtype);

in all (11 d^2 + 2 m^2 + 4 d m + 2 d_kv d) values of the accumulation dtype, whatever the number of tasks (one
task's moments exist at a time). The rest of the out-of-core peak is fitted, not derived: the runtime (measured
before any model), the streams (two per task: n x seq_len x d in the model's dtype, plus the batch's metadata) and
a remainder measured at the 3B and 8B shapes (blocks in use, the float64 solve of one module, activations).
"""

from __future__ import annotations

from typing import Dict, Mapping

BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}
SOLVE_BYTES = 8  # the solves and the norms' sums are float64 (core/solver.py's SOLVE_DTYPE)


def widths(shape: Mapping[str, int]) -> Dict[str, int]:
    d, m = shape["hidden_size"], shape["intermediate_size"]
    return {"d": d, "m": m, "d_kv": d // shape["num_attention_heads"] * shape["num_key_value_heads"]}


def statistics_values(shape: Mapping[str, int]) -> Dict[str, int]:
    """Values at the statistics' peak of one Llama block: of the accumulation dtype, and float64 (the RMSNorms' sums,
    built in the solve's dtype: ``BlockSums.add_norm``)."""
    w = widths(shape)
    d, m, kv = w["d"], w["m"], w["d_kv"]
    cross = lambda dim: 1 + dim + dim * dim + dim + dim * dim  # noqa: E731  weight, sum_cal, Gram, sum_exp, cross
    projected = lambda dim, out: 1 + dim + dim * dim + out + out * dim  # noqa: E731  ..., out_sum, out_cross
    norms = 2  # input_layernorm, post_attention_layernorm: weight_sum, sum_z, sum_zz
    moments = 3 * cross(d) + projected(m, d) + norms * (1 + 2 * d)
    sums = (3 * d * d + m * m) + (3 * d + m) + (2 * d * d + 2 * kv * d + 3 * m * d)  # Grams, means, targets
    return {"accumulation": moments + sums, "float64": norms * 3 * d}  # q, z, r_gamma per RMSNorm


def statistics_bytes(shape: Mapping[str, int], accumulation_dtype: str) -> int:
    values = statistics_values(shape)
    return values["accumulation"] * BYTES[accumulation_dtype] + values["float64"] * SOLVE_BYTES


def block_parameters(shape: Mapping[str, int]) -> int:
    w = widths(shape)
    d, m, kv = w["d"], w["m"], w["d_kv"]
    return 2 * d * d + 2 * kv * d + 3 * m * d + 2 * d


def largest_solve_bytes(shape: Mapping[str, int]) -> int:
    """``down_proj``'s float64 system: its m x m Gram (plus the ridge) and its d x m right-hand side and solution."""
    w = widths(shape)
    return SOLVE_BYTES * (w["m"] * w["m"] + 2 * w["d"] * w["m"])


def model_parameters(shape: Mapping[str, int], layers: int) -> int:
    d, vocab = shape["hidden_size"], shape["vocab_size"]
    heads = 1 if shape.get("tie_word_embeddings") else 2
    return heads * vocab * d + layers * block_parameters(shape) + d


def streams_bytes(shape: Mapping[str, int], tasks: int, tokens: int, model_dtype: str) -> int:
    """The calibrated and the expert stream of every task, all resident (CPU: the default budget is unbounded)."""
    return 2 * tasks * tokens * shape["hidden_size"] * BYTES[model_dtype]


def out_of_core_peak(shape: Mapping[str, int], *, tasks: int, tokens: int, model_dtype: str,
                     accumulation_dtype: str, runtime_bytes: int = 0.91 * 2**30) -> Dict[str, float]:
    """The out-of-core run's peak RSS, by component. ``rest``: the embedding and two blocks in the model's dtype, a
    fit to the 3B and 8B shapes' measured remainder (within 0.25 GiB there), not a derivation."""
    b = BYTES[model_dtype]
    parts = {
        "runtime": float(runtime_bytes),
        "statistics": float(statistics_bytes(shape, accumulation_dtype)),
        "streams": float(streams_bytes(shape, tasks, tokens, model_dtype)),
        "rest": float(b * (shape["vocab_size"] * shape["hidden_size"] + 2 * block_parameters(shape))),
    }
    parts["peak"] = sum(parts.values())
    return parts
