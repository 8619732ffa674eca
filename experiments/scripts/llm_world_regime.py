"""Print the offline LLM world's regime figures (from its world.json) as a Markdown table.

Usage: python experiments/scripts/llm_world_regime.py [--world-dir DIR]   # default: `featcal-world path llm`
None of these figures involves FeatCal: they are the checks the world must pass before FeatCal is measured on it.
"""

import argparse
import json
from pathlib import Path

from featcal_experiments.worlds.llm_world import regime_table
from featcal_experiments.worlds.registry import world_meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-dir", type=Path, default=None)
    args = parser.parse_args()
    meta = world_meta("llm", args.world_dir)
    figures = meta["figures"]
    print(regime_table(meta))
    print("\nTask Arithmetic on the validation split:", json.dumps(figures["task_arithmetic_validation"]))
    print("task vectors:", json.dumps(figures["task_vectors"]))
    print("regime checks:", json.dumps(figures["regime_checks"]))
    print(f"built in {meta['timings_s']['total'] / 60:.1f} min ({meta['timings_s']}); {meta['machine']}")


if __name__ == "__main__":
    main()
