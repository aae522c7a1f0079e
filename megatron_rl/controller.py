"""The single controller (LlamaRL figure 2) on native PyTorch: one torchrun launch, three executors.

- trainer ranks [0, T): Megatron-Core policy (TP x PP x DP); rank 0 is also the controller: it owns the
  prompts, the reward pool (worker processes), the rollout buffer and the metrics;
- generator ranks [T, T + G): engine replicas with their own TP (the built-in LocalEngine, or an SGLang server
  per replica driven by its ranks: --rollout-backend sglang);
- channels (over a gloo group spanning all ranks): controller -> generators carries requests and weight
  versions; generators -> controller carries finished rollouts, a group's together; DDMA moves the weights.

Data flows one way: prompts -> generators -> reward -> buffer -> trainer -> DDMA -> generators.

Asynchronous mode: the next step's prompts are dispatched before the trainer trains, so generation
overlaps training; after each optimizer step DDMA publishes the new version (trainer ranks post their sends
and wait for them just before the next optimizer step); generators pause their in-flight requests
(--rollout-pause-mode: retract, or in_place), take the weights between two decode steps, and resume them
(partial rollouts: tokens keep the version that produced them). Synchronous mode (--async-mode off) is the
same loop with prompts dispatched only after the new weights are published: every rollout is on-policy.
--async-mode alternate switches between the two every --async-alternate-steps steps (each metrics row says
which kind of step it was), so that a machine whose speed drifts compares both within seconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import threading
import time
import zlib
from collections import Counter, defaultdict

import torch
import torch.distributed as dist

from megatron_rl import checkpointing
from megatron_rl.algorithms import lag_summary
from megatron_rl.buffer import Rollout, RolloutBuffer
from megatron_rl.channels import Channel
from megatron_rl.ddma.plan import GeneratorLayout, TrainerLayout, make_plan
from megatron_rl.ddma.sync import publish
from megatron_rl.ddma.transport import TorchDistTransport
from megatron_rl.models.spec import ModelSpec, get_model_spec
from megatron_rl.roles import Roles, init_roles
from megatron_rl.rollout.types import SamplingParams

TAG_CONTROL, TAG_ROLLOUTS = 11, 12


def stable_seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


# ---- set-up shared by all roles ------------------------------------------------------------------------------------

def load_tokenizer(args):
    if args.tokenizer:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(args.tokenizer)
    from megatron_rl.data.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


def model_spec(args, tokenizer) -> ModelSpec:
    if args.load_hf:
        with open(os.path.join(args.load_hf, "config.json")) as f:
            spec = ModelSpec.from_hf_config(json.load(f), name=os.path.basename(os.path.normpath(args.load_hf)))
    elif args.model == "tiny-arith":
        spec = ModelSpec("tiny-arith", "llama", hidden_size=128, num_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, ffn_hidden_size=384, vocab_size=len(tokenizer),
                         max_position_embeddings=args.seq_length)
    else:
        spec = get_model_spec(args.model)
    overrides = {k: v for k, v in (("num_layers", args.num_layers), ("hidden_size", args.hidden_size),
                                   ("ffn_hidden_size", args.ffn_hidden_size),
                                   ("num_attention_heads", args.num_attention_heads),
                                   ("num_key_value_heads", args.num_query_groups)) if v is not None}
    spec = spec.replace(**overrides) if overrides else spec
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but model {spec.name!r} has vocab_size "
                         f"{spec.vocab_size}")
    return spec


def ddma_plan(args, spec: ModelSpec, roles: Roles):
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    trainer = TrainerLayout(tp, pp, roles.trainer_world_size // (tp * pp), args.make_vocab_size_divisible_by,
                            dtype_bytes=2 if args.bf16 else 4,
                            decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
                            decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers)
    generator = GeneratorLayout(args.rollout_tensor_parallel_size, args.rollout_num_replicas, args.rollout_fp8,
                                first_rank=roles.trainer_world_size)
    return make_plan(spec, trainer, generator)


# ---- generator executor -----------------------------------------------------------------------------------------

class GeneratorExecutor:
    def __init__(self, args, roles: Roles, spec: ModelSpec, tokenizer):
        self.args, self.roles, self.spec = args, roles, spec
        self.dtype = torch.bfloat16 if args.bf16 else torch.float32
        self.engine = self._sglang_engine(tokenizer) if args.rollout_backend == "sglang" else \
            self._local_engine(tokenizer)
        self.plan = ddma_plan(args, spec, roles)
        self.control = Channel(roles.sync_group, TAG_CONTROL, last_kind="stop")
        self.rollouts = Channel(roles.sync_group, TAG_ROLLOUTS)
        self.stats = {"busy_s": 0.0, "idle_s": 0.0, "sync_s": 0.0, "tokens": 0}

    def _local_engine(self, tokenizer):
        from megatron_rl.rollout.decoder import TPDecoder
        from megatron_rl.rollout.engine import LocalEngine

        args = self.args
        decoder = TPDecoder(self.spec, args.rollout_tensor_parallel_size, self.roles.rollout_tp_rank,
                            self.roles.replica_group, dtype=self.dtype, fp8=args.rollout_fp8,
                            max_slots=args.rollout_max_running + 1, max_seq_len=args.seq_length)
        return LocalEngine(decoder, eos_token_ids=[tokenizer.eos_token_id], seed=args.seed,
                           chunk_tokens=args.partial_rollout_max_tokens)

    def _sglang_engine(self, tokenizer):
        """The replica's leader launches its SGLang server on a config-only model directory (random
        start-up weights, never served: the first DDMA publish brings the policy), or attaches to
        --rollout-server-urls."""
        import importlib.util

        args, roles = self.args, self.roles
        if importlib.util.find_spec("sglang") is None:
            raise RuntimeError("--rollout-backend sglang: the sglang package is not installed in this environment "
                               "(on CPU: bash tools/sglang_cpu/setup_env.sh, then run with .venv-sglang/bin/python)")
        if args.rollout_fp8 and not torch.cuda.is_available():
            raise RuntimeError("--rollout-fp8 with --rollout-backend sglang needs a GPU (SGLang's FP8 layers "
                               "assert CUDA or AMX); use --rollout-backend local on CPU")
        from megatron_rl.rollout.sglang_engine import IN_PLACE_SERVER_FLAGS, start_replica_engine
        from megatron_rl.rollout.sglang_server import write_model_dir

        directory = os.path.join(args.output_dir, "sglang", f"replica{roles.replica}")
        model_dir = write_model_dir(self.spec, os.path.join(directory, "model"), tokenizer.eos_token_id,
                                    fp8=args.rollout_fp8) if roles.is_leader else None
        flags = {"max_running_requests": args.rollout_max_running, "context_length": args.seq_length,
                 "random_seed": args.seed, **args.sglang}
        url = args.rollout_server_urls[roles.replica] if args.rollout_server_urls else None
        return start_replica_engine(self.spec, args.rollout_tensor_parallel_size, roles.replica_group,
                                    roles.is_leader, model_dir, os.path.join(directory, "server.log"), url=url,
                                    extra_flags=flags, dtype="bfloat16" if args.bf16 else "float32",
                                    max_total_tokens=max(args.rollout_max_running * args.seq_length, 8192),
                                    timeout_s=args.rollout_server_timeout,
                                    stall_timeout_s=args.rollout_server_stall_timeout,
                                    max_restarts=args.rollout_server_max_restarts,
                                    required_flags=IN_PLACE_SERVER_FLAGS if args.rollout_pause_mode == "in_place"
                                    else None)

    def _messages(self) -> list:
        """The leader reads control messages (blocking only when there is nothing to decode) and shares
        them with the replica's other TP ranks, which then make exactly the same calls."""
        msgs = []
        if self.roles.is_leader:
            if not self.engine.has_work():
                start = time.perf_counter()
                msgs.append(self.control.recv(0)[0])
                self.stats["idle_s"] += time.perf_counter() - start
            while (m := self.control.poll(0)) is not None:
                msgs.append(m[0])
        if self.args.rollout_tensor_parallel_size > 1:
            box = [msgs]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.roles.replica_group, 0),
                                       group=self.roles.replica_group)
            msgs = box[0]
        return msgs

    def run(self) -> None:
        try:
            self._serve()
        finally:
            self.engine.shutdown()

    def _serve(self) -> None:
        meta: dict[str, dict] = {}
        # A group's rollouts leave together, once all of its samples sent here finished: the controller can use
        # only complete groups, and each message costs the trainer's rank (its receiving thread wakes), so
        # one message per engine step with complete groups instead of one per step with any finished sample.
        unfinished: Counter = Counter()  # (eval, prompt id) -> samples still generating
        held: dict[tuple, list] = defaultdict(list)  # (eval, prompt id) -> finished samples waiting for the rest
        while True:
            for kind, payload in self._messages():
                if kind == "requests":
                    for rid, prompt, params, m in payload:
                        self.engine.add_request(prompt, SamplingParams(**params), rid)
                        meta[rid] = m
                        unfinished[m["eval"], m["prompt_id"]] += 1
                elif kind == "sync":
                    start = time.perf_counter()
                    self.engine.pause(self.args.rollout_pause_mode)
                    publish(self.plan, self.roles.rank, payload, engine=self.engine,
                            transport=TorchDistTransport(self.roles.sync_group), dtype=self.dtype,
                            bucket_bytes=self.args.ddma_bucket_mb * 2**20,
                            debug_checksums=self.args.ddma_debug_checksums)
                    self.engine.continue_generation()
                    self.stats["sync_s"] += time.perf_counter() - start
                elif kind == "stop":
                    if self.roles.is_leader:
                        self.rollouts.send(("stopped", dict(self.stats)), 0)
                        self.rollouts.flush()
                    return
            if self.engine.has_work() and not self.engine.paused:
                start = time.perf_counter()
                finished = self.engine.step()
                self.stats["busy_s"] += time.perf_counter() - start
                self.stats["engine_restarts"] = self.engine.restarts
                self.stats["rerun_requests"] = self.engine.rerun_requests
                complete = []
                for o in finished:
                    m = meta.pop(o.request_id)
                    group = (m["eval"], m["prompt_id"])
                    held[group].append((o, m))
                    unfinished[group] -= 1
                    if not unfinished[group]:
                        del unfinished[group]
                        complete += held.pop(group)
                if complete and self.roles.is_leader:
                    self.stats["tokens"] += sum(len(o.token_ids) for o, _ in complete)
                    self.rollouts.send(("rollouts", (complete, dict(self.stats))), 0)


