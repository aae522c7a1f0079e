"""Entry point: `torchrun --nproc-per-node N -m megatron_rl.train [flags]` (python -m megatron_rl.train --help)."""

from __future__ import annotations

import os
import sys


def main(argv=None) -> int:
    from megatron_rl.arguments import parse_args
    from megatron_rl.launch import die_with_parent

    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()  # a killed torchrun takes its workers with it (they run in sessions of their own)
    args = parse_args(argv)
    try:
        if args.dry_run:
            from megatron_rl.dry_run import main as dry_run

            return dry_run(args)
        from megatron_rl.controller import run

        run(args)
    except ValueError as e:  # configuration errors: one clear line, no stack trace
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # the guard matters: the dist-checkpoint writer re-imports __main__
    raise SystemExit(main())
