"""Named offline worlds, where they are cached, and building them atomically."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from .clip_world import CLIP8, CLIP_QUICK, build_clip_world
from .t5_world import T5_WORLD, build_t5_world
from .toy_clip import ToyCLIPSpec, build_toy_clip_world

ENV_DIR = "FEATCAL_WORLDS_DIR"


@dataclass(frozen=True)
class World:
    name: str
    description: str
    build: Callable[..., dict]  # (root, seed=None): the spec's own seed unless another is given
    modelpool: str
    taskpool: str
    packaged: bool = False  # pools shipped with this package; otherwise inside the world's own config/ folder
    # the same world served through FusionBench's OpenCLIP pool and task pool (worlds/openclip_serving.py)
    openclip: Optional[Tuple[str, str]] = None


TOY_SPEC = ToyCLIPSpec(
    num_tasks=4, num_classes=8, noise=0.6, train_per_class=32, test_per_class=16,
    finetune_steps=60, hidden_size=48, num_layers=3,
)

WORLDS: Dict[str, World] = {
    "toy": World(
        name="toy",
        description="synthetic 4-task toy CLIP (seconds to build; a smoke world, not the paper's regime)",
        build=lambda root, seed=None: build_toy_clip_world(root, _seeded(TOY_SPEC, seed)),
        modelpool="CLIPVisionModelPool/toy",
        taskpool="CLIPVisionModelTaskPool/toy",
    ),
    "clip": World(
        name="clip",
        description="8 real packaged image tasks, contrastively pretrained tiny CLIP, small-step experts",
        build=lambda root, seed=None: build_clip_world(root, _seeded(CLIP8, seed)),
        modelpool="CLIPVisionModelPool/offline_clip8",
        taskpool="CLIPVisionModelTaskPool/offline_clip8",
        packaged=True,
        openclip=("OpenCLIPVisionModelPool/offline_clip8", "OpenCLIPVisionModelTaskPool/offline_clip8"),
    ),
    "clip-quick": World(
        name="clip-quick",
        description="4 of the clip world's tasks at 32 x 32, shorter pretraining: the quick start's world (minutes to build)",
        build=lambda root, seed=None: build_clip_world(root, _seeded(CLIP_QUICK, seed)),
        modelpool="CLIPVisionModelPool/offline_clip_quick",
        taskpool="CLIPVisionModelTaskPool/offline_clip_quick",
        packaged=True,
        openclip=("OpenCLIPVisionModelPool/offline_clip_quick", "OpenCLIPVisionModelTaskPool/offline_clip_quick"),
    ),
    "t5": World(
        name="t5",
        description="5 real packaged text tasks (fortunes, word list), byte-level tiny FLAN-T5, fully fine-tuned experts",
        build=lambda root, seed=None: build_t5_world(root, _seeded(T5_WORLD, seed)),
        modelpool="Seq2SeqLMPool/offline_t5",
        taskpool="offline_t5_text_generation",
        packaged=True,
    ),
    "llm": World(
        name="llm",
        description="SmolLM2-135M-Instruct (dequantised GGUF) with math, code and instruction experts, scored by lm-eval tasks",
        build=lambda root, seed=None: _build_llm_world(root, seed),
        modelpool="CausalLMPool/offline_llm",
        taskpool="LMEvalHarnessTaskPool/offline_llm",
    ),
}


def _seeded(spec, seed: Optional[int]):
    """A world's spec with another seed (every build step is seeded from it): the same recipe, another world."""
    return spec if seed is None else replace(spec, seed=seed)


def _build_llm_world(root: Path, seed: Optional[int] = None) -> dict:
    # imported when built: the LLM world's modules pull in lm-eval and the causal-LM family
    from .llm_world import LLM_WORLD, build_llm_world

    return build_llm_world(root, _seeded(LLM_WORLD, seed))


def worlds_dir() -> Path:
    default = Path.home() / ".cache" / "featcal-fusionbench" / "worlds"
    return Path(os.environ.get(ENV_DIR, default)).expanduser().resolve()


def get_world(name: str) -> World:
    if name not in WORLDS:
        raise KeyError(f"unknown world {name!r}; known worlds: {', '.join(WORLDS)}")
    return WORLDS[name]


def world_path(name: str) -> Path:
    get_world(name)
    return worlds_dir() / name


def is_built(name: str) -> bool:
    return (world_path(name) / "world.json").is_file()


def world_meta(name: str, folder: Optional[Path] = None) -> dict:
    """A built world's ``world.json`` (of the registered world, or of the one in ``folder``); a world that is not
    built is named with the command that builds it."""
    import json

    if folder is None and not is_built(name):
        raise SystemExit(f"the {name!r} world is not built; run: featcal-world build {name}")
    return json.loads(((folder or world_path(name)) / "world.json").read_text())


