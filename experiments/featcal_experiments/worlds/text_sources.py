"""Real packaged text for the offline T5 world: Debian's fortune files.

Fortune files (``/usr/share/games/fortunes``, Debian ``fortunes``, ``fortunes-min`` and the language packages
``fortunes-de``, ``-es``, ``-it``, ``-pl``, ``-ru``, ``-cs``, ``-br``, ``-ga``, ``-eo``, ``-bg``) hold entries
separated by lines holding only ``%``. Every task here is a real property of that text, phrased as prompted
generation with a short word (or number) as the answer:

- ``topic``: which of six English fortune files an entry comes from ("computers", "politics", ...);
- ``language``: which language package an entry comes from ("german", "russian", ...);
- ``form``: the entry's form, read off its layout ("quote" with an ``-- Author`` line, "dialogue" with speaker
  tags, "glossary" definitions, "poem" in short lines, plain "prose");
- ``author``: who an attributed English fortune quotes, the surname on its ``-- Name`` line (extraction; the
  answer is a word copied from the text);
- ``wordcount``: how many words a short English fortune has, a number scored by Spearman's rho.

Splits are seeded and class-balanced on the test side; every text is deduplicated, a text that is a test example
of any task is dropped from every task's train split, and :func:`pretraining_corpus` never contains a test text.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

FORTUNES_DIR = Path("/usr/share/games/fortunes")
MAX_TEXT_BYTES = 100  # of a fortune, UTF-8; ByT5 tokens are bytes

# English fortune files of `fortunes` and `fortunes-min` (ascii-art, translate-me and the one-entry pratchett left out)
ENGLISH_FILES = [
    "art", "computers", "cookie", "debian", "definitions", "disclaimer", "drugs", "education", "ethnic", "food",
    "goedel", "humorists", "kids", "knghtbrd", "law", "linux", "linuxcookie", "love", "magic", "medicine",
    "men-women", "miscellaneous", "news", "paradoxum", "people", "perl", "pets", "platitudes", "politics",
    "science", "songs-poems", "sports", "startrek", "tao", "wisdom", "work", "zippy",
    "fortunes", "literature", "riddles",
]
# language label -> (Debian package, folder or file under FORTUNES_DIR)
LANGUAGES: Dict[str, Tuple[str, str]] = {
    "english": ("fortunes", ""),
    "german": ("fortunes-de", "de"),
    "spanish": ("fortunes-es", "es"),
    "italian": ("fortunes-it", "it"),
    "polish": ("fortunes-pl", "pl"),
    "russian": ("fortunes-ru", "ru"),
    "czech": ("fortunes-cs", "cs"),
    "brazilian": ("fortunes-br", "brasil"),  # Brazilian Portuguese
    "irish": ("fortunes-ga", "ga"),
    "esperanto": ("fortunes-eo", "eo"),
    "bulgarian": ("fortunes-bg", "bg"),
}
# Files of a language folder that are not in its language, or are pictures, or are offensive.
EXCLUDED = {"cs/klasik-sk", "de/asciiart"}
# topic label -> English fortune file
TOPICS: Dict[str, str] = {
    "computers": "computers", "politics": "politics", "work": "work", "science": "science",
    "romance": "men-women", "art": "art",
}
FORMS = ["quote", "dialogue", "glossary", "poem", "prose"]
# FLAN-style prompts: a question, the answer options (classification), then the text.
QUESTIONS = {
    "topic": "Which topic is this fortune about?",
    "language": "Which language is this text in?",
    "form": "What form does this fortune take?",
    "author": "Who is quoted in this fortune?",
    "wordcount": "How many words does this fortune have?",
}


def prompt(question: str, options: Optional[Sequence[str]] = None) -> str:
    return f"{question} Options: {', '.join(options)}.\n" if options else f"{question}\n"


TASKS = list(QUESTIONS)
REGRESSION_TASKS = ["wordcount"]
WORDCOUNT_RANGE = (3, 15)


@dataclass
class TextTask:
    name: str
    prompt: str
    source: str
    labels: Optional[List[str]]  # the answers' vocabulary; None for a regression task (targets are numbers as text)
    train: List[Tuple[str, str]] = field(default_factory=list)  # (text, target); the input is prompt + text
    test: List[Tuple[str, str]] = field(default_factory=list)
    held_out: List[str] = field(default_factory=list)  # source entries of the test examples

    regression: bool = False

    def inputs(self, split: str) -> List[str]:
        return [self.prompt + text for text, _ in getattr(self, split)]

    def targets(self, split: str) -> List[str]:
        return [target for _, target in getattr(self, split)]

    def counts(self) -> Dict[str, Dict[str, int]]:
        return {s: dict(sorted(Counter(self.targets(s)).items(), key=lambda kv: _label_order(kv[0], self.labels)))
                for s in ("train", "test")}


def _label_order(label: str, labels: Optional[List[str]]):
    return labels.index(label) if labels and label in labels else (float(label) if _is_number(label) else 0)


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


# ----------------------------------------------------------------------------------------------- parsing

_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f]")


def clean(entry: str) -> Optional[str]:
    """One fortune, whitespace normalised (tabs and runs of spaces to one space, newlines kept); None if unusable."""
    entry = re.sub(r".\x08", "", entry)  # nroff overstrike
    lines = [re.sub(r"[ \t]+", " ", line).strip() for line in entry.split("\n")]
    text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    if len(text) < 8 or "\ufffd" in text or _CONTROL.search(text):
        return None
    return text


def read_fortune_file(path: Path) -> List[str]:
    """Cleaned entries of one fortune file (its UTF-8 ``.u8`` twin when there is a non-empty one)."""
    return list(_read_fortune_file(Path(path)))


@lru_cache(maxsize=None)
def _read_fortune_file(path: Path) -> Tuple[str, ...]:
    u8 = path.with_name(path.name + ".u8")
    raw = (u8 if u8.is_file() and u8.stat().st_size > 0 else path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("utf-8", errors="replace")  # entries with broken bytes are dropped by clean()
    entries = re.split(r"\n%\n|^%\n|\n%$", text.replace("\r\n", "\n"))
    return tuple(c for c in (clean(e) for e in entries) if c)


def _fortune_files(folder: str) -> List[Path]:
    base = FORTUNES_DIR / folder
    if base.is_file():
        return [base]
    if not base.is_dir():
        return []
    files = []
    for path in sorted(base.rglob("*")):
        rel = path.relative_to(FORTUNES_DIR).as_posix()
        if (not path.is_file() or path.suffix in (".dat", ".u8") or "/off/" in f"/{rel}" or rel in EXCLUDED
                or path.name.endswith("-pre")):
            continue
        files.append(path)
    return files


def _require(paths: Iterable[Path], package: str) -> None:
    if not any(p.is_file() for p in paths):
        raise FileNotFoundError(
            f"Debian package {package!r} is not installed (no files under {FORTUNES_DIR}); "
            "install the world's data with: experiments/scripts/install_world_data.sh (as root)"
        )


def english_files() -> Dict[str, List[str]]:
    """English fortune file -> its cleaned entries."""
    paths = [FORTUNES_DIR / name for name in ENGLISH_FILES]
    _require(paths, "fortunes")
    return {p.name: read_fortune_file(p) for p in paths if p.is_file()}


def language_entries() -> Dict[str, List[str]]:
    """Language label -> cleaned entries of that language's package (English: the English files)."""
    out: Dict[str, List[str]] = {}
    for label, (package, folder) in LANGUAGES.items():
        if label == "english":
            out[label] = [e for entries in english_files().values() for e in entries]
            continue
        files = _fortune_files(folder)
        _require(files, package)
        out[label] = [e for f in files for e in read_fortune_file(f)]
    return out


