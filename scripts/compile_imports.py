"""Write the bytecode of every module that our packages import, and of no other.

scripts/setup.sh installs with pip's --no-compile: pip would compile all of the environment's ~19k modules, where a
run imports ~6k (a sixth of a fresh setup's time here, 2026-11-27). Importing each module of the packages named on
the command line, with bytecode writing on, compiles exactly what they import, once. The machines of this project set
PYTHONDONTWRITEBYTECODE, under which a module without bytecode is compiled again by every process that imports it.
"""

import importlib
import pkgutil
import sys


def import_all(package: str, ours: set) -> int:
    """Import ``package`` and every module under it; a dependency that is not installed (an extra: lm-eval without
    ``--llm``) leaves its importer out, a missing module of ``ours`` is an error."""
    root = importlib.import_module(package)
    count = 1
    for info in pkgutil.walk_packages(getattr(root, "__path__", []), f"{package}."):  # a module has no __path__
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as missing:
            if missing.name is None or missing.name.split(".")[0] in ours:
                raise
            continue
        count += 1
    return count


def main(packages) -> None:
    if sys.dont_write_bytecode:
        raise SystemExit("compile_imports.py: run with PYTHONDONTWRITEBYTECODE unset (it writes bytecode)")
    ours = {package.split(".")[0] for package in packages}
    modules = sum(import_all(package, ours) for package in packages)
    print(f"bytecode for the {len(sys.modules)} modules that {modules} of ours import")


if __name__ == "__main__":
    main(sys.argv[1:])
