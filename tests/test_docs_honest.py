"""The README and the docs name only what exists: every config they choose (`method=...`, `modelpool=...`,
`taskpool=...`, `method/upstream=...`), every method option (`method.<name>=...` and the options tables), every
console script and its subcommands, every script, repository path and `featcal_fusionbench.*` object they name, and
every relative link (with its anchor). The README's own-merge commands compose with their example configs
(docs/examples/config) through `fusion_bench --cfg job`, and those configs' calibration data load from local files
in the fields the families read.

All but the two composes read files only (no `fusion_bench` process)."""

from __future__ import annotations

import importlib
import inspect
import re
import shlex
from functools import lru_cache
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "docs" / "examples" / "config"
#: the pages checked: the front page, the product's docs, the experiments' front page
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), REPO / "experiments" / "README.md"]
GROUPS = ("method/upstream", "method", "modelpool", "taskpool")
#: commands a shell line of the docs may start with, besides the console scripts
SHELL = {"bash", "python", "python3", "pip", "source", "cd", "export", "git", "ls", "cat", "mkdir", "cp", "rm", "sudo",
         "apt-get", "nice", "torchrun", "huggingface-cli", "hf", "tensorboard"}
#: top-level folders of the repository: a backticked path starting with one is a path of the repository
TOP_LEVEL = ("config/", "config_fixes/", "docs/", "experiments/", "featcal_fusionbench/", "hydra_plugins/", "scripts/",
             "tests/")
#: paths of other repositories that the docs quote, where they read like ours
OTHER_REPOSITORIES = {"scripts/evaluate.sh"}  # MergeBench's (uiuctml/MergeBench), docs/families/causal_lm.md


# ---- reading the pages -------------------------------------------------------------------------------------------


