"""The paper's Tables 1, 2, 3, 4, App. I (Tables 7-11) and Table 12 as data: every row as one or more `fusion_bench` commands.

A *setting* is a model pool and a task pool (CLIP-ViT-B/32 on TA8, FLAN-T5-base on GLUE, the offline CLIP world,
...). A *run* is one `fusion_bench` command in one setting; its identity ``<setting>/<method>[/<task>]`` names its
folder under the runs directory, so a run that two tables share (Table 2's averages are App. I's rows) runs once.
A *row* is one printed row of one table: one run, or one run per task for the per-task fine-tuned reference.

Methods: ``pretrained`` (``method=dummy``: the pool's ``_pretrained_``), ``finetuned`` (each expert alone on its
own task: ``method=dummy`` with ``_pretrained_`` pointed at the expert's pool entry), the upstream mergers
``simple_average``, ``ta``, ``adamerging``, ``wudi`` (FusionBench's own configs; each saves its merged model with
``merged_model_save_path``, AdaMerging also its merging weights), and ``<upstream>+<calibrator>`` for the
calibrators ``surgery``, ``probsurgery``, ``featcal`` (this plugin's configs, reading the saved merged model with
``method.merged_model_path``). ``mtl`` (Traditional MTL) is a paper number only. Table 12 (the sample budget)
runs each calibrator after Task Arithmetic once per budget n and seed, ``<setting>/ta+<calibrator>/n<n>-seed<seed>``,
all reading the one Task Arithmetic run that Table 1 reads too.

Nothing here imports torch or FusionBench: listing the commands is cheap.
"""

from __future__ import annotations

import fnmatch
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from featcal_fusionbench.integration.pool_names import PAPER_POOLS

from .paper import PAPER

WORLDS = ("hub", "offline")
UPSTREAMS = ("simple_average", "ta", "adamerging", "wudi")
CALIBRATORS = ("surgery", "probsurgery", "featcal")
REFERENCES = ("pretrained", "finetuned")

LABELS = {
    "pretrained": "Pre-trained",
    "finetuned": "Fine-tuned (STL)",
    "mtl": "Traditional MTL",
    "simple_average": "Simple Averaging",
    "ta": "Task Arithmetic",
    "adamerging": "AdaMerging",
    "wudi": "WUDI-Merging",
    "surgery": "w/ Surgery",
    "probsurgery": "w/ ProbSurgery",
    "featcal": "w/ FeatCal",
}

TA8 = ("sun397", "stanford-cars", "resisc45", "eurosat", "svhn", "gtsrb", "mnist", "dtd")
TALL14 = TA8 + ("oxford_flowers102", "pcam", "fer2013", "oxford-iiit-pet", "stl10", "cifar100")
TALL20 = TALL14 + ("cifar10", "food101", "fashion_mnist", "emnist_letters", "kmnist", "rendered-sst2")
LLM_WORLD_EXPERTS = {"llm_math": "math", "llm_code": "code", "llm_instruction": "instruction"}
GLUE = tuple(f"glue-{t}" for t in ("cola", "mnli", "mrpc", "qnli", "qqp", "rte", "sst2", "stsb"))
# Table 4's columns as lm-eval tasks, each with the MergeBench expert of its domain (None: no expert; the paper's
# fine-tuned row prints the base there), as config/taskpool/LMEvalHarnessTaskPool/mergebench_table4.yaml names them
MERGEBENCH_EXPERTS = {"math500_boxed": "math", "gsm8k_cot": "math", "evalplus_humaneval_chat": "coding",
                      "evalplus_mbpp_chat": "coding", "ifeval": "instruction", "arc_challenge_chat_lines": None}

# FusionBench's own upstream merger configs, with the values the paper's recipes use written out.
UPSTREAM_METHODS = {
    "simple_average": ("method=simple_average",),
    "ta": ("method=task_arithmetic", "method.scaling_factor=0.3"),
    "adamerging": ("method=adamerging/clip",),  # layer-wise, FusionBench's recipe; TTA on the test images
    "wudi": ("method=wudi/wudi", "method.iter_num=400"),
}
# FusionBench's Seq2SeqLMPool saves a state dict (torch.save); this subclass saves with save_pretrained, which
# is what `method.merged_model_path` loads.
SEQ2SEQ_SAVING_POOL = "featcal_experiments.reproduce.pools.Seq2SeqLMPoolSavingPretrained"
# MergeBench's Llama-3.2-3B experts have a larger vocabulary than their base: Task Arithmetic over the layers only.
CAUSAL_LM_UPSTREAMS = {
    "ta": ("method=linear/task_arithmetic_for_causallm", "method.scaling_factor=0.3", "method.merge_backbone=true"),
}


