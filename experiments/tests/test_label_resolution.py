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


def test_the_table_reads_each_builds_seeds_and_the_best_among_given_values(tmp_path, capsys):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import resolution_table

    sizes = {"a": 4, "b": 2}
    # three grid points; the rules and the summary as the lab writes them (their values are the file's, not recomputed)
    hits = [{"a": [1, 1, 1, 1], "b": [1, 1]}, {"a": [1, 1, 0, 0], "b": [1, 0]}, {"a": [1, 0, 0, 0], "b": [0, 0]}]
    values = [(1e-6, 2.0), (1e-4, 2.0), (1e-6, 2.5)]
    for seed, oracle in ((42, 100.0), (43, 90.0)):
        data = {"n": 8, "seed": seed, "sizes": sizes,
                "points": [{"lambda_": lam, "rho": rho, "alpha": 0.3,
                            "correct": {t: pack(np.array(h[t], bool)) for t in sizes}}
                           for (lam, rho), h in zip(values, hits)],
                "summary": {"oracle": oracle, "bias": 0.1, "rules": {"default": oracle - 1.0},
                            "split_half": {"sweep": {"mean": oracle - 0.5}}}}
        (tmp_path / "build").mkdir(exist_ok=True)
        (tmp_path / "build" / f"seed{seed}.json").write_text(json.dumps(data))
    resolution_table.main(["--among", "lambda_=0.0001,0.01 rho=2.0", *map(str, sorted((tmp_path / "build").iterdir()))])
    out = capsys.readouterr().out.splitlines()
    # point 2 (1e-4, rho 2) scores 50: oracle 100 -> 50 behind, oracle 90 -> 40: mean 45, worst 50
    assert out[2] == "| build | 8 | 42, 43 | 1.00 / 1.00 | 0.50 / 0.50 | 45.00 / 50.00 | 0.10 |"
