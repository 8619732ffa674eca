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


TEST_SH = Path(__file__).resolve().parents[1] / "scripts" / "test.sh"


def run_test_sh_on_a_disk(tmp_path, free_mib: int, one_filesystem: bool):
    """scripts/test.sh with `df` answering for a disk of ``free_mib`` free: one filesystem for everything, or one per
    folder asked about (the venv's parent and the temporary folder apart)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mount = '"/disk"' if one_filesystem else '"${@: -1}"'
    (bin_dir / "df").write_text(
        "#!/usr/bin/env bash\n"
        'echo "Filesystem 1024-blocks Used Available Capacity Mounted on"\n'
        f'echo "stub 999999999 0 {free_mib * 1024} 0% "{mount}\n'
    )
    (bin_dir / "df").chmod(0o755)
    venv = tmp_path / "venv"
    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FEATCAL_VENV": str(venv),
           "TMPDIR": str(tmp_path / "tmp")}
    done = subprocess.run(["bash", str(TEST_SH), "-k", "nothing"], env=env, capture_output=True, text=True, timeout=60)
    return done, venv


def test_the_tests_refuse_a_disk_too_small_in_one_line_before_setting_anything_up(tmp_path):
    done, venv = run_test_sh_on_a_disk(tmp_path, free_mib=8000, one_filesystem=True)
    assert done.returncode == 1 and not venv.exists(), done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"scripts/test.sh: 8000 MiB free on /disk, where the tests need about 8800 MiB (the venv {venv}: 6600 "
        f"unless set up already; {tmp_path / 'tmp'}: 2200)"]


def test_the_venv_and_the_temporary_folder_on_two_disks_are_each_checked_for_their_own_need(tmp_path):
    done, venv = run_test_sh_on_a_disk(tmp_path, free_mib=3000, one_filesystem=False)
    assert done.returncode == 1 and not venv.exists(), done.stdout + done.stderr
    assert f"3000 MiB free on {tmp_path}, where the tests need about 6600 MiB" in done.stderr  # the venv's parent
    assert "tmp, where" not in done.stderr  # 2200 MiB for the temporary folder fit in 3000


REPO = Path(__file__).resolve().parents[1]
WORLD_DATA = REPO / "experiments" / "scripts" / "install_world_data.sh"
SETUP_SH = REPO / "scripts" / "setup.sh"


def stubbed_system(tmp_path, uid: int, installed: bool) -> dict:
    """An environment whose `id -u` answers ``uid``, whose `dpkg -s` finds every package or none, and whose `apt-get`
    only records that it was called (in ``tmp_path / "apt-get.log"``)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {"id": f"echo {uid}", "dpkg": f"exit {0 if installed else 1}",
             "apt-get": f'echo "$*" >> {tmp_path / "apt-get.log"}'}
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FEATCAL_VENV": str(tmp_path / "venv")}


def packages() -> list:
    text = WORLD_DATA.read_text()
    listed = text.split("DEBIAN_PACKAGES=(", 1)[1].split(")", 1)[0].split()
    assert "dataset-fashion-mnist" in listed and len(listed) > 10
    return listed


def test_without_root_missing_world_data_packages_are_one_line_with_the_command_to_run_as_root(tmp_path):
    env = stubbed_system(tmp_path, uid=1000, installed=False)
    for command in (["bash", str(WORLD_DATA)], ["bash", str(WORLD_DATA), "--check"], ["bash", str(SETUP_SH)]):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1 and done.stdout == "", (command, done.stdout, done.stderr)
        assert done.stderr.strip().splitlines() == [
            "the offline worlds' data need Debian packages that are not installed; as root, run: "
            f"apt-get update && apt-get install -y {' '.join(packages())}"], command
    assert not (tmp_path / "apt-get.log").exists()  # no failed apt call
    assert not (tmp_path / "venv").exists()  # setup.sh stopped before setting anything up


def test_present_world_data_packages_need_no_root_and_root_installs_missing_ones(tmp_path):
    present = stubbed_system(tmp_path, uid=1000, installed=True)
    for command in (["bash", str(WORLD_DATA)], ["bash", str(WORLD_DATA), "--check"]):
        done = subprocess.run(command, env=present, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout == done.stderr == "", (command, done.stdout, done.stderr)
    assert not (tmp_path / "apt-get.log").exists()

    root = tmp_path / "root"
    root.mkdir()
    as_root = stubbed_system(root, uid=0, installed=False)
    checked = subprocess.run(["bash", str(WORLD_DATA), "--check"], env=as_root, capture_output=True, text=True,
                             timeout=60)
    assert checked.returncode == 0 and not (root / "apt-get.log").exists(), checked.stderr
    installed = subprocess.run(["bash", str(WORLD_DATA)], env=as_root, capture_output=True, text=True, timeout=60)
    assert installed.returncode == 0, installed.stderr
    assert (root / "apt-get.log").read_text().splitlines() == ["update -qq", f"install -y -qq {' '.join(packages())}"]
