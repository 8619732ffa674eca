"""The package's layers, lowest first, and the rule that keeps them: a module imports only its own layer and the
layers below it (``featcal_fusionbench/__init__.py`` explains the layout), and never another module's private names."""

import ast
from pathlib import Path
from typing import List

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "featcal_fusionbench"
LAYERS = ["core", "reports", "models", "evaluation", "families", "engine", "autoselect", "integration", "baselines"]


def layer_of(module: str) -> int:
    """``featcal_fusionbench.<layer>...`` -> the layer's rank; the package root ranks above every layer."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 else len(LAYERS)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def violations(source: str, here: str, is_package: bool = False) -> List[str]:
    """The imports in ``source`` (module ``here``) that break the rule, TYPE_CHECKING blocks included."""
    package = here if is_package else here.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
        elif isinstance(node, ast.Import):
            names, target = [], next((a.name for a in node.names if a.name.startswith(PACKAGE.name)), "")
        else:
            continue
        if target.split(".")[0] != PACKAGE.name:
            continue
        # ``from featcal_fusionbench import engine`` imports the layer it names
        for imported in [f"{target}.{n}" for n in names] if target == PACKAGE.name else [target]:
            if layer_of(imported) > layer_of(here):
                found.append(f"{here}:{node.lineno} imports {imported}, a higher layer")
        private = [n for n in names if n.startswith("_") and not n.startswith("__")]
        if private:
            found.append(f"{here}:{node.lineno} imports private names {private} of {target}")
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_lives_in_a_layer():
    loose = [p.name for p in MODULES if p.parent == PACKAGE and p.name != "__init__.py"]
    assert not loose, f"modules outside the layer folders {LAYERS}: {loose}"
    assert sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()) == sorted(LAYERS)


@pytest.mark.parametrize("path", MODULES, ids=module_name)
def test_a_module_imports_only_its_layer_and_those_below(path):
    assert violations(path.read_text(), module_name(path), path.name == "__init__.py") == []


def test_the_rule_names_an_upward_import_and_a_private_one():
    source = "from ..engine.loop import FeatCalEngine\nfrom .solver import _private\nfrom .moments import add_into\n"
    assert violations(source, "featcal_fusionbench.core.block_sums") == [
        "featcal_fusionbench.core.block_sums:1 imports featcal_fusionbench.engine.loop, a higher layer",
        "featcal_fusionbench.core.block_sums:2 imports private names ['_private'] of featcal_fusionbench.core.solver",
    ]


def test_the_task_pools_former_paths_that_built_worlds_name_still_resolve():
    """Worlds built before the task pools moved to ``evaluation`` name them by their former paths in their configs."""
    from fusion_bench.utils.packages import import_object

    from featcal_fusionbench.evaluation.clip_taskpool import LocalCLIPVisionModelTaskPool
    from featcal_fusionbench.evaluation.lm_eval_taskpool import LMEvalTaskPool

    assert import_object("featcal_fusionbench.integration.taskpool.LocalCLIPVisionModelTaskPool") is \
        LocalCLIPVisionModelTaskPool
    assert import_object("featcal_fusionbench.integration.lm_eval_taskpool.LMEvalTaskPool") is LMEvalTaskPool


def test_evaluation_knows_no_method():
    """The task pools and scorers import nothing of FeatCal or the baselines: only the models layer below them."""
    imported = set()
    for path in (PACKAGE / "evaluation").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2 and node.module:
                imported.add(node.module.split(".")[0])
    assert imported <= {"models"}, imported
