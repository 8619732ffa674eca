"""Memory and time of FeatCal at real LLM shapes: the base and experts whole in memory, or read block by block.

    python experiments/scripts/bench_llm_memory.py --arch llama-3.2-1b-shape --tasks 3 --n 8 --seq-len 256 \
        --device cpu --json OUT

Checkpoints with the architecture's real shapes and seeded random weights (cost does not depend on the values) are
written once to ``--workdir`` in ``--storage-dtype`` (the hub's LLM checkpoints are bf16; a float32 run converts
each tensor as it is read): the base, ``--tasks`` experts (base plus small noise) and, unless only ``out_of_core``
runs, their Task Arithmetic merge (0.3). They are sharded one decoder layer (or one other tensor) per file and
written a model at a time, so that writing them never holds a whole model. Each loading mode (``--modes``) then
runs in a fresh process, so that the process's peak RSS is that mode's own (its high-water mark: ``ru_maxrss``
would carry the parent's checkpoint-writing peak across fork and exec). A mode process loads
the merged model whole, as FusionBench evaluates and saves it. It loads the base and experts whole (``eager``) or
as skeletons that read each block when it is used (``lazy``: ``method.lazy_loading``). It then times the forward
floor and FeatCal's calibration stage. ``out_of_core`` (``method.out_of_core``) holds no model whole: the merge is
Task Arithmetic of the lazy base and experts computed tensor by tensor (over the decoder layers, as the LLM configs'
``merge_backbone``; the embedding and head are the base's), and each calibrated block is written to a
sharded checkpoint as it finishes (then the embedding, norm and head), as the method does; its floor is the same two
passes a block at a time, each block read before its passes are timed.

The forward floor is the merged model's decoder stack run twice over every task's tokens. That is one pass per
stream FeatCal advances (calibrated and expert), with nothing read from disk. Written per mode:
- ``seconds``, ``forward_floor_seconds``;
- ``peak_rss_bytes``: the process's peak, models included; ``rss_runtime_bytes``: the process before any model is
  loaded (interpreter, torch, transformers);
- ``peak_device_bytes``;
- ``model_bytes``: one model's parameters;
- ``statistics_bytes``: one task's moments plus a block's sums;
- ``streams``: the hidden-state streams' device budget and peak resident / spilled bytes (``--stream-device-bytes``,
  ``--stream-spill``: ``method.stream_device_bytes`` / ``method.stream_spill``);
- ``save_*``: saving the calibrated model with ``save_pretrained`` in ``--max-shard-size`` shards, as
  ``merged_model_save_path`` does. The RSS is taken before and during the save, so any second copy shows;
  out of core, the writing is part of the calibration, and ``output_bytes`` is what it wrote;
- ``disk_bytes``: each checkpoint folder's size on disk (base, experts, merge).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
REPO = Path(__file__).resolve().parents[2]
# --upstream -> the upstream config (config/method/upstream/) out of core computes tensor by tensor
UPSTREAMS = {"task_arithmetic": "task_arithmetic_causallm", "ties": "ties_merging_causallm"}
from bench_calibration import (  # noqa: E402
    RSSSampler, in_subprocess, model_bytes, provenance, stage_figures, sync, write_json,
)

LLAMA_VOCAB = 128256
ARCHS = {
    "llama-3.2-1b-shape": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                               num_key_value_heads=8, vocab_size=LLAMA_VOCAB, tie_word_embeddings=True),
    "llama-3.2-3b-shape": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                               num_key_value_heads=8, vocab_size=LLAMA_VOCAB, tie_word_embeddings=True),
    "llama-3.1-8b-shape": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                               num_key_value_heads=8, vocab_size=LLAMA_VOCAB, tie_word_embeddings=False),
    # meta-llama/Llama-3.1-70B(-Instruct)'s config.json (issue 62 quotes its widths)
    "llama-3.1-70b-shape": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                                num_key_value_heads=8, vocab_size=LLAMA_VOCAB, tie_word_embeddings=False),
    # meta-llama/Llama-3.1-405B's: predicted only (--predict), its checkpoints would not fit this disk
    "llama-3.1-405b-shape": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                                 num_attention_heads=128, num_key_value_heads=8, vocab_size=LLAMA_VOCAB,
                                 tie_word_embeddings=False),
    # the offline LLM world's base (experiments/docs/offline_llm_world.md): SmolLM2-135M-Instruct
    "smollm2-135m-shape": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
}
MODES = ("lazy", "eager", "out_of_core")
#: the worker key of an out-of-core run that chooses per block (``--auto-select``), run after the fixed-value one
AUTO_SELECT_MODE = "out_of_core+auto_select"
# --auto-select's grids of lambda and rho (alpha stays the run's, as criterion objective keeps it by default)
AUTO_SELECT_GRIDS = {
    "small": {"lambda_": (1e-5, 1e-3), "rho": (0.5, 1.0), "alpha": (0.15,)},
    "default": {"lambda_": tuple(10.0**k for k in range(-6, 2)), "rho": (0.5, 1.0, 1.5, 2.0, 2.5), "alpha": (0.15,)},
}


def llama_config(arch: str, dtype: str, layers: Optional[int] = None):
    from transformers import LlamaConfig

    shape = {**ARCHS[arch], **({} if layers is None else {"num_hidden_layers": layers})}
    return LlamaConfig(**shape, rope_theta=500000.0, max_position_embeddings=8192, torch_dtype=dtype)


def write_checkpoints(args, root: Path) -> dict:
    """base/, expert<i>/, merged/ under ``root``, one shard per decoder layer and one per other tensor, with an HF
    index. A shard is generated and written one model at a time (the base's tensors, then each expert's, then the
    merge accumulated from their deltas), so that at most three copies of one shard's tensors are held: at the 8B
    shape a vocabulary-sized shard is 2.1 GB a model. Done once per (arch, layers, tasks, dtype): a ``spec.json``
    says what a folder holds."""
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    with_merge = set(args.modes.split(",")) != {"out_of_core"}
    spec = checkpoint_spec(args)
    names = ["base", *(f"expert{i}" for i in range(args.tasks)), *(["merged"] if with_merge else [])]
    if checkpoints_written(args, root):
        return {n: root / n for n in names}
    config = llama_config(args.arch, args.storage_dtype, args.layers)
    with init_empty_weights():
        skeleton = LlamaForCausalLM(config)
    shapes = {k: v.shape for k, v in skeleton.state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")}
    groups = {}
    for key in shapes:
        group = key.split(".")[2] if key.startswith("model.layers.") else key
        groups.setdefault(group, []).append(key)
    dtype = getattr(torch, args.storage_dtype)
    generator = torch.Generator().manual_seed(0)
    index = {n: {} for n in names}
    for n in names:
        (root / n).mkdir(parents=True, exist_ok=True)
        config.save_pretrained(root / n)
    for number, keys in enumerate(groups.values(), start=1):
        shard = f"model-{number:05d}-of-{len(groups):05d}.safetensors"

        def write(name, tensors):
            save_file({k: v.to(dtype) for k, v in tensors.items()}, str(root / name / shard), metadata={"format": "pt"})
            index[name].update({key: shard for key in keys})

        base = {k: torch.ones(shapes[k]) if k.endswith("norm.weight") else 0.02 * torch.randn(shapes[k], generator=generator)
                for k in keys}
        write("base", base)
        merged = {k: v.clone() for k, v in base.items()}
        for i in range(args.tasks):
            expert = {}
            for k in keys:
                delta = 1e-3 * torch.randn(shapes[k], generator=generator)
                merged[k].add_(delta, alpha=0.3)
                expert[k] = delta.add_(base[k])
            write(f"expert{i}", expert)
            del expert
        if with_merge:
            write("merged", merged)
        del base, merged
    for n in names:
        (root / n / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index[n]}))
    (root / "spec.json").write_text(json.dumps(spec))
    return {n: root / n for n in names}


def token_batches(args, vocab: int):
    generator = torch.Generator().manual_seed(1)
    out = {}
    for i in range(args.tasks):
        ids = torch.randint(1, vocab, (args.n, args.seq_len), generator=generator)
        out[f"expert{i}"] = [{"input_ids": ids[s:s + args.batch_size], "attention_mask": torch.ones_like(ids[s:s + args.batch_size])}
                             for s in range(0, args.n, args.batch_size)]
    return out


@torch.no_grad()
def forward_floor(merged, batches, device) -> float:
    decoder = merged.model
    decoder(**{k: v[:1].to(device) for k, v in next(iter(batches.values()))[0].items()})  # warm-up, not timed
    sync(device)
    started = time.perf_counter()
    for task_batches in batches.values():
        for batch in task_batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            for _ in range(2):  # the calibrated stream and the expert's
                decoder(**batch)
    sync(device)
    return time.perf_counter() - started


@torch.no_grad()
def blockwise_forward_floor(merged, batches, device) -> float:
    """The two passes of ``forward_floor`` a block at a time, on a lazy model: each block is read onto the device,
    then its passes are timed (the reading is not)."""
    from featcal_fusionbench.families.causal_lm import CausalLMFamily
    from featcal_fusionbench.models.residency import on_device

    family = CausalLMFamily()
    with on_device(family.stem_modules(merged), device):
        states = [family.embed(merged, {k: v.to(device) for k, v in batch.items()})
                  for task_batches in batches.values() for batch in task_batches]
    seconds = 0.0
    for block in family.blocks(merged):
        with on_device([block], device):
            sync(device)
            started = time.perf_counter()
            for b, (hidden, meta) in enumerate(states):
                for _ in range(2):  # the calibrated stream and the expert's
                    out = family.run_block(block, hidden, meta)
                states[b] = (out, meta)
            sync(device)
            seconds += time.perf_counter() - started
    return seconds


def out_of_core_worker(args, device, dtype, paths, batches, hp, streams) -> dict:
    """``method.out_of_core``'s work: Task Arithmetic (or TIES, ``--upstream ties``) computed per tensor, each
    calibrated block written as it finishes."""
    from transformers import LlamaForCausalLM

    from featcal_fusionbench.engine.loop import FeatCalEngine
    from featcal_fusionbench.families.causal_lm import CausalLMFamily
    from omegaconf import OmegaConf

    from featcal_fusionbench.integration.out_of_core import lazy_merge_of, lazy_upstream, map_large_allocations
    from featcal_fusionbench.models.lazy import load_lazily
    from featcal_fusionbench.models.sinks import CheckpointSink, model_bytes

    mapped = map_large_allocations() if args.map_large_allocations else False  # first, as the method does
    base = load_lazily(LlamaForCausalLM, paths["base"], dtype)
    experts = {f"expert{i}": load_lazily(LlamaForCausalLM, paths[f"expert{i}"], dtype) for i in range(args.tasks)}
    # the LLM configs' upstreams, as the method reads them
    upstream = OmegaConf.load(REPO / "config" / "method" / "upstream" / f"{UPSTREAMS[args.upstream]}.yaml")
    started = time.perf_counter()
    merged = lazy_merge_of(base, experts, lazy_upstream(upstream))
    upstream_seconds = time.perf_counter() - started  # TIES' passes over the checkpoints; nothing for TA
    floor = blockwise_forward_floor(merged, batches, device)
    family = CausalLMFamily()
    output = Path(args.workdir) / "calibrated-out_of_core"
    with RSSSampler() as rss:
        started = time.perf_counter()
        blocks = family.blocks(merged)
        with CheckpointSink(output, merged, blocks, fingerprint={"bench": "out_of_core"},
                            save_extra=lambda folder: merged.config.save_pretrained(folder)) as sink:
            parts, policy = None, None
            selecting = args.worker == AUTO_SELECT_MODE
            if selecting:  # criterion objective in the one pass, cross-fitted: each task's batches in 4 parts
                from featcal_fusionbench.autoselect.policy import CrossFitSelection, Search

                grid = AUTO_SELECT_GRIDS[args.auto_select]
                folds = min(4, min(len(b) for b in batches.values()))
                parts = {t: [len(b) // folds + (i < len(b) % folds) for i in range(folds)] for t, b in batches.items()}
                policy = CrossFitSelection(Search(grid["lambda_"], grid["rho"], grid["alpha"], widen=False), folds)
            engine = FeatCalEngine(family, hp, device, progress=False, profile=args.profile, streams=streams,
                                   sink=sink, policy=policy)
            report = engine.run(merged, base, experts, {t: iter(b) for t, b in batches.items()}, parts)
            sink.finish()
        sync(device)
        seconds = time.perf_counter() - started
    written = folder_bytes(output)
    shutil.rmtree(output)
    return {
        **stage_figures(seconds, floor, rss, device),
        "model_bytes": model_bytes(merged),
        "output_bytes": written,
        "map_large_allocations": mapped,
        "upstream": args.upstream,
        "upstream_passes_seconds": upstream_seconds,
        "auto_select": args.auto_select if selecting else None,
        "selection_seconds": sum(b.get("selection_seconds", 0.0) for b in report["blocks"]),
        "report": report,
    }


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file())


def worker(args) -> dict:
    from transformers import LlamaForCausalLM

    from featcal_fusionbench.engine.loop import FeatCalEngine
    from featcal_fusionbench.families.causal_lm import CausalLMFamily
    from featcal_fusionbench.core.hparams import FeatCalHParams
    from featcal_fusionbench.models.lazy import load_lazily
    from featcal_fusionbench.engine.streams import StreamOptions

    import psutil

    # what the interpreter, torch and transformers hold before any model exists: at 1B bf16 scale a sizeable part
    # of the peak that no calibration design can remove
    runtime_bytes = psutil.Process().memory_info().rss
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    paths = {n: Path(args.workdir) / n for n in ["base", *(f"expert{i}" for i in range(args.tasks)), "merged"]}
    disk = {n: folder_bytes(p) for n, p in paths.items() if p.is_dir()}
    hp = FeatCalHParams(num_calibration_examples=args.n, batch_size=args.batch_size, rho=0.5, alpha=0.15, lambda_=1e-5,
                        accumulation_dtype=args.accumulation_dtype)
    streams = StreamOptions(args.stream_device_bytes, args.stream_spill, args.stream_spill_dir)
    if args.worker in ("out_of_core", AUTO_SELECT_MODE):
        batches = token_batches(args, llama_config(args.arch, args.dtype, args.layers).vocab_size)
        result = out_of_core_worker(args, device, dtype, paths, batches, hp, streams)
        report = result.pop("report")
        return {"mode": args.worker, **result, "rss_runtime_bytes": runtime_bytes, "disk_bytes": disk,
                "statistics_bytes": report["statistics_bytes"], "streams": report["streams"],
                "phase_seconds": report["phase_seconds"],
                "last_block_cosine": {t: d["after"]["cosine"] for t, d in report["blocks"][-1]["drift"].items()}}
    merged = LlamaForCausalLM.from_pretrained(paths["merged"], torch_dtype=dtype).eval().to(device)
    load = (lambda p: load_lazily(LlamaForCausalLM, p, dtype)) if args.worker == "lazy" else \
        (lambda p: LlamaForCausalLM.from_pretrained(p, torch_dtype=dtype).eval())
    base = load(paths["base"])
    experts = {f"expert{i}": load(paths[f"expert{i}"]) for i in range(args.tasks)}
    batches = token_batches(args, merged.config.vocab_size)
    floor = forward_floor(merged, batches, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine = FeatCalEngine(CausalLMFamily(), hp, device, progress=False, profile=args.profile, streams=streams)
    with RSSSampler() as rss:
        started = time.perf_counter()
        report = engine.run(merged, base, experts, {t: iter(b) for t, b in batches.items()})
        sync(device)
        seconds = time.perf_counter() - started
    if not all(torch.isfinite(p).all() for p in merged.parameters()):
        raise RuntimeError("the calibrated model has non-finite parameters")
    # saving as merged_model_save_path does (save_pretrained), shard by shard
    save_dir = Path(args.workdir) / f"calibrated-{args.worker}"
    with RSSSampler() as saving:
        started = time.perf_counter()
        merged.to("cpu").save_pretrained(save_dir, max_shard_size=args.max_shard_size)
        save_seconds = time.perf_counter() - started
    shutil.rmtree(save_dir)
    return {
        "mode": args.worker,
        **stage_figures(seconds, floor, rss, device),
        "rss_runtime_bytes": runtime_bytes,
        "disk_bytes": disk,
        "model_bytes": model_bytes(merged),
        "statistics_bytes": report["statistics_bytes"],
        "streams": report["streams"],
        "save_seconds": save_seconds,
        "save_rss_before_bytes": saving.start_bytes,
        "save_peak_rss_during_bytes": saving.peak_bytes,
        "phase_seconds": report["phase_seconds"],
        "last_block_cosine": {t: d["after"]["cosine"] for t, d in report["blocks"][-1]["drift"].items()},
    }


def checkpoint_spec(args) -> dict:
    with_merge = set(args.modes.split(",")) != {"out_of_core"}
    return {"arch": args.arch, "tasks": args.tasks, "dtype": args.storage_dtype, "seed": 0, "writer": 2,
            **({} if args.layers is None else {"layers": args.layers}), **({} if with_merge else {"merged": False})}


def checkpoints_written(args, root: Path) -> bool:
    return (root / "spec.json").is_file() and json.loads((root / "spec.json").read_text()) == checkpoint_spec(args)


def prediction(args):
    """``featcal_experiments.memory_budget``'s out-of-core peak for this run, and the disk it needs."""
    from featcal_experiments.memory_budget import BYTES, model_parameters, out_of_core_peak

    shape = ARCHS[args.arch]
    layers = args.layers or shape["num_hidden_layers"]
    predicted = out_of_core_peak(shape, tasks=args.tasks, tokens=args.n * args.seq_len, model_dtype=args.dtype,
                                 accumulation_dtype=args.accumulation_dtype)
    params = model_parameters(shape, layers)
    copies = 1 + args.tasks + (0 if set(args.modes.split(",")) == {"out_of_core"} else 1)
    disk = {"checkpoints": copies * params * BYTES[args.storage_dtype], "output": params * BYTES[args.dtype]}
    return predicted, disk


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", choices=sorted(ARCHS), required=True)
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("--n", type=int, default=8, help="calibration sequences per task")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--layers", type=int, help="decoder layers (default: the architecture's); fewer for a quick "
                        "look at one block's work, whose memory does not depend on the depth")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the run's dtype")
    parser.add_argument("--accumulation-dtype", choices=["float32", "float64"], default="float32",
                        help="the moments' dtype (method.accumulation_dtype; the 3B config's is float64)")
    parser.add_argument("--map-large-allocations", type=int, choices=[0, 1], default=1,
                        help="out_of_core: 1 as the method does (glibc's mmap threshold at 1 MiB), 0 glibc's default")
    parser.add_argument("--upstream", choices=sorted(UPSTREAMS), default="task_arithmetic",
                        help="out_of_core: the merge computed tensor by tensor (config/method/upstream/)")
    parser.add_argument("--storage-dtype", choices=["bfloat16", "float32"],
                        help="the checkpoints' dtype (default: --dtype)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-shard-size", default="1GB", help="save_pretrained's shard size for the calibrated model")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="lazy, eager, out_of_core, comma-separated (each in its own process)")
    parser.add_argument("--workdir", help="where the checkpoints are written (reused when they match); default: "
                        "~/.cache/featcal-fusionbench/bench/<arch>-<tasks>-<dtype>")
    parser.add_argument("--stream-device-bytes", help="budget of stream bytes on the device (e.g. 0, 2GB); default auto")
    parser.add_argument("--stream-spill", default="host", help="where streams beyond the budget go: host or disk")
    parser.add_argument("--stream-spill-dir", help="where disk spill makes its temporary folder")
    parser.add_argument("--profile", action="store_true", help="FeatCal's seconds per phase (embed, moments, solve, ...)")
    parser.add_argument("--auto-select", choices=sorted(AUTO_SELECT_GRIDS),
                        help="out_of_core only: choose lambda and rho per block on held-out moments (criterion "
                             "objective) over this grid; 'default' is auto_select's own 8 x 5, 'small' 2 x 2 (the "
                             "memory is one candidate's solution at a time: the grid sets the time, not the peak); "
                             "the fixed-value run is made first, in its own process, and the ratios printed")
    parser.add_argument("--without-fixed", action="store_true",
                        help="with --auto-select: the choosing run alone (a depth series; the ratios need both)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--predict", action="store_true",
                        help="print the predicted out-of-core peak and the disk the run needs, and stop")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES) or not modes:
        parser.error(f"--modes takes {', '.join(MODES)}, got {args.modes!r}")
    if args.auto_select and modes != ["out_of_core"]:
        parser.error("--auto-select measures the out-of-core run alone: give --modes out_of_core")
    if args.without_fixed and not args.auto_select:
        parser.error("--without-fixed goes with --auto-select")
    if min(args.tasks, args.n, args.seq_len, args.batch_size, 1 if args.layers is None else args.layers) < 1:
        parser.error("--tasks, --n, --seq-len, --batch-size and --layers must be >= 1")
    try:
        from featcal_fusionbench.engine.streams import StreamOptions

        StreamOptions(args.stream_device_bytes, args.stream_spill, args.stream_spill_dir)
    except ValueError as err:
        parser.error(str(err))
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA device is available")
    args.storage_dtype = args.storage_dtype or args.dtype
    if args.workdir is None:
        # the same in every mode process
        layers = "" if args.layers is None else f"-{args.layers}layers"
        args.workdir = str(Path.home() / ".cache" / "featcal-fusionbench" / "bench" /
                           f"{args.arch}{layers}-{args.tasks}-{args.storage_dtype}")

    if args.worker:
        print("RESULT " + json.dumps(worker(args)))
        return
    predicted, disk = prediction(args)
    gib = 2**30
    print(f"predicted out-of-core peak RSS {predicted['peak'] / gib:.2f} GiB = "
          + " + ".join(f"{k} {v / gib:.2f}" for k, v in predicted.items() if k != "peak")
          + f"; disk: checkpoints {disk['checkpoints'] / gib:.2f} GiB, output {disk['output'] / gib:.2f} GiB")
    if args.predict:
        return
    need = disk["output"] + (0 if checkpoints_written(args, Path(args.workdir)) else disk["checkpoints"])
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.workdir).free
    if free < need:
        sys.exit(f"bench_llm_memory: {args.workdir} has {free / gib:.2f} GiB free; this run needs {need / gib:.2f} GiB "
                 "(checkpoints not yet written, and the calibrated model's); give --workdir on a larger disk")
    started = time.perf_counter()
    write_checkpoints(args, Path(args.workdir))
    print(f"checkpoints in {args.workdir} ({time.perf_counter() - started:.0f} s)")
    results = []
    if args.auto_select:
        modes = [AUTO_SELECT_MODE] if args.without_fixed else [*modes, AUTO_SELECT_MODE]
    for mode in modes:
        result = in_subprocess(__file__, mode)
        results.append(result)
        print(f"{mode:6s} FeatCal {result['seconds']:8.1f} s  floor {result['forward_floor_seconds']:7.1f} s  "
              f"x{result['ratio_to_floor']:5.2f}  peak RSS {result['peak_rss_bytes'] / gib:6.2f} GiB "
              f"= {result['peak_rss_bytes'] / result['model_bytes']:.2f} x one model ({result['model_bytes'] / gib:.2f} GiB); "
              f"{(result['peak_rss_bytes'] - result['rss_runtime_bytes']) / result['model_bytes']:.2f} x above the "
              f"runtime's {result['rss_runtime_bytes'] / gib:.2f} GiB"
              f"  statistics {result['statistics_bytes'] / 2**20:.0f} MiB"
              + (f"  peak device {result['peak_device_bytes'] / gib:.2f} GiB" if result["peak_device_bytes"] else ""))
        if result.get("auto_select"):
            print(f"       auto_select ({result['auto_select']} grid): {result['selection_seconds']:.1f} s of the "
                  f"{result['seconds']:.1f} s spent choosing")
        if result["phase_seconds"]:
            print("       " + ", ".join(f"{k} {v:.1f}s" for k, v in sorted(result["phase_seconds"].items(), key=lambda kv: -kv[1])))
        streams = result["streams"]
        budget = "unbounded" if streams["device_budget_bytes"] is None else f"{streams['device_budget_bytes'] / gib:.2f} GiB"
        print(f"       streams: budget {budget}, peak resident {streams['peak_resident_bytes'] / gib:.2f} GiB, "
              f"spilled ({streams['spill']}) {streams['peak_spilled_bytes'] / gib:.2f} GiB")
        if "save_seconds" in result:
            print(f"       saving ({args.max_shard_size} shards) {result['save_seconds']:.1f} s, RSS "
                  f"{result['save_rss_before_bytes'] / gib:.2f} -> "
                  f"{result['save_peak_rss_during_bytes'] / gib:.2f} GiB")
        else:
            print(f"       written block by block: {result['output_bytes'] / gib:.2f} GiB; upstream "
                  f"{result['upstream']} (passes before calibration {result['upstream_passes_seconds']:.1f} s)")
        print("       disk: " + ", ".join(f"{n} {b / gib:.2f} GiB" for n, b in result["disk_bytes"].items()))
    if args.auto_select and not args.without_fixed:
        fixed, chosen = results
        print(f"auto_select / fixed values, one invocation: peak RSS x{chosen['peak_rss_bytes'] / fixed['peak_rss_bytes']:.3f}, "
              f"statistics x{chosen['statistics_bytes'] / fixed['statistics_bytes']:.3f}, time +{chosen['seconds'] - fixed['seconds']:.0f} s "
              f"(x{chosen['seconds'] / fixed['seconds']:.2f})")
    summary = {**provenance(__file__, args.device), "arch": args.arch, "layers": args.layers, "tasks": args.tasks, "n": args.n,
               "seq_len": args.seq_len, "batch_size": args.batch_size, "dtype": args.dtype,
               "storage_dtype": args.storage_dtype, "accumulation_dtype": args.accumulation_dtype,
               "device": args.device, "upstream": args.upstream,
               "stream_device_bytes": args.stream_device_bytes, "stream_spill": args.stream_spill,
               "predicted": {"out_of_core_peak": predicted, "disk": disk}, "results": results}
    if args.json:
        write_json(args.json, summary)


if __name__ == "__main__":
    main()
