"""Our EvalPlus sanitizer port (featcal_fusionbench.evaluation.code_sanitize) against EvalPlus's own ``sanitize``
(tree-sitter), on random replies assembled from the pieces Instruct models write (prose, fences, imports,
definitions, decorators, comments at every depth, tabs, multi-byte text, ``__main__`` blocks, loops, asserts).

EvalPlus's module is read from its wheel (``pip download evalplus==0.3.1 --no-deps``) with its two dataset imports
stubbed (they serve only its command line); it needs tree-sitter, which the project does not install:

    python -m venv /tmp/tsenv && /tmp/tsenv/bin/pip install tree-sitter tree-sitter-python
    pip download evalplus==0.3.1 --no-deps -d /tmp/evalplus-wheel
    /tmp/tsenv/bin/python experiments/scripts/sanitize_difftest.py --wheel /tmp/evalplus-wheel/evalplus-0.3.1-py3-none-any.whl

It prints the number of (reply, entry point) pairs on which the two differ, and the first few differences.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import types
import zipfile
from pathlib import Path

PIECES = [
    "Here is the solution:", "```python", "```", "```py", "That's it.", "Example usage:", "import math",
    "from typing import List", "from __future__ import annotations", "import os.path as osp",
    "def f(x):\n    return helper(x) + LIMIT", "def helper(y):\n    return math.sqrt(y)", "def helper(y):\n    print(y)",
    "def g(a, *args, key=None, **kw):\n    return [h(i) for i in args]", "LIMIT = 10", "LIMIT: int = 10",
    "a, b = LIMIT, 2", "obj.attr = helper", "x = y = 3", "class h:\n    def m(self):\n        return self.v",
    "@decorator\ndef f(x):\n    return x", "async def f(x):\n    return await x",
    "if __name__ == '__main__':\n    print(f(1))\n    assert f(2) == 3", "print(f(2))", "assert f(1) == 1", "f(3)",
    "while True:\n    pass", "def f(x):\n\treturn x + 'é'  # note", "x = 'ü'; y = 2",
    "def f(s):\n    def inner():\n        return s\n    inner()", "counter += 1",
    "def k(t):\n    try:\n        return t\n    except ValueError as err:\n        return err",
    "total = sum(f(i) for i in range(3))", "def f(x):  # trailing\n    # inside\n    return x  # end\n# after",
    "match = 1", "def m(p):\n    match p:\n        case {'a': 1, **rest}:\n            return rest\n"
    "        case Point(x=0) as q:\n            return q",
    "def fs(x):\n    return f'{helper(x)!r:>{LIMIT}}'", "global_list = [f, helper]", "def f(x): return x",
    "lambda_fn = lambda q: helper(q)", "", "   ", "# just a comment",
    "def f(x):\n    if x:\n        return 1\n        # deep\n    # mid\n# top",
    "def f(x):\n    for i in x:\n        pass\n  # between\n    return x", "class K:\n    x = 1\n    # end of class",
    "    # indented comment", "def helper(y):\n\treturn y\n\t# tab comment", "@dataclass\nclass P:\n    x: int",
    "def f(x):\n    return x\n\n\n    # after blanks", "try:\n    import numpy as np\nexcept ImportError:\n    np = None",
    "if True:\n    def f(x):\n        return x", "def g(x):\n    \"\"\"doc\"\"\"\n    return f(x)  # call f",
    "import re, sys  # two", "from math import (\n    sqrt,\n    pi,\n)", "def f(x):\n    return x \\\n        + 1",
    "s = '''multi\nline'''", "def f(x):\n    return '#not a comment'", "def g(x):\n    return x # é ü",
    "def f(x):\n    return x\n  # shallow first\n        # deep second",
    "def f(x):\n    return x\n        # deep first\n# shallow second",
    "class C(Base, metaclass=M):\n    def f(self):\n        return 1", "x: int", "def f(x) -> 'List[int]':\n    return [x]",
]
ENTRY_POINTS = (None, "f", "g", "helper")


def evalplus_sanitize(wheel: Path):
    """EvalPlus's ``evalplus/sanitize.py`` from its wheel, its ``evalplus.data`` import stubbed."""
    source = zipfile.ZipFile(wheel).read("evalplus/sanitize.py").decode()
    for name in ("evalplus", "evalplus.data", "evalplus.syncheck"):
        sys.modules.setdefault(name, types.ModuleType(name))
    data = sys.modules["evalplus.data"]
    for name in ("get_human_eval_plus", "get_mbpp_plus", "load_solutions", "write_directory", "write_jsonl"):
        setattr(data, name, None)
    syncheck = zipfile.ZipFile(wheel).read("evalplus/syncheck.py").decode()
    syncheck = syncheck.replace("from termcolor import colored", "").replace("from evalplus.data import load_solutions", "")
    exec(compile(syncheck, "evalplus/syncheck.py", "exec"), sys.modules["evalplus.syncheck"].__dict__)
    module = types.ModuleType("evalplus.sanitize")
    exec(compile(source.replace("from tqdm import tqdm", ""), "evalplus/sanitize.py", "exec"), module.__dict__)
    return module.sanitize


def ours():
    path = Path(__file__).resolve().parents[2] / "featcal_fusionbench" / "evaluation" / "code_sanitize.py"
    spec = importlib.util.spec_from_file_location("code_sanitize", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.sanitize


def outcome(sanitize, code, entry):
    try:
        return sanitize(code, entry)
    except Exception as error:  # a crash is an outcome to compare too
        return f"raised {type(error).__name__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", type=Path, required=True, help="evalplus-0.3.1-py3-none-any.whl")
    parser.add_argument("--replies", type=int, default=6000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    reference, port = evalplus_sanitize(args.wheel), ours()
    rng = random.Random(args.seed)
    differences = []
    for _ in range(args.replies):
        code = "\n".join(rng.choice(PIECES) for _ in range(rng.randint(1, 9)))
        for entry in ENTRY_POINTS:
            expected, got = outcome(reference, code, entry), outcome(port, code, entry)
            if expected != got:
                differences.append((code, entry, expected, got))
    for code, entry, expected, got in differences[:5]:
        print(f"--- entry point {entry!r}\n{code}\n--- EvalPlus: {expected!r}\n--- ours:     {got!r}")
    print(f"{len(differences)} differences in {args.replies * len(ENTRY_POINTS)} (reply, entry point) pairs, "
          f"seed {args.seed}")


if __name__ == "__main__":
    main()