@dataclass(frozen=True)
class Setting:
    key: str
    title: str
    family: str  # "clip", "openclip", "t5" or "causal_lm"
    modelpool: str
    taskpool: str
    tasks: Tuple[str, ...] = ()
    taskpool_overrides: Tuple[str, ...] = ()  # every run
    single_task_taskpool: Optional[str] = None  # "{task}" pattern of a FusionBench one-task task pool
    single_task_overrides: Tuple[str, ...] = ()  # for that task pool (instead of taskpool_overrides)
    calibrator_configs: Dict[str, str] = field(default_factory=dict)  # calibrator -> config for upstream "{u}"
    calibrator_overrides: Tuple[str, ...] = ()
    upstream_overrides: Dict[str, Tuple[str, ...]] = field(default_factory=dict)
    world: Optional[str] = None  # offline world name
    offline_env: bool = False  # run with HF_*_OFFLINE=1
    # tasks scored by Spearman's rho: a text task pool cut down to one task must list only that task's, if any
    regression_tasks: Tuple[str, ...] = ()
    upstream_methods: Optional[Dict[str, Tuple[str, ...]]] = None  # default UPSTREAM_METHODS
    # task -> the expert that scores it in the fine-tuned row (None: the base), where one expert covers several
    # tasks (MergeBench's domains); without it, each task's expert is the pool entry of the task's name
    task_experts: Optional[Dict[str, Optional[str]]] = None
    # (n, seed) of the calibrator rows outside a budget table, where a budget table runs this setting too: those
    # rows are then that table's runs (one run, not two with the same n and seed)
    budget: Optional[Tuple[int, int]] = None
    # upstream -> why it cannot run in this setting (its rows and the calibrators' after it are skipped)
    unavailable: Dict[str, str] = field(default_factory=dict)

    def calibrator_config(self, calibrator: str, upstream: str) -> str:
        return self.calibrator_configs[calibrator].format(u=upstream)


CLIP_CALIBRATORS = {c: f"{c}/clip_{{u}}" for c in CALIBRATORS}
OPENCLIP_CALIBRATORS = {c: f"{c}/openclip_{{u}}" for c in CALIBRATORS}
NO_OPENCLIP_ADAMERGING = {"adamerging": "FusionBench's layer-wise AdaMerging (adamerging/clip) runs on the HF CLIP "
                                        "pool only: it needs that pool's zero-shot heads"}
T5_CALIBRATORS = {"surgery": "surgery/flan_t5_ta", "probsurgery": "probsurgery/flan_t5_ta", "featcal": "featcal/flan_t5_ta"}
L14 = ("taskpool.base_model=openai/clip-vit-large-patch14",)


def _clip(key, title, arch, suite, tasks):
    pool = PAPER_POOLS[f"clip-vit-{arch}_{suite}"]
    return Setting(
        key=key, title=title, family="clip", modelpool=pool.modelpool, taskpool=pool.taskpool,
        tasks=tasks, taskpool_overrides=pool.taskpool_overrides,
        single_task_taskpool="CLIPVisionModelTaskPool/clip-vit-single-task_{task}",
        single_task_overrides=L14 if arch == "large-patch14" else (),
        calibrator_configs=CLIP_CALIBRATORS,
    )


