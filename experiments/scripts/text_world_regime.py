"""Print the offline text world's regime figures (from its world.json) as Markdown tables.

Usage: python experiments/scripts/text_world_regime.py [--world-dir DIR]   # default: `featcal-world path t5`
None of these figures involves FeatCal: they are the checks the world must pass before FeatCal is measured on it.
"""

import argparse
from pathlib import Path

from featcal_experiments.worlds.registry import world_meta
from featcal_experiments.worlds.t5_world import expert_matrix_table, regime_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-dir", type=Path, default=None)
    args = parser.parse_args()
    meta = world_meta("t5", args.world_dir)
    print(regime_table(meta), "", expert_matrix_table(meta), sep="\n")
    print(f"\nbuilt in {meta['build_seconds'] / 60:.1f} min ({meta['machine']}); {meta['parameters']:,} parameters")


if __name__ == "__main__":
    main()
