"""A model's code reply reduced to what EvalPlus scores: its imports and the definitions its entry point needs.

EvalPlus (evalplus/evalplus, ``evalplus/sanitize.py`` at commit 26d6d00) sanitizes every generated solution before
running it: the longest run of lines that parses as Python is kept (prose, markdown fences and a second block fall
outside it); of that, the top-level imports, and the classes, functions that return something, and variables that
the entry point reaches by name (a breadth-first walk over the identifiers each definition uses); every other
statement (example prints, asserts, an ``if __name__ == "__main__":`` self-test, calls) is dropped, as are a
later definition of a name already defined, decorated definitions and ``from __future__`` imports (EvalPlus's
tree-sitter walk does not match those node types).

The ``evalplus`` package itself (0.3.1) requires the OpenAI, Anthropic and Google generative-AI clients, among
others, for its code generators, so this is a port: on Python's own ``ast`` instead of tree-sitter (after the first
step the code parses, so both see the same tree), tested on EvalPlus's sanitizer tests
(``tests/test_treesitter_sanitizer.py``).
"""

from __future__ import annotations

import ast
import re
from collections import deque
from typing import Dict, Iterator, List, Optional, Set, Tuple

_ANSI_ESCAPE = re.compile(r"\x1B(?:[@-Z\\-_]|\[[0-?]*[ -/]*[@-~])")


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, MemoryError, ValueError, RecursionError):  # ValueError: a NUL byte
        return False
    return True


def code_extract(text: str) -> str:
    """The longest run of lines (counting non-blank ones) that parses as Python; the first such run on a tie."""
    lines = _ANSI_ESCAPE.sub("", text).split("\n")
    best, best_length = (0, 0), 0
    for i in range(len(lines)):
        for j in range(i + 1, len(lines)):
            chunk = lines[i:j + 1]
            length = sum(1 for line in chunk if line.strip())
            if length > best_length and _parses("\n".join(chunk)):
                best, best_length = (i, j), length
    return "\n".join(lines[best[0]:best[1] + 1])


def _identifiers(node: ast.AST) -> Iterator[str]:
    """Every name written in ``node``'s source: variables, attributes, parameters, keywords, imported names (what
    tree-sitter-python tags ``identifier``)."""
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            yield child.id
        elif isinstance(child, ast.Attribute):
            yield child.attr
        elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield child.name
        elif isinstance(child, ast.arg):
            yield child.arg
        elif isinstance(child, ast.keyword) and child.arg is not None:
            yield child.arg
        elif isinstance(child, ast.alias):
            yield from child.name.split(".")
            if child.asname:
                yield child.asname
        elif isinstance(child, ast.ImportFrom) and child.module:
            yield from child.module.split(".")
        elif isinstance(child, (ast.Global, ast.Nonlocal)):
            yield from child.names
        elif isinstance(child, ast.ExceptHandler) and child.name:
            yield child.name
        elif isinstance(child, (ast.MatchAs, ast.MatchStar)) and child.name:
            yield child.name
        elif isinstance(child, ast.MatchMapping) and child.rest:
            yield child.rest
        elif isinstance(child, ast.MatchClass):
            yield from child.kwd_attrs


def _assigned_name(statement: ast.stmt) -> Optional[str]:
    """The first bare name among an assignment's parts, as EvalPlus takes the first ``identifier`` child of a
    tree-sitter ``assignment``: its target, else (``a.b = c``, ``x, y = z``) its value; None when neither is one."""
    if isinstance(statement, ast.Assign):
        parts = [statement.targets[0]] + ([statement.value] if len(statement.targets) == 1 else [])
    else:  # AnnAssign
        parts = [statement.target] + ([statement.value] if statement.value is not None else [])
    for part in parts:
        if isinstance(part, ast.Name):
            return part.id
    return None


def _returns(node: ast.AST) -> bool:
    return any(isinstance(child, ast.Return) for child in ast.walk(node))


