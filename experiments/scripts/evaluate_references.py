"""Reference rows for a world: the pretrained model (zero-shot) on every task and each expert on its own task.

Usage: python experiments/scripts/evaluate_references.py WORLD [--json PATH]
Evaluates through FusionBench's CLIP task pool, exactly as the merged models are.
"""

import argparse
import json
import os

from featcal_experiments.worlds.references import reference_accuracies


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("world")
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = reference_accuracies(args.world)
    for name, accs in (("pretrained (zero-shot)", rows["pretrained"]), ("expert on its own task", rows["experts"])):
        avg = sum(accs.values()) / len(accs)
        print(f"{name:24s} " + " ".join(f"{t}={100 * a:.1f}" for t, a in accs.items()) + f" average={100 * avg:.1f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
