"""The result and diagnostic scripts' run cache: same command and same world build, or run again."""

import json
import os
import stat

import pytest

from featcal_experiments import cli_runs


@pytest.fixture
def fake_fusion_bench(tmp_path, monkeypatch):
    """A `fusion_bench` that writes a report into its working folder, counts its calls and leaves a head cache."""
    calls = tmp_path / "calls"
    script = tmp_path / "fusion_bench"
    script.write_text(
        "#!/bin/sh\n"
        f"echo run >> {calls}\n"
        "test -d outputs/cache && echo stale-cache >> " + str(calls) + "\n"
        "mkdir -p outputs/cache && echo heads > outputs/cache/heads\n"
        "echo '{\"accuracy\": 1}' > program_report.json\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(cli_runs, "fusion_bench_executable", lambda: str(script))
    return calls


def test_a_run_is_kept_for_its_command_and_world_build_and_made_again_on_a_rebuilt_world(tmp_path, fake_fusion_bench):
    world = tmp_path / "world"
    world.mkdir()
    (world / "world.json").write_text('{"build": 1}')
    run_dir = tmp_path / "runs" / "ta"
    assert cli_runs.run_fusion_bench(run_dir, ["method=dummy"], world=world) == {"accuracy": 1}
    assert cli_runs.run_fusion_bench(run_dir, ["method=dummy"], world=world) == {"accuracy": 1}
    assert fake_fusion_bench.read_text().split() == ["run"]  # resumed: same command, same build

    (world / "world.json").write_text('{"build": 2}')  # rebuilt in place: same paths, same command
    cli_runs.run_fusion_bench(run_dir, ["method=dummy"], world=world)
    # ran again, and without the earlier build's zero-shot-head cache
    assert fake_fusion_bench.read_text().split() == ["run", "run"]
    from featcal_experiments.worlds.registry import build_fingerprint

    assert (run_dir / "world.txt").read_text().strip() == build_fingerprint(world)
    cli_runs.run_fusion_bench(run_dir, ["method=dummy", "seed=1"], world=world)  # another command
    assert fake_fusion_bench.read_text().split() == ["run", "run", "run"]


def test_a_run_from_before_fingerprints_counts_only_if_it_finished_after_the_build(tmp_path, fake_fusion_bench):
    world = tmp_path / "world"
    world.mkdir()
    (world / "world.json").write_text("{}")
    run_dir = tmp_path / "ta"
    cli_runs.run_fusion_bench(run_dir, ["method=dummy"], world=world)
    (run_dir / "world.txt").unlink()  # as the runs made before world.txt existed
    built = (world / "world.json").stat().st_mtime
    os.utime(run_dir / "command.txt", (built + 60, built + 60))
    assert cli_runs.made_on(run_dir, world)
    os.utime(run_dir / "command.txt", (built - 60, built - 60))
    assert not cli_runs.made_on(run_dir, world)
    cli_runs.run_fusion_bench(run_dir, ["method=dummy"], world=world)
    assert fake_fusion_bench.read_text().split() == ["run", "run"]
    assert json.loads((run_dir / "program_report.json").read_text()) == {"accuracy": 1}