HUB_SETTINGS: Dict[str, Setting] = {s.key: s for s in [
    _clip("b32-8", "CLIP-ViT-B/32, 8 tasks (TA8)", "base-patch32", "TA8", TA8),
    _clip("b32-14", "CLIP-ViT-B/32, 14 tasks (TALL14)", "base-patch32", "TALL14", TALL14),
    _clip("b32-20", "CLIP-ViT-B/32, 20 tasks (TALL20)", "base-patch32", "TALL20", TALL20),
    # FusionBench has an L/14 variant of the TA8 task pool only; TALL14/20 take the L/14 text tower by override
    # (the single-task task pools of the fine-tuned rows too).
    _clip("l14-8", "CLIP-ViT-L/14, 8 tasks (TA8)", "large-patch14", "TA8", TA8),
    _clip("l14-14", "CLIP-ViT-L/14, 14 tasks (TALL14)", "large-patch14", "TALL14", TALL14),
    _clip("l14-20", "CLIP-ViT-L/14, 20 tasks (TALL20)", "large-patch14", "TALL20", TALL20),
    # The task-vector checkpoints themselves (OpenCLIP), through FusionBench's OpenCLIP pools
    Setting(
        key="openclip-b32-8", title="OpenCLIP ViT-B/32, 8 tasks (TA8): the task-vector checkpoints", family="openclip",
        modelpool="OpenCLIPVisionModelPool/ViT-B-32_TA8_quickgelu",
        taskpool="OpenCLIPVisionModelTaskPool/ViT-B-32_TA8_active_task",
        tasks=TA8, calibrator_configs=OPENCLIP_CALIBRATORS, unavailable=NO_OPENCLIP_ADAMERGING,
    ),
    Setting(
        key="t5-base", title="FLAN-T5-base, 8 GLUE tasks (full fine-tuned experts)", family="t5",
        modelpool=PAPER_POOLS["flan-t5-base_glue"].modelpool, taskpool=PAPER_POOLS["flan-t5-base_glue"].taskpool,
        tasks=GLUE, calibrator_configs=T5_CALIBRATORS, regression_tasks=("glue-stsb",),
    ),
    Setting(
        key="t5-large", title="FLAN-T5-large, 8 GLUE tasks (LoRA-16 experts)", family="t5",
        modelpool=PAPER_POOLS["flan-t5-large_glue_lora16"].modelpool,
        taskpool=PAPER_POOLS["flan-t5-large_glue_lora16"].taskpool,
        tasks=GLUE, calibrator_configs={**T5_CALIBRATORS, "featcal": "featcal/flan_t5_large_ta"},
        regression_tasks=("glue-stsb",),
    ),
    *(Setting(
        key=key, title=f"{model}, MergeBench coding / math / instruction experts", family="causal_lm",
        modelpool=f"CausalLMPool/mergebench_table4/{model}", taskpool="LMEvalHarnessTaskPool/mergebench_table4",
        tasks=tuple(MERGEBENCH_EXPERTS), task_experts=MERGEBENCH_EXPERTS, upstream_methods=CAUSAL_LM_UPSTREAMS,
        calibrator_configs={c: f"{c}/mergebench_{config}_{{u}}" for c in CALIBRATORS},
    ) for key, model, config in (("llama3.2-3b", "Llama-3.2-3B-Instruct", "llama3.2_3b"),
                                 ("llama3.1-8b", "Llama-3.1-8B-Instruct", "llama3.1_8b"))),
]}

OFFLINE_SETTINGS: Dict[str, Setting] = {s.key: s for s in [
    Setting(
        key="offline-clip8", title="offline CLIP world `clip` (tiny CLIP, 8 packaged image tasks)", family="clip",
        modelpool="CLIPVisionModelPool/offline_clip8", taskpool="CLIPVisionModelTaskPool/offline_clip8",
        calibrator_configs=CLIP_CALIBRATORS,
        # AdaMerging's 8 loader workers only add process start-up on small CPU machines
        upstream_overrides={"adamerging": ("method.num_workers=0",)},
        world="clip", offline_env=True,
    ),
    Setting(
        key="offline-openclip8", title="offline CLIP world `clip` served as OpenCLIP models (converted checkpoints)",
        family="openclip", modelpool="OpenCLIPVisionModelPool/offline_clip8",
        taskpool="OpenCLIPVisionModelTaskPool/offline_clip8",
        calibrator_configs=OPENCLIP_CALIBRATORS, unavailable=NO_OPENCLIP_ADAMERGING,
        world="clip", offline_env=True,
    ),
    Setting(
        key="offline-t5", title="offline text world `t5` (tiny FLAN-T5-shaped model, packaged text tasks)", family="t5",
        modelpool="Seq2SeqLMPool/offline_t5", taskpool="offline_t5_text_generation",
        calibrator_configs=T5_CALIBRATORS,
        # the paper's FLAN-T5 calibrator settings; calibration examples from the pool's own train splits
        calibrator_overrides=("method.calibration_datasets=null",),
        world="t5", offline_env=True,
        regression_tasks=("wordcount",),  # text_sources.REGRESSION_TASKS (not imported: it would load the worlds)
    ),
    # Table 4's 3B setting in small: the calibrators' causal-LM configs hold the paper's 3B values. Its pool
    # configs live in the built world's own folder (a hydra.searchpath argument, added by the catalog).
    Setting(
        key="offline-llm", title="offline LLM world `llm` (SmolLM2-135M-Instruct; math, code and instruction experts)",
        family="causal_lm", modelpool="CausalLMPool/offline_llm", taskpool="LMEvalHarnessTaskPool/offline_llm",
        tasks=tuple(LLM_WORLD_EXPERTS), task_experts=LLM_WORLD_EXPERTS, upstream_methods=CAUSAL_LM_UPSTREAMS,
        calibrator_configs={c: f"{c}/causal_lm_{{u}}" for c in CALIBRATORS},
        world="llm", offline_env=True, budget=(32, 42),
    ),
]}

