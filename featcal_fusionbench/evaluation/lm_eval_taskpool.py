"""lm-evaluation-harness as a FusionBench task pool, one score per task, with an ``average`` and a task switch.

FusionBench's ``LMEvalHarnessTaskPool`` runs every task in one lm-eval call and returns nothing to the report. This
pool runs lm-eval (``simple_evaluate`` over the model in memory, ``HFLM``) task by task so that

- a per-task wrapper (Surgery, ProbSurgery: ``LMHeadSurgery``) applies the map of the expert named for each task,
  as the paper evaluates them (``featcal_fusionbench.evaluation.text_taskpool.active_task``);
- each task's chosen metric, and their ``average``, land in FusionBench's report next to the method's figures.

lm-eval is the optional extra ``llm`` (``pip install 'featcal-fusionbench[llm]'`` or ``bash scripts/setup.sh
--llm``); a missing install is named when the pool is built, before any model is loaded or merged, and so are
unknown task names.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from fusion_bench.mixins import LightningFabricMixin
from fusion_bench.taskpool import BaseTaskPool
from omegaconf import DictConfig, ListConfig, OmegaConf

from ..models.task_switch import active_task
from .chat_prompts import EVALPLUS_CHAT_TASKS
from .text_taskpool import load_tokenizer

log = logging.getLogger(__name__)

INSTALL_HINT = "bash scripts/setup.sh --llm  (or: pip install 'featcal-fusionbench[llm]')"


def require_lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"this task pool evaluates with lm-evaluation-harness, which is not installed ({error}); install the "
            f"LLM extra: {INSTALL_HINT}"
        ) from None


def parse_tasks(tasks) -> Dict[str, Dict[str, Optional[str]]]:
    """``tasks`` as ``{task: {"metric": ..., "expert": ...}}``. A list names tasks without a chosen metric: every
    metric is reported and no average is formed. A task mapped to ``false`` is left out (a config composed from
    another drops one of its tasks so)."""
    if isinstance(tasks, (DictConfig, ListConfig)):
        tasks = OmegaConf.to_container(tasks, resolve=True)
    if isinstance(tasks, str):
        tasks = [tasks]
    if isinstance(tasks, (list, tuple)):
        tasks = {name: {} for name in tasks}
    if not isinstance(tasks, Mapping) or not tasks:
        raise ValueError(f"tasks must be a non-empty list of lm-eval task names or a mapping task -> "
                         f"{{metric, expert}}, got {tasks!r}")
    parsed = {}
    for name, spec in tasks.items():
        if spec is False:  # a config that composes another one leaves out a task it inherits
            continue
        spec = dict(spec or {})
        unknown = set(spec) - {"metric", "expert", "apply_chat_template"}
        if unknown:
            raise ValueError(f"task {name!r}: unknown key(s) {sorted(unknown)}; a task takes `metric` (lm-eval's "
                             f"'<metric>,<filter>' key, e.g. 'exact_match,strict-match'), `expert` and "
                             f"`apply_chat_template`")
        chat = spec.get("apply_chat_template")
        if chat is not None and not isinstance(chat, bool):
            raise ValueError(f"task {name!r}: apply_chat_template must be true, false or null, got {chat!r}")
        # No `expert` key: the task's own name; `expert: null`: no map (a task no expert was trained for).
        # `apply_chat_template` null: the pool's setting.
        parsed[str(name)] = {"metric": spec.get("metric"), "expert": spec.get("expert", str(name)),
                             "apply_chat_template": chat}
    if not parsed:
        raise ValueError(f"tasks leaves out every task it names: {sorted(tasks)}")
    return parsed


_TASK_LINE = re.compile(r"^task:\s*['\"]?([^'\"\s#]+)", re.M)


def _lm_eval_folders(names: Tuple[str, ...]) -> Optional[List[str]]:
    """The folders of lm-eval's own task files that define ``names`` (a YAML with ``task: <name>``), or None when
    one is not found so (a group, a tag, a misspelt name): then lm-eval's whole index is built."""
    import lm_eval.tasks

    wanted, found = set(names), {}
    for path in sorted(Path(lm_eval.tasks.__file__).parent.rglob("*.yaml")):
        for match in _TASK_LINE.finditer(path.read_text(errors="replace")):
            if match.group(1) in wanted:
                found.setdefault(match.group(1), str(path.parent))
    return sorted(set(found.values())) if set(found) == wanted else None


@functools.lru_cache(maxsize=8)
def _task_manager(include_paths: Tuple[str, ...], tasks: Tuple[str, ...]):
    """lm-eval's index of ``include_paths`` and of the folders of lm-eval's own files that define the rest of
    ``tasks``, built once per process: indexing all of lm-eval's ~14,000 task files takes 8-20 s on a 2-core machine,
    for each task pool built, where the few folders a pool needs take well under a second to find and index."""
    from lm_eval.tasks import TaskManager

    ours = TaskManager(include_path=list(include_paths), include_defaults=False)
    theirs = _lm_eval_folders(tuple(t for t in tasks if t not in set(ours.all_tasks)))
    if theirs is None:
        return TaskManager(include_path=list(include_paths))
    # lm-eval's folders first, as lm-eval indexes its own first: a folder of ours wins a name clash
    return TaskManager(include_path=[*theirs, *include_paths], include_defaults=False)