def _indent(line: str) -> int:
    """Indentation as tree-sitter-python's scanner counts it (a tab is 8, a form feed starts again)."""
    width = 0
    for char in line:
        if char == " ":
            width += 1
        elif char == "\t":
            width += 8
        elif char == "\f":
            width = 0
        else:
            break
    return width


def _block_end(lines: List[str], node: ast.AST) -> Tuple[int, Optional[int]]:
    """Where tree-sitter ends a top-level class or function: ast's end, extended over a comment on its last line
    and over the comment lines after it (blank lines between) up to the first one indented less than the body
    (its scanner places the block's dedent there). (line, byte column; None: the line's end)."""
    last = node.end_lineno - 1
    if lines[last].encode()[node.end_col_offset:].strip().startswith(b"#"):
        end: Tuple[int, Optional[int]] = (last, None)
    else:
        end = (last, node.end_col_offset)
    if node.body[0].lineno == node.lineno:  # `def f(x): return x`: no indented block to hold later comments
        return end
    body = _indent(lines[node.body[0].lineno - 1])
    for index in range(last + 1, len(lines)):
        text = lines[index].strip()
        if not text:
            continue
        if not text.startswith("#") or _indent(lines[index]) < body:
            break
        end = (index, None)
    return end


def _segment(lines: List[str], node: ast.AST) -> str:
    # ast's offsets are UTF-8 byte columns, as tree-sitter's are bytes
    first = node.lineno - 1
    last, end_col = (_block_end(lines, node) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     else (node.end_lineno - 1, node.end_col_offset))
    head_line = lines[first].encode()
    if first == last:
        return head_line[node.col_offset:end_col].decode()
    head = head_line[node.col_offset:].decode()
    tail = lines[last].encode()[:end_col].decode()
    return "\n".join([head, *lines[first + 1:last], tail])


def _reachable(entrypoint: str, uses: Dict[Optional[str], Set[str]]) -> Set[str]:
    seen, queue = {entrypoint}, deque([entrypoint])
    while queue:
        for name in uses.get(queue.popleft(), ()):
            if name not in seen:
                seen.add(name)
                queue.append(name)
    return seen


def extract_target_code_or_empty(code: str, entrypoint: Optional[str] = None) -> str:
    code = code_extract(code)
    lines = code.split("\n")
    try:
        tree = ast.parse(code)
    except (SyntaxError, MemoryError, ValueError, RecursionError):
        return ""  # one line that does not parse (nothing longer did): the caller falls back to it
    imports: List[ast.stmt] = []
    definitions: List[Tuple[Optional[str], ast.AST]] = []
    defined: Set[Optional[str]] = set()
    for statement in tree.body:
        if isinstance(statement, ast.Import) or (isinstance(statement, ast.ImportFrom)
                                                 and statement.module != "__future__"):
            imports.append(statement)
            continue
        if isinstance(statement, ast.ClassDef):
            name = statement.name
        elif isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = statement.name
            if not _returns(statement):
                continue
        elif isinstance(statement, (ast.Assign, ast.AnnAssign)):
            name = _assigned_name(statement)
        else:
            continue
        # a decorated definition is another node type to tree-sitter (decorated_definition): never kept
        if getattr(statement, "decorator_list", None) or name in defined:
            continue
        defined.add(name)
        definitions.append((name, statement))
    kept = None
    if entrypoint:
        kept = _reachable(entrypoint, {name: set(_identifiers(node)) for name, node in definitions})
    parts = [_segment(lines, node) for node in imports]
    parts += [_segment(lines, node) for name, node in definitions if kept is None or name in kept]
    return "\n".join(parts)


def sanitize(code: str, entrypoint: Optional[str] = None) -> str:
    """EvalPlus's ``sanitize``: the reply's imports and the definitions ``entrypoint`` reaches, else (nothing of
    the kind) the longest run of lines that parses."""
    sanitized = extract_target_code_or_empty(code, entrypoint).strip()
    return sanitized if sanitized else code_extract(code)


__all__ = ["code_extract", "extract_target_code_or_empty", "sanitize"]
