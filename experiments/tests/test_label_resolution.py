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


def test_spearman_rows_is_scipys_rho_per_row_and_zero_where_undefined():
    from scipy.stats import spearmanr

    from featcal_experiments.label_resolution import spearman_rows

    rng = np.random.default_rng(4)
    labels = rng.integers(0, 6, 40).astype(float)  # ties in the labels, as word counts have
    outputs = np.stack([labels + rng.integers(-2, 3, 40), rng.integers(0, 3, 40), -labels, np.full(40, 7.0)]).astype(float)
    rho = spearman_rows(outputs, labels)
    for row in range(3):
        assert rho[row] == pytest.approx(spearmanr(outputs[row], labels)[0], abs=1e-12)
    assert rho[2] == pytest.approx(-1.0)
    assert rho[3] == 0.0  # constant outputs: scipy's rho is NaN, counted as 0 as the text world counts it


def test_a_regression_task_is_scored_by_rho_beside_accuracy_and_a_paired_lead_has_a_bootstrap_error():
    from scipy.stats import spearmanr

    from featcal_experiments.label_resolution import paired, restored, stored

    rng = np.random.default_rng(5)
    labels = {"count": rng.integers(0, 10, 60).astype(float)}
    grid = {"acc": rng.random((3, 50)) < 0.6, "count": labels["count"] + rng.normal(0, [[1.0], [3.0], [9.0]], (3, 60))}
    for row in range(3):
        by_hand = 100 * (grid["acc"][row].mean() + spearmanr(grid["count"][row], labels["count"])[0]) / 2
        assert averages(grid, labels=labels)[row] == pytest.approx(by_hand)
    a, b = ({t: c[i] for t, c in grid.items()} for i in (0, 2))
    lead = paired(a, b, draws=300, seed=0, labels=labels)
    scores = averages(grid, labels=labels)
    assert lead["difference"] == pytest.approx(scores[0] - scores[2])
    assert 0 < lead["se"] < abs(lead["difference"])
    assert paired(a, a, draws=50, seed=0, labels=labels) == {"difference": 0.0, "se": 0.0}
    np.testing.assert_array_equal(restored(stored(grid["count"][1], True), 60), grid["count"][1])
    np.testing.assert_array_equal(restored(stored(grid["acc"][1], False), 50), grid["acc"][1])


def test_the_text_records_read_as_the_text_task_pool_scores(monkeypatch):
    """TextEvaluation's per-example records, averaged, give TextGenerationTaskPool's scores: exact match, and
    Spearman's rho of parsed outputs (an unparsable output reads 0.0), on a stand-in model whose answers are known."""
    import lightning as L
    import torch
    from datasets import Dataset
    from transformers import ByT5Tokenizer

    from featcal_experiments.autoselect_lab import TextEvaluation
    from featcal_experiments.label_resolution import check_against
    from featcal_experiments.reproduce.render import scores
    from featcal_fusionbench.evaluation.text_taskpool import TextGenerationTaskPool

    tokenizer = ByT5Tokenizer()
    answers = {"colour": ["red", "blue", "red", "green", "blue", "red", "blue"],
               "count": ["3", "1", "4", "x", "5", "9", "2"]}
    truths = {"colour": ["red", "blue", "blue", "green", "red", "red", "blue"],
              "count": ["2", "1", "5", "3", "4", "8", "1"]}
    datasets, replies = {}, {}
    for task in answers:
        prompts = [f"{task} {k}" for k in range(7)]
        encoded = tokenizer(prompts, padding="max_length", max_length=12)
        label_ids = tokenizer(truths[task], padding="max_length", max_length=6)["input_ids"]
        encoded["labels"] = [[t if t != tokenizer.pad_token_id else -100 for t in row] for row in label_ids]
        datasets[task] = Dataset.from_dict(dict(encoded))
        replies.update({tuple(ids): a for ids, a in zip(encoded["input_ids"], answers[task])})

    class Answering(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def generate(self, input_ids, max_length):
            out = [tokenizer(replies[tuple(row.tolist())])["input_ids"] for row in input_ids]
            width = max(map(len, out))
            return torch.tensor([[tokenizer.pad_token_id] + ids + [tokenizer.pad_token_id] * (width - len(ids))
                                 for ids in out])

    pool = TextGenerationTaskPool(datasets, tokenizer=tokenizer, regression_tasks=["count"], batch_size=3)
    pool._fabric_instance = L.Fabric(accelerator="cpu", devices=1)
    model = Answering()
    text = TextEvaluation(pool)
    records = text.correct(model)
    np.testing.assert_array_equal(records["colour"], [a == t for a, t in zip(answers["colour"], truths["colour"])])
    np.testing.assert_array_equal(records["count"], [3, 1, 4, 0, 5, 9, 2])
    np.testing.assert_array_equal(text.labels["count"], [2, 1, 5, 3, 4, 8, 1])
    exact = scores(pool.evaluate(model))
    check_against(records, text.labels, exact)
    with pytest.raises(AssertionError, match="colour"):
        check_against({**records, "colour": ~records["colour"]}, text.labels, exact)


def test_the_table_gives_each_rules_lead_over_a_reference_point_with_its_error(tmp_path, capsys):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import resolution_table

    rng = np.random.default_rng(6)
    sizes, labels = {"acc": 80, "count": 40}, rng.integers(0, 9, 40).astype(float)
    rows = [{"acc": rng.random(80) < p, "count": labels + rng.normal(0, s, 40)} for p, s in ((0.5, 2.0), (0.7, 1.0))]

    def entry(row):
        return {"acc": pack(row["acc"]), "count": [float(v) for v in row["count"]]}

    data = {"n": 32, "seed": 42, "sizes": sizes, "labels": {"count": labels.tolist()},
            "points": [{"lambda_": 1e-5, "rho": 2.0, "alpha": 0.6, "correct": entry(rows[0])},
                       {"lambda_": 1e-5, "rho": 2.0, "alpha": 1.0, "correct": entry(rows[1])}],
            "rules": {"default": {"correct": entry(rows[1])}},
            "summary": {"oracle": 60.0, "bias": 0.1, "rules": {"default": 59.0},
                        "split_half": {"sweep": {"mean": 59.5}}}}
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "file.json").write_text(json.dumps(data))
    resolution_table.main(["--reference", "lambda_=1e-05 alpha=0.6", str(tmp_path / "t5" / "file.json")])
    line = capsys.readouterr().out.splitlines()[-1]
    scores = averages({t: np.stack([r[t] for r in rows]) for t in sizes}, labels={"count": labels})
    assert line.startswith(f"| t5 | 32 | 42 | default | {scores[1] - scores[0]:.2f} | ")
    assert float(line.split("|")[-2]) > 0
    with pytest.raises(SystemExit, match="2 grid points"):
        resolution_table.main(["--reference", "lambda_=1e-05", str(tmp_path / "t5" / "file.json")])
