"""The trainer's weights outside the run: the description that makes a checkpoint of them self-contained, and the
HF export of the policy during a run.

`ModelDescription.write(directory, format)` puts beside weights what HF tools and `megatron_format.MegatronCheckpoint`
need to read them: `megatron_rl.json` (the HF config, the dtype, the trainer layout the weights are sharded in),
the run's tokenizer and a `generation_config.json`. The trainer's "save" writes it into each RL checkpoint
iteration, so that tools/convert_megatron_to_hf.py exports an iteration and --load-megatron starts a run from one.

`save_hf` (the trainer's "save_hf" command) writes the policy as an HF checkpoint without any rank holding the
whole model: each trainer rank of data-parallel rank 0 (and, with expert parallelism, of the next DP ranks up to
the layout's expert replica span, which hold the other experts) writes its own shard file (the per-rank
`safetensors` format of `conversion`), then trainer rank 0 assembles the HF tensors one at a time from those files
(`hf_conversion.megatron_to_hf`) and removes them.
"""

from __future__ import annotations

import dataclasses
import os
import shutil

import torch

from megatron_rl.checkpoint import hf_conversion, megatron_format
from megatron_rl.models.parallelism import TrainerLayout
from megatron_rl.models.spec import ModelSpec

GENERATION_CONFIG = "generation_config.json"


@dataclasses.dataclass(frozen=True)
class ModelDescription:
    """The model beside its weights: architecture, layout, dtype, tokenizer; `generation_source`: a directory whose
    generation_config.json is carried over (the HF model or checkpoint the run started from), if any."""

    spec: ModelSpec
    layout: TrainerLayout
    dtype: torch.dtype
    tokenizer: object
    generation_source: str | None = None

    def hf_config(self) -> dict:
        """The HF config.json of the model: the spec's, with the weights' dtype and the tokenizer's special ids."""
        config = self.spec.to_hf_config()
        config["torch_dtype"] = str(self.dtype).removeprefix("torch.")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self.tokenizer, name, None)
            if value is not None:
                config[name] = value
        return config

    def generation_config(self):
        """The source's generation config if it has one, else one from the tokenizer; its eos ids include the
        tokenizer's eos (the token the run's generators stop at)."""
        import transformers

        source = self.generation_source
        if source and os.path.isfile(os.path.join(source, GENERATION_CONFIG)):
            config = transformers.GenerationConfig.from_pretrained(source)
        else:
            config = transformers.GenerationConfig(bos_token_id=self.tokenizer.bos_token_id,
                                                   pad_token_id=self.tokenizer.pad_token_id)
        eos = config.eos_token_id
        eos = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos:
            eos.append(self.tokenizer.eos_token_id)
        config.eos_token_id = eos or None
        return config

    def write(self, directory: str, weights_format: str) -> dict:
        """Describe the weights in `directory` (of `weights_format`, see `checkpoint.megatron_format`); returns
        megatron_rl.json."""
        written = [os.path.basename(p) for p in self.tokenizer.save_pretrained(directory)]
        self.generation_config().save_pretrained(directory)
        auxiliary = sorted({n for n in written if os.path.isfile(os.path.join(directory, n))} | {GENERATION_CONFIG})
        return megatron_format.write_meta(directory, weights_format, self.hf_config(), self.dtype, self.layout,
                                          auxiliary)


def save_hf(model: torch.nn.Module, description: ModelDescription, directory: str) -> None:
    """Collective over the trainer's ranks: write this run's policy (`model` is this rank's shard) as an HF
    checkpoint in `directory`, replaced atomically. The rank files go to `directory`.shards/, removed after."""
    import torch.distributed as dist

    shards = os.path.abspath(directory) + ".shards"
    if dist.get_rank() == 0:
        shutil.rmtree(shards, ignore_errors=True)  # left by an interrupted export
        os.makedirs(shards)
    dist.barrier()
    megatron_format.write_rank_file(model, shards, description.layout)  # DP rank 0, and those with other experts
    dist.barrier()
    if dist.get_rank() == 0:
        try:
            description.write(shards, "safetensors")
            hf_conversion.megatron_to_hf(shards, directory, overwrite=True, progress=False)
        finally:
            shutil.rmtree(shards, ignore_errors=True)
