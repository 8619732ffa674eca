"""The offline worlds' commands: build atomically, locate, fail without leaving anything behind."""

import hashlib

import pytest

from featcal_experiments.worlds import cli, registry


def test_world_commands_build_atomically_and_locate(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(registry.ENV_DIR, str(tmp_path))
    calls = []

    def fake_build(root):
        calls.append(root)
        (root / "config").mkdir(parents=True)
        (root / "config" / "pool.yaml").write_text(f"path: {root.resolve()}/x\n")
        (root / "world.json").write_text("{}")

    monkeypatch.setitem(registry.WORLDS, "fake", registry.World("fake", "test", fake_build, "P/fake", "T/fake"))
    assert cli.main(["path", "fake"]) == 1
    assert registry.world_fingerprint("fake") is None  # not built
    assert "featcal-world build fake" in capsys.readouterr().err
    assert cli.main(["build", "fake"]) == 0
    final = tmp_path / "fake"
    assert (final / "world.json").is_file()
    assert (final / "config" / "pool.yaml").read_text() == f"path: {final}/x\n"  # paths point at the final place
    assert not list(tmp_path.glob(".fake.partial-*"))
    assert registry.world_fingerprint("fake") == hashlib.sha1(b"{}").hexdigest()[:12]
    cli.main(["build", "fake"])
    assert len(calls) == 1  # already built: skipped
    capsys.readouterr()
    assert cli.main(["args", "fake"]) == 0
    # a searchpath override, not --config-dir: it works anywhere on the command line
    assert capsys.readouterr().out.split() == [f"hydra.searchpath=[file://{final / 'config'}]", "modelpool=P/fake",
                                               "taskpool=T/fake"]


@pytest.mark.slow
def test_a_build_killed_with_sigterm_leaves_nothing_behind(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    script = (
        "import time\n"
        "from featcal_experiments.worlds import registry\n"
        "def slow(root):\n"
        "    (root / 'half').mkdir(parents=True)\n"
        "    time.sleep(120)\n"
        "registry.WORLDS['slow'] = registry.World('slow', 'test', slow, 'P/slow', 'T/slow')\n"
        "registry.build_world('slow')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, registry.ENV_DIR: str(tmp_path)})
    deadline = time.time() + 120
    while not list(tmp_path.glob(".slow.partial-*/half")) and time.time() < deadline:
        time.sleep(0.2)
    assert list(tmp_path.glob(".slow.partial-*/half")), "the build never started"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.ENV_DIR, str(tmp_path))

    def broken(root):
        (root / "half").mkdir(parents=True)
        raise RuntimeError("boom")

    monkeypatch.setitem(registry.WORLDS, "broken", registry.World("broken", "test", broken, "P", "T"))
    with pytest.raises(RuntimeError, match="boom"):
        registry.build_world("broken")
    assert list(tmp_path.iterdir()) == []




def test_a_world_is_built_with_another_seed_on_request(tmp_path, monkeypatch):
    """`featcal-world build NAME --seed S`: the recipe's every seeded step from S (here the toy world's, seconds),
    recorded in world.json; without it, the recipe's own seed."""
    import json
    from dataclasses import replace

    monkeypatch.setattr(registry, "TOY_SPEC", replace(registry.TOY_SPEC, finetune_steps=2, train_per_class=4,
                                                       test_per_class=2))  # the recipe in small: seconds
    builds = {}
    for seed in (None, 5):
        monkeypatch.setenv(registry.ENV_DIR, str(tmp_path / f"seed-{seed}"))
        assert cli.main(["build", "toy", *([] if seed is None else ["--seed", str(seed)])]) == 0
        builds[seed] = json.loads((tmp_path / f"seed-{seed}" / "toy" / "world.json").read_text())
    assert builds[None]["spec"]["seed"] == registry.TOY_SPEC.seed == 0 and builds[5]["spec"]["seed"] == 5
    assert {k: v for k, v in builds[5]["spec"].items() if k != "seed"} == \
        {k: v for k, v in builds[None]["spec"].items() if k != "seed"}
    weights = [(tmp_path / f"seed-{s}" / "toy" / "pretrained" / "model.safetensors").read_bytes() for s in builds]
    assert weights[0] != weights[1]  # another world, not the same one relabelled
