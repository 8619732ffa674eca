"""The lm-eval task pool: task by task through lm-eval on the model in memory, the chosen metric and the average
in FusionBench's report, the expert's map active on each task, bad input named before any model is loaded."""

import copy
import json

import lightning as L
import pytest
import torch
from fusion_bench.utils import instantiate
from omegaconf import OmegaConf

from featcal_fusionbench.evaluation.lm_eval_taskpool import LMEvalTaskPool, parse_tasks, task_scores


def tiny_taskpool(pool, **overrides):
    config = OmegaConf.load(f"{pool['config_dir']}/taskpool/LMEvalHarnessTaskPool/tiny_llama.yaml")
    for key, value in overrides.items():
        config[key] = value  # replaced, not merged: a smaller `tasks` mapping drops the others
    taskpool = instantiate(config)
    taskpool._fabric_instance = L.Fabric(accelerator="cpu", devices=1)
    return taskpool


def test_each_task_is_scored_by_its_metric_and_averaged(tiny_llama_pool, tmp_path):
    taskpool = tiny_taskpool(tiny_llama_pool, output_path=str(tmp_path / "lm_eval"))
    report = taskpool.evaluate(tiny_llama_pool["base"], name="base")
    assert report["tiny_sums"]["score"] == report["tiny_sums"]["exact_match,none"]
    bits = report["tiny_text"]["score"]
    assert bits == report["tiny_text"]["bits_per_byte,none"] and bits > 0 and torch.isfinite(torch.tensor(bits))
    assert report["average"]["score"] == pytest.approx((report["tiny_sums"]["score"] + bits) / 2)
    assert report["model_info"] == {"name": "base"}
    saved = json.loads((tmp_path / "lm_eval" / "tiny_text.json").read_text())
    assert saved["results"]["tiny_text"]["bits_per_byte,none"] == bits  # lm-eval's own record beside the report


def test_the_machine_is_described_once_for_every_task_and_model(tiny_llama_pool, tmp_path, monkeypatch):
    """lm-eval describes the machine at the end of each call (torch's collect_env, which starts `pip list`); the pool
    calls lm-eval per task and model, so the description is made once and every task's record carries it."""
    from torch.utils import collect_env

    from featcal_fusionbench.evaluation import lm_eval_taskpool

    calls = []

    def describe():
        calls.append(1)
        return f"machine described {len(calls)} time(s)"

    monkeypatch.setattr(collect_env, "get_pretty_env_info", describe)
    lm_eval_taskpool._describe_environment.cache_clear()
    taskpool = tiny_taskpool(tiny_llama_pool, output_path=str(tmp_path / "lm_eval"))
    for name in ("base", "again"):
        taskpool.evaluate(tiny_llama_pool["base"], name=name)
    assert len(calls) == 1
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "lm_eval").glob("*.json"))]
    assert len(records) == 2 and {r["pretty_env_info"] for r in records} == {"machine described 1 time(s)"}
    assert collect_env.get_pretty_env_info is describe  # torch's own is back after each evaluation
    lm_eval_taskpool._describe_environment.cache_clear()  # the fake is not what a later test's run describes


@pytest.mark.slow
def test_a_per_task_wrapper_sees_the_expert_named_for_each_task(tiny_llama_pool, tmp_path):
    """What the wrapped model's lm_head is fed during each task's evaluation carries that task's expert."""

    class Spy(torch.nn.Module):
        is_surgery_model = True

        def __init__(self, model, task_names=("math", "coding")):
            super().__init__()
            self.model, self.active_task, self.seen, self.task_names = model, None, [], list(task_names)
            model.lm_head.register_forward_pre_hook(lambda *_: self.seen.append(self.active_task))

    spy = Spy(copy.deepcopy(tiny_llama_pool["base"]))
    tiny_taskpool(tiny_llama_pool, output_path=str(tmp_path), tasks={"tiny_sums": {"expert": "math"}}).evaluate(spy)
    assert spy.seen and set(spy.seen) == {"math"} and spy.active_task is None
    spy.seen.clear()
    tiny_taskpool(tiny_llama_pool, output_path=str(tmp_path)).evaluate(spy)
    assert spy.seen[0] == "math" and spy.seen[-1] == "coding" and set(spy.seen) == {"math", "coding"}
    switch = spy.seen.index("coding")
    assert set(spy.seen[switch:]) == {"coding"}  # tasks run one after the other, each under its own expert
    spy.seen.clear()
    tiny_taskpool(tiny_llama_pool, output_path=str(tmp_path), tasks={"tiny_sums": {"expert": None}}).evaluate(spy)
    assert spy.seen and set(spy.seen) == {None}  # a task no expert was trained for: the merged model unchanged
    with pytest.raises(ValueError, match=r"maps for \['coding', 'math'\], not for the experts \{'tiny_sums': 'tiny_sums'\}"):
        tiny_taskpool(tiny_llama_pool, output_path=str(tmp_path), tasks=["tiny_sums"]).evaluate(spy)


