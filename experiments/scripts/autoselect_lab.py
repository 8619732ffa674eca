"""Issue 61's lab: on one world, (n, seed), the test-label landscape over lambda x rho x alpha and any per-block
rule, in one process (``featcal_experiments.autoselect_lab``).

  python experiments/scripts/autoselect_lab.py --world clip-quick --n 32 --seed 42 grid --out /tmp/lab
  python experiments/scripts/autoselect_lab.py --world clip-quick --n 32 --seed 42 auto --auto '{criterion: objective}'

``grid`` writes OUT/grid-n<n>-seed<seed>.json (every point's average and per-task scores) and resumes from it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from autoselect_study import catalog_for, without_log_dir  # noqa: E402
from diagnostics import machine  # noqa: E402

LAMBDAS = tuple(10.0**k for k in range(-8, 2))
RHOS = (0.5, 1.0, 1.5, 2.0, 2.5)
ALPHAS = (0.15, 0.3, 0.45, 0.6)
DEFAULT_RULES = "{default: {criterion: objective}, site: {criterion: site, search: grid}}"


def lab_for(world: str, n: int, seed: int, runs: Path):
    """The lab on the study's command for (world, n, seed), its Task Arithmetic merge made first (by the study's
    own ``fusion_bench`` run, cached)."""
    from featcal_experiments.autoselect_lab import Lab
    from featcal_experiments.cli_runs import run_fusion_bench
    from featcal_experiments.worlds.registry import world_path

    catalog, setting = catalog_for(world, runs)
    upstream = catalog.upstream_run(setting.key, "ta")
    run_fusion_bench(runs / upstream.id, without_log_dir(upstream.args), world=world_path(world))
    run = catalog.calibrator_run(setting.key, "ta", "featcal", (n, seed))
    return Lab(without_log_dir(run.args))


def resolution(lab, args, command: str) -> None:
    """Writes OUT/resolution-<world>-n<n>-seed<seed>.json (each grid point's and rule's per-example test records:
    correctness bit-packed, a regression task's parsed outputs, and the summary), resuming from it. The first
    point's scores read from its records are checked against the task pool's own evaluation."""
    import numpy as np
    from omegaconf import OmegaConf

    from featcal_experiments.label_resolution import (averages, check_against, file_records, oracle_bias, split_half,
                                                      stored)

    records_of = lab.per_example()
    if records_of is None:
        raise SystemExit(f"resolution reads each test example's record from a CLIP or text-generation task pool; "
                         f"{args.world}'s is neither")
    path = args.out / f"resolution-{args.world}-n{args.n}-seed{args.seed}.json"
    data = json.loads(path.read_text()) if path.is_file() else {"points": [], "rules": {}}
    data["labels"] = {t: [float(v) for v in values] for t, values in records_of.labels.items()}

    def record(model) -> dict:
        records = {t: np.asarray(r) for t, r in records_of.correct(model).items()}
        data["sizes"] = {t: len(r) for t, r in records.items()}
        if not data["points"]:
            check_against(records, {t: np.asarray(v) for t, v in data["labels"].items()},
                          lab.evaluate(model, exact=True))
        return {t: stored(r, t in data["labels"]) for t, r in records.items()}

    done = {(p["lambda_"], p["rho"], p["alpha"]) for p in data["points"]}
    values = [[float(v) for v in s.split(",")] for s in (args.lambdas, args.rhos, args.alphas)]
    for lam, rho, alpha in itertools.product(*values):
        if (lam, rho, alpha) not in done:
            model, _ = lab.calibrate(args.n, args.seed, lambda_=lam, rho=rho, alpha=alpha)
            data["points"].append({"lambda_": lam, "rho": rho, "alpha": alpha, "correct": record(model)})
            path.write_text(json.dumps(data))
    rules = args.rules or (DEFAULT_RULES if lab._clip_pool() else "{default: {criterion: objective}}")
    for name, options in OmegaConf.to_container(OmegaConf.create(rules)).items():
        if name not in data["rules"]:
            model, report = lab.calibrate(args.n, args.seed, auto_select=options)
            data["rules"][name] = {"auto_select": options, "choice": report["auto_select"]["choice"],
                                   "correct": record(model)}
            path.write_text(json.dumps(data))
    grid, labels = file_records(data, data["points"])
    names = list(data["rules"])
    by_rule = file_records(data, [data["rules"][name] for name in names])[0] if names else {}
    rules = {name: {t: r[i] for t, r in by_rule.items()} for i, name in enumerate(names)}
    scores = averages(grid, labels=labels)
    best = data["points"][int(np.argmax(scores))]
    data.update(command=command, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=machine(),
                world=args.world, n=args.n, seed=args.seed, summary={
                    "grid_points": len(scores), "best": {k: best[k] for k in ("lambda_", "rho", "alpha")},
                    "rules": {name: float(averages({t: r[None] for t, r in rule.items()}, labels=labels)[0])
                              for name, rule in rules.items()},
                    **oracle_bias(grid, args.draws, args.seed, labels),
                    "split_half": split_half(grid, rules, args.splits, args.seed, labels)})
    path.write_text(json.dumps(data))
    print(json.dumps(data["summary"], indent=1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", required=True)
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--runs", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("/tmp/autoselect_lab"))
    sub = parser.add_subparsers(dest="command", required=True)
    grid = sub.add_parser("grid")
    grid.add_argument("--lambdas", default=",".join(map(repr, LAMBDAS)))
    grid.add_argument("--rhos", default=",".join(map(repr, RHOS)))
    grid.add_argument("--alphas", default=",".join(map(repr, ALPHAS)))
    auto = sub.add_parser("auto")
    auto.add_argument("--auto", default="{criterion: objective}")
    variant = sub.add_parser("variant", help="a per-block rule of featcal_experiments.autoselect_variants")
    variant.add_argument("--target", choices=("expert", "own"), default="own")
    variant.add_argument("--tolerance", type=float, default=None, help="keep the config's values unless beaten by this")
    variant.add_argument("--lambdas", default=",".join(repr(10.0**k) for k in range(-6, 2)))
    variant.add_argument("--rhos", default=",".join(map(repr, RHOS)))
    variant.add_argument("--alphas", default=None, help="default: the config's alpha")
    variant.add_argument("--folds", type=int, default=0, help="cross-fit over this many folds (0: one held-out quarter)")
    variant.add_argument("--z", type=float, default=0.0, help="with --folds and --tolerance: standard errors to beat")
    variant.add_argument("--per-site", action="store_true", help="with --folds: each site its own candidate")
    variant.add_argument("--per-task", choices=("sum", "normalized"), default=None,
                         help="with --folds: each task's held-out objective apart, combined by this rule")
    variant.add_argument("--name", required=True)
    probe = sub.add_parser("alpha-probe", help="per alpha at a fixed lambda and rho: held-out end-of-model "
                                               "criteria after a calibration on the fit part, and the test score")
    probe.add_argument("--lambda", dest="lambda_", type=float, required=True)
    probe.add_argument("--rho", type=float, required=True)
    probe.add_argument("--alphas", default="0.15,0.3,0.45,0.6")
    probe.add_argument("--no-test", dest="test", action="store_false",
                       help="the held-out criteria only (no calibration on all examples, no test score)")
    probe.add_argument("--test-fit", action="store_true",
                       help="also the test score of the copy calibrated on the fit part, the one the criteria read")
    res = sub.add_parser("resolution", help="CLIP and text worlds: each test example's record over a grid and "
                         "label-free rules, then the oracle's selection bias and a labelled half-test sweep "
                         "(featcal_experiments.label_resolution)")
    res.add_argument("--lambdas", default="1e-07,1e-06,1e-05,0.0001,0.001,0.01")
    res.add_argument("--rhos", default="2.0,2.5")
    res.add_argument("--alphas", default="0.3,0.45,0.6")
    res.add_argument("--rules", default=None, help="name -> method.auto_select options, as YAML (default: "
                     "the default rule, and on CLIP worlds criterion site too)")
    res.add_argument("--draws", type=int, default=2000, help="bootstrap resamples of the test examples")
    res.add_argument("--splits", type=int, default=500, help="random halvings of the test examples")
    swap = sub.add_parser("swap", help="a variant's per-block choice with one block's values swapped, scored")
    swap.add_argument("--from", dest="source", type=Path, required=True, help="a variant's JSON")
    swap.add_argument("--blocks", required=True, help="comma-separated block indices")
    swap.add_argument("--candidates", required=True, help="semicolon-separated candidate keys, e.g. lambda_=1e-06,rho=2,alpha=0.6")
    args = parser.parse_args(argv)
    command = "python experiments/scripts/autoselect_lab.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    runs = (args.runs or REPO / "outputs" / "autoselect" / args.world).resolve()
    lab = lab_for(args.world, args.n, args.seed, runs)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.command == "grid":
        path = args.out / f"grid-{args.world}-n{args.n}-seed{args.seed}.json"
        points = json.loads(path.read_text()) if path.is_file() else []
        done = {(p["lambda_"], p["rho"], p["alpha"]) for p in points}
        values = [[float(v) for v in s.split(",")] for s in (args.lambdas, args.rhos, args.alphas)]
        for lam, rho, alpha in itertools.product(*values):
            if (lam, rho, alpha) in done:
                continue
            started = time.perf_counter()
            result = lab.score(args.n, args.seed, lambda_=lam, rho=rho, alpha=alpha)
            points.append({"lambda_": lam, "rho": rho, "alpha": alpha, "average": result["average"],
                           "scores": result["scores"], "seconds": time.perf_counter() - started})
            print(f"lambda {lam:g} rho {rho:g} alpha {alpha:g}: {result['average']:.2f} "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)
            path.write_text(json.dumps(points, indent=1))
        best = max(points, key=lambda p: p["average"])
        print("best", best["lambda_"], best["rho"], best["alpha"], round(best["average"], 2))
    elif args.command == "variant":
        from featcal_fusionbench.autoselect.options import all_candidates
        from featcal_experiments.autoselect_variants import VariantSelection

        hp = lab.prepare(args.n, args.seed)[0].featcal_hparams
        grid = {"lambda_": [float(v) for v in args.lambdas.split(",")],
                "rho": [float(v) for v in args.rhos.split(",")],
                "alpha": [float(v) for v in args.alphas.split(",")] if args.alphas else [hp.alpha]}
        config = {"lambda_": hp.lambda_, "rho": hp.rho, "alpha": hp.alpha}
        candidates = all_candidates(grid)
        if args.tolerance is not None and config not in candidates:
            candidates.insert(0, config)
        from featcal_experiments.autoselect_variants import (CrossFitSelection, PerSiteSelection,
                                                             TaskCrossFitSelection)

        kwargs = dict(target=args.target, prefer=config if args.tolerance is not None else None,
                      tolerance=args.tolerance or 0.0)
        cross_fit = PerSiteSelection if args.per_site else CrossFitSelection
        if args.per_task:
            policy = TaskCrossFitSelection(candidates, rule=args.per_task, folds=args.folds, **kwargs)
        elif args.folds:
            policy = cross_fit(candidates, folds=args.folds, z=args.z, **kwargs)
        else:
            policy = VariantSelection(candidates, **kwargs)
        started = time.perf_counter()
        result = lab.score(args.n, args.seed, policy=policy)
        out = {"command": command,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
               "name": args.name, "world": args.world, "n": args.n, "seed": args.seed, "average": result["average"],
               "scores": result["scores"], "choices": [e["chosen"] for e in policy.log], "log": policy.log,
               "seconds": time.perf_counter() - started}
        path = args.out / f"variant-{args.world}-n{args.n}-seed{args.seed}-{args.name}.json"
        path.write_text(json.dumps(out, indent=1))
        print(f"{args.name}: {result['average']:.2f}", out["choices"], flush=True)
    elif args.command == "alpha-probe":
        from featcal_experiments.autoselect_lab import alpha_probe

        rows = alpha_probe(lab, args.n, args.seed, [float(a) for a in args.alphas.split(",")], test=args.test,
                           test_fit=args.test_fit, lambda_=args.lambda_, rho=args.rho)
        out = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
               "world": args.world, "n": args.n, "seed": args.seed, "lambda_": args.lambda_, "rho": args.rho,
               "rows": rows}
        with open(args.out / "alpha-probe.jsonl", "a") as f:
            f.write(json.dumps(out) + "\n")
        for row in rows:
            print(json.dumps({k: round(v, 4) for k, v in row.items() if not isinstance(v, dict)}), flush=True)
    elif args.command == "resolution":
        resolution(lab, args, command)
    elif args.command == "swap":
        from dataclasses import replace

        from featcal_fusionbench.engine.policy import FixedHParams

        source = json.loads(args.source.read_text())
        hp = lab.prepare(args.n, args.seed)[0].featcal_hparams

        def parse(key):
            return {k: float(v) for k, v in (part.split("=") for part in key.split(","))}

        base = [parse(c) for c in source["choices"]]
        path = args.out / f"swap-{args.source.stem}.json"
        results = json.loads(path.read_text()) if path.is_file() else []
        for block in [int(b) for b in args.blocks.split(",")]:
            for key in args.candidates.split(";"):
                if any(r["block"] == block and r["candidate"] == key for r in results):
                    continue
                schedule = [replace(hp, **(parse(key) if i == block else c)) for i, c in enumerate(base)]
                result = lab.score(args.n, args.seed, policy=FixedHParams(schedule))
                results.append({"block": block, "candidate": key, "average": result["average"],
                                "scores": result["scores"]})
                print(f"block {block} {key}: {result['average']:.2f}", flush=True)
                path.write_text(json.dumps(results, indent=1))
    else:
        from omegaconf import OmegaConf

        options = OmegaConf.to_container(OmegaConf.create(args.auto))
        result = lab.score(args.n, args.seed, auto_select=options)
        auto = result["report"]["auto_select"]
        out = {"command": command,
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
               "world": args.world, "n": args.n, "seed": args.seed, "auto_select": options,
               "average": result["average"], "scores": result["scores"], "choice": auto["choice"],
               "cost_multiple": auto["cost_multiple"], "candidates": auto.get("candidates"), "blocks": auto.get("blocks"),
               **{key: auto[key] for key in ("alpha", "lambda") if key in auto}}
        with open(args.out / "auto.jsonl", "a") as f:
            f.write(json.dumps(out) + "\n")
        print(json.dumps({k: out[k] for k in ("average", "choice", "cost_multiple")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
