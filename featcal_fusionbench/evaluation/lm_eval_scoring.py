"""Scoring Table 4's columns as Instruct models answer them (lm-eval tasks in ``lm_eval_tasks/``).

lm-eval 0.4.13's own tasks for three of the columns cannot score an Instruct model's chat reply (docs/families/
causal_lm.md, "Evaluation"): ``hendrycks_math500`` compares the text between the first and the last ``$`` and never
reads ``\\boxed{}``; ``humaneval_plus`` appends the reply to the prompt as a completion; ``mbpp_plus`` runs the three
original MBPP asserts, not EvalPlus's tests. The scorers here read what an Instruct model writes:

- MATH-500: the last ``\\boxed{...}`` of the reply (braces balanced), equal to the dataset's ``answer`` after the
  normalisation of lm-eval's Hendrycks MATH scorer (``lm_eval.tasks.hendrycks_math.utils.is_equiv``).
- HumanEval+ / MBPP+: the program in the reply's first fenced code block (```` ```python ```` first, else any; the
  whole reply when it has none), run with EvalPlus's tests (the ``test`` field of ``evalplus/humanevalplus`` and
  ``evalplus/mbppplus``) in a sandboxed process (``code_execution``): pass@1 of one greedy sample.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

from .code_execution import run_program

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

_FENCE = re.compile(r"```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(response: str) -> str:
    """The reply's first ```` ```python ```` block, else its first fenced block of any language, else the reply."""
    blocks = _FENCE.findall(response)
    for language, body in blocks:
        if language.lower() in ("python", "py", "python3"):
            return body
    return blocks[0][1] if blocks else response


def _defines(code: str, name: str) -> bool:
    return re.search(rf"^\s*def\s+{re.escape(name)}\s*\(", code, re.M) is not None


def humaneval_program(doc: Dict, response: str) -> str:
    """The reply's function with EvalPlus's ``check(candidate)``; a reply that gives only the body is completed from
    the prompt (the signature and docstring)."""
    code = extract_code(response)
    entry = doc["entry_point"]
    if not _defines(code, entry):
        code = doc["prompt"] + code
    return f"{code}\n\n{doc['test']}\n\ncheck({entry})\n"


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
    """The reply's code with EvalPlus's MBPP+ test, which calls the tested function as ``candidate``."""
    code = extract_code(response)
    return f"{code}\n\ncandidate = {mbpp_entry_point(doc)}\n\n{doc['test']}\n"


def _passed(program: str) -> Dict[str, float]:
    return {"pass@1": float(run_program(program, CODE_TIMEOUT_S).passed)}


def humaneval_plus_process_results(doc: Dict, results: List[str]) -> Dict[str, float]:
    return _passed(humaneval_program(doc, results[0]))


def mbpp_plus_process_results(doc: Dict, results: List[str]) -> Dict[str, float]:
    return _passed(mbpp_program(doc, results[0]))


__all__ = [
    "extract_code", "humaneval_plus_process_results", "humaneval_program", "last_boxed", "math500_process_results",
    "math_answer_correct", "mbpp_entry_point", "mbpp_plus_process_results", "mbpp_program",
]
