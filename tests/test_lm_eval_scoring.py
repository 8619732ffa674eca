"""Table 4's scorers on replies written the way Instruct models write them (featcal_fusionbench.evaluation.lm_eval_scoring)."""

import tempfile
import time

import pytest

from featcal_fusionbench.evaluation.code_execution import run_program
from featcal_fusionbench.evaluation.lm_eval_scoring import (
    humaneval_plus_process_results,
    last_boxed,
    math500_process_results,
    mbpp_entry_point,
    mbpp_plus_process_results,
)
# EvalPlus's test helpers (evalplus tools/humaneval/to_original_fmt.py), as the mirror's stand-ins hold them
from hubmirror.standins import EVALPLUS_ASSERTION as _ASSERTION

HUMANEVAL_DOC = {
    "task_id": "HumanEval/0",
    "prompt": 'def mean_of(numbers: list) -> float:\n    """The mean of a non-empty list.\n    >>> mean_of([1.0, 3.0])\n'
              '    2.0\n    """\n',
    "entry_point": "mean_of",
    "test": _ASSERTION + "\n\ndef check(candidate):\n    inputs = [[[1.0, 3.0]], [[2.0]], [[0.1, 0.2, 0.3]]]\n"
            "    results = [2.0, 2.0, 0.2]\n    for i, (inp, exp) in enumerate(zip(inputs, results)):\n"
            "        assertion(candidate(*inp), exp, 0)\n",
}
# EvalPlus's MBPP+ form (tools/mbpp/to_original_fmt.py at 26d6d00): module-level code that calls the function by name
MBPP_DOC = {
    "task_id": 2,
    "prompt": "Write a function to find the shared elements from the given two lists.",
    "code": "def similar_elements(test_tup1, test_tup2):\n  return tuple(set(test_tup1) & set(test_tup2))\n",
    "test_list": ["assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))",
                  "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))",
                  "assert set(similar_elements((11, 12, 14, 13),(17, 15, 14, 13))) == set((13, 14))"],
    "test": _ASSERTION + "\n\ninputs = [[(3, 4, 5, 6), (5, 7, 4, 10)], [(1, 2), (2, 9)], [(7,), (8,)]]\n"
            "results = [{4, 5}, {2}, set()]\nfor i, (inp, exp) in enumerate(zip(inputs, results)):\n"
            "    assertion(set(similar_elements(*inp)), exp, 0)\n",
}
# the generator's earlier form (at 0b180c8) called it `candidate`
MBPP_DOC_CANDIDATE = {**MBPP_DOC, "test": MBPP_DOC["test"].replace("similar_elements(*inp)", "candidate(*inp)")}


@pytest.fixture(autouse=True)
def short_time_limit(monkeypatch):
    """The docs here run a handful of inputs in well under a second; a reply that loops is stopped after 3 s, not the
    20 s a real HumanEval+ program gets."""
    from featcal_fusionbench.evaluation import lm_eval_scoring

    monkeypatch.setattr(lm_eval_scoring, "CODE_TIMEOUT_S", 3.0)


def humaneval(reply):
    return humaneval_plus_process_results(HUMANEVAL_DOC, [reply])["pass@1"]


def mbpp(reply):
    return mbpp_plus_process_results(MBPP_DOC, [reply])["pass@1"]


# ------------------------------------------------------------------------------------------------------ MATH-500

WORKED = ("We need $x$ with $2x + 1 = 2$. Subtracting 1 gives $2x = 1$, so $x = \\frac{1}{2}$.\n\n"
          "Therefore, the final answer is: $\\boxed{\\frac{1}{2}}$. I hope it is correct.")


@pytest.mark.parametrize("reply, answer, score", [
    (WORKED, "\\frac{1}{2}", 1),  # nested braces inside the box
    (WORKED, "\\frac{1}{3}", 0),
    (WORKED.replace("\\boxed{\\frac{1}{2}}", "\\boxed{\\dfrac{1}{2}}"), "\\frac{1}{2}", 1),  # lm-eval's normalisation
    ("First try \\boxed{3}; on reflection the answer is \\boxed{4}.", "4", 1),  # the last box counts
    ("The answer is $4$.", "4", 0),  # no box: not read from dollars
    ("So the answer is \\boxed{\\frac{1}{2", "\\frac{1}{2}", 0),  # cut off inside the box
    ("The answer is \\boxed{(3, -2)}.", "(3,-2)", 1),
])
def test_math500_reads_the_last_box_of_a_worked_solution(reply, answer, score):
    assert math500_process_results({"answer": answer}, [reply]) == {"exact_match": score}


