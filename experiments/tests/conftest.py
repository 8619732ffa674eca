import os
import sys
from pathlib import Path

import pytest

# The experiments' tests reuse the product's test helpers (tiny models, the config-target walk).
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import commands  # noqa: E402
from scheduling import pytest_collection_modifyitems, pytest_configure  # noqa: E402,F401  (hooks: the slow tests first)

commands.share_the_cores()
# The benchmarks' and the GPU check's steps forked from their script's process, not started afresh: each start imports
# torch, transformers and Lightning again (featcal_experiments/python_processes.py). Set before any command server
# starts, so that the scripts' commands still fork from it.
os.environ.setdefault("FEATCAL_FORK_SCRIPTS", "1")


@pytest.fixture(autouse=True, scope="session")
def fusion_bench_through_the_tests_runner():
    """The experiments' `fusion_bench` runs (``cli_runs.execute_fusion_bench``) go through tests/commands.py: forked
    from a process that imported the CLI's modules once, where the run's environment allows; the same command and
    output otherwise (stdout, then stderr, in the run's log)."""
    from featcal_experiments import cli_runs

    started = cli_runs.execute_fusion_bench

    def execute(args, run_dir, log_path, env):
        if cli_runs.fusion_bench_executable() != str(commands.BIN / "fusion_bench"):  # a test's own stand-in
            return started(args, run_dir, log_path, env)
        done = commands.run("fusion_bench", *args, cwd=run_dir, env=env, offline=False, timeout=3600)
        Path(log_path).write_text(done.stdout + done.stderr)
        return done.returncode

    patch = pytest.MonkeyPatch()
    patch.setattr(cli_runs, "execute_fusion_bench", execute)
    yield
    patch.undo()
