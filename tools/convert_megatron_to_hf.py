#!/usr/bin/env python
"""Convert a Megatron-Core checkpoint written by megatron-rl back to HF: the HF -> Megatron converter's output (any
TP x PP, either format), or a trained policy in an RL run's checkpoint directory (--save; its latest iteration, or
--iteration N), or one iteration of it.

    python tools/convert_megatron_to_hf.py --load MEGATRON --save HF [--iteration N] [--max-shard-size-gb 5]

The output (config.json, safetensors, generation_config.json, the tokenizer) loads with
`transformers.AutoModelForCausalLM.from_pretrained(HF)`. Streams tensor by tensor; a distributed checkpoint (the
converter's torch_dist format, or an RL checkpoint) is first read by as many processes as its TP x PP.
"""

import argparse
import resource
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True,
                   help="Megatron checkpoint directory (megatron_rl.json), or an RL checkpoint directory")
    p.add_argument("--iteration", type=int, help="with an RL checkpoint directory: this step (default: the latest)")
    p.add_argument("--save", "--hf-dir", dest="save", required=True, help="output HF directory")
    p.add_argument("--max-shard-size-gb", type=float, default=5.0)
    p.add_argument("--overwrite", action="store_true", help="replace --save if it exists")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    from megatron_rl.checkpoint.hf_conversion import megatron_to_hf
    from megatron_rl.checkpoint.rl_checkpoint import weights_directory

    start = time.time()
    try:
        load = weights_directory(args.load, args.iteration)
        info = megatron_to_hf(load, args.save, int(args.max_shard_size_gb * 2**30), args.overwrite,
                              not args.no_progress)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"wrote {args.save} from {load}: {info['tensors']} tensors in {info['files']} file(s) in "
          f"{time.time() - start:.1f} s; peak RSS {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
