"""The peak memory the reports give is the process's own, not its parent's."""

import json
import subprocess
import sys

import pytest

CHILD = ("import json, resource; from featcal_fusionbench.integration.memory import peak_rss_bytes; "
         "print(json.dumps([peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]))")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's; elsewhere ru_maxrss is used")
def test_a_process_started_by_a_large_one_reports_its_own_peak():
    """Linux carries a parent's peak RSS into ru_maxrss of a child across fork and exec (the benchmark's worker, started
    after its parent wrote five 3B-shape embeddings, reported the parent's 11 GiB); peak_rss_bytes reads the child's
    own high-water mark."""
    held = bytearray(3 << 30)  # touched: resident
    held[:: 4096] = b"\1" * len(held[:: 4096])
    del held
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True).stdout
    own, inherited = json.loads(out.strip().splitlines()[-1])
    assert inherited >= 3 << 30 > 2 * own
