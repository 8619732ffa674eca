"""Every family contract case, calibrated with fixed values and with the per-block label-free choice, equals the
calibration saved before the package was restructured (``golden_cases``): state dicts by ``torch.equal`` and
reports (timings aside) by ``==``, on a machine of the fingerprint the golden file records. Elsewhere the CPU's
kernels sum in another order, so the comparison is to float32 rounding and a warning says why."""

import warnings

import pytest
import torch

from golden_cases import fingerprint, load, run_cases


def close(got, expected, path="report"):
    """Reports equal up to float32 rounding in their floats."""
    if isinstance(expected, dict):
        assert got.keys() == expected.keys(), path
        for key in expected:
            close(got[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, list):
        assert len(got) == len(expected), path
        for i, (g, e) in enumerate(zip(got, expected)):
            close(g, e, f"{path}[{i}]")
    elif isinstance(expected, float):
        assert got == pytest.approx(expected, rel=1e-4, abs=1e-6, nan_ok=True), path
    else:
        assert got == expected, path


def test_calibrations_equal_the_golden_ones():
    tensors, reports = run_cases()
    golden_tensors, golden_reports, golden_machine = load()
    assert tensors.keys() == golden_tensors.keys()
    assert reports.keys() == golden_reports.keys()
    if golden_machine == fingerprint():
        changed = [key for key, value in tensors.items() if not torch.equal(value, golden_tensors[key])]
        assert not changed, f"{len(changed)} tensors differ from the golden ones, e.g. {changed[:5]}"
        for key, report in reports.items():
            assert report == golden_reports[key], key
        return
    warnings.warn(f"golden files written on {golden_machine}, this is {fingerprint()}: compared to float32 rounding")
    for key, value in tensors.items():
        torch.testing.assert_close(value, golden_tensors[key], rtol=1e-4, atol=1e-5, msg=key)
    for key, report in reports.items():
        close(report, golden_reports[key], key)

