"""Seeded generators of the LLM world's three tasks: math word problems, Python function completion, and
instructions with verifiable format constraints.

Every task has a train side and a test side that share no prompt template, no name and no number (a math
problem's large operand or pair of factors, a function's constant, a bullet count or word limit), so a test
prompt is never a train prompt with new words; what the sides share is the kinds of problem (operation
structures, kinds of function, kinds of constraint), as GSM8K's or IFEval's train and test do. Each side is split into disjoint pools
once (by ``seed``), then examples are drawn from a side's pools; the validation split is drawn from the train side
(it chooses Task Arithmetic's scale, so it must not see the test side). An example is a dict with ``prompt`` and
``response`` (the reference answer the expert is trained on) and the fields its scorer needs.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

from .llm_scoring import follows_all

TASKS = ("math", "code", "instruction")
SIDES = ("train", "test")


def _split(items: Sequence, seed: int, salt: str) -> Dict[str, List]:
    """Shuffle ``items`` with a seed of its own and cut them in two halves: one per side."""
    items = list(items)
    random.Random(f"{seed}-{salt}").shuffle(items)
    half = len(items) // 2
    return {"train": items[:half], "test": items[half:]}


# ---------------------------------------------------------------------------------------------------- math

NAMES = [
    "Ava", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivan", "Jade", "Kai", "Lena", "Milo", "Nora",
    "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Vic", "Wade", "Yara", "Zack", "Iris", "Leo", "Mia",
]
ITEMS = ["apples", "marbles", "stickers", "pencils", "cookies", "stamps", "coins", "books", "shells", "cards",
         "beads", "eggs"]

# The operation structures: answer and worked steps from the operands. Products take two small factors (2-9),
# the other structures a large first operand (10-39) and small ones, so answers stay in the range a 135M model
# can learn to compute.
STRUCTURES: Dict[str, Callable] = {
    "a+b": lambda a, b, c: (a + b, [f"{a} + {b} = {a + b}"]),
    "a-b": lambda a, b, c: (a - b, [f"{a} - {b} = {a - b}"]),
    "a*b": lambda a, b, c: (a * b, [f"{a} * {b} = {a * b}"]),
    "a+b-c": lambda a, b, c: (a + b - c, [f"{a} + {b} = {a + b}", f"{a + b} - {c} = {a + b - c}"]),
    "a+b+c": lambda a, b, c: (a + b + c, [f"{a} + {b} = {a + b}", f"{a + b} + {c} = {a + b + c}"]),
    "a*b-c": lambda a, b, c: (a * b - c, [f"{a} * {b} = {a * b}", f"{a * b} - {c} = {a * b - c}"]),
    "a*b+c-a": lambda a, b, c: (a * b + c - a, [f"{a} * {b} = {a * b}", f"{a * b} + {c} = {a * b + c}",
                                                f"{a * b + c} - {a} = {a * b + c - a}"]),
}
# (structure, wording) pairs. Both sides cover the same structures (as GSM8K's train and test share their kinds of
# reasoning) in wordings of their own, one to three operations each.
MATH_TEMPLATES = {
    "train": [
        ("a+b", "{name} has {a} {item}. {name} buys {b} more. How many {item} does {name} have now?"),
        ("a+b", "There are {a} {item} in a jar and {name} adds {b}. How many {item} are in the jar?"),
        ("a-b", "{name} had {a} {item} and gave away {b} of them. How many {item} does {name} have left?"),
        ("a-b", "A box holds {a} {item}. {name} eats {b}. How many {item} are in the box now?"),
        ("a*b", "{name} buys {a} bags with {b} {item} in each bag. How many {item} does {name} buy?"),
        ("a*b", "{name} makes {a} piles of {b} {item}. How many {item} are in the piles?"),
        ("a+b-c", "{name} has {a} {item}, finds {b} more and then loses {c}. How many {item} does {name} have now?"),
        ("a+b+c", "{name} gets {a} {item} from a teacher, {b} from a cousin and {c} from a neighbour. How many {item} does {name} get?"),
        ("a*b-c", "There are {a} boxes with {b} {item} in each. {name} takes {c} {item} out. How many {item} are still in the boxes?"),
        ("a*b+c-a", "{name} packs {a} rows of {b} {item}, adds {c} more and then gives {a} away. How many {item} are left?"),
    ],
    "test": [
        ("a+b", "A shelf holds {a} {item}. {name} puts {b} more on it. How many {item} are on the shelf?"),
        ("a-b", "{name} started the week with {a} {item} and used {b}. How many {item} remain?"),
        ("a*b", "Each of {a} friends gives {name} {b} {item}. How many {item} does {name} get in all?"),
        ("a+b-c", "{name} counts {a} {item} in the morning. {b} arrive at noon and {c} are sold at night. How many {item} are there at the end?"),
        ("a+b+c", "{name} picks {a} {item}, then {b} more, then another {c}. How many {item} did {name} pick?"),
        ("a*b-c", "{name} earns {b} {item} a day for {a} days and then spends {c}. How many {item} does {name} keep?"),
    ],
}
_SMALL = range(2, 10)
_LARGE = range(10, 40)
_PAIRS = [(a, b) for a in _SMALL for b in _SMALL if a <= b]


@dataclass
class _Pools:
    names: List[str]
    items: List[str]
    large: List[int]
    pairs: List[Tuple[int, int]]


def _math_pools(seed: int) -> Dict[str, _Pools]:
    """Names, large operands and the pairs of factors multiplied are split between the sides: a test problem
    never adds to a number, or multiplies two factors, that a train problem does."""
    names, large, pairs = _split(NAMES, seed, "names"), _split(_LARGE, seed, "large"), _split(_PAIRS, seed, "pairs")
    return {side: _Pools(names[side], ITEMS, large[side], pairs[side]) for side in SIDES}


def math_example(rng: random.Random, side: str, pools: _Pools) -> Dict:
    structure, template = rng.choice(MATH_TEMPLATES[side])
    c = rng.choice(_SMALL)
    if "*" in structure:
        a, b = rng.choice(pools.pairs)
        if rng.random() < 0.5:
            a, b = b, a
        numbers = [min(a, b), max(a, b)]
    else:
        a, b = rng.choice(pools.large), rng.choice(_SMALL)
        numbers = [a]
    answer, steps = STRUCTURES[structure](a, b, c)
    if answer < 0:  # more taken away than there is: draw again
        return math_example(rng, side, pools)
    name, item = rng.choice(pools.names), rng.choice(pools.items)
    question = template.format(name=name, item=item, a=a, b=b, c=c)
    prompt = f"{question} Answer with a number."
    response = ". ".join(steps) + f". The answer is {answer}."
    return {"prompt": prompt, "response": response, "answer": str(answer), "numbers": numbers,
            "structure": structure}


# ---------------------------------------------------------------------------------------------------- code

# (signature arguments, description with {k}, body with {k}, test inputs): one kind of function each. The kinds are
# shared by both sides (as GSM8K's train and test share arithmetic); the wording, function names and constants
# are not.
CODE_KINDS: List[Tuple[str, str, str, List]] = [
    ("x", "returns x plus {k}", "return x + {k}", [0, 3, -5, 12]),
    ("x", "returns x multiplied by {k}", "return x * {k}", [0, 2, -3, 7]),
    ("xs", "returns the largest number in the list xs", "return max(xs)", [[1, 5, 3], [-2, -9], [7]]),
    ("xs", "returns the sum of the even numbers in the list xs", "return sum(v for v in xs if v % 2 == 0)",
     [[1, 2, 3, 4], [], [5, 7], [10, -2]]),
    ("s", "returns the string s reversed", "return s[::-1]", ["abc", "", "racecar", "hello"]),
    ("n", "returns True if n is divisible by {k} and False otherwise", "return n % {k} == 0", [0, 6, 7, 20, 21]),
    ("s", "returns how many times the letter 'a' occurs in the string s", "return s.count('a')",
     ["banana", "", "xyz", "aaa"]),
    ("xs", "returns a new list with every number in xs multiplied by {k}", "return [v * {k} for v in xs]",
     [[1, 2], [], [-3, 0, 4]]),
    ("s", "returns the first {k} characters of the string s", "return s[:{k}]", ["abcdefghij", "ab", ""]),
    ("xs", "returns the number of elements of xs that are greater than {k}", "return sum(1 for v in xs if v > {k})",
     [[1, 5, 9, 12], [], [3, 4, 5, 6, 7, 8]]),
    ("s", "returns the string s in upper case", "return s.upper()", ["abc", "Hello World", ""]),
    ("xs", "returns the list xs sorted from smallest to largest", "return sorted(xs)", [[3, 1, 2], [], [5, -1, 5]]),
]
CODE_TEMPLATES = {
    "train": [
        "Write a Python function `{fn}({args})` that {desc}.",
        "Complete this Python function:\n```python\ndef {fn}({args}):\n    \"\"\"The function {desc}.\"\"\"\n```",
        "Create a Python function called {fn} with parameter {args}. It {desc}.",
    ],
    "test": [
        "Implement `{fn}({args})` in Python: the function {desc}.",
        "Define a Python function named {fn} that takes {args} and {desc}.",
    ],
}
VERBS = ["get", "compute", "find", "make", "calc", "build", "take", "give", "fetch", "eval", "produce", "derive"]
NOUNS = ["value", "result", "answer", "total", "output", "item", "number", "thing", "score", "amount", "entry",
         "figure"]
CONSTANTS = range(2, 12)


def _code_pools(seed: int) -> Dict[str, Dict[str, List]]:
    verbs, nouns, ks = _split(VERBS, seed, "verbs"), _split(NOUNS, seed, "nouns"), _split(CONSTANTS, seed, "ks")
    return {side: {"verbs": verbs[side], "nouns": nouns[side], "ks": ks[side]} for side in SIDES}


def code_example(rng: random.Random, side: str, pools: Dict[str, List]) -> Dict:
    args, desc, body, inputs = rng.choice(CODE_KINDS)
    k = rng.choice(pools["ks"])
    fn = f"{rng.choice(pools['verbs'])}_{rng.choice(pools['nouns'])}"
    desc, body = desc.format(k=k), body.format(k=k)
    reference: Dict[str, Callable] = {}
    exec(f"def {fn}({args}):\n    {body}\n", reference)  # the reference implementation computes the expected values
    tests = "\n".join(f"assert {fn}({v!r}) == {reference[fn](v)!r}" for v in inputs)
    prompt = rng.choice(CODE_TEMPLATES[side]).format(fn=fn, args=args, desc=desc) + "\nReply with the code only."
    response = f"```python\ndef {fn}({args}):\n    {body}\n```"
    return {"prompt": prompt, "response": response, "tests": tests, "entry_point": fn, "constant": k}


# ---------------------------------------------------------------------------------------------------- instruction

TOPICS = ["the ocean", "autumn", "bicycles", "coffee", "mountains", "libraries", "rain", "gardens", "trains",
          "music", "the moon", "bread", "winter", "cats", "rivers", "chess", "forests", "bridges", "tea", "kites"]
ADJECTIVES = ["calm", "bright", "quiet", "old", "simple", "useful", "gentle", "strong", "warm", "lovely", "fresh",
              "busy"]
KEYWORDS = ["window", "river", "morning", "friend", "garden", "silver", "journey", "pocket", "candle", "harbor",
            "meadow", "lantern"]
REQUESTS = {
    "train": ["Write a short text about {topic}.", "Tell me something about {topic}.", "Describe {topic}."],
    "test": ["Share a few thoughts on {topic}.", "Give a brief description of {topic}."],
}
SENTENCES = [
    "{Topic} can be {adj} and {adj2}", "Many people think {topic} is {adj}", "I like {topic} because it feels {adj}",
    "{Topic} looks {adj} in the evening", "There is something {adj} about {topic}", "People often find {topic} {adj}",
]
# Counts: bullet points and word limits, split between the sides like the math operands.
BULLETS = [2, 3, 4, 5]
WORD_LIMITS = [15, 20, 25, 30, 35, 40]
# Constraint kinds that cannot hold together (they rewrite the same letters or the answer's ends).
CONFLICTS = {
    frozenset({"lowercase", "uppercase"}), frozenset({"json", "bullets"}), frozenset({"json", "end_phrase"}),
    frozenset({"json", "start_word"}), frozenset({"uppercase", "end_phrase"}), frozenset({"uppercase", "start_word"}),
    frozenset({"lowercase", "end_phrase"}), frozenset({"lowercase", "start_word"}), frozenset({"max_words", "min_words"}),
    frozenset({"bullets", "max_words"}), frozenset({"bullets", "min_words"}), frozenset({"json", "min_words"}),
    frozenset({"json", "max_words"}), frozenset({"json", "uppercase"}),
}
END_PHRASES = ["Is there anything else?", "That is all.", "Thank you for reading.", "Hope this helps.",
               "Any other questions?", "That is my answer."]
START_WORDS = ["Well", "Honestly", "Indeed", "Certainly", "Today", "Overall"]


def constraint_text(kind: str, value) -> str:
    """The instruction that asks for a constraint (both sides: a constraint's wording is what is being learned)."""
    return {
        "lowercase": "Your entire answer must be in lowercase letters, with no capital letters at all.",
        "uppercase": "Your entire answer must be in capital letters.",
        "max_words": f"Answer in fewer than {value} words.",
        "min_words": f"Answer with at least {value} words.",
        "keyword": f"Include the word \"{value}\" in your answer.",
        "json": "Wrap your entire answer in JSON format.",
        "bullets": f"Your answer must contain exactly {value} bullet points, each starting with \"* \".",
        "end_phrase": f"Finish your answer with the exact phrase \"{value}\" and nothing after it.",
        "start_word": f"Start your answer with the word \"{value}\".",
        "no_commas": "Do not use any commas in your answer.",
    }[kind]


def _instruction_pools(seed: int) -> Dict[str, Dict[str, List]]:
    parts = {name: _split(items, seed, name) for name, items in (
        ("topics", TOPICS), ("keywords", KEYWORDS), ("bullets", BULLETS), ("word_limits", WORD_LIMITS),
        ("end_phrases", END_PHRASES), ("start_words", START_WORDS))}
    return {side: {name: split[side] for name, split in parts.items()} for side in SIDES}


def _sentences(rng: random.Random, topic: str, count: int, commas: bool) -> List[str]:
    out = []
    for _ in range(count):
        adj, adj2 = rng.sample(ADJECTIVES, 2)
        text = rng.choice(SENTENCES).format(topic=topic, Topic=topic[0].upper() + topic[1:], adj=adj, adj2=adj2)
        if commas and rng.random() < 0.3:
            text = f"{text}, at least to me"
        out.append(text + ".")
    return out


def instruction_example(rng: random.Random, side: str, pools: Dict[str, List]) -> Dict:
    kinds = ["lowercase", "uppercase", "max_words", "min_words", "keyword", "json", "bullets", "end_phrase",
             "start_word", "no_commas"]
    while True:
        chosen = rng.sample(kinds, rng.choice([1, 2]))
        if not any(frozenset(pair) in CONFLICTS for pair in _pairs(chosen)):
            break
    values = {
        "max_words": rng.choice(pools["word_limits"]), "min_words": rng.choice(pools["word_limits"]),
        "keyword": rng.choice(pools["keywords"]), "bullets": rng.choice(pools["bullets"]),
        "end_phrase": rng.choice(pools["end_phrases"]), "start_word": rng.choice(pools["start_words"]),
    }
    constraints = [{"kind": kind, "value": values.get(kind)} for kind in chosen]
    topic = rng.choice(pools["topics"])
    prompt = " ".join([rng.choice(REQUESTS[side]).format(topic=topic)]
                      + [constraint_text(c["kind"], c["value"]) for c in constraints])
    response = _compliant_response(rng, topic, {c["kind"]: c["value"] for c in constraints})
    if not follows_all(response, constraints):  # e.g. no sentence short enough for a word limit plus an end phrase
        return instruction_example(rng, side, pools)
    return {"prompt": prompt, "response": response, "constraints": json.dumps(constraints), "topic": topic}


def _pairs(items):
    return [(a, b) for i, a in enumerate(items) for b in items[i + 1:]]


def _compliant_response(rng: random.Random, topic: str, want: Dict) -> str:
    """A reference answer that meets every constraint (checked by the scorer when the data is built)."""
    count = want.get("bullets") or rng.choice([2, 3])
    if "min_words" in want:
        count = max(count, want["min_words"] // 5 + 1)
    sentences = _sentences(rng, topic, count, commas="no_commas" not in want)
    if "keyword" in want:
        sentences[-1 if len(sentences) > 1 else 0] = f"It reminds me of a {want['keyword']}."
    if "max_words" in want:
        while len(" ".join(sentences).split()) >= want["max_words"] - 4 and len(sentences) > 1:
            sentences.pop(0)
    if "start_word" in want:
        first = sentences[0]
        sentences[0] = f"{want['start_word']} {first[0].lower()}{first[1:]}"
    text = "\n".join(f"* {s}" for s in sentences) if "bullets" in want else " ".join(sentences)
    if "end_phrase" in want:
        text = f"{text} {want['end_phrase']}"
    if "lowercase" in want:
        text = text.lower()
    if "uppercase" in want:
        text = text.upper()
    if "json" in want:
        text = json.dumps({"answer": text})  # one key: no comma, lower-case keys
    return text


# ---------------------------------------------------------------------------------------------------- all tasks

GENERATORS = {"math": (math_example, _math_pools), "code": (code_example, _code_pools),
              "instruction": (instruction_example, _instruction_pools)}


def generate(task: str, sizes: Dict[str, int], seed: int) -> Dict[str, List[Dict]]:
    """``sizes`` maps split (train, validation, test) to a count. Prompts are unique within and across splits;
    validation comes from the train side, test from the test side."""
    example, make_pools = GENERATORS[task]
    pools = make_pools(seed)
    rng = random.Random(f"{seed}-{task}-examples")
    seen, out = set(), {}
    for split in ("train", "validation", "test"):
        side = "test" if split == "test" else "train"
        rows, attempts = [], 0
        while len(rows) < sizes.get(split, 0):
            attempts += 1
            if attempts > 200 * sizes[split] + 1000:
                raise ValueError(f"{task}: the {side} side has too few distinct prompts for {sizes[split]} {split} examples")
            row = example(rng, side, pools[side])
            if row["prompt"] in seen:
                continue
            seen.add(row["prompt"])
            rows.append(row)
        out[split] = rows
    return out
