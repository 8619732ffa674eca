"""Scoring Table 4's columns as Instruct models answer them (lm-eval tasks in ``lm_eval_tasks/``).

lm-eval 0.4.13's own tasks for three of the columns cannot score an Instruct model's chat reply (docs/families/
causal_lm.md, "Evaluation"): ``hendrycks_math500`` compares the text between the first and the last ``$`` and never
reads ``\\boxed{}``; ``humaneval_plus`` appends the reply to the prompt as a completion; ``mbpp_plus`` runs the three
original MBPP asserts, not EvalPlus's tests. The scorers here read what an Instruct model writes:

- MATH-500: the last ``\\boxed{...}`` of the reply (braces balanced), equal to the dataset's ``answer`` after the
  normalisation of lm-eval's Hendrycks MATH scorer (``lm_eval.tasks.hendrycks_math.utils.is_equiv``).
- HumanEval+ / MBPP+: the reply sanitized as EvalPlus sanitizes it (``code_sanitize``: its imports and the
  definitions the entry point reaches), run with EvalPlus's tests (the ``test`` field of ``evalplus/humanevalplus``
  and ``evalplus/mbppplus``) in a sandboxed process (``code_execution``): pass@1 of one greedy sample. And as
  MergeBench scores them (bigcode-evaluation-harness): the prompt plus each of several sampled completions, run
  with the same tests, pass@1 and pass@10 estimated from the samples.
"""

from __future__ import annotations

import math
import re
from typing import Dict, List, Optional, Sequence

from .code_execution import run_program, run_programs
from .code_sanitize import sanitize

# Each program's wall-clock limit: EvalPlus's tests run hundreds of inputs, a few seconds on a CPU.
CODE_TIMEOUT_S = 20.0


# ------------------------------------------------------------------------------------------------------ MATH-500


def last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced; None if none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    if rest.startswith("\\boxed "):  # \boxed 5 (no braces), as lm-eval's remove_boxed reads it
        return rest[len("\\boxed "):].split("$")[0].strip()
    open_at = rest.find("{")
    if open_at < 0:
        return None
    depth = 0
    for i, char in enumerate(rest[open_at:], open_at):
        depth += char == "{"
        depth -= char == "}"
        if depth == 0:
            return rest[open_at + 1:i]
    return None  # unbalanced: the reply was cut off inside the box


def math_answer_correct(response: str, answer: str) -> bool:
    from lm_eval.tasks.hendrycks_math.utils import is_equiv

    boxed = last_boxed(response)
    return boxed is not None and bool(is_equiv(boxed, answer))


def math500_process_results(doc: Dict, results: List[str]) -> Dict[str, int]:
    return {"exact_match": int(math_answer_correct(results[0], doc["answer"]))}


# ----------------------------------------------------------------------------------------------------- code tasks

def _solution(response: str, entry_point: str) -> str:
    """The reply as EvalPlus scores a chat model's: tabs as four spaces (its HF provider's decoding), then sanitized
    to the imports and the definitions ``entry_point`` reaches (``code_sanitize``): prose, other blocks, example
    prints and a ``__main__`` self-test decide nothing. A reply without the entry point's definition fails, as in
    EvalPlus (a chat reply is scored as written, not appended to the prompt)."""
    return sanitize(response.replace("\t", "    "), entrypoint=entry_point)


def humaneval_program(doc: Dict, response: str) -> str:
    """The sanitized reply with EvalPlus's ``check(candidate)`` on the entry point."""
    entry = doc["entry_point"]
    return f"{_solution(response, entry)}\n\n{doc['test']}\n\ncheck({entry})\n"


