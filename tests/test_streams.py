"""The stream store: exact round trips, the budget, the spill folder's lifetime, and the method's options.

Bit-identical calibration with spilled streams, for every model family, is in the contract suite
(``test_streams_spilled_beyond_a_budget_calibrate_bit_identically``)."""

import copy
import json
from collections import namedtuple
from dataclasses import dataclass
from typing import Any, Dict, Tuple

import pytest
import torch

from featcal_fusionbench import FeatCalAlgorithm
from featcal_fusionbench.integration.algorithm import REPORT_NAME
from featcal_fusionbench.engine.loop import FeatCalEngine
from featcal_fusionbench.engine.plan import block_reserve_bytes
from featcal_fusionbench.families.causal_lm import CausalLMFamily
from featcal_fusionbench.families.clip_vision import CLIPVisionFamily
from featcal_fusionbench.core.hparams import FeatCalHParams
from featcal_fusionbench.engine.streams import StreamOptions, StreamStore, auto_device_budget, parse_bytes, tree_bytes

from helpers import tiny_causal_lm_world, tiny_world
from test_algorithm import load_pool, make

Pair = namedtuple("Pair", "first second")


@dataclass(frozen=True)
class State:
    """Shaped like the families' per-batch metadata: masks, shared and expanded tensors, plain values."""

    mask: torch.Tensor
    rotary: Tuple[torch.Tensor, torch.Tensor]
    masks: Dict[str, Any]
    decoder: bool = False


def batch(seed: int, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5, 8, generator=g).to(dtype)
    both = torch.randn(2, 5, 8, generator=g).to(dtype)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()[None, None].expand(2, 1, 5, 5)
    wide = torch.arange(40, dtype=torch.int64)
    meta = State(
        mask=torch.ones(2, 5, dtype=torch.long),
        rotary=tuple(both.chunk(2, dim=-1)),  # each a slice of one buffer
        masks={"full": causal, "again": causal, "sliding": None, "positions": Pair(wide[3:8], [wide[10:12]])},
    )
    return hidden, meta


def assert_identical(got, expected):
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)
        if expected.untyped_storage().nbytes() <= expected.numel() * expected.element_size():  # not a slice
            assert got.stride() == expected.stride()
    elif isinstance(expected, State):
        for name in ("mask", "rotary", "masks", "decoder"):
            assert_identical(getattr(got, name), getattr(expected, name))
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys()
        for key in expected:
            assert_identical(got[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected)
        for a, b in zip(got, expected):
            assert_identical(a, b)
    else:
        assert got == expected


@pytest.mark.parametrize("spill", ["host", "disk"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_spilled_batches_come_back_bit_for_bit_with_their_layout(spill, dtype, tmp_path):
    with StreamStore("cpu", 0, spill, str(tmp_path)) as store:
        stream = store.stream()
        originals = [batch(seed, dtype) for seed in range(3)]
        for hidden, meta in originals:
            stream.append(hidden, meta)
        assert store.resident_bytes == 0
        assert store.spilled_bytes == sum(tree_bytes(h) + tree_bytes(m) for h, m in originals)
        for b, (hidden, meta) in enumerate(originals):
            got_hidden, got_meta = stream.get(b)
            assert_identical(got_hidden, hidden)
            assert_identical(got_meta, meta)
            full, again = got_meta.masks["full"], got_meta.masks["again"]
            assert full.untyped_storage().data_ptr() == again.untyped_storage().data_ptr()  # still one buffer ...
            assert full.untyped_storage().nbytes() == 25  # ... of one 5 x 5 mask, expanded
        stream.put(1, originals[1][0] + 1)  # new hidden states, the metadata kept
        assert_identical(stream.hidden(1), originals[1][0] + 1)
        assert_identical(stream.get(1)[1], originals[1][1])
        if spill == "disk":
            (folder,) = tmp_path.iterdir()
            assert len(list(folder.iterdir())) == 2 * len(originals)  # a replaced batch's file is removed
    assert not any(tmp_path.iterdir()) and len(stream) == 0


def test_batches_stay_on_the_device_while_they_fit_the_budget_and_the_peaks_are_reported():
    hidden, meta = batch(0)
    one = tree_bytes(hidden)
    assert one == hidden.numel() * 2
    # the expanded mask (held twice) counts 25 bytes, each slice only its own elements
    assert tree_bytes(meta) == 2 * 5 * 8 + 2 * 5 * 8 * 2 + 25 + (5 + 2) * 8
    with StreamStore("cpu", one, "host") as store:
        stream = store.stream()
        stream.append(hidden, meta)  # the hidden states fit, the metadata does not
        stream.append(hidden + 1, meta)
        assert stream.get(0)[0] is hidden  # resident: the very tensor, no copy
        report = store.report()
    assert report["device_budget_bytes"] == one
    assert report["peak_resident_bytes"] == one
    assert report["peak_spilled_bytes"] == report["spill_written_bytes"] == one + 2 * tree_bytes(meta)
    assert report["peak_bytes"] == 2 * (one + tree_bytes(meta))
    assert report["spill_read_bytes"] == tree_bytes(meta)


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_the_disk_spill_folder_is_removed_when_calibration_stops_midway(error, tmp_path):
    base, experts, merged, data = tiny_world()
    family = CLIPVisionFamily()
    run_block, calls = family.run_block, []

    def failing(block, hidden, meta):
        calls.append(sorted(p.name for p in tmp_path.rglob("*.pt")))
        if len(calls) == 30:  # in the second block, with every batch on disk
            raise error("stopped")
        return run_block(block, hidden, meta)

    family.run_block = failing
    hp = FeatCalHParams(num_calibration_examples=12, batch_size=4)
    engine = FeatCalEngine(family, hp, "cpu", progress=False, streams=StreamOptions(0, "disk", str(tmp_path)))
    with pytest.raises(error, match="stopped"):
        engine.run(merged, base, experts, {t: iter(v) for t, v in data.items()})
    assert len(calls[-1]) == 2 * 2 * 3  # two streams of three batches per task, their hidden states on disk
    assert not any(tmp_path.iterdir())


def test_the_automatic_budget_is_unbounded_on_the_host_and_a_share_of_free_cuda_memory(monkeypatch):
    assert StreamOptions().device_budget(torch.device("cpu"), 10**9) is None
    assert StreamOptions("auto").device_budget(torch.device("cpu"), 0) is None
    assert StreamOptions("2KiB").device_budget(torch.device("cpu"), 10**9) == 2048
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10_000, 80_000))
    assert auto_device_budget(torch.device("cuda"), 2_000) == 4_000
    assert auto_device_budget(torch.device("cuda"), 20_000) == 0


def test_the_reserve_covers_the_statistics_a_block_holds():
    """The automatic budget leaves a block's statistics free: the estimate is at least what the engine measured."""
    base, experts, merged, data = tiny_causal_lm_world("llama")
    family = CausalLMFamily()
    hp = FeatCalHParams(num_calibration_examples=8, batch_size=4)
    report = FeatCalEngine(family, hp, "cpu", progress=False).run(
        copy.deepcopy(merged), base, experts, {t: iter(v) for t, v in data.items()}
    )
    blocks = family.blocks(merged)
    weights = 2 * sum(p.numel() * p.element_size() for p in blocks[0].parameters())
    assert block_reserve_bytes(blocks, torch.float32) - weights >= report["statistics_bytes"] > 0


@pytest.mark.parametrize("text, value", [(0, 0), (4096, 4096), ("0", 0), ("8GB", 8 * 10**9), ("1.5 MiB", 3 * 2**19), (8e9, 8 * 10**9)])
def test_byte_counts_are_read_with_their_units(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"stream_device_bytes": -1}, "stream_device_bytes: a byte count must be >= 0"),
        ({"stream_device_bytes": "lots"}, r"stream_device_bytes: 'lots' is not a byte count"),
        ({"stream_device_bytes": "8 parsecs"}, "is not a byte count"),
        ({"stream_device_bytes": 1.5}, "is not a byte count"),
        ({"stream_spill": "gpu"}, r"stream_spill must be one of \['host', 'disk'\], got 'gpu'"),
        ({"stream_spill": "disk", "stream_spill_dir": "/no/such/folder"}, "'/no/such/folder' is not an existing folder"),
    ],
)
def test_bad_stream_options_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FeatCalAlgorithm(**kwargs)