def world_fingerprint(name: str) -> Optional[str]:
    """The first 12 hex digits of the sha1 of the built world's ``world.json`` (None when it is not built).

    Results carry it because a same-seed rebuild on another machine is not bit-identical: it says which build a
    number was measured on.
    """
    return build_fingerprint(world_path(name))


def build_fingerprint(root: Path) -> Optional[str]:
    """``world_fingerprint`` of the world built at ``root`` (a registered world or a reduced variant)."""
    path = Path(root) / "world.json"
    return hashlib.sha1(path.read_bytes()).hexdigest()[:12] if path.is_file() else None


def pools(name: str, openclip: bool = False) -> Tuple[str, str]:
    """The (modelpool, taskpool) config names of a world; ``openclip``: those serving it as an OpenCLIP pool."""
    world = get_world(name)
    if not openclip:
        return world.modelpool, world.taskpool
    if world.openclip is None:
        served = ", ".join(n for n, w in WORLDS.items() if w.openclip)
        raise KeyError(f"world {name!r} has no OpenCLIP pools; worlds served as OpenCLIP pools: {served}")
    return world.openclip


def fusion_bench_args(name: str, openclip: bool = False) -> List[str]:
    """The `fusion_bench` arguments that select a world's pools. A world whose configs live in its own folder adds
    that folder by a ``hydra.searchpath`` override rather than ``--config-dir``, which works only before every
    override: these arguments go anywhere on the command line."""
    world = get_world(name)
    modelpool, taskpool = pools(name, openclip)
    search = [] if world.packaged else [f"hydra.searchpath=[file://{world_path(name) / 'config'}]"]
    return [*search, f"modelpool={modelpool}", f"taskpool={taskpool}"]


def compose_cli(overrides: List[str]):
    """The config the `fusion_bench` CLI composes with these overrides (the installed search-path plugins and their
    configs' ``defaults:`` included), unresolved."""
    import fusion_bench_config
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from .resolvers import register_resolvers

    register_resolvers()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=list(fusion_bench_config.__path__)[0], version_base=None):
            return compose("fabric_model_fusion", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


def compose_pools(modelpool: str, taskpool: str):
    """(modelpool, taskpool) configs as the `fusion_bench` CLI composes them, unresolved."""
    cfg = compose_cli([f"modelpool={modelpool}", f"taskpool={taskpool}"])
    return cfg.modelpool, cfg.taskpool


def pool_configs(name: str, modelpool: Optional[str] = None, taskpool: Optional[str] = None):
    """The (modelpool, taskpool) configs of a world, unresolved, as the CLI would compose them."""
    from omegaconf import OmegaConf

    from .resolvers import register_resolvers

    world = get_world(name)
    modelpool, taskpool = modelpool or world.modelpool, taskpool or world.taskpool
    if world.packaged:
        return compose_pools(modelpool, taskpool)
    register_resolvers()
    # a world's own configs are self-contained files (written by its build, no `defaults:`)
    config = world_path(name) / "config"
    return tuple(OmegaConf.load(config / kind / f"{choice}.yaml")
                 for kind, choice in (("modelpool", modelpool), ("taskpool", taskpool)))


def build_world(name: str, force: bool = False, seed: Optional[int] = None) -> Path:
    """Build into a scratch folder and rename it into place, so no half-built world is ever visible. ``seed``:
    build the world's recipe with another seed than its own (a world to check a result on that it was not tuned
    on; give it its own ``FEATCAL_WORLDS_DIR``, since the world keeps its name)."""
    world = get_world(name)
    final = world_path(name)
    if is_built(name) and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = final.parent / f".{name}.partial-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    # `kill` (SIGTERM) would end the process without running `finally`: raise instead, so the scratch folder goes
    on_terminate = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
    if on_terminate is not None:
        signal.signal(signal.SIGTERM, _terminated)
    try:
        # Paths inside the world's YAMLs must point at the final location.
        world.build(scratch) if seed is None else world.build(scratch, seed=seed)
        for yaml_file in (scratch / "config").rglob("*.yaml"):
            yaml_file.write_text(yaml_file.read_text().replace(str(scratch.resolve()), str(final)))
        if final.exists():
            shutil.rmtree(final)
        scratch.rename(final)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if on_terminate is not None:
            signal.signal(signal.SIGTERM, on_terminate)
    return final


def _terminated(signum, frame):
    raise SystemExit(128 + signum)