@pytest.mark.slow
def test_a_merged_model_saved_without_a_tokenizer_is_scored_with_the_model_pools(tiny_llama_pool, tmp_path):
    """`merged_model_save_path` writes the model alone; a calibrator reading it back (`method.merged_model_path`)
    hands the task pool a model whose folder has no tokenizer: the run's model pool has the one to use."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    tiny_llama_pool["base"].save_pretrained(tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    modelpool = instantiate(OmegaConf.load(f"{tiny_llama_pool['config_dir']}/modelpool/tiny_llama.yaml"))
    tasks = {"tiny_sums": {"metric": "exact_match,none", "expert": None}}
    expected = tiny_taskpool(tiny_llama_pool, output_path=str(tmp_path / "a"), tasks=tasks).evaluate(merged)
    taskpool = tiny_taskpool(tiny_llama_pool, output_path=str(tmp_path / "b"), tasks=tasks, tokenizer=None)
    with pytest.raises(AttributeError):  # what transformers says of a folder without a tokenizer
        taskpool.evaluate(merged)
    taskpool._program = SimpleNamespace(modelpool=modelpool)
    assert taskpool.evaluate(merged)["tiny_sums"] == expected["tiny_sums"]


def test_tasks_are_parsed_and_bad_ones_named():
    default = {"metric": None, "apply_chat_template": None}
    assert parse_tasks(["a", "b"]) == {"a": {**default, "expert": "a"}, "b": {**default, "expert": "b"}}
    assert parse_tasks({"a": {"metric": "acc,none", "expert": None, "apply_chat_template": False}}) == {
        "a": {"metric": "acc,none", "expert": None, "apply_chat_template": False}}
    with pytest.raises(ValueError, match="apply_chat_template must be true, false or null"):
        parse_tasks({"a": {"apply_chat_template": "yes"}})
    with pytest.raises(ValueError, match="unknown key"):
        parse_tasks({"a": {"metrc": "acc,none"}})
    with pytest.raises(ValueError, match="non-empty"):
        parse_tasks([])
    results = {"results": {"a": {"alias": "a", "acc,none": 0.5, "acc_stderr,none": 0.1}}}
    assert task_scores(results, "a", "acc,none") == {"acc,none": 0.5, "score": 0.5}
    with pytest.raises(KeyError, match=r"reports no metric 'acc_norm,none'; it reports \['acc,none'\]"):
        task_scores(results, "a", "acc_norm,none")


def test_unknown_tasks_and_a_missing_task_folder_fail_when_the_pool_is_built(tiny_llama_pool, tmp_path):
    with pytest.raises(ValueError, match=r"no task\(s\) \['tiny_sumz'\]"):
        LMEvalTaskPool({"tiny_sumz": {}}, include_path=str(tiny_llama_pool["root"] / "lm_eval_tasks"))
    with pytest.raises(FileNotFoundError, match="include_path"):
        LMEvalTaskPool(["tiny_sums"], include_path=str(tmp_path / "absent"))


def test_a_missing_lm_eval_is_named_with_the_install_command(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_lm_eval(name, *args, **kwargs):
        if name == "lm_eval" or name.startswith("lm_eval."):
            raise ImportError("No module named 'lm_eval'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_lm_eval)
    with pytest.raises(ImportError, match=r"scripts/setup.sh --llm"):
        LMEvalTaskPool(["tiny_sums"])


def test_table_4s_task_pool_names_lm_eval_tasks_for_the_papers_columns():
    """Building the pool checks every task name against lm-eval's index (offline: no data is loaded)."""
    from pathlib import Path

    import featcal_fusionbench_config

    path = Path(list(featcal_fusionbench_config.__path__)[0]) / "taskpool" / "LMEvalHarnessTaskPool" / "mergebench_table4.yaml"
    taskpool = instantiate(OmegaConf.load(path))
    assert [(t, s["expert"]) for t, s in taskpool.tasks.items()] == [
        ("math500_boxed", "math"), ("gsm8k_cot", "math"), ("evalplus_humaneval_chat", "coding"),
        ("evalplus_mbpp_chat", "coding"), ("ifeval", "instruction"), ("arc_challenge_chat_lines", None)]
    assert all(s["metric"] for s in taskpool.tasks.values()) and taskpool.confirm_run_unsafe_code


def test_arc_c_prompt_breaks_lines_where_lm_evals_arc_challenge_chat_writes_backslash_n():
    """Our ARC-C task is lm-eval's arc_challenge_chat with its single-quoted prompt (literal backslash-n) written
    with line breaks; every other field is lm-eval's."""
    from pathlib import Path

    import lm_eval
    import yaml
    from lm_eval.utils import apply_template

    from featcal_fusionbench.evaluation.lm_eval_tasks import TASKS_DIR

    ours = yaml.safe_load((Path(TASKS_DIR) / "arc_challenge_chat_lines.yaml").read_text())
    theirs = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks/arc/arc_challenge_chat.yaml").read_text())
    assert {k for k in theirs if theirs[k] != ours.get(k)} == {"tag", "task", "doc_to_text"} and set(ours) <= set(theirs)
    doc = {"question": " Which is a mammal? ", "choices": {"text": ["shark", "whale", "trout", "eel"],
                                                         "label": ["1", "2", "3", "4"]}, "answerKey": "2"}
    assert "\\n" in apply_template(theirs["doc_to_text"], doc)
    prompt = apply_template(ours["doc_to_text"], doc)
    assert "\\" not in prompt
    assert prompt.splitlines() == [
        "Given the following question and four candidate answers (A, B, C and D), choose the best answer.",
        "Question: Which is a mammal?", "A. shark", "B. whale", "C. trout", "D. eel",
        'Your response should end with "The best answer is [the_answer_letter]" where the [the_answer_letter] is one '
        "of A, B, C or D."]
    assert apply_template(ours["doc_to_target"], doc) == "B"


