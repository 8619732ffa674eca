"""Running the paper's tables: each run once, resumable, upstream merged models saved once and reused.

Every run has a folder ``<runs>/<setting>/<method>[/<task>]`` (``path.log_dir`` points there, so FusionBench writes
its ``program_report.json`` and Hydra its logs there). When the command exits 0 with a report, the runner writes
``result.json`` atomically (a temporary file, then ``os.replace``): the command text, the report, the seconds it
took, a stamp, and the stamps of the runs it read from. A run is skipped ("resumed") when its ``result.json`` holds
the same command, the same upstream stamps and, for an offline world, the same build of the world (its
``world.json`` fingerprint: a rebuilt world keeps its paths, so the command alone cannot tell), and the outputs later
runs read (the merged model) exist; any other state (no result: never run or interrupted; another command; another
build; an upstream merged model that was made again) runs it again. A calibrator whose upstream failed is not run.
Each command runs in its own folder, where FusionBench's joblib cache of zero-shot heads lands: that cache is keyed by
task and model path, so a shared one would hand a rebuilt world's AdaMerging the old build's heads. The command
executor is injected (tests use a fake).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .. import cli_runs
from ..cli_runs import OFFLINE_ENV, write_json_atomic
from .catalog import Catalog, Row, Run, world_unavailable

RESULT = "result.json"
REPORT = "program_report.json"

# (argv after `fusion_bench`, the run's folder, its log file, environment) -> exit status
Executor = Callable[[Sequence[str], Path, Path, Dict[str, str]], int]


def subprocess_executor() -> Executor:
    """Run `fusion_bench` in the run's folder (``cli_runs.execute_fusion_bench``)."""

    def execute(args: Sequence[str], run_dir: Path, log_path: Path, env: Dict[str, str]) -> int:
        return cli_runs.execute_fusion_bench(args, run_dir, log_path, env)

    return execute


def world_build(catalog: Catalog, run: Run) -> Optional[str]:
    """The fingerprint of the built offline world ``run`` reads; None for the hub's models (or an unbuilt world)."""
    world = catalog.settings[run.setting].world
    if world is None:
        return None
    from ..worlds.registry import world_fingerprint

    return world_fingerprint(world)


def load_result(run_dir: Path) -> Optional[dict]:
    path = run_dir / RESULT
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


@dataclass
class Outcome:
    run: Run
    status: str  # "ran", "resumed", "failed", "skipped"
    message: str = ""
    seconds: float = 0.0


@dataclass
class Summary:
    outcomes: List[Outcome] = field(default_factory=list)
    skipped_rows: List[Row] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    @property
    def ok(self) -> bool:
        return not any(o.status in ("failed", "skipped") for o in self.outcomes)

    def text(self) -> str:
        lines = [f"runs: {self.count('ran')} ran, {self.count('resumed')} resumed (report with the same command), "
                 f"{self.count('failed')} failed, {self.count('skipped')} not run"]
        for o in self.outcomes:
            if o.status in ("failed", "skipped"):
                lines.append(f"  {o.status}: {o.run.id}: {o.message}")
        for row in self.skipped_rows:
            lines.append(f"  row not run: table {row.table} {row.id}: {row.skip}")
        return "\n".join(lines)