def test_the_method_spills_to_disk_calibrates_the_same_and_reports_the_streams(toy_world, tmp_path):
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    whole = make().run(load_pool(toy_world))
    spilled = make(tmp_path / "log", stream_device_bytes="0", stream_spill="disk", stream_spill_dir=str(spill_dir))
    calibrated = spilled.run(load_pool(toy_world))
    assert all(torch.equal(a, b) for a, b in zip(calibrated.state_dict().values(), whole.state_dict().values()))
    (report_path,) = (tmp_path / "log").rglob(REPORT_NAME)
    streams = json.loads(report_path.read_text())["streams"]
    assert streams["device_budget_bytes"] == 0 and streams["device_budget"] == "option" and streams["spill"] == "disk"
    assert streams["peak_resident_bytes"] == 0 and streams["peak_spilled_bytes"] > 0
    assert not any(spill_dir.iterdir())


@pytest.mark.slow
def test_the_stream_options_reach_the_method_from_the_command_line(tiny_llama_pool, tmp_path):
    """`method.stream_device_bytes=1KiB method.stream_spill=disk` through Hydra on a tiny Llama pool: the batches
    spilled, the calibrated model the same, bit for bit."""
    from safetensors.torch import load_file

    from test_causal_lm import fusion_bench_run

    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    common = ("method=featcal/causal_lm_ta", "method.num_calibration_examples=8", "method.batch_size=4",
              tiny_llama_pool["search"], "modelpool=tiny_llama", "taskpool=dummy")
    runs = {"whole": (), "spilled": ("method.stream_device_bytes=1KiB", "method.stream_spill=disk",
                                     f"method.stream_spill_dir={spill_dir}")}
    for name, options in runs.items():
        fusion_bench_run(tmp_path, *common, *options, f"path.log_dir={tmp_path / name}",
                         f"merged_model_save_path={tmp_path / name / 'calibrated'}")
    whole, spilled = (load_file(tmp_path / name / "calibrated" / "model.safetensors") for name in runs)
    assert whole.keys() == spilled.keys() and all(torch.equal(whole[k], spilled[k]) for k in whole)
    streams = json.loads((tmp_path / "spilled" / "featcal_report.json").read_text())["streams"]
    assert streams["device_budget_bytes"] == 1024 and streams["spill"] == "disk"
    assert streams["peak_resident_bytes"] <= 1024 < streams["peak_spilled_bytes"]
    assert not any(spill_dir.iterdir())
