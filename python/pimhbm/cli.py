"""The ``pimhbm`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pimhbm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the main job: damage a model-sized pytree, find every fault")
    demo.add_argument("--hidden", type=int, default=512, help="model width (default 512)")
    demo.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    demo.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default 8192)")
    demo.add_argument("--flips", type=int, default=32, help="bit flips to inject (default 32)")
    demo.add_argument("--nonfinite", type=int, default=6, help="NaN/Inf values to inject")
    demo.add_argument("--chunk-bytes", type=int, default=None, help="digest chunk size")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.add_argument("--device", default=None, help="cpu or gpu (default: JAX's default)")

    args = parser.parse_args(argv)
    if args.command == "demo":
        from pimhbm import demo as demo_mod
        return demo_mod.run(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