class Runner:
    def __init__(self, catalog: Catalog, executor: Optional[Executor] = None, log: Callable[[str], None] = print,
                 base_env: Optional[Dict[str, str]] = None):
        self.catalog = catalog
        self.executor = executor or subprocess_executor()
        self.log = log
        self.base_env = dict(os.environ if base_env is None else base_env)

    # -- planning ---------------------------------------------------------------------------------------------
    def plan(self, rows: Sequence[Row]) -> List[Run]:
        """The runs of ``rows`` with the upstream runs they read from first, each once."""
        order: Dict[str, Run] = {}
        for row in rows:
            for run in row.runs:
                for dep in self.catalog.dependencies(run):
                    order.setdefault(dep.id, dep)
                order.setdefault(run.id, run)
        return list(order.values())

    # -- state ------------------------------------------------------------------------------------------------
    def run_dir(self, run: Run) -> Path:
        return self.catalog.run_dir(run.id)

    def stamp(self, run_id: str) -> Optional[str]:
        result = load_result(self.catalog.run_dir(run_id))
        return result.get("stamp") if result else None

    def is_current(self, run: Run) -> bool:
        result = load_result(self.run_dir(run))
        if not result or result.get("command") != run.command:
            return False
        if result.get("depends_on", {}) != {d: self.stamp(d) for d in run.depends}:
            return False
        if result.get("world") != world_build(self.catalog, run):
            return False
        return all((self.run_dir(run) / out).exists() for out in run.saves)

    # -- running ----------------------------------------------------------------------------------------------
    def execute(self, run: Run, failed: Dict[str, str]) -> Outcome:
        if self.is_current(run):
            return Outcome(run, "resumed")
        broken = [d for d in run.depends if d in failed or self.stamp(d) is None]
        if broken:
            return Outcome(run, "skipped", f"its upstream run {', '.join(broken)} has no result")
        setting = self.catalog.settings[run.setting]
        why = world_unavailable(setting)
        if why:
            return Outcome(run, "skipped", why)
        folder = self.run_dir(run)
        folder.mkdir(parents=True, exist_ok=True)
        for stale in (RESULT, REPORT):
            (folder / stale).unlink(missing_ok=True)
        shutil.rmtree(folder / "outputs" / "cache", ignore_errors=True)  # zero-shot heads of an earlier build
        for out in run.saves:  # a half-written merged model must not be read by a calibrator
            path = folder / out
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        (folder / "command.txt").write_text(run.command + "\n")
        env = {**self.base_env, **(OFFLINE_ENV if run.offline_env else {})}
        self.log(f"run {run.id}: {run.command}")
        started = time.perf_counter()
        status = self.executor(list(run.args), folder, folder / "run.log", env)
        seconds = time.perf_counter() - started
        report_path = folder / REPORT
        if status != 0:
            return Outcome(run, "failed", f"exit status {status} after {seconds:.0f} s; see {folder / 'run.log'}", seconds)
        if not report_path.is_file():
            return Outcome(run, "failed", f"no {REPORT} in {folder}; see {folder / 'run.log'}", seconds)
        missing = [out for out in run.saves if not (folder / out).exists()]
        if missing:
            return Outcome(run, "failed", f"it did not save {', '.join(missing)} in {folder}", seconds)
        finished = _dt.datetime.now().isoformat(timespec="seconds")
        result = {
            "id": run.id,
            "command": run.command,
            "depends_on": {d: self.stamp(d) for d in run.depends},
            "world": world_build(self.catalog, run),
            "stamp": hashlib.sha1(f"{run.command}\n{finished}\n{time.time_ns()}".encode()).hexdigest()[:16],
            "finished": finished,
            "seconds": round(seconds, 1),
            "report": json.loads(report_path.read_text()),
        }
        write_json_atomic(folder / RESULT, result)
        self.log(f"  {run.id}: {seconds:.0f} s")
        return Outcome(run, "ran", seconds=seconds)

    def run(self, rows: Sequence[Row]) -> Summary:
        summary = Summary(skipped_rows=[row for row in rows if row.skip])
        failed: Dict[str, str] = {}
        for run in self.plan(rows):
            outcome = self.execute(run, failed)
            if outcome.status in ("failed", "skipped"):
                failed[run.id] = outcome.message
                self.log(f"  {outcome.status}: {run.id}: {outcome.message}")
            summary.outcomes.append(outcome)
        return summary


def collect(catalog: Catalog, rows: Sequence[Row]):
    """(run id -> result.json of every run of ``rows`` whose result holds its current command and world build,
    run id -> why the result of a run is not shown: another command line produced it, or another build)."""
    current, stale = {}, {}
    for row in rows:
        for run in row.runs:
            result = load_result(catalog.run_dir(run.id))
            if result is None:
                continue
            build = world_build(catalog, run)
            if result.get("command") != run.command:
                stale[run.id] = (f"its result came from another command line (`{result.get('command', '')}`); "
                                 "run it again or pass the same --override options")
            elif result.get("world") != build:
                stale[run.id] = (f"its result was measured on another build of the world (world.json sha1 "
                                 f"{result.get('world') or 'not recorded'}, now {build}); run it again")
            else:
                current[run.id] = result
    return current, stale
