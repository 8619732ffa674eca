#!/usr/bin/env python3
"""Merge the offline LLM world's experts with mergekit, as its users run it (a YAML and `mergekit-yaml`), so that
FeatCal can calibrate mergekit's output. Stdlib only: mergekit lives in its own venv
(bash experiments/scripts/mergekit_setup.sh) because it needs transformers 5 and .venv pins 4.x.

    python3 experiments/scripts/mergekit_merge.py --method ties --out /tmp/llm-ties

Writes <out>.mergekit.yaml beside <out>; mergekit copies it verbatim into <out>/mergekit_config.yml (and a README.md).
Citations are to mergekit 0.1.5 as installed (site-packages/mergekit/...)."""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXPERTS = ("math", "code", "instruction")
WORLDS = Path(os.environ.get("FEATCAL_WORLDS_DIR", "~/.cache/featcal-fusionbench/worlds")).expanduser()


def fail(msg: str):
    sys.exit(f"mergekit_merge: {msg}")


def config_yaml(method: str, base: Path, experts: list, density: float, weight: float, lam: float) -> str:
    # Keys: MergeConfiguration in config.py:106-120 (models, merge_method, base_model, dtype, out_dtype); per-model
    # `parameters` in config.py:82-84. weight has no default and density defaults to 1.0
    # (merge_methods/generalized_task_arithmetic.py:53-63); task_arithmetic never sparsifies
    # (merge_methods/registry.py:60-68), so density is left out there.
    # Paths as JSON strings: valid YAML double-quoted scalars, whatever the path holds.
    params = f"weight: {weight}" + ("" if method == "task_arithmetic" else f", density: {density}")
    lines = [f"merge_method: {method}", f"base_model: {json.dumps(str(base))}", "models:"]
    lines += [f"  - model: {json.dumps(str(e))}\n    parameters: {{{params}}}" for e in experts]
    # dtype: what the inputs are cast to for the arithmetic (plan.py:206-209); out_dtype: what is saved (plan.py:357)
    # and the config's dtype (merge.py:297-300).
    lines += ["dtype: float32", "out_dtype: float32"]
    if lam != 1.0:  # a global parameter (config.py:120): scales the mixed delta (generalized_task_arithmetic.py:143)
        lines.append(f"parameters: {{lambda: {lam}}}")
    return "\n".join(lines) + "\n"


def restore_rope_theta(config_json: Path):
    """mergekit saves the config with transformers 5, which moves rope_theta (and rope_scaling) into rope_parameters.
    transformers 4.x ignores rope_parameters and silently falls back to its default rope_theta (10000; the world's
    SmolLM2 base has 100000), with no warning. Writing the 4.x keys back beside rope_parameters serves both."""
    cfg = json.loads(config_json.read_text())
    rope = cfg.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_theta" in cfg or "rope_theta" not in rope:
        return
    cfg["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    config_json.write_text(json.dumps(cfg, indent=2) + "\n")
    print(f"{config_json}: rope_theta {cfg['rope_theta']} (and rope_scaling {cfg.get('rope_scaling')}) written back "
          "for transformers 4.x", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=Path, default=WORLDS / "llm", help="default $FEATCAL_WORLDS_DIR/llm")
    p.add_argument("--method", choices=("ties", "dare_ties", "task_arithmetic"), default="ties")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--density", type=float, default=0.5, help="kept fraction per tensor (ties, dare_ties)")
    p.add_argument("--weight", type=float, default=1.0, help="per expert; ties divides by the agreeing weights' sum")
    p.add_argument("--lambda", dest="lam", type=float, default=1.0,
                   help="scales the merged task vector; with ties the only scale that acts when the weights are equal")
    p.add_argument("--venv", type=Path, default=Path(os.environ.get("MERGEKIT_VENV", ".venv-mergekit")),
                   help="relative to the repository root, as mergekit_setup.sh makes it")
    # Bytes per shard (tensor_writer.py:73-79; options.py's help says parameters): small, so even the world is sharded
    # with an index, as a large merge is.
    p.add_argument("--out-shard-size", default="100M")
    p.add_argument("--seed", type=int, default=0, help="dare_ties drops at random (sparsify.py); options.py:54-55")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out (stale shards would mix in)")
    a = p.parse_args()

    world = a.world.expanduser().resolve()
    models = [world / "pretrained"] + [world / "experts" / e for e in EXPERTS]
    missing = [str(m) for m in models if not (m / "config.json").is_file()]
    if missing:
        fail(f"no model at {', '.join(missing)}; build the world first: featcal-world build llm")
    # ModelReference reads '+' as a LoRA and '@' as a revision (common.py:66-75, 194-201).
    if any(c in str(m) for m in models for c in "+@"):
        fail(f"mergekit cannot take a path holding '+' or '@': {world}")
    venv = a.venv if a.venv.is_absolute() else REPO / a.venv
    mergekit_yaml = venv / "bin" / "mergekit-yaml"
    if not os.access(mergekit_yaml, os.X_OK):
        fail(f"no {mergekit_yaml}; make the venv first: bash experiments/scripts/mergekit_setup.sh")

    out = a.out.expanduser().resolve()
    if out.exists() and any(out.iterdir()):
        if not a.force:
            fail(f"{out} is not empty (pass --force to replace it)")
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    yaml_path = out.parent / f"{out.name}.mergekit.yaml"
    yaml_path.write_text(config_yaml(a.method, models[0], models[1:], a.density, a.weight, a.lam))

    # Flags from options.py:18-42 (bools as --x/--no-x, options.py:183-187). --copy-tokenizer is the default already
    # (options.py:28): copies the base's tokenizer files (merge.py:241-273). --lazy-unpickle only matters for pickled
    # .bin inputs; safetensors are always opened lazily (io/loader.py:34-38). No --cuda: mergekit then computes on CPU
    # (options.py:74-79). The output streams to disk a shard at a time (plan.py:332-362, io/tensor_writer.py:67-83).
    cmd = [str(mergekit_yaml), str(yaml_path), str(out), "--copy-tokenizer", "--lazy-unpickle",
           "--out-shard-size", a.out_shard_size, "--random-seed", str(a.seed)]
    print("+ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    start = time.perf_counter()
    rc = subprocess.call(cmd)
    if rc == 0:
        restore_rope_theta(out / "config.json")
    print(f"mergekit-yaml exited {rc} after {time.perf_counter() - start:.1f} s; config {yaml_path}", flush=True)
    sys.exit(rc)


if __name__ == "__main__":
    main()