def test_mergebench_code_protocol_pool_swaps_the_code_tasks_and_keeps_the_others():
    """The bigcode variant composes Table 4's pool, leaves out the chat code tasks (`false`) and adds MergeBench's."""
    import fusion_bench_config
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=list(fusion_bench_config.__path__)[0], version_base=None):
        cfg = compose("fabric_model_fusion", overrides=["taskpool=LMEvalHarnessTaskPool/mergebench_table4_bigcode"])
    GlobalHydra.instance().clear()
    taskpool = instantiate(cfg.taskpool)
    assert [(t, s["expert"], s["apply_chat_template"]) for t, s in taskpool.tasks.items()] == [
        ("math500_boxed", "math", None), ("gsm8k_cot", "math", False), ("ifeval", "instruction", False),
        ("arc_challenge_chat_lines", None, None), ("humanevalplus_bigcode", "coding", False),
        ("mbppplus_bigcode", "coding", False)]


def test_a_task_set_to_false_is_left_out_and_leaving_out_every_task_is_refused():
    assert list(parse_tasks({"a": {"metric": "m,f"}, "b": False})) == ["a"]
    with pytest.raises(ValueError, match="leaves out every task"):
        parse_tasks({"a": False})


def _evalplus_make_raw_chat_prompt():
    """EvalPlus's own ``make_raw_chat_prompt`` (the installed evalplus 0.3.1's evalplus/provider/utility.py, read by
    path: the package's ``__init__`` imports its generation stack, which the tests do not install)."""
    import importlib.util
    from importlib.metadata import distribution

    path = distribution("evalplus").locate_file("evalplus/provider/utility.py")
    spec = importlib.util.spec_from_file_location("evalplus_provider_utility", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_raw_chat_prompt


@pytest.mark.parametrize("task", ["evalplus_humaneval_chat", "evalplus_mbpp_chat"])
def test_evalplus_chat_prompts_are_evalplus_own_to_the_character(task, tmp_path):
    """The prompt lm-eval builds from our task file through the pool's language model is the string EvalPlus's
    ``make_raw_chat_prompt`` makes, for a Llama 3 template (which trims each message: lm-eval's own rendering of
    the gen_prefix, continued, would end "```python" and not "```python\\n")."""
    from helpers import tiny_causal_lm
    from hubmirror.standins import _llama_tokenizer
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml
    from test_lm_eval_scoring import HUMANEVAL_DOC, MBPP_DOC

    from featcal_fusionbench.evaluation.chat_prompts import language_model
    from featcal_fusionbench.evaluation.lm_eval_tasks import TASKS_DIR

    doc = HUMANEVAL_DOC if task == "evalplus_humaneval_chat" else MBPP_DOC
    # EvalPlus's task prompt: HumanEval+'s `prompt`; MBPP+'s docstring of the sentence and the first assert
    # (evalplus_mbpp_chat.yaml says where it comes from)
    evalplus_prompt = (doc["prompt"] if task == "evalplus_humaneval_chat"
                       else f'"""\n{doc["prompt"]}\n{doc["test_list"][0]}\n"""\n')
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps(doc) + "\n")
    config = load_yaml(TASKS_DIR / f"{task}.yaml")  # lm-eval's loader: the !function scorers resolved
    config.update(dataset_path="json", dataset_kwargs={"data_files": {"test": str(data)}})
    lm_task = ConfigurableTask(config=config)
    tokenizer = _llama_tokenizer()
    lm = language_model(tiny_causal_lm("llama", vocab=len(tokenizer)), tokenizer, batch_size=1)
    (evaluated,) = list(lm_task.test_docs())

    def prompt():
        return lm_task.fewshot_context(evaluated, 0, apply_chat_template=True, fewshot_as_multiturn=True,
                                       chat_template=lm.apply_chat_template, gen_prefix=lm_task.doc_to_prefix(evaluated))

    lm.reply_as_evalplus = True
    ours = prompt()
    theirs = _evalplus_make_raw_chat_prompt()(
        evalplus_prompt,
        "Please provide a self-contained Python script that solves the following problem in a markdown code block:",
        "Below is a Python script with a self-contained function that solves the problem and passes corresponding tests:",
        tokenizer)
    assert ours == theirs and ours.endswith("```python\n")
    lm.reply_as_evalplus = False  # lm-eval's own rendering: the trimmed prefix
    assert prompt() == theirs[:-1]
