"""scripts/compile_imports.py, setup.sh's bytecode step: it compiles what our packages import, and nothing else."""

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compile_imports.py"


def compile_imports(folder: Path, *args, write_bytecode=True):
    env = {**os.environ, "PYTHONPATH": str(folder)}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if not write_bytecode:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_bytecode_of_what_our_modules_import_is_written_and_of_nothing_else(tmp_path):
    (tmp_path / "ours" / "inner").mkdir(parents=True)
    (tmp_path / "ours" / "__init__.py").write_text("")
    (tmp_path / "ours" / "inner" / "__init__.py").write_text("")
    (tmp_path / "ours" / "inner" / "uses.py").write_text("import theirs_used\n")
    (tmp_path / "ours" / "extra.py").write_text("import an_extra_not_installed\n")
    (tmp_path / "theirs_used.py").write_text("X = 1\n")
    (tmp_path / "theirs_unused.py").write_text("Y = 2\n")

    done = compile_imports(tmp_path, "ours")
    assert done.returncode == 0, done.stderr
    compiled = {path.name.split(".")[0] for path in tmp_path.rglob("*.pyc")}
    assert {"theirs_used", "uses", "__init__"} <= compiled and "theirs_unused" not in compiled

    (tmp_path / "ours" / "broken.py").write_text("import ours.renamed_away\n")
    broken = compile_imports(tmp_path, "ours")
    assert broken.returncode != 0 and "No module named 'ours.renamed_away'" in broken.stderr

    refused = compile_imports(tmp_path, "ours", write_bytecode=False)
    assert refused.returncode != 0 and "PYTHONDONTWRITEBYTECODE" in refused.stderr