NO_OFFLINE = ("offline worlds exist only for an 8-task CLIP (`clip`: Tables 1 and 12), a FLAN-T5-base-shaped "
              "text model (`t5`: Table 3's base rows) and a small Llama (`llm`: Table 4's 3B rows and Table 12-llm)")


@dataclass(frozen=True)
class Group:
    """A block of a table: its rows' setting in each world (None: not available there)."""
    key: str  # "" for one-block tables; the column (Table 2) or the block (Table 3) otherwise
    title: str
    hub: Optional[str]
    offline: Optional[str]
    offline_missing: str = ""
    hub_missing: str = ""


@dataclass(frozen=True)
class TableSpec:
    number: str
    title: str
    groups: Tuple[Group, ...]
    methods: Tuple[str, ...]
    layout: str = "tasks"  # "tasks": per-task columns and Avg. per block; "settings": one column per group (Table 2);
    # "budget": one column per calibration budget n, each cell the mean and standard deviation over seeds (Table 12)
    budgets: Tuple[int, ...] = ()
    seeds: Tuple[int, ...] = ()


def _merger_rows(upstreams=UPSTREAMS):
    return tuple(m for u in upstreams for m in (u, *(f"{u}+{c}" for c in CALIBRATORS)))


def _single(number, hub, offline=None, mtl=False, why=""):
    title = PAPER[number]["caption"]
    return TableSpec(
        number, title, (Group("", HUB_SETTINGS[hub].title, hub, offline, why),),
        ("pretrained", "finetuned", *(("mtl",) if mtl else ()), *_merger_rows()),
    )


TABLES: Dict[str, TableSpec] = {
    "1": _single("1", "b32-8", "offline-clip8", mtl=True),
    "2": TableSpec(
        "2", PAPER["2"]["caption"],
        tuple(Group(k, HUB_SETTINGS[k].title, k, None, f"no offline world for {HUB_SETTINGS[k].title}; {NO_OFFLINE}")
              for k in PAPER["2"]["columns"]),
        ("pretrained", "finetuned", *_merger_rows(("ta", "wudi"))),
        layout="settings",
    ),
    "3": TableSpec(
        "3", PAPER["3"]["caption"],
        (Group("base", "Base", "t5-base", "offline-t5"),
         Group("large", "Large", "t5-large", None, f"no offline FLAN-T5-large (LoRA) world; {NO_OFFLINE}")),
        ("pretrained", "finetuned", *_merger_rows(("ta",))),
    ),
    "4": TableSpec(
        "4", PAPER["4"]["caption"],
        (Group("llama3.2-3b", HUB_SETTINGS["llama3.2-3b"].title, "llama3.2-3b", "offline-llm"),
         Group("llama3.1-8b", HUB_SETTINGS["llama3.1-8b"].title, "llama3.1-8b", None,
               f"no offline world for {HUB_SETTINGS['llama3.1-8b'].title}; {NO_OFFLINE}")),
        ("pretrained", "finetuned", *_merger_rows(("ta",))),
    ),
    "7": _single("7", "l14-8", mtl=True, why=f"no offline CLIP-ViT-L/14 world; {NO_OFFLINE}"),
    "8": _single("8", "b32-14", why=f"no offline 14-task world; {NO_OFFLINE}"),
    "9": _single("9", "l14-14", why=f"no offline 14-task CLIP-ViT-L/14 world; {NO_OFFLINE}"),
    "10": _single("10", "b32-20", why=f"no offline 20-task world; {NO_OFFLINE}"),
    "11": _single("11", "l14-20", why=f"no offline 20-task CLIP-ViT-L/14 world; {NO_OFFLINE}"),
    # App. K: exactly n examples per task for every calibrator, seeds 42, 43 and 44
    "12": TableSpec(
        "12", PAPER["12"]["caption"], (Group("", HUB_SETTINGS["b32-8"].title, "b32-8", "offline-clip8"),),
        tuple(f"ta+{c}" for c in CALIBRATORS), layout="budget",
        budgets=tuple(int(c[1:]) for c in PAPER["12"]["columns"]), seeds=(42, 43, 44),
    ),
    # Not a table of the paper: Table 1's rows on the OpenCLIP task-vector checkpoints (FusionBench's OpenCLIP pools),
    # offline on the same world as Table 1 served as OpenCLIP models
    "1-openclip": TableSpec(
        "1-openclip", "Table 1's rows on OpenCLIP models: the task-vector checkpoints (ViT-B/32, TA8) through "
        "FusionBench's OpenCLIP pool and task pool; offline, the CLIP world's checkpoints converted to OpenCLIP.",
        (Group("", HUB_SETTINGS["openclip-b32-8"].title, "openclip-b32-8", "offline-openclip8"),),
        ("pretrained", "finetuned", *_merger_rows()),
    ),
    # Not a table of the paper: its Table 12 for the offline LLM world (the paper has no LLM sample budget)
    "12-llm": TableSpec(
        "12-llm", "Sample budget on the offline LLM world: each calibrator after Task Arithmetic (0.3) at n examples "
        "per task, three seeds; mean and standard deviation of the average score, and each task's mean.",
        (Group("", OFFLINE_SETTINGS["offline-llm"].title, None, "offline-llm",
               hub_missing="the paper's sample budget is CLIP-ViT-B/32's (Table 12); this table is the offline LLM "
                           "world's (--world offline)"),),
        tuple(f"ta+{c}" for c in CALIBRATORS), layout="budget", budgets=(8, 32, 128), seeds=(42, 43, 44),
    ),
}
TABLE_ALIASES = {"I": ("7", "8", "9", "10", "11"), "all": tuple(TABLES)}


