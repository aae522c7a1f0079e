"""Built-in engine throughput vs `transformers.generate` (and vs a real SGLang server when sglang is
installed, e.g. in the environment of tools/sglang_cpu/setup_env.sh): same model, same prompts, greedy,
fp32, CPU. Generated tokens per second for each, and their ratios, at several batch sizes.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
import time

import torch


def run(quick: bool = False) -> dict:
    from megatron_rl.models.hf import save_random_hf_model
    from megatron_rl.models.spec import get_model_spec
    from megatron_rl.rollout import LocalEngine, SamplingParams

    spec = get_model_spec("tiny-llama").replace(name="bench-engine", hidden_size=256, ffn_hidden_size=688,
                                                num_layers=4, num_attention_heads=8, num_key_value_heads=4,
                                                vocab_size=512)
    new_tokens, prompt_len = (32, 16) if quick else (64, 32)
    batches = (1, 8) if quick else (1, 8, 16)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    out = {"model": {"hidden": spec.hidden_size, "layers": spec.num_layers, "vocab": spec.vocab_size},
           "new_tokens": new_tokens, "prompt_len": prompt_len, "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as d:
        model = save_random_hf_model(spec, d, seed=0)
        engine = LocalEngine.from_hf(d, max_slots=33, max_seq_len=prompt_len + new_tokens + 1)
        params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
        g = torch.Generator().manual_seed(0)
        for b in batches:
            prompts = torch.randint(0, spec.vocab_size, (b, prompt_len), generator=g)
            engine.generate(prompts[:1].tolist(), params)  # warm-up
            start = time.perf_counter()
            outs = engine.generate(prompts.tolist(), params)
            t_engine = time.perf_counter() - start
            with torch.no_grad():
                model.generate(prompts[:1], max_new_tokens=4, do_sample=False)  # warm-up
                start = time.perf_counter()
                ref = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False)
                t_hf = time.perf_counter() - start
            same = sum(o.token_ids == r[prompt_len:].tolist() for o, r in zip(outs, ref))
            tokens = b * new_tokens
            out[f"batch_{b}"] = {"engine_tokens_per_s": tokens / t_engine, "transformers_tokens_per_s": tokens / t_hf,
                                 "speedup_vs_transformers": t_hf / t_engine, "identical_sequences": f"{same}/{b}"}
        if importlib.util.find_spec("sglang") is not None:
            _vs_sglang(d, spec, out, batches, prompt_len, new_tokens)
    out["speedup_vs_transformers"] = out[f"batch_{batches[-1]}"]["speedup_vs_transformers"]
    return out


def _vs_sglang(model_dir, spec, out, batches, prompt_len, new_tokens) -> None:
    """The same prompts through a real SGLang server on the same checkpoint (HTTP included, as the adapter
    uses it); server start-up is not timed."""
    from megatron_rl.rollout import SamplingParams
    from megatron_rl.rollout.sglang.engine import SGLangEngine
    from megatron_rl.rollout.sglang.server import SGLangServer
    from megatron_rl.runtime.spawn import free_port

    server = SGLangServer.launch(model_dir, 1, free_port(), os.path.join(model_dir, "sglang.log"), load_format="auto")
    engine = SGLangEngine(spec, server)
    try:
        params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
        g = torch.Generator().manual_seed(0)  # the prompts of the loop above
        for b in batches:
            prompts = torch.randint(0, spec.vocab_size, (b, prompt_len), generator=g)
            engine.generate(prompts[:1].tolist(), params)  # warm-up
            start = time.perf_counter()
            engine.generate(prompts.tolist(), params)
            t_sglang = time.perf_counter() - start
            row = out[f"batch_{b}"]
            row["sglang_tokens_per_s"] = b * new_tokens / t_sglang
            row["speedup_vs_sglang"] = row["engine_tokens_per_s"] / row["sglang_tokens_per_s"]
        out["speedup_vs_sglang"] = out[f"batch_{batches[-1]}"]["speedup_vs_sglang"]
    finally:
        engine.shutdown()
