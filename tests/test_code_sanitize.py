"""Our port of EvalPlus's sanitizer (featcal_fusionbench.evaluation.code_sanitize) on EvalPlus's own sanitizer tests
(evalplus/evalplus tests/test_treesitter_sanitizer.py at commit 26d6d00: the same inputs and expected outputs), then
on cases those tests leave open, each expected value being what EvalPlus 0.3.1's own ``sanitize`` returns (run with
tree-sitter 0.26.1 and tree-sitter-python 0.25.0 outside the project; experiments/scripts/sanitize_difftest.py
compares the two on random replies)."""

from featcal_fusionbench.evaluation.code_sanitize import code_extract, sanitize

# ---- EvalPlus's tests -------------------------------------------------------------------------------------------


def test_code_extract():
    text = ("Here is some python code generated\nimport numpy as np\nSorry, I made a mistake, let me try again\n"
            "from numpy import sin, cos, tan\n\ndef f(x):\n    return tan(x)\nAs you can observe from above\n    ")
    assert code_extract(text) == "from numpy import sin, cos, tan\n\ndef f(x):\n    return tan(x)"
    text = ("import numpy as np\n\n\nimport pandas\nSorry, let me try again\nfrom numpy import sin, cos, tan\n"
            "def f(x):\n    return tan(x)\n")
    assert code_extract(text) == "from numpy import sin, cos, tan\ndef f(x):\n    return tan(x)"


SIMPLE = """Following is the code snippet:
```python
import numpy as np
from numpy import sin, cos

def f(x):
    return np.tan(x)

def g(x):
    return cos(f(x))

def g(x):
    return sin(f(x))

def c(x):
    assert 1==1

assert g(0) == 1
```
"""


def test_sanitize_simple():
    assert sanitize(SIMPLE) == ("import numpy as np\nfrom numpy import sin, cos\ndef f(x):\n    return np.tan(x)\n"
                                "def g(x):\n    return cos(f(x))")


def test_sanitize_class():
    code = ("Following is the code snippet:\n```python\nimport numpy as np\nfrom numpy import sin, cos\nclass g():\n"
            "    def hello_world():\n        return 0\ndef f(x):\n    print(g.hello_world())\n    return np.tan(x)\n```\n")
    assert sanitize(code) == ("import numpy as np\nfrom numpy import sin, cos\nclass g():\n    def hello_world():\n"
                              "        return 0\ndef f(x):\n    print(g.hello_world())\n    return np.tan(x)")


def test_entrypoint_basic():
    code = SIMPLE.replace("def c(x):\n    assert 1==1", "def c(x):\n    return 0")
    assert sanitize(code, "g") == ("import numpy as np\nfrom numpy import sin, cos\ndef f(x):\n    return np.tan(x)\n"
                                   "def g(x):\n    return cos(f(x))")


CHAIN = """Following is the code snippet:
```python
import numpy as np
from numpy import sin, cos

def f(x):
    return c(x)
assert f(1) == 5
def g(x):
    return cos(f(x))

def c(x):
    newObj = h()
    return x

class h():
    def hello_world():
        return 0

class h():
    def goodbye_world():
        return 0


assert g(0) == 1
```
"""


def test_entrypoint_chain():
    assert sanitize(CHAIN, "g") == (
        "import numpy as np\nfrom numpy import sin, cos\ndef f(x):\n    return c(x)\ndef g(x):\n    return cos(f(x))\n"
        "def c(x):\n    newObj = h()\n    return x\nclass h():\n    def hello_world():\n        return 0")


def test_entrypoint_no_chain():
    code = ("Following is the code snippet:\n```python\nimport numpy as np\nfrom numpy import sin, cos, sum\n\n"
            "def f(x):\n    return np.sum(x)\nassert f(1) == 5\ndef g(x):\n    return cos(f(x))\n\ndef c(x):\n"
            "    newObj = h()\n    return x\n\nclass h():\n    def hello_world():\n        return 0\n\n\n"
            "assert g(0) == 1\n```\n")
    assert sanitize(code, "g") == ("import numpy as np\nfrom numpy import sin, cos, sum\ndef f(x):\n"
                                   "    return np.sum(x)\ndef g(x):\n    return cos(f(x))")


def test_entrypoint_variable():
    code = ("Following is the code snippet:\n```python\nimport numpy as np\nfrom numpy import sin, cos\n\n"
            "SOME_CONSTANT = 5\n\ndef f(x):\n    return c(x)\nassert f(1) == 5\ndef g(x):\n    return cos(f(x))\n\n"
            "def c(x):\n    newObj = h()\n    return x\n\nclass h():\n    def hello_world():\n"
            "        return SOME_CONSTANT\n\ndef d(x):\n    return g(x)\n\n# Some tests\nassert g(0) == 1\n"
            "print(g(123))\nret = g(321)\n```\n")
    assert sanitize(code, "g") == (
        "import numpy as np\nfrom numpy import sin, cos\nSOME_CONSTANT = 5\ndef f(x):\n    return c(x)\n"
        "def g(x):\n    return cos(f(x))\ndef c(x):\n    newObj = h()\n    return x\nclass h():\n"
        "    def hello_world():\n        return SOME_CONSTANT")


# ---- what EvalPlus's tree-sitter walk does where its tests are silent ------------------------------------------


def test_a_main_block_a_decorated_definition_and_a_future_import_are_dropped():
    code = ("from __future__ import annotations\nimport functools\n\n@functools.lru_cache\ndef helper(n):\n"
            "    return n\n\ndef f(n):\n    return helper(n) + 1\n\nif __name__ == '__main__':\n    assert f(1) == 3\n")
    # a decorated function is tree-sitter's decorated_definition, a node EvalPlus does not keep
    assert sanitize(code, "f") == "import functools\ndef f(n):\n    return helper(n) + 1"


def test_the_name_of_a_top_level_assignment_is_its_first_bare_name():
    code = "a, b = LIMIT\nLIMIT = 3\nobj.attr = other\nother = 1\ndef f():\n    return LIMIT + other\n"
    # `a, b = LIMIT` is named LIMIT (its first identifier child), so the real `LIMIT = 3` is a repeated name
    assert sanitize(code, "f") == "a, b = LIMIT\nobj.attr = other\ndef f():\n    return LIMIT + other"


def test_nothing_of_the_kind_gives_the_longest_run_that_parses():
    assert sanitize("The answer:\nprint(1)\nprint(2)\nThat's all.", "f") == "print(1)\nprint(2)"


def test_comments_after_a_block_belong_to_it_down_to_the_first_one_left_of_its_body():
    code = "def f(x):\n    if x:\n        return 1\n    # mid\n        # deep\n# top\ny = 1"
    assert sanitize(code) == "def f(x):\n    if x:\n        return 1\n    # mid\n        # deep\ny = 1"


def test_tabs_and_multibyte_characters_keep_their_columns():
    code = "def f(s):\n\treturn s + 'é'  # accent\nx = 'ü'; y = 2\n"
    assert sanitize(code, "f") == "def f(s):\n\treturn s + 'é'  # accent"
    assert sanitize(code) == "def f(s):\n\treturn s + 'é'  # accent\nx = 'ü'\ny = 2"
