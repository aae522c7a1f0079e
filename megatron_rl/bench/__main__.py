"""python -m megatron_rl.bench {async,ddma,engine,trainer,packing,reward,r3,fp8,gpu,trl,all} [--quick]: one JSON object
per benchmark, and as the last line one object with all of them (`all` runs every benchmark but fp8 and gpu, which
need a GPU, and trl, the head-to-head with TRL on a real model: up to an hour, --quick 15 minutes).

python -m megatron_rl.bench ablation [--quick] [flags] [-- train flags]: the off-policy correction vs lag ablation, with
flags of its own (`python -m megatron_rl.bench ablation -h`); hours for the full grid, so not part of `all`.
python -m megatron_rl.bench soak [--quick] [flags]: the chaos soak (SIGKILLs and resumes, then an accounting)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time

BENCHMARKS = ("async", "ddma", "engine", "trainer", "packing", "reward", "r3")
GPU_ONLY = ("fp8", "gpu")
HEAD_TO_HEAD = ("trl",)  # against another system, on a real model: long, so not part of `all`
STUDIES = {"ablation": "megatron_rl.bench.ablation.study", "soak": "megatron_rl.bench.soak"}  # many trainings each


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    for study in STUDIES:  # with flags of its own, wherever its name stands
        if study in argv:
            argv.remove(study)
            return importlib.import_module(STUDIES[study]).main(argv)
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("which", choices=BENCHMARKS + GPU_ONLY + HEAD_TO_HEAD + tuple(STUDIES) + ("all",))
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a run of a few minutes")
    parser.add_argument("--results-file", default=os.environ.get("BENCH_RESULTS", "bench_results.jsonl"),
                        help="each result is also appended here as one JSON line")
    args = parser.parse_args(argv)
    names = BENCHMARKS if args.which == "all" else (args.which,)
    combined = {}
    for name in names:
        module = importlib.import_module(f"megatron_rl.bench.{'async_rl' if name == 'async' else name}")
        result = module.run(quick=args.quick)
        combined[name] = result
        print(json.dumps({name: result}), flush=True)
        with open(args.results_file, "a") as f:
            f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "benchmark": name, "quick": args.quick,
                                **result}) + "\n")
    print(json.dumps(combined))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
