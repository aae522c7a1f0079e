"""HuggingFace models as the independent reference: built offline from a ModelSpec (no downloads) for tests and the
tiny CPU example, and greedy answers of a `transformers` model to many prompts (tools/eval_hf.py, the benchmarks)."""

from __future__ import annotations

import torch

from megatron_rl.models.spec import ModelSpec


def hf_config(spec: ModelSpec):
    import transformers

    return transformers.AutoConfig.for_model(**spec.to_hf_config())


def random_hf_model(spec: ModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A `transformers` causal LM of this architecture with seeded random weights, in eval mode."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(spec), dtype=dtype)
    with torch.no_grad():  # random norm weights, so that a wrong norm mapping cannot go unnoticed
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model.eval()


def save_random_hf_model(spec: ModelSpec, directory: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    model = random_hf_model(spec, seed, dtype)
    model.save_pretrained(directory)
    return model


@torch.no_grad()
def greedy_responses(model, prompts: list[list[int]], max_new_tokens: int, stop_token_ids, pad_token_id: int,
                     batch_size: int = 32, progress: bool = False) -> list[tuple[list[int], str]]:
    """(response token ids without the stop token, finish reason "stop" or "length") of each prompt, answered
    greedily by `model.generate`, `batch_size` prompts at a time (sorted by length, left-padded). A padded batch runs
    other matmul shapes than one prompt alone, so a near-tie can break the other way: batch_size 1 is the exact mode."""
    from tqdm import tqdm

    stops = set(stop_token_ids)
    out: list = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    with tqdm(total=len(prompts), desc="generate", unit="prompt", disable=not progress, dynamic_ncols=True) as bar:
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            width = max(len(prompts[i]) for i in batch)
            ids = torch.tensor([[pad_token_id] * (width - len(prompts[i])) + prompts[i] for i in batch])
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in batch])
            generated = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                       eos_token_id=list(stops), pad_token_id=pad_token_id)
            for row, i in enumerate(batch):
                new = generated[row, width:].tolist()
                end = next((k for k, t in enumerate(new) if t in stops), None)
                out[i] = (new[:end], "stop" if end is not None else "length")
            bar.update(len(batch))
    return out
