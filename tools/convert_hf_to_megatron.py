#!/usr/bin/env python
"""Convert a HuggingFace Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE / Mixtral checkpoint into a Megatron-Core
checkpoint at a target TP x PP (and, for experts, EP x expert-TP).

    python tools/convert_hf_to_megatron.py --hf-dir HF --save OUT \
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2 [--megatron-format torch_dist] \
        [--target-expert-model-parallel-size 2 [--target-expert-tensor-parallel-size 1]]

Streams tensor by tensor (reads only the rows each shard needs); copies the tokenizer and config files.
"""

import argparse
import resource
import sys
import time

from megatron_rl.models.parallelism import TRANSFORMER_IMPLS

# The layout's errors name the trainer's flags; this tool's are these.
TARGET_FLAGS = {"--tensor-model-parallel-size": "--target-tensor-parallel-size",
                "--pipeline-model-parallel-size": "--target-pipeline-parallel-size",
                "--expert-model-parallel-size": "--target-expert-model-parallel-size",
                "--expert-tensor-parallel-size": "--target-expert-tensor-parallel-size"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-dir", "--load", dest="hf_dir", required=True, help="HF checkpoint directory")
    p.add_argument("--save", required=True, help="output Megatron checkpoint directory")
    p.add_argument("--target-tensor-parallel-size", type=int, default=1)
    p.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    p.add_argument("--target-expert-model-parallel-size", type=int, default=1,
                   help="experts split over this many EP ranks (a mixture of experts)")
    p.add_argument("--target-expert-tensor-parallel-size", type=int,
                   help="tensor parallelism inside each expert (default: --target-tensor-parallel-size)")
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

    from megatron_rl.checkpoint.hf_conversion import hf_to_megatron
    from megatron_rl.models.parallelism import TrainerLayout

    start = time.time()
    try:
        layout = TrainerLayout(args.target_tensor_parallel_size, args.target_pipeline_parallel_size, 1,
                               args.make_vocab_size_divisible_by, args.transformer_impl,
                               args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers,
                               expert_model_parallel_size=args.target_expert_model_parallel_size,
                               expert_tensor_parallel_size=args.target_expert_tensor_parallel_size)
        meta = hf_to_megatron(args.hf_dir, args.save, layout, args.megatron_format, args.overwrite,
                              not args.no_progress)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as e:
        message = str(e)
        for trainer_flag, flag in TARGET_FLAGS.items():
            message = message.replace(trainer_flag, flag)
        print(f"error: {message}", file=sys.stderr)
        return 2
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    experts = f", EP={meta['expert_model_parallel_size']}" if meta["expert_model_parallel_size"] > 1 else ""
    print(f"wrote {args.save} ({meta['format']}, TP={meta['tensor_parallel_size']}, "
          f"PP={meta['pipeline_parallel_size']}{experts}, {meta['dtype']}) in {time.time() - start:.1f} s; "
          f"peak RSS {peak:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
