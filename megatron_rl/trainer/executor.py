"""The trainer executor: every trainer rank runs the same command, decided by trainer rank 0.

Rank 0 (where the controller also runs) calls `command(name, payload)`: the command is broadcast to the other
trainer ranks, which wait for commands in `serve()`, and all of them execute it through one table of handlers
(train, sft, publish, save, load, save_hf, and for a KL penalty snapshot_reference and ref_logprobs). Commands are
collective: Megatron's schedules, DDP and the optimizer run on every trainer rank at once. A command that carries
a step's batch (train, sft, ref_logprobs) sends each rank only its data-parallel rank's share of it: rank 0 plans
the micro-batches of the whole step and scatters the shares (`trainer.packing.split`).

Commands travel on a gloo group of their own: the idle ranks wait in host memory, never inside NCCL, whose watchdog
would end the job when an evaluation or a generation phase outlasts --distributed-timeout-minutes. Gloo bounds the
wait too (a peer that vanished is noticed): while rank 0 sends no command, it sends a keep-alive every quarter of
that timeout, so that only a peer silent for the whole timeout fails the run.

DDMA sends are posted in the background after each optimizer step ("publish") and waited for just before the
next optimizer step changes the parameters, so the trainer computes the next batch's forward and backward while
generators receive. On a GPU they run on a CUDA stream of their own (`ddma.sync.SideStream`): the training stream
never waits for a generator.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_rl.algorithms import AlgorithmConfig
from megatron_rl.checkpoint import rl_checkpoint
from megatron_rl.checkpoint.megatron_format import RL_FORMAT
from megatron_rl.config.setup import RunSetup, model_directory
from megatron_rl.ddma.sync import SideStream, publish
from megatron_rl.ddma.transport import make_transport
from megatron_rl.runtime import failpoints
from megatron_rl.runtime.keep_alive import KeepAlive
from megatron_rl.runtime.roles import Roles
from megatron_rl.trainer.batch import TrainBatch
from megatron_rl.trainer.export import ModelDescription, save_hf
from megatron_rl.trainer.packing import split as split_batch

# The commands that carry a step's batch (the payload, or its first item), by whether their pass is forward only.
BATCH_COMMANDS = {"train": False, "sft": False, "ref_logprobs": True}


class TrainerExecutor:
    def __init__(self, setup: RunSetup, roles: Roles):
        from megatron_rl.trainer import parallel
        from megatron_rl.trainer.packing import MicroBatching
        from megatron_rl.trainer.policy import build_policy
        from megatron_rl.trainer.train_step import PolicyTrainer, build_scheduler

        args, spec, layout = setup.args, setup.spec, setup.trainer
        self.args, self.roles, self.spec = args, roles, spec
        parallel.initialize(layout, spec, seed=args.seed, device=roles.device)
        init = None
        if (args.load_hf or args.load_megatron) and not args.load:  # a resume reads the checkpoint's weights
            from megatron_rl.trainer.weights import load_weights_from

            flag, directory = ("--load-hf", args.load_hf) if args.load_hf else ("--load-megatron", args.load_megatron)
            if roles.is_controller and args.load_megatron:
                print(f"[megatron-rl] --load-megatron {args.load_megatron}: initial weights from "
                      f"{model_directory(args)} (a new run, not a resume: no RL state is read)", flush=True)
            init = lambda m: load_weights_from(m, spec, layout, directory, flag)  # noqa: E731
        policy = build_policy(spec, layout, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                              clip_grad=args.clip_grad, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
                              adam_eps=args.adam_eps, bf16=args.bf16,
                              use_distributed_optimizer=args.use_distributed_optimizer, init_weights=init,
                              device=roles.device, use_cpu_initialization=args.use_cpu_initialization,
                              routing_replay=args.use_rollout_routing_replay,
                              moe_aux_loss_coeff=args.moe_aux_loss_coeff,
                              overlap_grad_reduce=args.overlap_grad_reduce,
                              grad_reduce_in_bf16=args.grad_reduce_in_bf16)
        self.scheduler = build_scheduler(policy, args.lr_warmup_iters, args.train_iters, args.lr_decay_style,
                                         args.lr_wsd_decay_iters, args.lr_wsd_decay_style)
        self.rl_algo = AlgorithmConfig.from_args(args)
        self.sft_algo = AlgorithmConfig(loss="sft")
        self.reference = self._build_reference(policy)
        batching = MicroBatching(args.micro_batch_size, args.max_tokens_per_gpu, args.log_probs_max_tokens_per_gpu)
        self.trainer = PolicyTrainer(policy, self.rl_algo, batching, self.scheduler, self.reference)
        self.description = ModelDescription(spec, layout, torch.bfloat16 if args.bf16 else torch.float32,
                                            setup.tokenizer, model_directory(args))
        self.plan = setup.plan()
        self.transport = make_transport(roles)
        self._publishing = None  # this rank's DDMA sends in flight (a BackgroundSend), if any
        self._publish_stream = SideStream(roles.device) if roles.device.type == "cuda" else None
        self.version = -1  # the last weight version published
        self.commands_group = dist.new_group(backend="gloo", timeout=roles.timeout) if dist.get_world_size() > 1 \
            else None
        self._dp_rank_of = self._data_parallel_ranks()  # by trainer rank: whom each batch share goes to
        self._sending = threading.Lock()  # one message at a time on commands_group: a command, or a keep-alive
        self._last_sent = time.monotonic()  # of rank 0's last command (infinity while it runs)
        self.keep_alive = None
        if roles.is_controller and self.commands_group is not None:
            self.keep_alive = KeepAlive(roles.timeout.total_seconds() / 4, lambda: self._last_sent, lambda: (
                dist.broadcast_object_list([("keep-alive", None)], src=0, group=self.commands_group)),
                self._sending, name="trainer-keep-alive")
        self.handlers: dict[str, Callable[[Any], Any]] = {
            "train": self._train, "sft": self._sft, "publish": self._publish, "save": self._save, "load": self._load,
            "snapshot_reference": self._snapshot_reference, "ref_logprobs": self._ref_logprobs,
            "save_hf": self._save_hf,
        }

    def _build_reference(self, policy):
        """The frozen reference model of --kl-coef (None without a KL penalty): --ref-load's weights, or (set by
        "snapshot_reference" or a resumed checkpoint) the policy's when RL begins."""
        if not self.args.kl_coef:
            return None
        from megatron_rl.trainer.reference import ReferenceModel

        reference = ReferenceModel(policy)
        if self.args.ref_load:
            reference.load(self.args.ref_load)
        return reference

    def _data_parallel_ranks(self) -> list[int]:
        """Every trainer rank's DP rank, gathered once on the (host) command group."""
        from megatron.core import parallel_state as ps

        ranks = [ps.get_data_parallel_rank()] * dist.get_world_size()
        if self.commands_group is not None:
            dist.all_gather_object(ranks, ps.get_data_parallel_rank(), group=self.commands_group)
        return ranks

    def command(self, name: str, payload=None):
        """Trainer rank 0: run a command on every trainer rank; returns this rank's result."""
        if dist.get_world_size() == 1:
            return self._execute(name, payload)
        batch = _batch_of(name, payload)
        if batch is None:
            self._send((name, payload))
            return self._execute_then_mark(name, payload)
        from megatron.core import parallel_state as ps

        shares = split_batch(batch, self.trainer.batching, ps.get_data_parallel_world_size(), BATCH_COMMANDS[name])
        self._send((name, _with_batch(payload, None)), [shares[d] for d in self._dp_rank_of])
        return self._execute_then_mark(name, _with_batch(payload, shares[self._dp_rank_of[0]]))

    def _send(self, message, shares: list | None = None) -> None:
        """Rank 0: broadcast `message` on the command group, then scatter `shares` (one per trainer rank)."""
        with self._sending:
            dist.broadcast_object_list([message], src=0, group=self.commands_group)
            if shares is not None:
                dist.scatter_object_list([None], shares, src=0, group=self.commands_group)
            self._last_sent = float("inf")  # executing: the other ranks are busy too, no keep-alive

    def _execute_then_mark(self, name: str, payload):
        try:
            return self._execute(name, payload)
        finally:
            self._last_sent = time.monotonic()

    def serve(self) -> None:
        """Trainer ranks other than 0: execute rank 0's commands until it says "stop"."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0, group=self.commands_group)
            name, payload = box[0]
            if name == "keep-alive":
                continue
            if name == "stop":
                self._finish_publish()
                return
            if name in BATCH_COMMANDS:  # then this rank's share of the batch
                share = [None]
                dist.scatter_object_list(share, None, src=0, group=self.commands_group)
                payload = _with_batch(payload, share[0])
            self._execute(name, payload)

    def stop(self) -> None:
        """Trainer rank 0: release the other ranks from `serve`."""
        if self.commands_group is not None:
            self.keep_alive.stop()
            with self._sending:
                dist.broadcast_object_list([("stop", None)], src=0, group=self.commands_group)
        self._finish_publish()

    def _execute(self, name: str, payload):
        if name not in ("train", "sft"):  # those wait just before their optimizer step
            self._finish_publish()
        if name not in self.handlers:
            raise ValueError(f"unknown trainer command {name!r}; known: {sorted(self.handlers)}")
        return self.handlers[name](payload)

    def _finish_publish(self) -> None:
        """Wait for this rank's last DDMA sends: they read the parameters, which must not change before. A failed
        publish raises here once (not again from `stop`, on the way out)."""
        publishing, self._publishing = self._publishing, None
        if publishing is not None:
            publishing.wait()

    # ---- handlers -------------------------------------------------------------------------------------------------
    def _train(self, batch):
        self.trainer.algo, self.trainer.scheduler = self.rl_algo, self.scheduler
        self.scheduler.step(increment=0)  # the scheduled lr again, after a warm-up step set its own
        metrics = self.trainer.train_step(batch, before_update=self._before_rl_update)
        if self.args.log_param_checksum:
            metrics["param_checksum"] = self.param_checksum()
        return metrics

    def _before_rl_update(self) -> None:
        self._finish_publish()
        failpoints.crash("train", self.version)  # after the forward and backward passes, before the update

    def _sft(self, payload):
        batch, lr = payload
        self.trainer.algo, self.trainer.scheduler = self.sft_algo, None
        for group in self.trainer.policy.optimizer.param_groups:
            group["lr"] = lr
        return self.trainer.train_step(batch, before_update=self._finish_publish)

    def _snapshot_reference(self, _payload) -> None:
        """The default reference: a copy of the policy's current weights (sent right before the first RL step)."""
        if self.reference is None or self.args.ref_load:
            raise ValueError("snapshot_reference: the run has no default reference (it needs --kl-coef > 0 and no "
                             "--ref-load)")
        self.reference.copy_from(self.trainer.policy)

    def _ref_logprobs(self, batch):
        """The reference model's log-probs of `batch` [N, L-1] on every rank (for --use-kl-in-reward)."""
        self.trainer.algo = self.rl_algo  # the RL temperature
        return self.trainer.compute_logprobs(batch, reference=True)

    def _publish(self, version: int) -> None:
        """Post this rank's DDMA sends of the current weights as `version`, without waiting for them."""
        params = {n: p.detach() for n, p in self.trainer.policy.module.named_parameters()}
        self.version = version
        self._publishing = publish(self.plan, self.roles.rank, version, trainer_tensors=params,
                                   transport=self.transport, bucket_bytes=self.args.ddma_bucket_mb * 2**20,
                                   debug_checksums=self.args.ddma_debug_checksums, background=True,
                                   stream=self._publish_stream)

    def _save(self, directory: str) -> None:
        from megatron_rl.trainer.checkpoint import save_trainer_checkpoint

        rng = rl_checkpoint.rng_state()  # as the step left it
        save_trainer_checkpoint(self.trainer.policy, directory, self.scheduler,
                                reference=None if self.reference is None else self.reference.module)
        # after Megatron's files: its save warns of an "incomplete / corrupted checkpoint" in a directory not empty
        rl_checkpoint.save_rng(directory, dist.get_rank(), rng)
        dist.barrier()  # every rank's files are written before rank 0 completes the iteration (checksums, rename)
        if dist.get_rank() == 0:  # the model beside its weights: the iteration exports to HF on its own
            self.description.write(directory, RL_FORMAT)

    def _save_hf(self, directory: str) -> None:
        """Write the policy as an HF checkpoint in `directory` (streamed: see `trainer.export.save_hf`)."""
        save_hf(self.trainer.policy.module, self.description, directory)

    def _load(self, directory: str) -> None:
        from megatron_rl.trainer.checkpoint import load_trainer_checkpoint

        restore_reference = self.reference is not None and not self.args.ref_load  # --ref-load is read at start
        load_trainer_checkpoint(self.trainer.policy, directory, self.scheduler,
                                reference=self.reference.module if restore_reference else None)
        if restore_reference:
            self.reference.restored()
        rl_checkpoint.load_rng(directory, dist.get_rank())

    def param_checksum(self) -> float:
        """Sum of every weight of the model (each shard counted once), in float64."""
        from megatron.core import parallel_state as ps

        total = torch.zeros(1, dtype=torch.float64, device=self.roles.device)
        for name, p in self.trainer.policy.module.named_parameters():
            replicated = "norm" in name and ps.get_tensor_model_parallel_rank() != 0
            tied_copy = name == "output_layer.weight" and self.spec.tie_word_embeddings
            if not replicated and not tied_copy:
                total += p.detach().double().sum()
        dist.all_reduce(total, group=ps.get_model_parallel_group())
        return float(total)


def _batch_of(name: str, payload) -> TrainBatch | None:
    """The batch a command carries: its payload, or the payload's first item (sft's is (batch, lr))."""
    if name not in BATCH_COMMANDS:
        return None
    batch = payload[0] if isinstance(payload, tuple) else payload
    if not isinstance(batch, TrainBatch):
        raise TypeError(f"trainer command {name!r} takes a TrainBatch, got {type(batch).__name__}")
    return batch


def _with_batch(payload, batch):
    """`payload` with its batch replaced by `batch` (a share, or None to broadcast the rest)."""
    return (batch, *payload[1:]) if isinstance(payload, tuple) else batch
