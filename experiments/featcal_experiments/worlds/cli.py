"""`featcal-world`: list, build and locate the offline worlds."""

from __future__ import annotations

import argparse
import sys

from .registry import WORLDS, build_world, fusion_bench_args, is_built, pools, world_path, worlds_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="featcal-world", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the known worlds and whether each is built")
    build = sub.add_parser("build", help="build a world (skipped when already built)")
    build.add_argument("name", choices=sorted(WORLDS))
    build.add_argument("--force", action="store_true", help="rebuild even if built")
    build.add_argument("--seed", type=int, default=None,
                       help="build the recipe with this seed instead of its own (another world of the same kind; "
                            "set FEATCAL_WORLDS_DIR to keep it apart from the default build)")
    path = sub.add_parser("path", help="print a world's folder")
    path.add_argument("name", choices=sorted(WORLDS))
    path.add_argument("--build", action="store_true", help="build it first if absent")
    fb_args = sub.add_parser("args", help="print the fusion_bench arguments that select a world's pools")
    fb_args.add_argument("name", choices=sorted(WORLDS))
    fb_args.add_argument("--openclip", action="store_true",
                         help="the world served through FusionBench's OpenCLIP pool and task pool (CLIP worlds)")
    args = parser.parse_args(argv)

    if args.command == "list":
        print(f"worlds folder: {worlds_dir()} (set FEATCAL_WORLDS_DIR to move it)")
        for name, world in WORLDS.items():
            state = "built" if is_built(name) else "not built"
            print(f"{name:10s} {state:10s} {world.description}")
        return 0
    if args.command == "build":
        print(build_world(args.name, force=args.force, seed=args.seed))
        return 0
    if args.command == "args":
        try:
            pools(args.name, openclip=args.openclip)
        except KeyError as error:  # a world with no OpenCLIP pools: named before the build check
            print(error.args[0], file=sys.stderr)
            return 2
        if not is_built(args.name):
            print(f"world {args.name!r} is not built; run: featcal-world build {args.name}", file=sys.stderr)
            return 1
        print(" ".join(fusion_bench_args(args.name, openclip=args.openclip)))
        return 0
    if args.build:
        build_world(args.name)
    elif not is_built(args.name):
        print(f"world {args.name!r} is not built; run: featcal-world build {args.name}", file=sys.stderr)
        return 1
    print(world_path(args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