def test_last_boxed_balances_braces_and_knows_fbox():
    assert last_boxed("\\boxed{\\sqrt{2}+\\frac{a}{b}} and more") == "\\sqrt{2}+\\frac{a}{b}"
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("nothing here") is None


# --------------------------------------------------------------------------------------------------- code replies

RIGHT_FUNCTION = "def mean_of(numbers: list) -> float:\n    return sum(numbers) / len(numbers)\n"


SELF_TEST = "\n\nif __name__ == '__main__':\n    assert mean_of([1.0, 3.0]) == 3.0, 'my own check'\n"


@pytest.mark.parametrize("reply, score", [
    (f"Sure! Here is a self-contained script:\n```python\n{RIGHT_FUNCTION}```\nThis works for any list.", 1.0),
    # example usage printed, a wrong self-test under __main__: dropped by the sanitizer, as EvalPlus drops them
    (f"```python\nfrom statistics import fmean\n\n{RIGHT_FUNCTION}\nprint(mean_of([1.0, 3.0]))\n```", 1.0),
    (f"```python\n{RIGHT_FUNCTION}{SELF_TEST}```", 1.0),
    # several blocks: the function in the first, its usage (with a loop that never ends) in a second
    (f"Solution:\n```python\n{RIGHT_FUNCTION}```\n\nUsage:\n```python\nwhile True:\n    mean_of([1.0])\n```", 1.0),
    # a helper the entry point calls is kept; a helper it does not call may be broken
    ("```python\ndef _total(xs):\n    return sum(xs)\n\ndef mean_of(numbers):\n    return _total(numbers) / len(numbers)"
     "\n\ndef unused():\n    return undefined_name\n```", 1.0),
    ("```python\ndef mean_of(numbers):\n    while True:\n        pass\n```", 0.0),  # loops: stopped, scores 0
    ("```python\n    return sum(numbers) / len(numbers)\n```", 0.0),  # the body only: no definition, as in EvalPlus
    ("```python\ndef mean_of(numbers):\n    return sum(numbers) / (len(numbers) + 1)\n```", 0.0),  # wrong
    ("The mean is the sum divided by the count.", 0.0),  # prose, no code
    ("```python\ndef mean_of(numbers):\n    return numbers[0]\n```", 0.0),  # passes the docstring, fails plus inputs
])
def test_humaneval_plus_scores_a_chat_reply_with_evalplus_tests(reply, score):
    assert humaneval(reply) == score


def test_a_reply_continuing_evalplus_response_prefix_is_scored_as_written():
    """With the task's gen_prefix the reply starts inside the ```python fence and stops at EvalPlus's stop strings."""
    assert humaneval(RIGHT_FUNCTION.replace("    ", "\t")) == 1.0  # tabs read as four spaces, as EvalPlus does


@pytest.mark.parametrize("reply, score", [
    ("```python\ndef similar_elements(a, b):\n    return tuple(set(a) & set(b))\n```", 1.0),
    ("Here you go:\n```python\ndef similar_elements(a, b):\n    return tuple(x for x in a if x in b)\n```", 1.0),
    ("```python\ndef similar_elements(a, b):\n    return tuple(set(a) & set(b))\n\nassert similar_elements((1,), (2,)) == (1,)"
     "\n```", 1.0),  # a failing example assert of its own decides nothing
    ("```python\ndef similar_elements(a, b):\n    return tuple(set(a) | set(b))\n```", 0.0),
    ("```python\ndef shared(a, b):\n    return tuple(set(a) & set(b))\n```", 0.0),  # another name: not the tested one
])
def test_mbpp_plus_scores_a_chat_reply_with_evalplus_tests(reply, score):
    assert mbpp(reply) == score


def test_mbpp_plus_rows_that_call_the_function_candidate_score_alike():
    reply = "```python\ndef similar_elements(a, b):\n    return tuple(set(a) & set(b))\n```"
    assert mbpp_plus_process_results(MBPP_DOC_CANDIDATE, [reply]) == {"pass@1": 1.0}
    assert mbpp_plus_process_results(MBPP_DOC_CANDIDATE, [reply.replace("&", "|")]) == {"pass@1": 0.0}


def test_mbpp_plus_tests_the_function_its_first_assert_calls():
    assert mbpp_entry_point(MBPP_DOC) == "similar_elements"  # not `set`, the wrapper around the call