def relative(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


@lru_cache(maxsize=None)
def blocks(page: Path) -> Tuple[Tuple[Tuple[str, str], ...], str]:
    """((language, code) of each fenced block, ...), and the page's text outside them."""
    found, prose, language, code = [], [], None, []
    for line in page.read_text().splitlines():
        fence = re.match(r"\s*```(\w*)\s*$", line)
        if fence and language is None:
            language, code = fence.group(1) or "text", []
        elif fence:
            found.append((language, "\n".join(code)))
            language = None
        elif language is not None:
            code.append(line)
        else:
            prose.append(line)
    return tuple(found), "\n".join(prose)


def spans(text: str) -> List[str]:
    """Inline code spans (`x`, ``x``)."""
    return [m.group(2) for m in re.finditer(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", text)]


def code_of(page: Path) -> str:
    """Every piece of code on a page: its fenced blocks and its inline spans, a line each."""
    fenced, prose = blocks(page)
    return "\n".join([code for _, code in fenced] + spans(prose))


def shell_lines(page: Path) -> Iterator[str]:
    """The commands of a page's shell blocks, continuation lines joined, comments dropped."""
    for language, code in blocks(page)[0]:
        if language not in ("bash", "sh", "shell", "console"):
            continue
        for line in re.sub(r"\\\n", " ", code).splitlines():
            line = line.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                yield line


def expand(value: str) -> List[str]:
    """A Hydra choice as its config names: `a,b` (a sweep) and `x_{p,q}` (the docs' shorthand) each several."""
    parts, depth, current = [], 0, ""
    for char in value:
        depth += {"{": 1, "}": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    names = []
    for part in parts:
        brace = re.search(r"\{([^{}]*)\}", part)
        if brace:
            names += expand_all(part[:brace.start()] + alt + part[brace.end():] for alt in brace.group(1).split(","))
        else:
            names.append(part)
    return names


def expand_all(values) -> List[str]:
    return [name for value in values for name in expand(value)]


def placeholder(value: str) -> bool:
    return any(mark in value for mark in ("...", "<", "$", "*", "PATH"))


# ---- what exists -------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def config_roots() -> List[Path]:
    import fusion_bench_config

    return [REPO / "config", REPO / "config_fixes", Path(list(fusion_bench_config.__path__)[0]),
            REPO / "experiments" / "config", EXAMPLES]


def config_exists(group: str, name: str) -> bool:
    if group == "method/upstream" and config_exists("method", name):
        return True  # FusionBench's method configs are upstream options too (hydra_plugins/.../upstream_methods.py)
    return any((root / group / f"{name}.yaml").is_file() for root in config_roots())


def parameters(cls) -> Set[str]:
    """The named arguments of a class's constructors, its and its featcal_fusionbench bases'."""
    names = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("featcal_fusionbench") and "__init__" in vars(klass):
            names |= {p.name for p in inspect.signature(klass.__init__).parameters.values()
                      if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}
    return names


@lru_cache(maxsize=None)
def method_options() -> Dict[str, Set[str]]:
    import featcal_fusionbench
    from featcal_fusionbench.autoselect.options import SelectionOptions
    from featcal_fusionbench.families import families

    featcal = parameters(featcal_fusionbench.FeatCalAlgorithm)
    baselines = parameters(featcal_fusionbench.SurgeryAlgorithm) | parameters(featcal_fusionbench.ProbSurgeryAlgorithm)
    upstream_keys = set()
    fusion_bench_methods = config_roots()[2] / "method"
    for path in [*(REPO / "config" / "method" / "upstream").glob("*.yaml"), *fusion_bench_methods.rglob("*.yaml")]:
        loaded = yaml.safe_load(path.read_text())
        upstream_keys |= set(loaded) if isinstance(loaded, dict) else set()
    return {
        "featcal": featcal,
        "baselines": baselines,
        "family_options": {name for cls in families() for name in cls.options},
        "auto_select": set(SelectionOptions.__dataclass_fields__),
        # an upstream is replaced through its config group (method/upstream=...): `_target_` alone would keep the
        # previous upstream's arguments
        "upstream": upstream_keys - {"_target_", "defaults"},
    }


PYPROJECTS = (REPO / "pyproject.toml", REPO / "experiments" / "pyproject.toml")


def toml_table(pyproject: Path, table: str) -> Dict[str, str]:
    """The `key = "value"` lines of one table of a pyproject (tomllib is Python 3.11's; the product supports 3.10)."""
    body = re.search(rf"^\[{re.escape(table)}\]\n(.*?)(?=^\[|\Z)", pyproject.read_text(), flags=re.M | re.S)
    return dict(re.findall(r'^([\w.-]+)\s*=\s*"([^"]*)"', body.group(1), flags=re.M)) if body else {}


@lru_cache(maxsize=None)
def console_scripts() -> Dict[str, str]:
    """name -> the pyproject (or distribution) that declares it."""
    from importlib.metadata import distribution

    found = {}
    for pyproject in PYPROJECTS:
        for name in toml_table(pyproject, "project.scripts"):
            found[name] = relative(pyproject)
    for entry in distribution("fusion-bench").entry_points:
        if entry.group == "console_scripts":
            found[entry.name] = "fusion-bench"
    return found


@lru_cache(maxsize=None)
def distributions() -> Set[str]:
    """The names our pyprojects and FusionBench's distribution go by (a name, not a command)."""
    return {toml_table(p, "project")["name"] for p in PYPROJECTS} | {"fusion-bench"}


@lru_cache(maxsize=None)
def subcommands() -> Dict[str, Set[str]]:
    """The argparse subcommands of our console scripts, read from their sources (the experiments' package is not
    imported by the product's tests)."""
    sources = {"featcal-report": REPO / "featcal_fusionbench" / "reports" / "cli.py",
               "featcal-world": REPO / "experiments" / "featcal_experiments" / "worlds" / "cli.py"}
    return {name: set(re.findall(r"add_parser\(\s*\"([\w-]+)\"", path.read_text())) for name, path in sources.items()}


@lru_cache(maxsize=None)
def headings(page: Path) -> List[str]:
    _, prose = blocks(page)
    return [m.group(1).strip() for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", prose, flags=re.M)]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.lower().replace("`", ""))
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(page: Path) -> Set[str]:
    seen: Dict[str, int] = {}
    found = set()
    for heading in headings(page):
        slug = anchor(heading)
        found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return found


# ---- what the pages name -----------------------------------------------------------------------------------------


def config_choices(page: Path) -> Iterator[Tuple[str, str]]:
    pattern = r"(?<![\w.+/@-])(%s)=([^\s`'\"|]+)" % "|".join(re.escape(g) for g in GROUPS)
    for match in re.finditer(pattern, page.read_text()):
        if placeholder(match.group(2)):
            continue
        value = match.group(2).rstrip(".,;:)")
        if value:
            for name in expand(value):
                yield match.group(1), name


def method_option_uses(page: Path) -> Iterator[Tuple[str, str]]:
    """(option, sub-option or "") of every `method.<option>[.<sub>...]=` in the page's code."""
    for match in re.finditer(r"(?<![\w.])\+{0,2}method\.([A-Za-z_]\w*)((?:\.[A-Za-z_<][\w>]*)*)=", code_of(page)):
        yield match.group(1), match.group(2)[1:].split(".", 1)[0]


def option_table_names(page: Path) -> Iterator[str]:
    """The names in the first column of a page's `| option | default | meaning |` tables."""
    _, prose = blocks(page)
    in_table = False
    for line in prose.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.lstrip().startswith("|") else None
        if cells is None:
            in_table = False
        elif cells[0] == "option":
            in_table = True
        elif in_table and not set(cells[0]) <= set("-: "):
            yield from re.findall(r"`([A-Za-z_]\w*)`", cells[0])


def links(page: Path) -> Iterator[str]:
    _, prose = blocks(page)
    prose = re.sub(r"(`+)(?!`).+?(?<!`)\1(?!`)", "", prose)  # a link inside code is no link
    for match in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose):
        target = match.group(1)
        if not re.match(r"[a-z]+:", target):
            yield target


def section_references(page: Path) -> Iterator[Tuple[str, str]]:
    """(page, heading) of references such as [x.md](x.md), "Heading" or (README, "Heading")."""
    text = page.read_text()
    for match in re.finditer(r"\[[^\]]*\]\(([^)#\s]+\.md)\),? \"([^\"]+)\"", text):
        yield match.group(1), match.group(2)
    for match in re.finditer(r"\(README(?:\.md)?, \"([^\"]+)\"", text):
        yield "/README.md", match.group(1)


def repository_paths(page: Path) -> Iterator[str]:
    for span in spans(blocks(page)[1]) + [line for _, code in blocks(page)[0] for line in code.split()]:
        for word in span.split():
            word = word.strip("`'\"(),:;").split("#", 1)[0].split("::", 1)[0]
            if word.startswith(TOP_LEVEL) and not re.search(r"[*<>{}$]|\.\.\.", word):
                yield word


def python_objects(page: Path) -> Iterator[str]:
    for span in spans(blocks(page)[1]):
        for name in re.findall(r"\bfeatcal_fusionbench(?:\.\w+)+", span):
            yield name


def resolve(page: Path, target: str) -> Path:
    return REPO / target.lstrip("/") if target.startswith("/") else (page.parent / target).resolve()


def where(page: Path) -> str:
    return relative(page)


# ---- the checks --------------------------------------------------------------------------------------------------


def test_the_pages_are_read():
    readme = REPO / "README.md"
    assert {"README.md", "docs/featcal.md", "docs/families/causal_lm.md"} <= {relative(p) for p in PAGES}
    assert ("method", "featcal") in set(config_choices(readme))
    assert any(o == "auto_select" for o, _ in method_option_uses(REPO / "docs" / "featcal.md"))
    assert {"fusion_bench", "featcal-report"} <= {shlex.split(line)[0] for line in shell_lines(readme)}
    assert "docs/featcal.md" in set(links(readme))
    assert "lambda_" in set(option_table_names(REPO / "docs" / "featcal.md"))


@pytest.mark.parametrize("page", PAGES, ids=where)
def test_every_config_named_exists(page):
    missing = sorted({f"{group}={name}" for group, name in config_choices(page) if not config_exists(group, name)})
    assert not missing, f"{where(page)} names configs that no config folder holds: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=where)
def test_every_method_option_named_exists(page):
    options = method_options()
    known = options["featcal"] | options["baselines"]
    wrong = []
    for option, sub in method_option_uses(page):
        if option not in known:
            wrong.append(f"method.{option}")
        elif option in ("family_options", "auto_select", "upstream") and sub and not sub.startswith("<") \
                and sub not in options[option]:
            wrong.append(f"method.{option}.{sub}")
    table = options["baselines"] if page.name == "baselines.md" else \
        options["family_options"] if page.parent.name == "families" else options["featcal"]
    wrong += [f"table: {name}" for name in option_table_names(page) if name not in table]
    assert not wrong, f"{where(page)} names options the methods do not have: {sorted(set(wrong))}"


@pytest.mark.parametrize("page", PAGES, ids=where)
def test_every_command_is_a_console_script_or_a_known_program(page):
    scripts, wrong = console_scripts(), []
    for line in shell_lines(page):
        words = shlex.split(line, comments=True) if line.count("'") % 2 == 0 else line.split()
        while words and re.match(r"[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value before the command
            words.pop(0)
        if not words or words[0].startswith(("(", "$(")):
            continue
        command = words[0]
        if command not in scripts and command not in SHELL:
            wrong.append(f"{command} (in: {line})")
        if command in subcommands() and len(words) > 1 and not words[1].startswith("-") \
                and words[1] not in subcommands()[command]:
            wrong.append(f"{command} {words[1]} (its subcommands: {sorted(subcommands()[command])})")
        if command in ("bash", "python", "python3") and len(words) > 1 and words[1].endswith((".sh", ".py")) \
                and not (REPO / words[1]).is_file():
            wrong.append(f"{command} {words[1]}: no such file")
    for span in spans(blocks(page)[1]):
        first = span.split()[0] if span.split() else ""
        if re.fullmatch(r"featcal-[\w-]+|fusion[_-]bench\w*", first) and first not in scripts \
                and first not in distributions():
            wrong.append(f"{first} (in `{span}`)")
    assert not wrong, f"{where(page)} names commands that are not installed: {wrong}"


@pytest.mark.parametrize("page", PAGES, ids=where)
def test_every_relative_link_and_its_anchor_resolves(page):
    broken = []
    for target in links(page):
        path, _, fragment = target.partition("#")
        file = resolve(page, path) if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif fragment and file.suffix == ".md" and fragment not in anchors(file):
            broken.append(f"{target}: no such heading in {relative(file)}")
    for path, heading in section_references(page):
        file = resolve(page, path)
        if not file.exists() or not any(h.lower().startswith(heading.lower()) for h in headings(file)):
            broken.append(f'{path}, "{heading}": no such section')
    assert not broken, f"{where(page)}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=where)
def test_every_repository_path_and_python_object_named_exists(page):
    missing = sorted({p for p in repository_paths(page) if not (REPO / p).exists() and p not in OTHER_REPOSITORIES})
    for name in sorted(set(python_objects(page))):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attribute in parts[cut:]:
                    obj = getattr(obj, attribute)
            except AttributeError:
                missing.append(name)
            break
        else:
            missing.append(name)
    assert not missing, f"{where(page)} names paths or objects that do not exist: {missing}"


def test_the_configs_point_at_docs_that_exist():
    """A config's comments name pages of the docs; each must exist."""
    missing = []
    for folder in ("config", "config_fixes", "docs/examples/config"):
        for path in sorted((REPO / folder).rglob("*.yaml")):
            for named in re.findall(r"\b((?:docs|experiments)/[\w./-]+\.md)\b", path.read_text()):
                if not (REPO / named).is_file():
                    missing.append(f"{relative(path)}: {named}")
            if re.search(r"README[^\n]*explains each", path.read_text()):
                missing.append(f"{relative(path)}: the README does not explain each option")
    assert not missing, missing


# ---- the own-merge examples --------------------------------------------------------------------------------------


def readme_own_merge_commands() -> Dict[str, str]:
    """The README's `fusion_bench` commands over the example configs, by the model pool they name."""
    commands = {}
    for line in shell_lines(REPO / "README.md"):
        pool = re.search(r"\bmodelpool=(my_\w+)", line)
        if pool and line.startswith("fusion_bench"):
            commands[pool.group(1)] = line
    return commands


def test_the_readme_runs_each_example_pool_and_the_examples_name_what_exists():
    from test_config_targets import all_targets
    from hydra.utils import get_object

    commands = readme_own_merge_commands()
    pools = sorted(p.stem for p in (EXAMPLES / "modelpool").glob("*.yaml"))
    assert sorted(commands) == pools == ["my_clip_merge", "my_llm_merge"], commands
    for command in commands.values():
        assert "hydra.searchpath=[file://$PWD/my_config]" in command, command
    targets = all_targets(["docs/examples/config"])
    assert "featcal_fusionbench.evaluation.clip_taskpool.LocalCLIPVisionModelTaskPool" in targets
    for target, first in targets.items():
        assert callable(get_object(target)), f"{target} ({first})"


def local_copy(example: Path, files: Dict[str, str]) -> dict:
    """An example config with its placeholder paths (/data/...) replaced by ``files``'s."""
    text = example.read_text()
    for placeholder_path, path in files.items():
        text = re.sub(rf"(?<=[ :]){re.escape(placeholder_path)}(?=[\s,}}])", path, text)
    return yaml.safe_load(text)


def test_the_example_pools_calibration_data_load_from_local_files_in_the_fields_the_families_read(tmp_path):
    """Each form of local calibration data the examples show (an image folder, Parquet, JSON Lines of image paths,
    a `save_to_disk` folder; text from JSON Lines, JSON, Parquet and a `save_to_disk` folder) loads through the
    example's own entry, with the fields FeatCal reads: `image` for CLIP, `prompt` / `response` for causal LMs."""
    import json

    from datasets import Dataset, Features, Image as ImageFeature
    from fusion_bench.utils import instantiate
    from omegaconf import OmegaConf
    from PIL import Image

    images = []
    for i in range(3):
        path = tmp_path / "images" / ("a" if i % 2 else "b") / f"{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (4, 4), (40 * i, 0, 0)).save(path)
        images.append(str(path))
    Dataset.from_dict({"image": images}, features=Features({"image": ImageFeature()})).to_parquet(
        str(tmp_path / "images.parquet"))
    (tmp_path / "images.jsonl").write_text("".join(json.dumps({"image": p}) + "\n" for p in images))
    rows = [{"question": f"q{i}", "answer": f"a{i}", "instruction": f"do {i}", "input": "" if i else "x",
             "output": f"done {i}"} for i in range(3)]
    (tmp_path / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Dataset.from_list(rows).to_parquet(str(tmp_path / "text.parquet"))
    Dataset.from_dict({"prompt": ["p"] * 3, "response": ["r"] * 3}).save_to_disk(str(tmp_path / "chat"))

    clip = local_copy(EXAMPLES / "modelpool" / "my_clip_merge.yaml", {
        "/data/cars/calibration": str(tmp_path / "images"),
        "/data/flowers/calibration.parquet": str(tmp_path / "images.parquet"),
        "/data/pets/calibration.jsonl": str(tmp_path / "images.jsonl")})
    llm = local_copy(EXAMPLES / "modelpool" / "my_llm_merge.yaml", {
        "/data/math/calibration.jsonl": str(tmp_path / "text.jsonl"),
        "/data/code/calibration.parquet": str(tmp_path / "text.parquet"),
        "/data/chat/calibration": str(tmp_path / "chat")})
    for task, config in clip["train_datasets"].items():
        dataset = instantiate(OmegaConf.create(config))
        assert len(dataset) == 3 and isinstance(dataset[0]["image"], Image.Image), task
    for task, config in llm["train_datasets"].items():
        dataset = instantiate(OmegaConf.create(config))
        assert len(dataset) == 3 and dataset.column_names == ["prompt", "response"], (task, dataset.column_names)
    # the JSON form of the math entry: a file holding a list of objects
    (tmp_path / "text.json").write_text(json.dumps(rows))
    as_json = {**llm["train_datasets"]["math"], "data_files": str(tmp_path / "text.json")}
    assert instantiate(OmegaConf.create(as_json))[1] == {"prompt": "q1", "response": "a1"}
    assert instantiate(OmegaConf.create(llm["train_datasets"]["code"]))[0]["prompt"] == "do 0\n\nx"


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["my_clip_merge", "my_llm_merge"])
def test_the_readme_own_merge_command_composes_with_the_example_configs(pool, tmp_path):
    """The README's command as typed, its search path pointed at docs/examples/config, composed (`--cfg job`,
    resolved): the example pool and task pool, the method and its options are what the run would get."""
    import commands

    line = readme_own_merge_commands()[pool].replace("$PWD/my_config", str(EXAMPLES))
    args = shlex.split(line)
    assert args[0] == "fusion_bench"
    done = commands.run("fusion_bench", *args[1:], "--cfg", "job", "--resolve", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    config = yaml.safe_load(done.stdout)
    expected = yaml.safe_load((EXAMPLES / "modelpool" / f"{pool}.yaml").read_text())
    assert config["modelpool"]["models"] == expected["models"]
    assert config["modelpool"]["train_datasets"] == expected["train_datasets"]
    assert config["method"]["_target_"] == "featcal_fusionbench.FeatCalAlgorithm"
    assert config["method"]["merged_model_path"].startswith("/data/")
    assert config["method"]["auto_select"], "the own-merge commands choose lambda and rho without labels"
    if pool == "my_clip_merge":
        tasks = yaml.safe_load((EXAMPLES / "taskpool" / "my_clip_tasks.yaml").read_text())
        assert config["taskpool"]["classnames"] == tasks["classnames"]
        assert set(config["taskpool"]["test_datasets"]) == set(expected["models"]) - {"_pretrained_"}