class CatalogError(ValueError):
    """Bad input: an unknown table, row or world."""


def parse_tables(spec: Sequence[str]) -> List[str]:
    """``["1", "2"]``, ``["1,3"]``, ``["I"]`` (App. I: Tables 7-11) or ``["all"]`` -> table numbers, in order."""
    out: List[str] = []
    for item in spec:
        for part in str(item).split(","):
            part = part.strip()
            if not part:
                continue
            numbers = TABLE_ALIASES.get(part) or TABLE_ALIASES.get(part.upper()) or ((part,) if part in TABLES else None)
            if numbers is None:
                raise CatalogError(
                    f"unknown table {part!r}; known: {', '.join(TABLES)}, I (App. I: Tables 7-11), all")
            out.extend(n for n in numbers if n not in out)
    if not out:
        raise CatalogError("no table given")
    return out


@dataclass(frozen=True)
class Run:
    """One `fusion_bench` command; ``args`` are everything after ``fusion_bench``."""
    id: str  # <setting>/<method>[/<task>]; also its folder under the runs directory
    setting: str
    method: str
    kind: str  # "reference", "upstream" or "calibrator"
    args: Tuple[str, ...]
    task: Optional[str] = None
    depends: Tuple[str, ...] = ()  # runs whose saved outputs this one reads
    saves: Tuple[str, ...] = ()  # outputs, relative to its folder, that later runs read
    offline_env: bool = False
    budget: Optional[Tuple[int, int]] = None  # (n, seed) of a Table 12 run
    columns: Tuple[str, ...] = ()  # the fine-tuned row's columns this run scores, where not just its task

    @property
    def provides(self) -> Tuple[str, ...]:
        return self.columns or ((self.task,) if self.task else ())

    @property
    def part(self) -> Optional[str]:
        """What tells the runs of one row apart: the task of a per-task run, the budget of a Table 12 run."""
        if self.budget:
            return f"n{self.budget[0]}-seed{self.budget[1]}"
        return self.task

    @property
    def command(self) -> str:
        return "fusion_bench " + shlex.join(self.args)

    @property
    def calibrator(self) -> Optional[str]:
        return self.method.split("+", 1)[1] if "+" in self.method else None


@dataclass(frozen=True)
class Row:
    table: str
    id: str  # the row's id within its table, as --rows takes it
    group: str
    method: str
    label: str
    setting: Optional[str]  # the setting it runs in, in this world; None: not run
    paper_key: Optional[str]  # its key in PAPER[table]["rows"] (hub setting / method)
    runs: Tuple[Run, ...] = ()
    skip: Optional[str] = None  # why it is not run


def method_label(method: str) -> str:
    return LABELS[method.split("+", 1)[1]] if "+" in method else LABELS[method]


def _config_root() -> Path:
    import featcal_experiments_config

    return Path(list(featcal_experiments_config.__path__)[0])


def offline_tasks(setting: Setting) -> Tuple[Tuple[str, ...], Optional[str]]:
    """The task names of an offline setting, from its packaged pool config (what Hydra composes); or why not."""
    import yaml

    path = _config_root() / "modelpool" / f"{setting.modelpool}.yaml"
    if not path.is_file():
        return (), f"the offline world's pool config {setting.modelpool} is not installed ({path} is missing)"
    models = (yaml.safe_load(path.read_text()) or {}).get("models") or {}
    return tuple(k for k in models if not (k.startswith("_") and k.endswith("_"))), None


