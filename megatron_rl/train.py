"""Entry point: `torchrun --nproc-per-node N -m megatron_rl.train [flags]` (python -m megatron_rl.train --help)."""

from __future__ import annotations

import os
import sys


def main(argv=None) -> int:
    from megatron_rl.config.arguments import parse_args
    from megatron_rl.runtime.lifetime import die_with_parent

    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()  # a killed torchrun takes its workers with it (they run in sessions of their own)
    args = parse_args(argv)
    try:
        if args.dry_run:
            from megatron_rl.config.dry_run import main as dry_run

            return dry_run(args)
        run(args)
    except ValueError as e:  # configuration errors: one clear line, no stack trace
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _device(args, setup):
    """This rank's device (`runtime.device.select_device`). A generator rank of an SGLang server computes on the GPU
    of its SGLang TP worker when the run launched the server (DDMA lands there, and the worker opens it through CUDA
    IPC), and on the CPU for an attached server, which may sit on other GPUs (shared memory on the same node)."""
    from megatron_rl.runtime.device import select_device

    local_rank, rank = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("RANK", "0"))
    if args.rollout_backend != "sglang" or rank < setup.trainer.world_size:
        return select_device(args.device, local_rank)
    if args.rollout_server_urls:
        return select_device("cpu")
    from megatron_rl.rollout.sglang.server import worker_gpu

    tp_rank = (rank - setup.trainer.world_size) % setup.generator.tensor_parallel_size
    return select_device(args.device, worker_gpu(local_rank, tp_rank, setup.sglang_flags))


def run(args) -> None:
    """One rank of a launch: build the run setup, this rank's role and executor, and (on trainer rank 0) the
    controller beside the trainer executor; then run until the controller says stop."""
    import torch.distributed as dist

    from megatron_rl.config.setup import build_run_setup
    from megatron_rl.runtime.channels import TAG_CONTROL, TAG_ROLLOUTS, Channel
    from megatron_rl.runtime.early_exit import EarlyExit
    from megatron_rl.runtime.lifetime import reap_when_gone
    from megatron_rl.runtime.roles import init_roles

    setup = build_run_setup(args, int(os.environ.get("WORLD_SIZE", "1")))
    early_exit = EarlyExit.from_args(args)  # every rank: the signal only stops the controller, which stops the rest
    reap_when_gone()  # whatever this rank starts from here on dies with it
    device = _device(args, setup)
    roles = init_roles(setup.trainer.world_size, setup.generator.tensor_parallel_size,
                       setup.generator.num_replicas, device=device, timeout_minutes=args.distributed_timeout_minutes)
    if not roles.is_trainer:
        from megatron_rl.rollout.worker import GeneratorWorker

        GeneratorWorker(setup, roles).run()
    else:
        from megatron_rl.trainer.executor import TrainerExecutor

        trainer = TrainerExecutor(setup, roles)
        if roles.is_controller:
            from megatron_rl.controller.loop import Controller

            try:  # whatever happens, the other trainer ranks are released from serve()
                setup.tokenizer.save_pretrained(os.path.join(args.output_dir, "tokenizer"))
                leaders = [setup.generator.rank(r, 0) for r in range(setup.generator.num_replicas)]
                controller = Controller(setup, trainer, Channel(roles.sync_group, TAG_CONTROL),
                                        Channel(roles.sync_group, TAG_ROLLOUTS, senders=leaders), leaders,
                                        early_exit)
                controller.run()
                controller.shutdown()
            finally:
                trainer.stop()
        else:
            trainer.serve()
    dist.destroy_process_group()


if __name__ == "__main__":  # the guard matters: the dist-checkpoint writer re-imports __main__
    raise SystemExit(main())