def test_a_looping_program_is_stopped_and_scores_zero():
    started = time.monotonic()
    result = run_program("while True:\n    pass\n", timeout_s=2)
    assert result.status == "timeout" and not result.passed
    assert time.monotonic() - started < 10
    spawner = "import os\nwhile True:\n    pass\n"
    assert not run_program(spawner, timeout_s=1).passed


def test_a_file_writing_program_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    target, scratch = tmp_path / "target", tmp_path / "scratch"
    target.mkdir()
    scratch.mkdir()
    # the sandbox's own folders go under a temporary folder of this test only (other tests run programs meanwhile)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    for program in (f"open({str(target / 'written.txt')!r}, 'w').write('x')\n",
                    "open('local.txt', 'w').write('x')\n",
                    f"import os\nos.makedirs({str(target / 'made')!r})\n",
                    f"import shutil\nshutil.rmtree({str(target)!r})\n",
                    "import subprocess\nsubprocess.run(['touch', 'x'])\n"):
        result = run_program(program, timeout_s=10)
        assert result.status == "failed" and "sandbox refuses" in result.output, (program, result)
    assert list(target.iterdir()) == []  # nothing written, nothing removed
    assert list(scratch.iterdir()) == []  # its own folder is gone


def test_a_reply_that_writes_files_scores_zero_and_leaves_nothing(tmp_path):
    target = tmp_path / "out.txt"
    writer = f"def mean_of(numbers):\n    open({str(target)!r}, 'w').write('x')\n    return sum(numbers) / len(numbers)\n"
    reply = f"```python\n{writer}```"
    assert humaneval(reply) == 0.0
    assert not target.exists()


# ------------------------------------------------------------------------- MergeBench's code protocol (bigcode)


def test_pass_at_k_is_the_unbiased_estimator():
    from math import comb

    from featcal_fusionbench.evaluation.lm_eval_scoring import pass_at_k

    for n, c, k in [(10, 0, 1), (10, 3, 1), (10, 3, 10), (10, 10, 1), (10, 9, 10), (20, 5, 10)]:
        expected = 1.0 - comb(n - c, k) / comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12), (n, c, k)


def test_bigcode_completions_are_the_prompt_plus_each_sample_scored_over_all_samples():
    from featcal_fusionbench.evaluation.lm_eval_scoring import (
        bigcode_humaneval_prompt,
        humanevalplus_bigcode_process_results,
        mbppplus_bigcode_process_results,
    )

    assert bigcode_humaneval_prompt(HUMANEVAL_DOC) == HUMANEVAL_DOC["prompt"].strip()
    right, wrong = "\n    return sum(numbers) / len(numbers)", "\n    return numbers[0]"
    # lm-eval's take_first_k filter hands the doc's samples as one list; bigcode appends them to the prompt
    scores = humanevalplus_bigcode_process_results(HUMANEVAL_DOC, [[right] * 3 + [wrong] * 7])
    assert scores["pass@1"] == pytest.approx(0.3) and scores["pass@10"] == 1.0
    assert humanevalplus_bigcode_process_results(HUMANEVAL_DOC, [[wrong] * 10]) == {"pass@1": 0.0, "pass@10": 0.0}
    mbpp_right = "def similar_elements(a, b):\n    return tuple(set(a) & set(b))\n"
    scores = mbppplus_bigcode_process_results(MBPP_DOC, [[mbpp_right, mbpp_right.replace("&", "|")]])
    assert scores == {"pass@1": 0.5}  # two samples: pass@10 is not estimated


@pytest.mark.parametrize("task, doc", [("humanevalplus_bigcode", HUMANEVAL_DOC), ("mbppplus_bigcode", MBPP_DOC)])
def test_the_bigcode_tasks_prompt_is_the_one_the_scorer_completes(task, doc):
    """The program is the prompt plus the completion: the prompt lm-eval renders must be the scorer's."""
    from pathlib import Path

    import yaml
    from lm_eval.utils import apply_template

    from featcal_fusionbench.evaluation.lm_eval_scoring import bigcode_humaneval_prompt, bigcode_mbpp_prompt
    from featcal_fusionbench.evaluation.lm_eval_tasks import TASKS_DIR

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: node.value)
    config = yaml.load((Path(TASKS_DIR) / f"{task}.yaml").read_text(), Loader=Loader)
    prompt = bigcode_humaneval_prompt if task.startswith("humaneval") else bigcode_mbpp_prompt
    assert apply_template(config["doc_to_text"], doc) == prompt(doc)