# ------------------------------------------------------------------------------------------- properties

def truncate(text: str, max_bytes: int = MAX_TEXT_BYTES) -> str:
    return text.encode("utf-8")[:max_bytes].decode("utf-8", errors="ignore").rstrip()


def head_and_tail(text: str, max_bytes: int = MAX_TEXT_BYTES) -> str:
    """The text when it fits, else its beginning and its end around " ... ": layout and attribution stay visible."""
    if fits(text, max_bytes):
        return text
    raw = text.encode("utf-8")
    head = raw[: max_bytes // 2].decode("utf-8", errors="ignore").rstrip()
    tail = raw[-(max_bytes // 2 - 5) :].decode("utf-8", errors="ignore").lstrip()
    return f"{head} ... {tail}"


def fits(text: str, max_bytes: int = MAX_TEXT_BYTES) -> bool:
    return len(text.encode("utf-8")) <= max_bytes


_ATTRIBUTION = re.compile(r"^(--|~~|- )\s?\S")
_SPEAKER = re.compile(r"^[A-Z][A-Za-z.' ]{0,18}:\s\S")
_GLOSSARY = re.compile(r"^[^\n:]{1,40}[,:]? ?\((n|v|adj|adv|vt|vi|prep|interj)\.?\)|^[^\n:]{1,40}, (n|v|adj|adv|vt|vi)\.", re.M)


def form_of(text: str) -> Optional[str]:
    """The layout of a fortune, or None when it is ambiguous (then it is not an example of the task)."""
    lines = [l for l in text.split("\n") if l.strip()]
    if not lines:
        return None
    attributed = bool(_ATTRIBUTION.match(lines[-1])) and len(lines) >= 2
    speakers = sum(bool(_SPEAKER.match(l)) for l in lines)
    glossary = bool(_GLOSSARY.match(lines[0]))
    body = lines[:-1] if attributed else lines
    short = len(body) >= 3 and all(len(l) <= 45 for l in body) and sum(l[:1].isupper() for l in body) >= 0.75 * len(body)
    kinds = [k for k, hit in (("dialogue", speakers >= 2), ("glossary", glossary), ("poem", short)) if hit]
    if len(kinds) > 1:
        return None
    if kinds:
        return kinds[0] if not attributed or kinds[0] == "poem" else None
    if attributed:
        return "quote"
    if len(lines) <= 4 and speakers == 0 and not any(l.startswith(("-", "*", "#", ">")) for l in lines):
        return "prose"
    return None


def word_count(text: str) -> int:
    return len(text.split())


_NAME_END = re.compile(r"[,(\"\[]| in | on | to | about ")


def author_of(text: str) -> Optional[str]:
    """The surname on a fortune's attribution line (``-- Ambrose Bierce, "The Devil's Dictionary"`` -> Bierce), when
    it is one capitalised word of 3 to 9 letters; else None."""
    lines = [l for l in text.split("\n") if l.strip()]
    if len(lines) < 2 or not lines[-1].startswith(("--", "~~")):
        return None
    name = _NAME_END.split(lines[-1].lstrip("-~ "))[0].split()
    surname = name[-1].strip(".") if name else ""
    return surname if surname.isalpha() and surname[:1].isupper() and 3 <= len(surname.encode("utf-8")) <= 9 else None


# ---------------------------------------------------------------------------------------------- splits

def _key(seed, text: str) -> str:
    return hashlib.sha1(f"{seed}\x00{text}".encode("utf-8")).hexdigest()


def _test_and_rest(
    by_label: Dict[str, Dict[str, str]], test_per_label: int, key_seed: str,
) -> Tuple[List[Tuple[str, str, str]], List[Tuple[str, str, str]]]:
    """Per label, the entries in a seeded order: the first ``test_per_label`` are the test split (a class with fewer
    than three times that many keeps two thirds for training), the rest train candidates. Items: (raw, shown, label)."""
    test, rest = [], []
    for label, entries in by_label.items():
        ordered = sorted(entries, key=lambda raw: _key(key_seed, raw))
        n_test = min(test_per_label, len(ordered) // 3)
        test += [(raw, entries[raw], label) for raw in ordered[:n_test]]
        rest += [(raw, entries[raw], label) for raw in ordered[n_test:]]
    return test, rest


def _dedupe_across(groups: Dict[str, List[str]]) -> Dict[str, List[str]]:
    """Drop texts that occur under more than one label (e.g. a fortune in two files); dedupe within a label."""
    owners = defaultdict(set)
    for label, texts in groups.items():
        for t in texts:
            owners[t].add(label)
    return {label: sorted({t for t in texts if len(owners[t]) == 1}) for label, texts in groups.items()}


@dataclass
class TaskSizes:
    test_per_label: int
    train_per_label: int


DEFAULT_SIZES: Dict[str, TaskSizes] = {
    "topic": TaskSizes(60, 400),
    "language": TaskSizes(36, 300),
    "form": TaskSizes(60, 500),
    "author": TaskSizes(1, 8),  # per surname: one test fortune from each author quoted at least 3 times
    "wordcount": TaskSizes(25, 200),
}


def build_tasks(names: Sequence[str], sizes: Dict[str, TaskSizes], seed: int) -> Dict[str, TextTask]:
    """The named tasks with seeded, class-balanced splits; no test text of any task is a train text of any task."""
    import random

    english = english_files()
    all_english = _dedupe_across({"en": [e for entries in english.values() for e in entries]})["en"]

    def shown_as(groups: Dict[str, Iterable[str]], show=lambda t: t) -> Dict[str, Dict[str, str]]:
        """label -> {entry: the text the task shows}; entries that would show the same text (e.g. truncated
        alike) are dropped, so a shown text has one answer and occurs once."""
        shown = {label: {raw: show(raw) for raw in texts} for label, texts in groups.items()}
        seen = Counter(text for entries in shown.values() for text in entries.values())
        return {label: {raw: text for raw, text in entries.items() if seen[text] == 1} for label, entries in shown.items()}

    def topic():
        groups = _dedupe_across({label: english[f] for label, f in TOPICS.items()})
        task = TextTask("topic", prompt(QUESTIONS["topic"], list(TOPICS)), "fortunes: " + ", ".join(TOPICS.values()), list(TOPICS))
        return task, shown_as(groups, truncate)

    def language():
        groups = _dedupe_across(language_entries())
        task = TextTask("language", prompt(QUESTIONS["language"], list(LANGUAGES)), "fortunes, fortunes-{de,es,it,pl,ru,cs,br,ga,eo,bg}", list(LANGUAGES))
        return task, shown_as(groups, truncate)

    def form():
        groups: Dict[str, List[str]] = {k: [] for k in FORMS}
        for t in all_english:
            kind = form_of(t)
            if kind:
                groups[kind].append(t)
        task = TextTask("form", prompt(QUESTIONS["form"], list(FORMS)), "fortunes, fortunes-min (all English files; layout rules)", list(FORMS))
        # beginning and end shown, so the layout and any attribution stay visible
        return task, shown_as(groups, head_and_tail)

    def author():
        groups: Dict[str, List[str]] = defaultdict(list)
        for t in all_english:
            surname = author_of(t)
            if surname:
                groups[surname].append(t)
        task = TextTask("author", prompt(QUESTIONS["author"]), "fortunes, fortunes-min (attributed English fortunes)",
                        sorted(groups))
        # beginning and end shown: the attribution line stays visible
        return task, shown_as(dict(sorted(groups.items())), head_and_tail)

    def wordcount():
        lo, hi = WORDCOUNT_RANGE
        groups: Dict[str, List[str]] = {str(n): [] for n in range(lo, hi + 1)}
        for t in all_english:
            n = word_count(t)
            if fits(t) and lo <= n <= hi:  # the whole entry is visible
                groups[str(n)].append(t)
        task = TextTask("wordcount", prompt(QUESTIONS["wordcount"]), "fortunes, fortunes-min (English entries that fit)", None,
                        regression=True)
        return task, shown_as(groups)

    builders = {"topic": topic, "language": language, "form": form, "author": author, "wordcount": wordcount}
    unknown = [n for n in names if n not in builders]
    if unknown:
        raise KeyError(f"unknown text tasks {unknown}; known: {list(builders)}")
    built = {n: builders[n]() for n in names}  # name -> (TextTask without examples, label -> {raw: shown})
    splits = {n: _test_and_rest(groups, sizes[n].test_per_label, f"{seed}/{n}") for n, (_, groups) in built.items()}
    # An entry tested by any task is held out of every task's training (and of pretraining: see held_out_entries).
    held_out = {raw for test, _ in splits.values() for raw, _, _ in test}
    tasks = {}
    for n, (task, _) in built.items():
        test, rest = splits[n]
        taken = Counter()
        for raw, shown, label in rest:
            if raw not in held_out and taken[label] < sizes[n].train_per_label:
                task.train.append((shown, label))
                taken[label] += 1
        task.test = [(shown, label) for _, shown, label in test]
        task.held_out = sorted({raw for raw, _, _ in test})
        random.Random(f"{seed}-{n}-train").shuffle(task.train)
        random.Random(f"{seed}-{n}-test").shuffle(task.test)
        tasks[n] = task
    return tasks


def held_out_entries(tasks: Iterable[TextTask]) -> set:
    """The source entries (whole fortunes) behind every test example."""
    return {raw for task in tasks for raw in task.held_out}


def pretraining_corpus(held_out: set, seed: int) -> List[str]:
    """Every cleaned fortune of every installed language package, deduplicated, minus every entry behind a test
    example (see :func:`held_out_entries`). Seeded order."""
    texts = {t for entries in language_entries().values() for t in entries if t not in held_out}
    return sorted(texts, key=lambda t: _key(str(seed), t))

