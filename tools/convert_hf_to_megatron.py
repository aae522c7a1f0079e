#!/usr/bin/env python
"""Convert a HuggingFace Llama / Qwen2 checkpoint into a Megatron-Core checkpoint at a target TP x PP.

    python tools/convert_hf_to_megatron.py --hf-dir HF --save OUT \
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2 [--megatron-format torch_dist]

Streams tensor by tensor (reads only the rows each shard needs); copies the tokenizer and config files.
"""

import argparse
import resource
import sys
import time

from megatron_rl.models.layout import TRANSFORMER_IMPLS


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", "--load", dest="hf_dir", required=True, help="HF checkpoint directory")
    p.add_argument("--save", required=True, help="output Megatron checkpoint directory")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1)
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument("--megatron-format", choices=["safetensors", "torch_dist"], default="safetensors",
                   help="per-rank safetensors files (streamed), or Megatron-Core's distributed checkpoint")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--transformer-impl", choices=TRANSFORMER_IMPLS, default="local",
                   help="Megatron-Core layer spec whose parameter names the checkpoint uses")
    p.add_argument("--decoder-first-pipeline-num-layers", type=int)
    p.add_argument("--decoder-last-pipeline-num-layers", type=int)
    p.add_argument("--overwrite", action="store_true", help="replace --save if it exists")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)

    from megatron_rl.conversion import hf_to_megatron
    from megatron_rl.models.layout import TrainerLayout

    start = time.time()
    try:
        layout = TrainerLayout(args.target_tensor_parallel_size, args.target_pipeline_parallel_size, 1,
                               args.make_vocab_size_divisible_by, args.transformer_impl,
                               args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers)
        meta = hf_to_megatron(args.hf_dir, args.save, layout, args.megatron_format, args.overwrite,
                              not args.no_progress)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as e:
        # The layout's errors name the trainer's flags; this tool's are the --target-* ones.
        message = str(e).replace("--tensor-model-parallel-size", "--target-tensor-parallel-size") \
            .replace("--pipeline-model-parallel-size", "--target-pipeline-parallel-size")
        print(f"error: {message}", file=sys.stderr)
        return 2
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"wrote {args.save} ({meta['format']}, TP={meta['tensor_parallel_size']}, "
          f"PP={meta['pipeline_parallel_size']}, {meta['dtype']}) in {time.time() - start:.1f} s; "
          f"peak RSS {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
