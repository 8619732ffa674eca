"""Label-free choice of lambda, rho and alpha (`method.auto_select`) against the paper's values and the test-label
oracle, on an offline world (issues 27 and 61).

  python experiments/scripts/autoselect_study.py --world clip-quick --n 8,32,256 --seeds 42,43,44 --criteria objective
  python experiments/scripts/autoselect_study.py --world t5 --n 32 --seeds 42,43 --criteria objective,agreement --oracle short

Per world: Task Arithmetic (0.3) once, saved; then per (n, seed), FeatCal from that merge with the world's paper
config (the paper's values: `featcal/clip_ta`, `featcal/flan_t5_ta`, `featcal/causal_lm_ta`), the authors' demo
values on CLIP worlds, and `auto_select` for each criterion, each a `fusion_bench` run in its own folder under
--runs (cached by command and world build: an interrupted invocation resumes). `--before`: the rule of before
issue 61 (one held-out quarter, lambda x rho scored at once), run in process (`featcal_experiments.autoselect_lab`).
The oracle, on the test labels, also in process (the lab scores a model as the world's task pool does; its score
of the paper's values is checked against their `fusion_bench` run): `--oracle full` is lambda (1e-8 .. 10) x alpha
(0.15 .. 0.6) at the paper's rho, then rho (0.5 .. 2.5) at the best; `--oracle short` (worlds where a point costs
minutes) is lambda (1e-7 .. 1e-2) at the paper's rho and alpha, alpha (0.15 .. 0.8) at the best lambda, lambda
again at the best alpha, then rho; `--oracle lambda` (where a point costs several minutes) the first of these alone. Writes OUT/<world>.json and .md with the command, machine and date, and issue
61's targets: auto >= the paper's values - 0.3 points; oracle - auto <= 0.5 averaged over seeds and <= 1.0 at worst.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from diagnostics import machine  # noqa: E402

# world -> the reproduction catalog's setting whose upstream and calibrator commands the study runs
SETTINGS = {"clip": "offline-clip8", "clip-quick": "offline-clip8", "t5": "offline-t5", "llm": "offline-llm"}
TARGET_BELOW_PAPER, TARGET_FROM_ORACLE, TARGET_FROM_ORACLE_WORST = 0.3, 0.5, 1.0
# CLIP worlds: the authors' demo values, as featcal/clip_ta_demo sets them
DEMO = ("method.rho=2.2", "method.alpha=0.25", "++method.family_options.last_block_patch_token_weight=0.01")
ORACLE = {
    "full": {"lambdas": tuple(10.0**k for k in range(-8, 2)), "alphas": (0.15, 0.3, 0.45, 0.6),
             "rhos": (0.5, 1.0, 1.5, 2.0, 2.5)},
    "short": {"lambdas": tuple(10.0**k for k in range(-7, -1)), "alphas": (0.15, 0.3, 0.45, 0.6, 0.8),
              "rhos": (0.5, 1.0, 1.5, 2.0, 2.5)},
    "lambda": {"lambdas": tuple(10.0**k for k in range(-7, -1))},
}
LAB_CHECK = 0.05  # points: the lab's score of the paper's values against their fusion_bench run


def catalog_for(world: str, runs: Path):
    from featcal_experiments.reproduce.catalog import OFFLINE_SETTINGS, Catalog

    catalog = Catalog("offline", runs)
    setting = OFFLINE_SETTINGS[SETTINGS[world]]
    if world == "clip-quick":  # the quick world: the 8-task world's setting on its own pools
        setting = replace(setting, key="offline-clip-quick", world="clip-quick",
                          modelpool="CLIPVisionModelPool/offline_clip_quick",
                          taskpool="CLIPVisionModelTaskPool/offline_clip_quick")
        catalog.settings = {**catalog.settings, setting.key: setting}
    return catalog, setting


def without_log_dir(args):
    return [a for a in args if not a.startswith("path.log_dir=")]


def shown(args) -> str:
    """The command as the results show it: run folders relative to the repository, which is where it runs from, and
    the worlds folder as the variable that sets it (default ~/.cache/featcal-fusionbench/worlds)."""
    from featcal_experiments.worlds.registry import ENV_DIR, worlds_dir

    return "fusion_bench " + " ".join(a.replace(f"{REPO}/", "").replace(str(worlds_dir()), f"${{{ENV_DIR}}}")
                                      for a in without_log_dir(args))


def percentages(report: dict) -> dict:
    """Task (and ``average``) -> percentage: accuracy, Spearman's rho or lm-eval's score, as the tables read them."""
    from featcal_experiments.reproduce.render import scores

    return scores(report)


def featcal_report(folder: Path) -> dict:
    return json.loads((folder / "featcal_report.json").read_text())


def hparams_of(report: dict) -> dict:
    return {k: report["hparams"][k] for k in ("lambda_", "rho", "alpha")}


def study(args) -> dict:
    from featcal_experiments.cli_runs import run_fusion_bench, write_json_atomic
    from featcal_experiments.worlds.registry import world_fingerprint, world_path

    catalog, setting = catalog_for(args.world, args.runs)
    world = world_path(args.world)
    upstream = catalog.upstream_run(setting.key, "ta")
    ta = run_fusion_bench(args.runs / upstream.id, without_log_dir(upstream.args), world=world)
    out = {"world": args.world, "world_fingerprint": world_fingerprint(args.world),
           "upstream": percentages(ta)["average"], "upstream_command": shown(upstream.args), "runs": []}
    lab = None
    for n in args.n:
        for seed in args.seeds:
            run = catalog.calibrator_run(setting.key, "ta", "featcal", (n, seed))
            base = without_log_dir(run.args)
            folder = args.runs / run.id
            entry = {"n": n, "seed": seed, "command": shown(base)}
            print(f"n = {n}, seed {seed}: the paper's values", flush=True)
            report = run_fusion_bench(folder / "default", base, world=world)
            fixed = featcal_report(folder / "default")
            entry["default"] = {"average": percentages(report)["average"], "tasks": percentages(report),
                                "seconds": fixed["seconds"], **hparams_of(fixed)}
            if setting.family == "clip":
                print(f"n = {n}, seed {seed}: the authors' demo values", flush=True)
                report = run_fusion_bench(folder / "demo", [*base, *DEMO], world=world)
                entry["demo"] = {"average": percentages(report)["average"], "tasks": percentages(report)}
            entry["auto"] = {}
            for criterion in args.criteria:
                print(f"n = {n}, seed {seed}: auto_select {criterion}", flush=True)
                options = f"criterion:{criterion}" + ("" if args.folds is None else f",folds:{args.folds}")
                report = run_fusion_bench(folder / f"auto_{criterion}",
                                          [*base, f"method.auto_select={{{options}}}"], world=world)
                calibration = featcal_report(folder / f"auto_{criterion}")
                selection = calibration["auto_select"]
                entry["auto"][criterion] = {
                    "average": percentages(report)["average"], "tasks": percentages(report),
                    "choice": selection["choice"], "criterion_used": selection.get("criterion_used", criterion),
                    "cost_multiple": selection["cost_multiple"], "seconds": calibration["seconds"],
                    "vs_fixed": calibration["seconds"] / fixed["seconds"], "calibrations": selection.get("calibrations"),
                    "blocks": [{k: b.get(k) for k in ("block", "chosen", "runner_up", "margin", "margin_relative",
                                                      "margin_se", "kept", "edge", "widened", "held_out_best_lambda")}
                               for b in selection.get("blocks", [])],
                }
            if lab is None or lab.args != base:
                lab = lab_for(base)
            cache = folder / "lab.json"
            cached = json.loads(cache.read_text()) if cache.is_file() else {}
            if cached.get("world") != out["world_fingerprint"]:
                cached = {"world": out["world_fingerprint"], "points": [], "before": None}
            entry["oracle"] = oracle(lab, n, seed, entry["default"], args.oracle, cached,
                                     lambda: write_json_atomic(cache, cached))
            if args.before:
                if cached["before"] is None:
                    print(f"n = {n}, seed {seed}: the rule of before issue 61", flush=True)
                    cached["before"] = before_rule(lab, n, seed)
                    write_json_atomic(cache, cached)
                entry["before"] = cached["before"]
            out["runs"].append(entry)
    return out


def lab_for(args):
    from featcal_experiments.autoselect_lab import Lab

    return Lab(args)


def oracle(lab, n, seed, default, space, cached, save) -> dict:
    """The grid on the test labels (see the module's docstring); each point's average and tasks, and the best. The
    lab's score of the paper's values must equal their ``fusion_bench`` run's."""
    points = cached["points"]
    grid = ORACLE[space]

    def score(lam, rho, alpha):
        for p in points:
            if (p["lambda_"], p["rho"], p["alpha"]) == (lam, rho, alpha):
                return p
        started = time.perf_counter()
        result = lab.score(n, seed, lambda_=lam, rho=rho, alpha=alpha)
        point = {"lambda_": lam, "rho": rho, "alpha": alpha, "average": result["average"],
                 "tasks": result["scores"], "seconds": time.perf_counter() - started}
        points.append(point)
        save()
        print(f"  oracle lambda {lam:g} rho {rho:g} alpha {alpha:g}: {point['average']:.2f}", flush=True)
        return point

    paper = score(default["lambda_"], default["rho"], default["alpha"])
    if abs(paper["average"] - default["average"]) > LAB_CHECK:
        raise SystemExit(f"the lab scores the paper's values {paper['average']:.3f}, their fusion_bench run "
                         f"{default['average']:.3f}: the oracle would not be the runs' own")
    rho0, alpha0 = default["rho"], default["alpha"]
    if space == "lambda":
        for lam in grid["lambdas"]:
            score(lam, rho0, alpha0)
    elif space == "full":
        for lam in grid["lambdas"]:
            for alpha in grid["alphas"]:
                score(lam, rho0, alpha)
        best = max(points, key=lambda p: p["average"])
        for rho in grid["rhos"]:
            score(best["lambda_"], rho, best["alpha"])
    else:
        for lam in grid["lambdas"]:
            score(lam, rho0, alpha0)
        best = max(points, key=lambda p: p["average"])
        for alpha in grid["alphas"]:
            score(best["lambda_"], rho0, alpha)
        best = max(points, key=lambda p: p["average"])
        for lam in grid["lambdas"]:
            score(lam, rho0, best["alpha"])
        best = max(points, key=lambda p: p["average"])
        for rho in grid["rhos"]:
            score(best["lambda_"], rho, best["alpha"])
    best = max(points, key=lambda p: p["average"])
    at_paper_alpha = [p for p in points if p["alpha"] == alpha0]
    return {"space": space, "grid": points, "best": best,
            "best_at_paper_alpha": max(at_paper_alpha, key=lambda p: p["average"]) if at_paper_alpha else None}


def before_rule(lab, n, seed) -> dict:
    """The product's rule before issue 61 (one held-out quarter; every lambda x rho at the paper's alpha scored at
    once, the best taken), through the lab's copy of it."""
    from featcal_fusionbench.autoselect.options import DEFAULT_GRID, all_candidates
    from featcal_experiments.autoselect_variants import VariantSelection

    hp = lab.prepare(n, seed)[0].featcal_hparams
    grid = {"lambda_": DEFAULT_GRID["lambda_"], "rho": DEFAULT_GRID["rho"], "alpha": (hp.alpha,)}
    policy = VariantSelection(all_candidates(grid), target="expert")
    result = lab.score(n, seed, policy=policy)
    return {"average": result["average"], "tasks": result["scores"], "choice": [e["chosen"] for e in policy.log]}


def summary(result: dict) -> dict:
    """Per criterion and n: auto - the paper's values (worst), oracle - auto (mean over seeds, worst), and whether
    issue 61's targets hold."""
    out = {}
    for criterion in result["criteria"]:
        per_n = {}
        for n in sorted({r["n"] for r in result["runs"]}):
            rows = [r for r in result["runs"] if r["n"] == n]
            vs_paper = [r["auto"][criterion]["average"] - r["default"]["average"] for r in rows]
            from_oracle = [r["oracle"]["best"]["average"] - r["auto"][criterion]["average"] for r in rows]
            per_n[str(n)] = {
                "auto_minus_paper": vs_paper, "oracle_minus_auto": from_oracle,
                "worst_below_paper": -min(vs_paper), "mean_from_oracle": statistics.mean(from_oracle),
                "worst_from_oracle": max(from_oracle),
                "meets_paper_target": -min(vs_paper) <= TARGET_BELOW_PAPER,
                "meets_oracle_targets": (statistics.mean(from_oracle) <= TARGET_FROM_ORACLE
                                         and max(from_oracle) <= TARGET_FROM_ORACLE_WORST),
                "cost_multiple": [r["auto"][criterion]["cost_multiple"] for r in rows],
                "vs_fixed": [r["auto"][criterion]["vs_fixed"] for r in rows],
            }
        out[criterion] = per_n
    return out


def markdown(result: dict) -> str:
    lines = [f"# auto_select on the offline world `{result['world']}` (build {result['world_fingerprint']})", "",
             f"Command: `{result['command']}`. Machine: {result['machine']}. Date: {result['date']}; "
             f"{result['seconds'] / 60:.0f} min for {result['runs_made']} `fusion_bench` runs, "
             f"{result['runs_resumed']} more resumed from an earlier invocation of the same command (the oracle "
             "and the rule of before are run in process).", "",
             f"Task Arithmetic (0.3) alone: {result['upstream']:.1f}. Each row: FeatCal after it with the world's "
             "paper values, with `method.auto_select` per criterion (auto: average, then the calibration's time as a "
             "multiple of the paper's values' run, then the search's own multiple), and the best point of the "
             f"oracle grid on the test labels ({result['oracle_space']}: see the script's docstring).", ""]
    runs = result["runs"]
    demo = bool(runs) and "demo" in runs[0]
    before = bool(runs) and "before" in runs[0]
    head = ["n", "seed", "paper's values", *(["authors' demo"] if demo else []), *(["before (issue 27)"] if before else []),
            *(f"auto: {c}" for c in result["criteria"]), "oracle at the paper's alpha", "oracle (best point)"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---:|" * (len(head) - 1) + "---|"]
    for r in runs:
        best, at_alpha = r["oracle"]["best"], r["oracle"]["best_at_paper_alpha"]
        cells = [str(r["n"]), str(r["seed"]), f"{r['default']['average']:.1f}"]
        cells += [f"{r['demo']['average']:.1f}"] if demo else []
        cells += [f"{r['before']['average']:.1f}"] if before else []
        cells += [f"{r['auto'][c]['average']:.1f} ({r['auto'][c]['vs_fixed']:.1f}x; {r['auto'][c]['cost_multiple']:.1f}x)"
                  for c in result["criteria"]]
        cells.append(f"{at_alpha['average']:.1f} (lambda {at_alpha['lambda_']:g}, rho {at_alpha['rho']:g})")
        cells.append(f"{best['average']:.1f} (lambda {best['lambda_']:g}, rho {best['rho']:g}, alpha {best['alpha']:g})")
        lines.append("| " + " | ".join(cells) + " |")
    paper = ", ".join(f"{runs[0]['default'][k]:g}" for k in ("lambda_", "rho", "alpha")) if runs else ""
    lines += ["", f"The paper's values: lambda, rho, alpha = {paper}"
              + ("; authors' demo: rho 2.2, alpha 0.25, last-block patch-token weight 0.01" if demo else "")
              + f". Targets (issue 61): auto >= the paper's values - {TARGET_BELOW_PAPER}; oracle - auto <= "
              f"{TARGET_FROM_ORACLE} averaged over seeds and <= {TARGET_FROM_ORACLE_WORST} at worst, at every n.", ""]
    for criterion, per_n in result["summary"].items():
        for n, s in per_n.items():
            lines.append(f"- `{criterion}`, n = {n}: auto - paper {min(s['auto_minus_paper']):+.1f} at worst "
                         f"({'meets' if s['meets_paper_target'] else 'misses'} the first target); oracle - auto "
                         f"{s['mean_from_oracle']:.2f} on average, {s['worst_from_oracle']:.2f} at worst "
                         f"({'meets' if s['meets_oracle_targets'] else 'misses'} the second)")
    lines += ["", "Per (n, seed), each block's choice (`objective`: the chosen values, the runner-up's margin in "
              "standard errors of the folds (negative: the runner-up scored better, and the choice is the method's "
              "values kept, or the smallest lambda within the noise of the held-out best), where it sat at an edge):",
              ""]
    for r in runs:
        for criterion in result["criteria"]:
            blocks = r["auto"][criterion]["blocks"]
            if blocks:
                shown_blocks = "; ".join(
                    f"{b['block']}: {b['chosen']}"
                    + (f" ({b['margin_se']:.1f} se)" if isinstance(b.get("margin_se"), (int, float)) else "")
                    + (" kept" if b.get("kept") else "") + (" edge" if b.get("edge") else "")
                    + (f" (held-out best lambda {b['held_out_best_lambda']:g})" if b.get("held_out_best_lambda") else "")
                    for b in blocks)
                lines.append(f"- n = {r['n']}, seed {r['seed']}, `{criterion}`: {shown_blocks}")
            else:
                lines.append(f"- n = {r['n']}, seed {r['seed']}, `{criterion}`: {r['auto'][criterion]['choice']}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", choices=sorted(SETTINGS), required=True)
    parser.add_argument("--n", default="32,256", help="calibration examples per task, comma-separated")
    parser.add_argument("--seeds", default="42", help="comma-separated")
    parser.add_argument("--criteria", default="objective", help="auto_select criteria, comma-separated")
    parser.add_argument("--folds", type=int, default=None,
                        help="objective's auto_select.folds (default: the method's, auto); the tables of before "
                             "2026-11-29 were made with 4, then the default")
    parser.add_argument("--oracle", choices=sorted(ORACLE), default="full")
    parser.add_argument("--before", action="store_true", help="also the rule of before issue 61 (in process)")
    parser.add_argument("--out", type=Path, default=REPO / "experiments" / "results" / "autoselect")
    parser.add_argument("--runs", type=Path, default=None, help="run folders (default outputs/autoselect/<world>)")
    args = parser.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args.n = [int(v) for v in args.n.split(",")]
        args.seeds = [int(v) for v in args.seeds.split(",")]
    except ValueError as error:
        parser.error(f"--n and --seeds take comma-separated integers: {error}")
    from featcal_fusionbench.autoselect.options import CRITERIA, SelectionOptions

    try:
        options = SelectionOptions(**({} if args.folds is None else {"folds": args.folds}))
    except ValueError as error:
        parser.error(f"--folds: {error}")
    small = [n for n in args.n if n < options.folds_for(n)]
    if small:
        parser.error(f"--n: auto_select cross-fits over {options.folds_for(min(small))} folds of each task's examples "
                     f"at n = {min(small)}; give at least that many")

    args.criteria = [c for c in args.criteria.split(",") if c]
    unknown = [c for c in args.criteria if c not in CRITERIA]
    if unknown or not args.criteria:
        parser.error(f"--criteria: unknown {unknown}; known: {sorted(CRITERIA)}")
    from featcal_experiments.worlds.registry import is_built

    if not is_built(args.world):
        parser.error(f"the {args.world!r} world is not built; run: featcal-world build {args.world}")
    args.runs = (args.runs or REPO / "outputs" / "autoselect" / args.world).resolve()
    started = time.time()
    result = study(args)
    from featcal_experiments.cli_runs import COUNTS, write_json_atomic

    result.update({"runs_made": COUNTS["ran"], "runs_resumed": COUNTS["resumed"],
                   "command": "python experiments/scripts/autoselect_study.py " + " ".join(argv),
                   "machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
                   "seconds": time.time() - started, "criteria": args.criteria, "oracle_space": args.oracle})
    result["summary"] = summary(result)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out / f"{args.world}.json", result)
    (args.out / f"{args.world}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