def world_unavailable(setting: Setting) -> Optional[str]:
    """Why an offline setting cannot run now (its world is not built), or None."""
    if setting.world is None:
        return None
    from ..worlds.registry import is_built

    try:
        built = is_built(setting.world)
    except KeyError as error:
        return str(error)
    if not built:
        return f"the offline world {setting.world!r} is not built: run `featcal-world build {setting.world}`"
    return None


def world_config_args(setting: Setting) -> Tuple[str, ...]:
    """The search-path argument of an offline world whose pool configs live in its own folder (the LLM world's)."""
    if setting.world is None:
        return ()
    from ..worlds.registry import fusion_bench_args

    return tuple(a for a in fusion_bench_args(setting.world) if a.startswith("hydra.searchpath="))


def split_calibrator(override: str) -> Tuple[Optional[str], str]:
    """``surgery:method.x=1`` -> ("surgery", "method.x=1"): an override for one calibrator; no prefix -> (None, it)."""
    key = override.split("=", 1)[0]
    if ":" in key:
        target, hydra = override.split(":", 1)
        return target, hydra
    return None, override


class Catalog:
    """The rows of the paper's tables in one world, with their commands for one runs directory."""

    def __init__(self, world: str = "hub", runs_dir: Path = Path("outputs/reproduce/hub"),
                 calibrator_overrides: Sequence[str] = (), all_overrides: Sequence[str] = ()):
        if world not in WORLDS:
            raise CatalogError(f"unknown world {world!r}; known: {', '.join(WORLDS)}")
        for override, prefix_allowed in [(o, True) for o in calibrator_overrides] + [(o, False) for o in all_overrides]:
            target, hydra = split_calibrator(override)
            if target is not None and not (prefix_allowed and target in CALIBRATORS):
                raise CatalogError(f"{override!r}: a CALIBRATOR: prefix names one of {', '.join(CALIBRATORS)} and "
                                   "applies to calibrator overrides only")
            if not (hydra.startswith("~") or ("=" in hydra and not hydra.startswith("="))):
                raise CatalogError(f"an override must be KEY=VALUE or ~KEY (Hydra syntax), got {override!r}")
        self.world = world
        self.runs_dir = Path(runs_dir).expanduser().resolve()
        self.calibrator_overrides = tuple(calibrator_overrides)
        self.all_overrides = tuple(all_overrides)
        self.settings = HUB_SETTINGS if world == "hub" else OFFLINE_SETTINGS
        self._tasks: Dict[str, Tuple[Tuple[str, ...], Optional[str]]] = {}

    # -- settings ---------------------------------------------------------------------------------------------
    def tasks(self, key: str) -> Tuple[Tuple[str, ...], Optional[str]]:
        if key not in self._tasks:
            setting = self.settings[key]
            self._tasks[key] = (setting.tasks, None) if setting.tasks else offline_tasks(setting)
        return self._tasks[key]

    def run_dir(self, run_id: str) -> Path:
        return self.runs_dir / run_id

    # -- runs -------------------------------------------------------------------------------------------------
    def _args(self, setting: Setting, run_id: str, head: Sequence[str], taskpool: Sequence[str],
              pool: Sequence[str] = (), tail: Sequence[str] = (), single_task: bool = False) -> Tuple[str, ...]:
        """method=... and its options, modelpool=... and its, taskpool=... and its, outputs, the folder."""
        taskpool_overrides = setting.single_task_overrides if single_task else setting.taskpool_overrides
        return (*head, *world_config_args(setting), f"modelpool={setting.modelpool}", *pool, *taskpool,
                *taskpool_overrides, *tail, *self.all_overrides, f"path.log_dir={self.run_dir(run_id)}")

    def upstream_run(self, key: str, upstream: str) -> Run:
        setting = self.settings[key]
        run_id = f"{key}/{upstream}"
        folder = self.run_dir(run_id)
        head = list((setting.upstream_methods or UPSTREAM_METHODS)[upstream])
        head += list(setting.upstream_overrides.get(upstream, ()))
        saves = ["merged"]
        if upstream == "adamerging":
            head.append(f"method.save_merging_weights={folder / 'merging_weights.pt'}")
            saves.append("merging_weights.pt")
        pool = [f"modelpool._target_={SEQ2SEQ_SAVING_POOL}"] if setting.family == "t5" else []
        args = self._args(setting, run_id, head, [f"taskpool={setting.taskpool}"], pool,
                          [f"merged_model_save_path={folder / 'merged'}"])
        return Run(run_id, key, upstream, "upstream", args, saves=tuple(saves), offline_env=setting.offline_env)

    def calibrator_run(self, key: str, upstream: str, calibrator: str,
                       budget: Optional[Tuple[int, int]] = None) -> Run:
        """``budget``: (n, seed), set after every other option so that it is what the run uses."""
        setting = self.settings[key]
        run_id = f"{key}/{upstream}+{calibrator}" + (f"/n{budget[0]}-seed{budget[1]}" if budget else "")
        head = [f"method={setting.calibrator_config(calibrator, upstream)}",
                f"method.merged_model_path={self.run_dir(f'{key}/{upstream}') / 'merged'}",
                *setting.calibrator_overrides,
                *(hydra for target, hydra in map(split_calibrator, self.calibrator_overrides) if target in (None, calibrator)),
                *((f"method.num_calibration_examples={budget[0]}", f"method.seed={budget[1]}") if budget else ())]
        return Run(run_id, key, f"{upstream}+{calibrator}", "calibrator",
                   self._args(setting, run_id, head, [f"taskpool={setting.taskpool}"]),
                   depends=(f"{key}/{upstream}",), offline_env=setting.offline_env, budget=budget)

    def pretrained_run(self, key: str) -> Run:
        setting = self.settings[key]
        run_id = f"{key}/pretrained"
        return Run(run_id, key, "pretrained", "reference",
                   self._args(setting, run_id, ["method=dummy"], [f"taskpool={setting.taskpool}"]),
                   offline_env=setting.offline_env)

    def finetuned_run(self, key: str, task: str) -> Run:
        """The expert of ``task`` alone on ``task``: the pool's own entry for it, evaluated as FusionBench does."""
        setting = self.settings[key]
        tasks, _ = self.tasks(key)
        run_id = f"{key}/finetuned/{task}"
        if setting.single_task_taskpool:
            taskpool = [f"taskpool={setting.single_task_taskpool.format(task=task)}"]
        else:
            taskpool = [f"taskpool={setting.taskpool}", *(f"~taskpool.test_datasets.{t}" for t in tasks if t != task)]
            if setting.family == "t5":
                kept = ",".join(t for t in setting.regression_tasks if t == task)
                taskpool.append(f"taskpool.regression_tasks=[{kept}]")
        pool = [f"modelpool.models._pretrained_=${{.{task}}}"]  # dummy returns `_pretrained_`: here the expert
        args = self._args(setting, run_id, ["method=dummy"], taskpool, pool,
                          single_task=bool(setting.single_task_taskpool))
        return Run(run_id, key, "finetuned", "reference", args, task=task, offline_env=setting.offline_env)

    def finetuned_runs(self, key: str) -> Tuple[Run, ...]:
        """The fine-tuned row: each task's expert alone on its task; with ``task_experts``, each expert alone on
        the tasks of its domain, and the base on the tasks no expert was trained for."""
        setting = self.settings[key]
        if not setting.task_experts:
            return tuple(self.finetuned_run(key, t) for t in self.tasks(key)[0])
        runs = []
        for expert in dict.fromkeys(setting.task_experts.values()):
            columns = tuple(t for t, e in setting.task_experts.items() if e == expert)
            if expert is None:
                runs.append(replace(self.pretrained_run(key), columns=columns))
                continue
            run_id = f"{key}/finetuned/{expert}"
            taskpool = [f"taskpool={setting.taskpool}", *(f"~taskpool.tasks.{t}" for t in setting.task_experts if t not in columns)]
            args = self._args(setting, run_id, ["method=dummy"], taskpool, [f"modelpool.models._pretrained_=${{.{expert}}}"])
            runs.append(Run(run_id, key, "finetuned", "reference", args, task=expert, columns=columns,
                            offline_env=setting.offline_env))
        return tuple(runs)

    # -- rows -------------------------------------------------------------------------------------------------
    def rows(self, table: str) -> List[Row]:
        if table not in TABLES:
            raise CatalogError(f"unknown table {table!r}; known: {', '.join(TABLES)}")
        spec = TABLES[table]
        paper_rows = PAPER[table]["rows"] if table in PAPER else {}
        out = []
        for group in spec.groups:
            key = group.hub if self.world == "hub" else group.offline
            for method in spec.methods:
                row_id = f"{group.key}/{method}" if group.key else method
                paper_key = f"{group.hub}/{method}"
                paper_key = paper_key if group.hub and paper_key in paper_rows else None
                base = dict(table=table, id=row_id, group=group.key, method=method, label=method_label(method),
                            paper_key=paper_key)
                if key is None:
                    why = (group.offline_missing or NO_OFFLINE) if self.world == "offline" else group.hub_missing
                    out.append(Row(setting=None, skip=why, **base))
                    continue
                upstream = method.split("+", 1)[0]
                if upstream in self.settings[key].unavailable:
                    out.append(Row(setting=key, skip=self.settings[key].unavailable[upstream], **base))
                    continue
                if method == "mtl":
                    out.append(Row(setting=key, skip="paper number only: Traditional MTL is joint multi-task "
                                   "training, not a merging recipe (no FusionBench command reproduces it here)", **base))
                    continue
                tasks, why = self.tasks(key)
                if why:  # e.g. the world's pool config is not installed: no command of this setting composes
                    out.append(Row(setting=key, skip=why, **base))
                    continue
                if method == "finetuned":
                    runs = self.finetuned_runs(key)
                elif method == "pretrained":
                    runs = (self.pretrained_run(key),)
                elif "+" in method and spec.layout == "budget":
                    upstream, calibrator = method.split("+")
                    runs = tuple(self.calibrator_run(key, upstream, calibrator, (n, seed))
                                 for n in spec.budgets for seed in spec.seeds)
                elif "+" in method:
                    upstream, calibrator = method.split("+")
                    runs = (self.calibrator_run(key, upstream, calibrator, self.settings[key].budget),)
                else:
                    runs = (self.upstream_run(key, method),)
                out.append(Row(setting=key, runs=runs, **base))
        return out

    def select(self, tables: Sequence[str], patterns: Optional[Sequence[str]] = None) -> List[Row]:
        """The rows of ``tables``; with ``patterns``, those whose id matches one (an id, a prefix up to a ``/``,
        a glob such as ``*/ta+featcal``, or the method part alone such as ``ta+featcal``; ``<id>/<part>`` picks
        runs of a row: a task of the fine-tuned row, ``n8-seed42`` or ``n8-*`` of a Table 12 row). A pattern that
        matches nothing is an error, before anything runs."""
        rows = [row for table in tables for row in self.rows(table)]
        if not patterns:
            return rows
        chosen: Dict[int, Optional[set]] = {}  # row index -> the parts chosen of a row's runs (None: all)
        unmatched = []
        for pattern in patterns:
            hit = False
            for i, row in enumerate(rows):
                if row_matches(row, pattern):
                    chosen[i], hit = None, True
                    continue
                parts = {r.part for r in row.runs if r.part and fnmatch.fnmatchcase(f"{row.id}/{r.part}", pattern)}
                if parts:
                    hit = True
                    if i not in chosen or chosen[i] is not None:
                        chosen[i] = (chosen.get(i) or set()) | parts
            if not hit:
                unmatched.append(pattern)
        if unmatched:
            known = ", ".join(dict.fromkeys(r.id for r in rows))
            raise CatalogError(f"no row matches {', '.join(map(repr, unmatched))} in table(s) "
                               f"{', '.join(tables)}; row ids: {known} (a per-task row also takes <id>/<task>, a Table 12 row "
                               "<id>/n<n>-seed<seed>)")
        out = []
        for i, row in enumerate(rows):
            if i in chosen:
                parts = chosen[i]
                out.append(row if parts is None else replace(row, runs=tuple(r for r in row.runs if r.part in parts)))
        return out

    def dependencies(self, run: Run) -> List[Run]:
        """The runs that ``run`` reads from (its upstream merger's run)."""
        out = []
        for dep in run.depends:
            key, method = dep.split("/", 1)
            out.append(self.upstream_run(key, method))
        return out


def row_matches(row: Row, pattern: str) -> bool:
    pattern = pattern.strip()
    return (row.id == pattern or row.id.startswith(pattern.rstrip("/") + "/") or fnmatch.fnmatchcase(row.id, pattern)
            or fnmatch.fnmatchcase(row.method, pattern))


def list_lines(rows: Iterable[Row]) -> List[str]:
    """One line per command: the command, then a shell comment naming its row (and the run it reads from);
    a row that is not run is a comment line giving the reason."""
    lines = []
    for row in rows:
        prefix = f"table {row.table} {row.id}"
        if row.skip:
            lines.append(f"# {prefix}: skipped ({row.skip})")
            continue
        for run in row.runs:
            where = f"{prefix}" + (f" [{run.part}]" if run.part else "")
            after = f"; after {', '.join(run.depends)}" if run.depends else ""
            lines.append(f"{run.command}  # {where} ({run.id}{after})")
    return lines
