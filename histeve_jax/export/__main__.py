"""``python -m histeve_jax.export --run=<workdir> --out=<dir> [--step=N] [--dtype=bfloat16] [--overwrite]
[--detector=<detector run> [--detector_step=M]]``.

``--detector``: also export the completion detector a detector run trained beside this policy (a detector
run is its own workdir, e.g. ``experiments.detector``'s ``<workdir>/run_x4``; ``export.detector_export``).
Bad input (no checkpoint, a non-empty ``--out`` without ``--overwrite``, a checkpoint that does not match
its run's config, a detector that does not read this policy) is one line on stderr naming it, and exit
status 2.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Parse the flags and export; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m histeve_jax.export", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="the run's workdir (config.json + checkpoints/)")
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="weights' dtype (default: the parameters')")
    parser.add_argument("--max_shard_size", default="5GB", help="safetensors shard size, e.g. 5GB")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--detector", default=None,
                        help="a detector run's workdir to export beside the policy")
    parser.add_argument("--detector_step", type=int, default=None,
                        help="the detector's checkpoint step (default: the latest)")
    args = parser.parse_args(argv)

    from histeve_jax.export.directory import export_run

    try:
        out = export_run(args.run, args.out, step=args.step, dtype=args.dtype,
                         max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                         detector=args.detector, detector_step=args.detector_step)
    except (FileNotFoundError, ValueError) as e:
        print(f"export: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    print(f"exported {args.run} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
