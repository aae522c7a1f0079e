"""Smoke job: Megatron-Core trains a tiny Llama on CPU under a TP/PP layout and the loss must fall.

    torchrun --nproc-per-node 2 -m megatron_rl.smoke --tensor-model-parallel-size 2

It learns a fixed cyclic token sequence (next token = current + 1 mod vocab) by cross entropy, printing a
progress line per step; it exits non-zero if the loss did not fall by half.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--train-iters", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    from megatron_rl.models.layout import TrainerLayout
    from megatron_rl.models.spec import get_model_spec
    from megatron_rl.trainer import parallel
    from megatron_rl.trainer.logprobs import mask_padded_vocab
    from megatron_rl.trainer.policy import build_policy, optimizer_step, run_microbatches

    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    spec = get_model_spec("tiny-llama")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    try:
        if dist.get_world_size() % (tp * pp):
            raise ValueError(f"world size {dist.get_world_size()} is not divisible by --tensor-model-parallel-size "
                             f"{tp} x --pipeline-model-parallel-size {pp}")
        layout = TrainerLayout(tp, pp, dist.get_world_size() // (tp * pp), dtype_bytes=4)
        parallel.initialize(layout, spec, seed=1234)
    except ValueError as e:
        if dist.get_rank() == 0:
            print(f"error: {e}")
        dist.destroy_process_group()
        return 2
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    policy = build_policy(spec, layout, lr=args.lr)
    g = torch.Generator().manual_seed(ps.get_data_parallel_rank())
    first = last = None
    start = time.time()
    for it in range(1, args.train_iters + 1):
        starts = torch.randint(0, spec.vocab_size, (8, 1), generator=g)
        seq = (starts + torch.arange(33)) % spec.vocab_size
        mb = {"input_ids": seq[:, :-1].contiguous(), "labels": seq[:, 1:].contiguous()}
        n = mb["labels"].numel() * ps.get_data_parallel_world_size()

        def loss_fn(logits, mb, n=n):
            loss = vocab_parallel_cross_entropy(mask_padded_vocab(logits.float(), spec.vocab_size), mb["labels"])
            return loss.sum() / n, {"loss": loss.detach().sum() / n}

        out = run_microbatches(policy, [mb], loss_fn)
        step = optimizer_step(policy)
        loss = torch.tensor(out[0]["loss"].item() if out else 0.0)
        # The loss lives on the last pipeline stage; sum it over the DP group there and share it.
        dist.all_reduce(loss)
        loss = loss.item() / ps.get_tensor_model_parallel_world_size()
        first = first if first is not None else loss
        last = loss
        if dist.get_rank() == 0:
            rate = it / (time.time() - start)
            print(f"step {it}/{args.train_iters}  loss {loss:.4f}  grad_norm {step['grad_norm']:.3f}  "
                  f"{rate:.1f} it/s  eta {(args.train_iters - it) / rate:.0f}s", flush=True)
    ok = last < 0.5 * first
    if dist.get_rank() == 0:
        print(f"smoke {'passed' if ok else 'FAILED'}: loss {first:.3f} -> {last:.3f} "
              f"(TP={layout.tensor_parallel_size}, PP={layout.pipeline_parallel_size}, "
              f"DP={ps.get_data_parallel_world_size()})")
    parallel.destroy()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