class LMEvalTaskPool(LightningFabricMixin, BaseTaskPool):
    """Each task through lm-eval's ``simple_evaluate`` on the model in memory.

    Args:
        tasks: lm-eval task names, or a mapping ``task -> {metric, expert, apply_chat_template}``: ``metric`` is the
            key of lm-eval's results that scores the task (``"<metric>,<filter>"``) and enters the ``average``;
            ``expert`` the pool model whose per-task map a Surgery / ProbSurgery model applies on that task (default:
            the task's name; ``null``: none, the merged model unchanged, as for a task that no expert was trained
            for); ``apply_chat_template`` the task's own setting (default: the pool's); ``false`` instead of a
            mapping leaves an inherited task out.
        include_path: a folder of task YAMLs (local tasks over local files).
        tokenizer: path, hub name or ``_target_`` config; default: the model pool's tokenizer in a FusionBench run
            (a merged model saved without one, read back by ``method.merged_model_path``, has none of its own),
            else the model's ``name_or_path``.
        apply_chat_template: format prompts with the tokenizer's chat template (few-shot examples as turns), for
            every task that does not set its own.
        limit: examples per task (an int, or a fraction); ``None`` for all.
        confirm_run_unsafe_code: run generated code (HumanEval+, MBPP+, code tasks); sets ``HF_ALLOW_CODE_EVAL``.
        output_path: where lm-eval's results go; default ``<log_dir>/lm_eval_results``.
    """

    _config_mapping = BaseTaskPool._config_mapping | {
        "_tasks": "tasks",
        "include_path": "include_path",
        "_tokenizer": "tokenizer",
        "apply_chat_template": "apply_chat_template",
        "batch_size": "batch_size",
        "num_fewshot": "num_fewshot",
        "limit": "limit",
        "gen_kwargs": "gen_kwargs",
        "confirm_run_unsafe_code": "confirm_run_unsafe_code",
        "random_seed": "random_seed",
        "output_path": "output_path",
        "log_samples": "log_samples",
    }

    def __init__(
        self,
        tasks,
        *,
        include_path: Optional[str] = None,
        tokenizer: Any = None,
        apply_chat_template: bool = True,
        batch_size: int = 1,
        num_fewshot: Optional[int] = None,
        limit: Optional[float] = None,
        gen_kwargs: Optional[Mapping[str, Any]] = None,
        confirm_run_unsafe_code: bool = False,
        random_seed: int = 0,
        output_path: Optional[str] = None,
        log_samples: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        require_lm_eval()
        self._tasks = tasks
        self.tasks = parse_tasks(tasks)
        if include_path is not None and not Path(include_path).is_dir():
            raise FileNotFoundError(f"include_path {include_path!r} is not a folder of lm-eval task YAMLs")
        self.include_path = None if include_path is None else str(include_path)
        self._tokenizer = tokenizer
        self.apply_chat_template = bool(apply_chat_template)
        self.batch_size = batch_size
        self.num_fewshot = num_fewshot
        self.limit = limit
        self.gen_kwargs = OmegaConf.to_container(gen_kwargs) if isinstance(gen_kwargs, DictConfig) else gen_kwargs
        self.confirm_run_unsafe_code = bool(confirm_run_unsafe_code)
        self.random_seed = random_seed
        self.output_path = output_path
        self.log_samples = bool(log_samples)
        self._task_manager = self._check_task_names()

    def _check_task_names(self):
        from .lm_eval_tasks import TASKS_DIR
        from .nltk_data import ensure_punkt_tab

        if any(t.startswith("ifeval") for t in self.tasks):
            ensure_punkt_tab()  # before lm-eval imports IFEval's checkers, which download it otherwise

        # Our Table 4 task files (lm_eval_tasks/) are always indexed; the user's folder after them wins a name clash.
        manager = _task_manager((str(TASKS_DIR), *([self.include_path] if self.include_path else [])), tuple(self.tasks))
        known = set(manager.all_tasks)
        missing = [t for t in self.tasks if t not in known]
        if missing:
            where = f" or in include_path {self.include_path}" if self.include_path else ""
            raise ValueError(f"lm-eval has no task(s) {missing} (lm-eval {_lm_eval_version()}{where})")
        return manager

    def _results_dir(self) -> Optional[Path]:
        """Where lm-eval's per-task records go; none outside a FusionBench run (no log_dir) unless given."""
        if self.output_path:
            return Path(self.output_path)
        return None if self.log_dir is None else Path(self.log_dir) / "lm_eval_results"

    def _language_model(self, model):
        from .chat_prompts import language_model

        # A per-task wrapper keeps its hook on the inner model's lm_head: lm-eval drives the inner model.
        inner = model.model if getattr(model, "is_surgery_model", False) else model
        return language_model(inner, self._tokenizer_for(inner), self.batch_size)

    def _tokenizer_for(self, model):
        if self._tokenizer is not None:
            return load_tokenizer(self._tokenizer)
        pool = getattr(getattr(self, "_program", None), "modelpool", None)
        if getattr(pool, "tokenizer", None) is not None and hasattr(pool, "load_tokenizer"):  # a CausalLMPool
            return pool.load_tokenizer()
        return model.name_or_path

    def evaluate(self, model, name: Optional[str] = None) -> Dict[str, Any]:
        from lm_eval import simple_evaluate
        from lm_eval.utils import handle_non_serializable

        if self.confirm_run_unsafe_code:
            os.environ["HF_ALLOW_CODE_EVAL"] = "1"  # lm-eval's code_eval metric refuses without it
        if getattr(model, "is_surgery_model", False):
            maps = set(model.task_names)
            missing = {t: s["expert"] for t, s in self.tasks.items() if s["expert"] is not None and s["expert"] not in maps}
            if missing:
                raise ValueError(f"the per-task model has maps for {sorted(maps)}, not for the experts {missing} that "
                                 "the task pool names (set each task's `expert`, or null for none)")
        if getattr(model, "hf_device_map", None) is None:  # one dispatched by device_map stays where it was put
            model = model.to(self.fabric.device)
        model = model.eval()
        language_model = self._language_model(model)
        results_dir = self._results_dir()
        if results_dir is not None:
            results_dir.mkdir(parents=True, exist_ok=True)
        report: Dict[str, Any] = {}
        with environment_described_once():
            for task, spec in self.tasks.items():
                chat = self.apply_chat_template if spec["apply_chat_template"] is None else spec["apply_chat_template"]
                language_model.reply_as_evalplus = task in EVALPLUS_CHAT_TASKS
                with active_task(model, spec["expert"]):
                    results = simple_evaluate(
                        model=language_model, tasks=[task], task_manager=self._task_manager,
                        num_fewshot=self.num_fewshot, limit=self.limit, gen_kwargs=self.gen_kwargs,
                        apply_chat_template=chat, fewshot_as_multiturn=chat,
                        confirm_run_unsafe_code=self.confirm_run_unsafe_code, log_samples=self.log_samples,
                        random_seed=self.random_seed, numpy_random_seed=self.random_seed,
                        torch_random_seed=self.random_seed, fewshot_random_seed=self.random_seed,
                    )
                if results_dir is not None:
                    saved = json.dumps(results, indent=2, default=handle_non_serializable)
                    (results_dir / f"{task}.json").write_text(saved)
                report[task] = task_scores(results, task, spec["metric"])
                log.info("task %s: %s", task, report[task])
        scored = [report[t]["score"] for t, spec in self.tasks.items() if spec["metric"]]
        if scored and len(scored) == len(self.tasks):
            report["average"] = {"score": sum(scored) / len(scored)}
        if name is not None:
            report["model_info"] = {"name": name}
        return report


@contextlib.contextmanager
def environment_described_once():
    """lm-eval 0.4.13's ``simple_evaluate`` ends with ``add_env_info`` (lm_eval/loggers/utils.py), which calls torch's
    ``collect_env.get_pretty_env_info``: it starts ``pip list`` and other programs (``nvidia-smi`` where there is a
    GPU) every time, about a second here, and this pool calls lm-eval once per task and model (12 times for Table 4).
    The machine does not change within a run: it is described once per process, and every task's record keeps the
    same ``pretty_env_info``. ``add_env_info`` imports the function when it runs, so the module attribute is what it
    finds."""
    from torch.utils import collect_env

    original = collect_env.get_pretty_env_info
    collect_env.get_pretty_env_info = functools.partial(_describe_environment, original)
    try:
        yield
    finally:
        collect_env.get_pretty_env_info = original


@functools.lru_cache(maxsize=1)
def _describe_environment(describe) -> str:
    return describe()


def task_scores(results: Mapping[str, Any], task: str, metric: Optional[str]) -> Dict[str, float]:
    """The numeric metrics lm-eval reports for ``task`` (standard errors left out), with the chosen one as
    ``score``."""
    row = results["results"][task]
    scores = {key: float(value) for key, value in row.items()
              if isinstance(value, (int, float)) and not isinstance(value, bool) and "_stderr" not in key}
    if metric is not None:
        if metric not in scores:
            raise KeyError(f"task {task!r} reports no metric {metric!r}; it reports {sorted(scores)}")
        scores["score"] = scores[metric]
    return scores


def _lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


__all__ = ["LMEvalTaskPool", "environment_described_once", "parse_tasks", "require_lm_eval", "task_scores"]
