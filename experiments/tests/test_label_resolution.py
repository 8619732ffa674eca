"""featcal_experiments.label_resolution: the oracle's selection bias and the labelled half-test sweep."""

import numpy as np
import pytest

from featcal_experiments.label_resolution import averages, oracle_bias, pack, split_half, unpack


def _grid(rng, rows, sizes, p):
    return {f"task{i}": rng.random((rows, n)) < p for i, n in enumerate(sizes)}


def test_averages_is_the_mean_over_tasks_of_each_tasks_accuracy():
    rng = np.random.default_rng(0)
    grid = _grid(rng, 3, (10, 7), 0.6)
    for row in range(3):
        by_hand = 100.0 * sum(grid[t][row].sum() / grid[t].shape[1] for t in grid) / len(grid)
        assert averages(grid)[row] == pytest.approx(by_hand)
    index = {"task0": np.array([0, 0, 4]), "task1": np.array([6])}
    expected = 100.0 * (grid["task0"][:, [0, 0, 4]].mean(1) + grid["task1"][:, [6]].mean(1)) / 2
    np.testing.assert_allclose(averages(grid, index), expected)


def test_a_rule_read_on_both_halves_averages_to_its_full_score():
    # with an even number of examples per task the two halves of a split hold half each, so their mean is exact
    rng = np.random.default_rng(1)
    grid = _grid(rng, 5, (40, 60), 0.5)
    rule = {t: rng.random(c.shape[1]) < 0.7 for t, c in grid.items()}
    out = split_half(grid, {"rule": rule}, splits=7, seed=3)
    assert out["rule"]["mean"] == pytest.approx(averages({t: r[None] for t, r in rule.items()})[0])
    assert out["sweep"]["mean"] <= out["half_oracle"]["mean"]


def test_equal_rows_bias_the_maximum_and_a_clear_winner_does_not():
    rng = np.random.default_rng(2)
    tied = _grid(rng, 30, (200, 200), 0.5)  # thirty rows of the same true accuracy: any lead is the test's noise
    bias = oracle_bias(tied, draws=400, seed=0)
    assert bias["bias"] > 5 * bias["bias_se"]
    halves = split_half(tied, {}, splits=50, seed=0)
    assert halves["half_oracle"]["mean"] - halves["sweep"]["mean"] > 1.0

    clear = {t: np.concatenate([np.ones((1, c.shape[1]), bool), c[1:]]) for t, c in tied.items()}
    bias = oracle_bias(clear, draws=400, seed=0)
    assert bias["oracle"] == 100.0 and bias["bias"] == 0.0
    halves = split_half(clear, {}, splits=20, seed=0)
    assert halves["sweep"]["mean"] == halves["half_oracle"]["mean"] == 100.0


def test_pack_round_trips_any_length():
    rng = np.random.default_rng(3)
    for size in (1, 7, 8, 9, 601):
        hits = rng.random(size) < 0.5
        np.testing.assert_array_equal(unpack(pack(hits), size), hits)