def mbpp_entry_point(doc: Dict) -> str:
    """The function MBPP+ tests: the one its canonical solution (``code``) defines and its first original assert
    calls (the prompt shows that assert, so the reply names it the same)."""
    defined = re.findall(r"^def\s+([A-Za-z_]\w*)\s*\(", doc["code"], re.M)
    called = set(re.findall(r"([A-Za-z_]\w*)\s*\(", doc["test_list"][0]))
    tested = [name for name in defined if name in called]
    if not tested:
        raise ValueError(f"MBPP+ task {doc.get('task_id')}: no function of its solution is called in "
                         f"{doc['test_list'][0]!r}")
    return tested[0]


def mbpp_program(doc: Dict, response: str) -> str:
    """The sanitized reply with EvalPlus's MBPP+ test. Today's rows call the tested function by its name
    (evalplus tools/mbpp/to_original_fmt.py at 26d6d00: ``assertion({entry_point}(*inp), exp, atol)``); the
    generator before it (at 0b180c8) called it ``candidate``, which the alias keeps working."""
    entry = mbpp_entry_point(doc)
    return f"{_solution(response, entry)}\n\ncandidate = {entry}\n\n{doc['test']}\n"


def _passed(program: str) -> Dict[str, float]:
    return {"pass@1": float(run_program(program, CODE_TIMEOUT_S).passed)}


def humaneval_plus_process_results(doc: Dict, results: List[str]) -> Dict[str, float]:
    return _passed(humaneval_program(doc, results[0]))


def mbpp_plus_process_results(doc: Dict, results: List[str]) -> Dict[str, float]:
    return _passed(mbpp_program(doc, results[0]))


# ---- MergeBench's protocol: bigcode-evaluation-harness completions, several samples ----------------------------

BIGCODE_HUMANEVAL_TIMEOUT_S, BIGCODE_MBPP_TIMEOUT_S = 20.0, 10.0  # humanevalplus.py / mbppplus.py at 8fc5bae6


def pass_at_k(samples: int, correct: int, k: int) -> float:
    """The unbiased estimator of pass@k from ``samples`` programs of which ``correct`` pass (Chen et al. 2021,
    as bigcode_eval/tasks/custom_metrics/code_eval.py ``estimate_pass_at_k`` computes it)."""
    if samples - correct < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / n for n in range(samples - correct + 1, samples + 1))


def _samples(results: List) -> List[str]:
    # with the take_first_k filter lm-eval hands the doc's samples as one list
    return list(results[0]) if results and isinstance(results[0], (list, tuple)) else list(results)


def _pass_at(programs: Sequence[str], timeout_s: float) -> Dict[str, float]:
    correct = sum(r.passed for r in run_programs(programs, timeout_s))
    return {f"pass@{k}": pass_at_k(len(programs), correct, k) for k in (1, 10) if k <= len(programs)}


def bigcode_humaneval_prompt(doc: Dict) -> str:
    return doc["prompt"].strip()


def bigcode_mbpp_prompt(doc: Dict) -> str:
    return f'"""\n{doc["prompt"]}\n{doc["test_list"][0]}\n"""\n'


def humanevalplus_bigcode_process_results(doc: Dict, results: List) -> Dict[str, float]:
    prompt, reference = bigcode_humaneval_prompt(doc), f"\n{doc['test']}\ncheck({doc['entry_point']})"
    return _pass_at([prompt + sample + reference for sample in _samples(results)], BIGCODE_HUMANEVAL_TIMEOUT_S)


def mbppplus_bigcode_process_results(doc: Dict, results: List) -> Dict[str, float]:
    prompt, reference = bigcode_mbpp_prompt(doc), f"\n{doc['test']}"
    return _pass_at([prompt + sample + reference for sample in _samples(results)], BIGCODE_MBPP_TIMEOUT_S)


__all__ = [
    "bigcode_humaneval_prompt", "bigcode_mbpp_prompt", "humaneval_plus_process_results", "humaneval_program",
    "humanevalplus_bigcode_process_results", "last_boxed", "math500_process_results", "math_answer_correct",
    "mbpp_entry_point", "mbpp_plus_process_results", "mbpp_program", "mbppplus_bigcode_process_results", "pass_at_k",
]
