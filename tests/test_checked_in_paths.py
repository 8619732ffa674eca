"""No checked-in text names the machine it was made on: not the checkout's absolute path, not the home folder
(renderers write paths relative to the repository or as ~/...)."""

import subprocess
from pathlib import Path

from featcal_fusionbench.integration.reporting import portable

REPO = Path(__file__).resolve().parents[1]


def test_no_checked_in_text_file_names_the_checkout_or_the_home_folder():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    home = str(Path.home())
    forbidden = [str(REPO)] + ([home + "/"] if len(home) > 1 else [])
    offenders = []
    for name in filter(None, files):
        path = REPO / name.decode()
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary (PNG, ...)
            continue
        text = data.decode("utf-8", errors="replace")
        offenders += [f"{name.decode()}: {needle}" for needle in forbidden if needle in text]
    assert len(files) > 100 and not offenders, offenders


def test_portable_paths_are_relative_to_the_working_folder_or_to_home(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path.parent / "home"))
    assert portable(str(tmp_path / "outputs" / "x")) == "outputs/x" and portable(str(tmp_path)) == "."
    assert portable(f"--root={tmp_path.parent}/home/.cache/w") == "--root=~/.cache/w"
    assert portable("/opt/data") == "/opt/data"
