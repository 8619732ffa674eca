"""Golden calibrations: every family contract case calibrated with fixed values and with the per-block label-free
choice, saved once and compared bit for bit (``tests/test_golden.py``).

The floats a calibration produces depend on the CPU's kernels (AVX2 and AVX-512 sum in different orders) and on
torch's version, so the file records the machine it was written on; ``test_golden`` compares bit for bit where the
fingerprint matches and says so where it cannot. Rewrite it (only after a change meant to alter the numbers) with

    python tests/golden_cases.py --write
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
from pathlib import Path
from typing import Any, Dict, Tuple

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))

GOLDEN_DIR = Path(__file__).parent / "golden"
TENSORS = GOLDEN_DIR / "contract.safetensors"
REPORTS = GOLDEN_DIR / "contract.json"
#: report fields that measure the run (time) rather than its result
VOLATILE = {"seconds", "phase_seconds", "selection_seconds", "search_seconds", "final_seconds"}
#: the per-block choice's grid, small enough for every case and wide enough that blocks choose differently
GRID = {"lambda_": (1e-3, 1e-1), "rho": (1.0, 2.0), "alpha": (0.3, 0.6)}


def fingerprint() -> Dict[str, str]:
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
    }


def stable(report: Any) -> Any:
    """The report without its timings, as JSON would hold it."""
    if isinstance(report, dict):
        return {k: stable(v) for k, v in report.items() if k not in VOLATILE}
    if isinstance(report, (list, tuple)):
        return [stable(v) for v in report]
    return report


def make_engine(hp, family, search=False, **options):
    from featcal_fusionbench.engine.loop import FeatCalEngine

    return FeatCalEngine(family, hp, "cpu", progress=False, **options)


def calibrate_fixed(family, merged, base, experts, data, examples):
    from featcal_fusionbench.core.hparams import FeatCalHParams

    hp = FeatCalHParams(num_calibration_examples=examples, batch_size=4)
    return merged, make_engine(hp, family).run(merged, base, experts, {t: iter(v) for t, v in data.items()})


def calibrate_selected(family, merged, base, experts, data, examples):
    """The per-block choice (criterion ``objective``), cross-fitted with each batch a fold, each block then solved
    with its choice on every batch: one calibration."""
    from featcal_fusionbench.autoselect.options import SelectionOptions
    from featcal_fusionbench.autoselect.search import calibrate_per_block
    from featcal_fusionbench.core.hparams import FeatCalHParams

    hp = FeatCalHParams(num_calibration_examples=examples, batch_size=4)
    parts = {t: [[batch] for batch in v] for t, v in data.items()}
    options = SelectionOptions(folds=min(len(p) for p in parts.values()))
    report, choice, search = calibrate_per_block(make_engine, family, hp, options, GRID, merged, base, experts,
                                                 parts, lambda part: part)
    return merged, {"search": search, "choice": choice, "final": report}


def run_cases() -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """Every case's calibrated state dict (keys prefixed ``<case>/<mode>/``) and stable report, one thread."""
    from test_family_contract import CASES  # noqa: E402  (the contract's worlds)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    tensors, reports = {}, {}
    try:
        for case in CASES:
            for mode, run in (("fixed", calibrate_fixed), ("selected", calibrate_selected)):
                base, experts, merged, data = case.world()
                model, report = run(case.family(), copy.deepcopy(merged), base, experts, data, case.examples)
                for key, value in model.state_dict().items():
                    tensors[f"{case.id}/{mode}/{key}"] = value.detach().clone().contiguous()
                reports[f"{case.id}/{mode}"] = json.loads(json.dumps(stable(report)))
    finally:
        torch.set_num_threads(threads)
    return tensors, reports


def write() -> None:
    tensors, reports = run_cases()
    GOLDEN_DIR.mkdir(exist_ok=True)
    save_file(tensors, str(TENSORS))
    REPORTS.write_text(json.dumps({"fingerprint": fingerprint(), "reports": reports}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(tensors)} tensors and {len(reports)} reports to {GOLDEN_DIR}")


def load() -> Tuple[Dict[str, torch.Tensor], Dict[str, Any], Dict[str, str]]:
    saved = json.loads(REPORTS.read_text())
    return load_file(str(TENSORS)), saved["reports"], saved["fingerprint"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="(re)write the golden files")
    if parser.parse_args().write:
        write()
    else:
        parser.print_help()
