"""``python -m icr.data.synthetic --out DIR [--preset P] [--seed N] [--workers N]``.

Presets: tiny, small, default, default-2048, large, xlarge (:data:`icr.data.synthetic.writer.PRESETS`).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

from icr.data.synthetic.writer import PRESETS, generate
from icr.errors import UserError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m icr.data.synthetic", description=__doc__)
    parser.add_argument("--out", required=True, help="folder to create (must not hold files)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing folder")
    parser.add_argument("--workers", type=int, help="processes generating images (default: up to "
                        "2); the files do not depend on it")
    args = parser.parse_args(argv)
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers {args.workers}: give 1 or more")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    try:
        out = generate(args.out, args.preset, args.seed, overwrite=args.overwrite,
                       workers=args.workers)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{out}: preset {args.preset}, seed {args.seed}, {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