# ---- trainer executor (rank 0 is the controller) --------------------------------------------------------------------

@dataclasses.dataclass
class StepTimes:
    wait_s: float = 0.0  # trainer idle: waiting for rollouts
    reward_s: float = 0.0  # scoring this step's rollouts in the reward stage (overlapped, not the trainer's time)
    train_s: float = 0.0  # includes waiting, before the optimizer step, for the previous step's DDMA sends
    sync_s: float = 0.0  # announcing the new version and posting this rank's DDMA sends


class TrainerExecutor:
    def __init__(self, args, roles: Roles, spec: ModelSpec, tokenizer):
        from megatron_rl import parallel
        from megatron_rl.trainer.policy import build_policy
        from megatron_rl.trainer.train_step import AlgorithmConfig, PolicyTrainer, build_scheduler

        self.args, self.roles, self.spec, self.tokenizer = args, roles, spec, tokenizer
        layout = parallel.ParallelLayout(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
        parallel.initialize(layout, spec, seed=args.seed)
        init = None
        if args.load_hf:
            from megatron_rl.models.safetensors_io import HFCheckpoint
            from megatron_rl.trainer.weights import load_hf_weights

            reader = HFCheckpoint(args.load_hf)
            init = lambda m: load_hf_weights(m, spec, reader.get_slice,  # noqa: E731
                                             make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
        policy = build_policy(spec, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                              clip_grad=args.clip_grad, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
                              adam_eps=args.adam_eps, bf16=args.bf16,
                              use_distributed_optimizer=args.use_distributed_optimizer,
                              make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, init_weights=init)
        self.scheduler = build_scheduler(policy, args.lr_warmup_iters, args.train_iters, args.lr_decay_style)
        self.rl_algo = AlgorithmConfig(loss=args.loss, rho=args.aipo_rho, clip_eps=args.ppo_clip_eps,
                                       aggregation=args.loss_aggregation, kl_coef=args.kl_coef,
                                       entropy_coef=args.entropy_coef, temperature=args.rollout_temperature)
        self.sft_algo = AlgorithmConfig(loss="sft")
        self.trainer = PolicyTrainer(policy, self.rl_algo, args.micro_batch_size, self.scheduler)
        self.plan = ddma_plan(args, spec, roles)
        self._publishing = None  # this rank's DDMA sends in flight (a Transfer), if any
        if roles.is_controller:
            self.controller = Controller(args, roles, tokenizer, self)

    # Collective commands: rank 0 decides and broadcasts; every trainer rank executes the same command.
    def command(self, name: str, payload=None):
        if dist.get_world_size() > 1:
            dist.broadcast_object_list([(name, payload)], src=0)
        return self._execute(name, payload)

    def run(self) -> None:
        if self.roles.is_controller:
            try:
                self.controller.run()
            finally:
                self.command("stop")
            return
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            name, payload = box[0]
            if name == "stop":
                self._finish_publish()
                return
            self._execute(name, payload)

    def param_checksum(self) -> float:
        """Sum of every weight of the model (each shard counted once), in float64."""
        from megatron.core import parallel_state as ps

        total = torch.zeros(1, dtype=torch.float64)
        for name, p in self.trainer.policy.module.named_parameters():
            replicated = "norm" in name and ps.get_tensor_model_parallel_rank() != 0
            tied_copy = name == "output_layer.weight" and self.spec.tie_word_embeddings
            if not replicated and not tied_copy:
                total += p.detach().double().sum()
        dist.all_reduce(total, group=ps.get_model_parallel_group())
        return float(total)

    def _finish_publish(self) -> None:
        """Wait for this rank's last DDMA sends: they read the parameters, which must not change before."""
        if self._publishing is not None:
            self._publishing.wait()
            self._publishing = None

    def _execute(self, name: str, payload):
        if name not in ("train", "sft"):  # those wait just before their optimizer step
            self._finish_publish()
        if name == "train":
            self.trainer.algo, self.trainer.scheduler = self.rl_algo, self.scheduler
            metrics = self.trainer.train_step(payload, before_update=self._finish_publish)
            if self.args.log_param_checksum:
                metrics["param_checksum"] = self.param_checksum()
            return metrics
        if name == "sft":
            batch, lr = payload
            self.trainer.algo, self.trainer.scheduler = self.sft_algo, None
            for group in self.trainer.policy.optimizer.param_groups:
                group["lr"] = lr
            return self.trainer.train_step(batch, before_update=self._finish_publish)
        if name == "publish":
            # Posted, not waited for: the trainer goes on while the generators reach a step boundary and receive.
            params = {n: p.detach() for n, p in self.trainer.policy.module.named_parameters()}
            self._publishing = publish(self.plan, self.roles.rank, payload, trainer_tensors=params,
                                       transport=TorchDistTransport(self.roles.sync_group),
                                       bucket_bytes=self.args.ddma_bucket_mb * 2**20,
                                       debug_checksums=self.args.ddma_debug_checksums, background=True)
            return None
        if name == "save":
            from megatron_rl.trainer.checkpoint import save_trainer_checkpoint

            directory, extra = payload
            checkpointing.save_rng(directory, dist.get_rank())
            dist.barrier()
            return save_trainer_checkpoint(self.trainer.policy, directory, self.scheduler, extra)
        if name == "load":
            from megatron_rl.trainer.checkpoint import load_trainer_checkpoint

            extra = load_trainer_checkpoint(self.trainer.policy, payload, self.scheduler)
            checkpointing.load_rng(payload, dist.get_rank())
            return extra
        if name == "stop":
            return None
        raise ValueError(f"unknown trainer command {name!r}")


# ---- the controller (trainer rank 0) ---------------------------------------------------------------------------------

class PromptSource:
    """RL prompts (a JSONL dataset, or the arithmetic task), held-out eval prompts, and SFT examples."""

    SFT_OFFSET = 10**7  # SFT examples are drawn from a separate index range of the task's train split

    def __init__(self, args):
        from megatron_rl.data.arithmetic import ArithmeticTask
        from megatron_rl.data.jsonl import JsonlDataset

        self.dataset = JsonlDataset(args.data_path, seed=args.seed) if args.data_path else None
        self.task = ArithmeticTask(seed=args.seed, min_digits=args.task_min_digits, max_digits=args.task_max_digits,
                                   num_operands=args.task_operands)
        self.cursor = 0
        self.sft_cursor = 0

    def state_dict(self) -> dict:
        return {"cursor": self.cursor, "sft_cursor": self.sft_cursor,
                "dataset": self.dataset.state_dict() if self.dataset is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.cursor, self.sft_cursor = state["cursor"], state["sft_cursor"]
        if self.dataset is not None:
            self.dataset.load_state_dict(state["dataset"])

    def next(self, n: int) -> list[dict]:
        if self.dataset is not None:
            return [dict(r, id=str(r["id"])) for r in self.dataset.next(n)]
        out = self.task.problems(self.cursor, n)
        self.cursor += n
        return out

    def eval(self, n: int) -> list[dict]:
        return [] if self.dataset is not None else self.task.problems(0, n, "eval")

    def sft(self, n: int) -> list[dict]:
        if self.dataset is not None:
            raise ValueError("--sft-warmup-iters needs the arithmetic task (no --data-path)")
        out = self.task.problems(self.SFT_OFFSET + self.sft_cursor, n)
        self.sft_cursor += n
        return out


class Controller:
    def __init__(self, args, roles: Roles, tokenizer, trainer: TrainerExecutor):
        from megatron_rl.logging import MetricsLogger
        from megatron_rl.rewards import MathScorer, load_reward_fn
        from megatron_rl.rewards.failures import RewardFailures

        self.args, self.roles, self.tokenizer, self.trainer = args, roles, tokenizer, trainer
        self.source = PromptSource(args)
        self.buffer = RolloutBuffer(args.n_samples_per_prompt, args.max_staleness, not args.keep_uniform_groups)
        if args.reward_fn == "math":
            self.scorer = MathScorer(args.reward_num_workers, args.reward_timeout)
            self.reward_fn = self.scorer.score
        else:
            self.scorer, self.reward_fn = None, load_reward_fn(args.reward_fn)
        self.control = Channel(roles.sync_group, TAG_CONTROL)
        self.rollouts = Channel(roles.sync_group, TAG_ROLLOUTS)
        self.leaders = [roles.leader(r) for r in range(args.rollout_num_replicas)]
        self.prompts_per_step = args.global_batch_size // args.n_samples_per_prompt
        self.inflight: dict[str, dict] = {}  # RL prompts dispatched whose group has not left the buffer, by id
        self.eval_rewards: dict[str, float] = {}
        self.gen_stats: dict[int, dict] = {}
        self.version = -1
        self.consumed = 0
        self.skipped_steps = self.consecutive_skips = 0  # optimizer steps skipped for NaN/Inf gradients
        self.reward_failures = RewardFailures(args.max_consecutive_reward_failures)
        self.dispatched = Counter()  # prompt id -> times dispatched (each prompt exactly once)
        self._gen_totals = dict.fromkeys(("busy_s", "idle_s", "sync_s", "tokens"), 0.0)  # at the previous step
        # On a resume the logs continue from the checkpoint's step: lines of later (lost) steps are dropped.
        resume_step = checkpointing.latest_checkpoint_step(args.load) if args.load else None
        rollout_log = os.path.join(args.output_dir, "rollouts.jsonl")
        if resume_step is not None:
            for name in ("metrics.jsonl", "rollouts.jsonl"):
                checkpointing.truncate_jsonl_after_step(os.path.join(args.output_dir, name), resume_step)
        self._rollout_log = open(rollout_log, "a" if args.load else "w") if args.log_rollouts else None
        self.logger = MetricsLogger(args.output_dir, args.wandb_project, args.wandb_exp_name, args.wandb_save_dir,
                                    args.tensorboard_dir, config={k: v for k, v in vars(args).items()
                                                                  if isinstance(v, (int, float, str, bool))},
                                    append=bool(args.load))
        self._next_leader = 0
        self._scored: queue.Queue = queue.Queue()  # (kind, generator rank, payload, reward seconds)
        self._stopped = 0
        threading.Thread(target=self._reward_stage, daemon=True, name="reward-stage").start()

    # -- generators --------------------------------------------------------------------------------------------
    def encode_prompt(self, text: str) -> list[int]:
        bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        return bos + self.tokenizer.encode(text, add_special_tokens=False)

    def dispatch(self, problems: list[dict], samples: int | list[int], params: dict, eval_: bool = False,
                 resent: bool = False) -> None:
        """Send `samples` (a count, or the sample indices) of each problem to a generator. `resent`: samples lost
        in flight at a crash, sent again after a resume (not a new dispatch of the prompt)."""
        by_leader = defaultdict(list)
        for problem in problems:
            pid = str(problem["id"])
            if not eval_ and not resent:
                self.dispatched[pid] += 1
                self.inflight[pid] = problem
            prompt = self.encode_prompt(problem["prompt"])
            leader = self.leaders[self._next_leader % len(self.leaders)]
            self._next_leader += 1
            for k in (range(samples) if isinstance(samples, int) else samples):
                rid = f"{'eval:' if eval_ else ''}{pid}#{k}"
                meta = {"prompt_id": pid, "sample_index": k, "reference": problem["answer"], "eval": eval_,
                        "dispatched_at": time.time()}
                by_leader[leader].append((rid, prompt, dict(params, seed=stable_seed(self.args.seed, rid)), meta))
        for leader, requests in by_leader.items():
            self.control.send(("requests", requests), leader)

    def rl_params(self) -> dict:
        a = self.args
        return {"temperature": a.rollout_temperature, "top_k": a.rollout_top_k, "top_p": a.rollout_top_p,
                "max_new_tokens": a.rollout_max_response_len, "stop_token_ids": (self.tokenizer.eos_token_id,)}

    def top_up(self, target: int) -> None:
        """Keep `target` RL prompts in flight."""
        if target > len(self.inflight):
            self.dispatch(self.source.next(target - len(self.inflight)), self.args.n_samples_per_prompt,
                          self.rl_params())

    def _reward_stage(self) -> None:
        """A thread between the generators and the buffer: receives each generator message as it arrives and
        scores its rollouts (in the reward worker processes), so scoring overlaps generation and training
        instead of running on the trainer's critical path. Ends after every generator said it stopped."""
        stopped = 0
        try:
            while stopped < len(self.leaders):
                (kind, payload), src = self.rollouts.recv()
                if kind == "stopped":
                    stopped += 1
                    self._scored.put(("stopped", src, payload, 0.0))
                    continue
                outputs, stats = payload
                start = time.perf_counter()
                texts = [self.tokenizer.decode([t for t in o.token_ids if t != self.tokenizer.eos_token_id])
                         for o, _ in outputs]
                results = self.reward_fn(texts, [m["reference"] for _, m in outputs])
                self._scored.put(("rollouts", src, (outputs, results, stats), time.perf_counter() - start))
        except BaseException as e:  # noqa: BLE001 - raised again in the controller's thread
            self._scored.put(("error", None, e, 0.0))

    def receive(self, times: StepTimes | None = None, block: bool = True) -> bool:
        """Take one scored message from the reward stage and buffer its rollouts. `block=False`: only if one is
        ready; returns whether a message was taken."""
        start = time.perf_counter()
        try:
            kind, src, payload, reward_s = self._scored.get(timeout=self.args.generator_timeout) if block else \
                self._scored.get_nowait()
        except queue.Empty:
            if not block:
                return False
            raise RuntimeError(f"no rollouts from any generator for {self.args.generator_timeout:.0f} s "
                               f"(--generator-timeout) with {len(self.inflight)} prompts in flight: a generator hangs "
                               f"or died (generator ranks {self.leaders[0]}..{self.roles.world_size - 1}; see "
                               "their output)") from None
        if kind == "error":
            raise payload
        if kind == "stopped":
            self.gen_stats[src] = payload
            self._stopped += 1
            return True
        outputs, results, stats = payload
        self.gen_stats[src] = stats
        self.reward_failures.check(results)
        if times is not None:
            times.wait_s += time.perf_counter() - start
            times.reward_s += reward_s
        for (out, meta), result in zip(outputs, results):
            if meta["eval"]:
                self.eval_rewards[meta["prompt_id"]] = result.reward if not result.is_failure else float("nan")
                continue
            self.buffer.add(Rollout(
                prompt_id=meta["prompt_id"], sample_index=meta["sample_index"],
                prompt_token_ids=out.prompt_token_ids, token_ids=out.token_ids, logprobs=out.logprobs,
                versions=out.versions, finish_reason=out.finish_reason, logprob_convention=out.logprob_convention,
                temperature=self.args.rollout_temperature, reference=meta["reference"], reward=result.reward,
                reward_status=result.status, num_retractions=out.num_retractions,
                created_at=meta["dispatched_at"], finished_at=time.time()))
        return True

    def log_outcomes(self, step: int, outcomes) -> None:
        if self._rollout_log is None:
            return
        for r, reason in outcomes:
            self._rollout_log.write(json.dumps({
                "step": step, "prompt_id": r.prompt_id, "sample_index": r.sample_index, "versions": r.versions,
                "consumed_at_version": self.version, "lag": self.version - r.oldest_version,
                "outcome": reason or "trained", "reward": r.reward, "reward_status": r.reward_status,
                "finish_reason": r.finish_reason, "num_retractions": r.num_retractions,
                "logprob_convention": r.logprob_convention, "response_tokens": len(r.token_ids)}) + "\n")
        self._rollout_log.flush()

    def publish(self) -> float:
        start = time.perf_counter()
        self.version += 1
        for leader in self.leaders:
            self.control.send(("sync", self.version), leader)
        self.trainer.command("publish", self.version)
        return time.perf_counter() - start

    # -- checkpoints (Megatron's layout: iter_NNNNNNN/ and latest_checkpointed_iteration.txt) ----------------------
    def save_checkpoint(self, step: int) -> None:
        """The whole RL state: the trainer's (model, optimizer, schedule, RNG; written by every trainer rank)
        and the controller's (step, weight version, data cursor, rollout buffer with incomplete groups, the
        prompts in flight, counters) in rl_state.json. Written to iter_N.partial, renamed when complete, and
        only then named by the tracker (megatron_rl/checkpointing.py)."""
        import shutil

        final = checkpointing.iteration_dir(self.args.save, step)
        partial = final + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        extra = {"step": step, "weight_version": self.version, "consumed_samples": self.consumed,
                 "source": self.source.state_dict()}
        self.trainer.command("save", (partial, extra))
        checkpointing.write_durably(os.path.join(partial, checkpointing.RL_STATE_FILE), json.dumps({
            "step": step, "model": self.trainer.spec.weight_fields(), "buffer": self.buffer.state_dict(),
            "inflight": self.inflight, "dispatched": dict(self.dispatched), "skipped_steps": self.skipped_steps,
            "reward_failures": dict(self.reward_failures.counts)}))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        checkpointing.publish_tracker(self.args.save, step)

    def load_checkpoint(self) -> int:
        """Restore a checkpoint that `run` checked at start-up."""
        step = checkpointing.latest_checkpoint_step(self.args.load)
        state = checkpointing.read_rl_state(self.args.load, step)
        extra = self.trainer.command("load", checkpointing.iteration_dir(self.args.load, step))
        self.version, self.consumed = extra["weight_version"], extra["consumed_samples"]
        self.source.load_state_dict(extra["source"])
        self.buffer.load_state_dict(state["buffer"])
        self.inflight = state["inflight"]
        self.dispatched = Counter(state["dispatched"])
        self.skipped_steps = state["skipped_steps"]
        self.reward_failures.counts = Counter(state["reward_failures"])
        return extra["step"]

    def resend_lost_samples(self, step: int) -> None:
        """After a resume: samples of the prompts in flight at the checkpoint that were not in its buffer died
        with the crashed generators; send them again (same request ids and seeds) and record why."""
        lost = {pid: [k for k in range(self.args.n_samples_per_prompt) if k not in self.buffer.sample_indices(pid)]
                for pid in self.inflight}
        lost = {pid: ks for pid, ks in lost.items() if ks}
        for pid, samples in lost.items():
            self.dispatch([self.inflight[pid]], samples, self.rl_params(), resent=True)
            if self._rollout_log is not None:
                for k in samples:
                    self._rollout_log.write(json.dumps({"step": step, "prompt_id": pid, "sample_index": k,
                                                        "outcome": "in flight at the checkpoint: generated again"})
                                            + "\n")
        print(f"resumed at step {step}: {self.buffer.pending()} buffered rollouts kept, "
              f"{sum(map(len, lost.values()))} in-flight samples of {len(lost)} prompts generated again", flush=True)

    # -- phases --------------------------------------------------------------------------------------------------
    def evaluate(self) -> float:
        problems = self.source.eval(self.args.eval_size)
        if not problems:
            return float("nan")
        self.eval_rewards = {}
        greedy = {"temperature": 0.0, "max_new_tokens": self.args.rollout_max_response_len,
                  "stop_token_ids": (self.tokenizer.eos_token_id,)}
        self.dispatch(problems, 1, greedy, eval_=True)
        while len(self.eval_rewards) < len(problems):
            self.receive()
        values = [v for v in self.eval_rewards.values() if v == v]
        return sum(v == 1.0 for v in values) / max(len(values), 1)

    def sft_warmup(self) -> None:
        from tqdm import tqdm

        from megatron_rl.trainer.train_step import TrainBatch

        eos = self.tokenizer.eos_token_id
        bar = tqdm(range(self.args.sft_warmup_iters), desc="SFT warm-up", dynamic_ncols=True)
        for _ in bar:
            problems = self.source.sft(self.args.sft_batch_size)
            prompts = [self.encode_prompt(p["prompt"]) for p in problems]
            answers = [self.tokenizer.encode(p["answer"], add_special_tokens=False) + [eos] for p in problems]
            batch = TrainBatch.from_sequences(prompts, answers, [[0.0] * len(a) for a in answers],
                                              [1.0] * len(problems))
            metrics = self.trainer.command("sft", (batch, self.args.sft_lr))
            bar.set_postfix(loss=f"{metrics['loss']:.3f}")

    def train_batch(self, groups: list[list[Rollout]]):
        from megatron_rl.algorithms import compute_advantages
        from megatron_rl.trainer.train_step import TrainBatch

        rollouts = [r for g in groups for r in g]
        rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float32)
        group_ids = torch.tensor([i for i, g in enumerate(groups) for _ in g])
        advantages = compute_advantages(rewards, group_ids, self.args.advantage_estimator)
        return TrainBatch.from_sequences([r.prompt_token_ids for r in rollouts], [r.token_ids for r in rollouts],
                                         [r.logprobs for r in rollouts], advantages.tolist(),
                                         [r.loss_mask for r in rollouts] if any(r.loss_mask for r in rollouts)
                                         else None)

    def is_async_step(self, step: int) -> bool:
        if self.args.async_mode == "alternate":  # blocks of steps, the first one asynchronous
            return (step - 1) // self.args.async_alternate_steps % 2 == 0
        return self.args.async_mode == "on"

    def rl_step(self, step: int, run_start: float) -> dict:
        P, ahead = self.prompts_per_step, self.is_async_step(step)
        times, start = StepTimes(), time.perf_counter()
        groups, discards, lags, sampled_rewards, popped, ages = [], Counter(), Counter(), [], 0, []
        while len(groups) < P:
            # Dynamic sampling: replace groups without signal, up to --max-oversample x P groups per step; past
            # that, uniform groups (zero advantage: no gradient) fill the batch.
            exhausted = popped >= self.args.max_oversample * P
            self.top_up(P - len(groups) + (P if ahead else 0))
            while self.buffer.complete_groups() == 0:
                self.receive(times)
            while self.receive(times, block=False):  # and whatever else is scored already: one take per batch
                pass
            batch = self.buffer.take(P - len(groups), self.version, drop_uniform=None if not exhausted else False)
            popped += batch.popped
            for r, _ in batch.outcomes:
                self.inflight.pop(r.prompt_id, None)
            groups += batch.groups
            discards.update(batch.discards)
            lags.update(batch.lag_histogram)
            sampled_rewards += batch.sampled_rewards
            ages += [batch.age_seconds_mean] * len(batch.groups)
            self.log_outcomes(step, batch.outcomes)
        if ahead:
            self.top_up(P)  # the next step's prompts generate while this step trains
        t = time.perf_counter()
        train_metrics = self.trainer.command("train", self.train_batch(groups))
        times.train_s = time.perf_counter() - t
        if train_metrics["update_successful"]:
            self.consecutive_skips = 0
            times.sync_s = self.publish()
        else:  # NaN/Inf gradient: nothing changed, so nothing is published
            self.skipped_steps += 1
            self.consecutive_skips += 1
            if self.consecutive_skips > self.args.max_consecutive_skipped_steps:
                raise RuntimeError(f"step {step}: {self.consecutive_skips} optimizer steps in a row had a NaN/Inf "
                                   f"gradient (loss {train_metrics.get('loss')}); stopping "
                                   f"(--max-consecutive-skipped-steps {self.args.max_consecutive_skipped_steps})")
        if not ahead:
            self.top_up(P)
        rollouts = [r for g in groups for r in g]
        self.consumed += len(rollouts)
        step_s = time.perf_counter() - start
        gen = {k: sum(s.get(k, 0) for s in self.gen_stats.values()) for k in self._gen_totals}
        gen_delta = {k: gen[k] - self._gen_totals[k] for k in gen}
        self._gen_totals = gen
        return {
            "weight_version": self.version, "consumed_samples": self.consumed, "time_s": time.time() - run_start,
            "async": ahead,
            # over every rollout sampled for this step (the policy's performance), and over those trained on
            # (uniform-reward groups carry no signal and are dropped)
            "reward_mean": sum(sampled_rewards) / len(sampled_rewards),
            "accuracy": sum(r == 1.0 for r in sampled_rewards) / len(sampled_rewards),
            "reward_mean_trained": sum(r.reward for r in rollouts) / len(rollouts),
            "response_length_mean": sum(len(r.token_ids) for r in rollouts) / len(rollouts),
            "retracted_fraction": sum(r.num_retractions > 0 for r in rollouts) / len(rollouts),
            "step_time_s": step_s,
            "trainer_time": {"wait_for_rollouts_s": times.wait_s, "reward_s": times.reward_s,
                             "train_s": times.train_s, "sync_s": times.sync_s},
            "generator_time": {"generate_s": gen_delta["busy_s"], "idle_s": gen_delta["idle_s"],
                               "sync_s": gen_delta["sync_s"]},
            "generation_tokens_per_s": gen_delta["tokens"] / step_s,
            "train_tokens_per_s": train_metrics["tokens_per_s"],
            "staleness_histogram": {str(k): v for k, v in sorted(lags.items())},
            **lag_summary(dict(lags)),
            "rollout_age_s": sum(ages) / max(len(ages), 1),  # wall time from dispatch to consumption
            "discards": dict(discards),
            "skipped_steps": self.skipped_steps,
            "generator_restarts": sum(s.get("engine_restarts", 0) for s in self.gen_stats.values()),
            "rerun_requests": sum(s.get("rerun_requests", 0) for s in self.gen_stats.values()),
            "reward_failures": dict(self.reward_failures.counts),  # cumulative, by status
            "train": {k: v for k, v in train_metrics.items() if isinstance(v, (int, float))},
        }

    def run(self) -> None:
        from tqdm import tqdm

        args = self.args
        start_step = 0
        if args.load:
            start_step = self.load_checkpoint()  # the trainer's and the controller's state
            self.version -= 1  # publish() below re-publishes the loaded weights under their version
        self.publish()  # generators start empty: the first publish gives them the policy
        if args.load:
            self.resend_lost_samples(start_step)
        if args.sft_warmup_iters and not args.load:
            self.sft_warmup()
            self.publish()
        accuracy_before = self.evaluate()
        print(f"held-out accuracy before RL: {accuracy_before:.3f}", flush=True)
        run_start = time.time()
        bar = tqdm(range(start_step + 1, args.train_iters + 1), initial=start_step, total=args.train_iters,
                   desc=f"AIPO ({ {'on': 'async', 'off': 'sync', 'alternate': 'async/sync'}[args.async_mode]})",
                   dynamic_ncols=True)
        for step in bar:
            metrics = self.rl_step(step, run_start)
            self.logger.log(step, metrics)
            if args.save and args.save_interval and step % args.save_interval == 0:
                self.save_checkpoint(step)
            bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", acc=f"{metrics['accuracy']:.2f}",
                            lag=max(map(int, metrics["staleness_histogram"]), default=0))
        accuracy_after = self.evaluate()
        print(f"held-out accuracy after RL: {accuracy_after:.3f}", flush=True)
        with open(os.path.join(args.output_dir, "eval.json"), "w") as f:
            json.dump({"accuracy_before_rl": accuracy_before, "accuracy_after_rl": accuracy_after,
                       "eval_size": args.eval_size, "train_iters": args.train_iters, "async_mode": args.async_mode,
                       "rl_seconds": time.time() - run_start,
                       "prompts_dispatched": len(self.dispatched),
                       "prompts_dispatched_more_than_once": sum(c > 1 for c in self.dispatched.values()),
                       "prompts_in_flight_at_end": len(self.inflight),
                       "discards": dict(self.buffer.discards)}, f, indent=2)
        self.shutdown()

    def shutdown(self) -> None:
        for leader in self.leaders:
            self.control.send(("stop", None), leader)
        while self._stopped < len(self.leaders):  # drain what generators still send, until each says it stopped
            kind, _, payload, _ = self._scored.get()
            self._stopped += kind == "stopped"
        self.control.flush()
        self.logger.close()
        if self._rollout_log is not None:
            self._rollout_log.close()
        if self.scorer is not None:
            self.scorer.close()


def trainer_world_size(args, world_size: int) -> int:
    """The ranks left to the trainer after the generators' (which come last); an error names the flags."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    gtp, replicas = args.rollout_tensor_parallel_size, args.rollout_num_replicas
    trainer_world = world_size - gtp * replicas
    if trainer_world < 1 or trainer_world % (tp * pp):
        raise ValueError(f"world size {world_size} leaves {trainer_world} trainer ranks after {gtp * replicas} "
                         f"generator ranks (--rollout-tensor-parallel-size {gtp} x --rollout-num-replicas "
                         f"{replicas}); it must be a positive multiple of --tensor-model-parallel-size {tp} x "
                         f"--pipeline-model-parallel-size {pp}")
    return trainer_world


def run(args) -> None:
    trainer_world = trainer_world_size(args, int(os.environ.get("WORLD_SIZE", "1")))
    tokenizer = load_tokenizer(args)
    spec = model_spec(args, tokenizer)
    if args.load:  # before any work: a damaged or foreign checkpoint fails here, naming what is wrong
        checkpointing.check_checkpoint(args.load, spec)
    roles = init_roles(trainer_world, args.rollout_tensor_parallel_size, args.rollout_num_replicas)
    if roles.is_controller:
        os.makedirs(args.output_dir, exist_ok=True)
        tokenizer.save_pretrained(os.path.join(args.output_dir, "tokenizer"))
    executor = TrainerExecutor(args, roles, spec, tokenizer) if roles.is_trainer else \
        GeneratorExecutor(args, roles, spec, tokenizer)
    executor.run()
    dist.destroy_process_group()
