"""The single controller's loop (LlamaRL figure 2), on trainer rank 0.

Each step: prompts go to the generators; their rollouts come back a group at a time, are scored by the reward
stage and wait in the rollout buffer; complete groups pass the buffer's gates and become a `TrainBatch`; the
trainer executor takes an optimizer step on every trainer rank; DDMA publishes the new weight version.
Asynchronous steps (--async-mode on, or alternate) dispatch the next step's prompts before training, so
generation overlaps training (generators pause in-flight requests for each update and resume them: partial
rollouts); synchronous steps dispatch them only after the new weights are published (on-policy).

--controlled-lag K (synchronous dispatch) trains every batch exactly K weight versions after the version that
generated it, so off-policy corrections can be compared at a known lag: each step collects its groups, all
generated under the latest version, into a FIFO of held batches (`HeldBatch`) and trains on the oldest one once
the FIFO holds K + 1. The first step collects those K + 1 batches under the first version, since no older one
exists: steps 1..K train at lags 0..K-1 (the ramp, each step's metrics say its lag), every later step at K. A
skipped update (NaN/Inf gradient: no new version) shortens the lag of the next K batches to K - 1. The buffer's
gates run as the groups are collected (lag 0); the parser keeps --max-staleness >= K, which the lag at training
meets too. Held batches are part of the RL checkpoint: a resume keeps the lag.

The controller reaches the trainer through `trainer.command(name, payload)` and the generators through two
channels; `train.run` builds it beside the executors, so it owns none of them (tests drive it with fakes).
"""

from __future__ import annotations

import math
import os
import queue
import time
from collections import Counter, defaultdict, deque

from megatron_rl.checkpoint import rl_checkpoint
from megatron_rl.config.setup import RunSetup, stable_seed
from megatron_rl.controller import evaluation
from megatron_rl.controller.buffer import Rollout, RolloutBuffer
from megatron_rl.controller.held import HeldBatch
from megatron_rl.controller.prompt_source import PromptSource
from megatron_rl.controller.reward_failures import RewardFailures, environment_failures
from megatron_rl.controller.reward_stage import RewardStage
from megatron_rl.data.prompts import check_prompt_lengths, encode_prompt
from megatron_rl.observability.metrics import (
    MetricsLogger,
    Progress,
    RolloutLog,
    StepTimes,
    console_fields,
    generator_totals,
    run_config,
    step_metrics,
    write_json,
)
from megatron_rl.rewards import build_reward_fn
from megatron_rl.rewards.shaping import OverlongPenalty
from megatron_rl.rollout import uses_agents
from megatron_rl.rollout.types import RequestMeta
from megatron_rl.runtime.early_exit import EarlyExit
from megatron_rl.runtime.keep_alive import KeepAlive
from megatron_rl.trainer.batch import TrainBatch


class Controller:
    def __init__(self, setup: RunSetup, trainer, control, rollouts, leaders: list[int],
                 early_exit: EarlyExit | None = None):
        """`trainer.command(name, payload)` runs a command on every trainer rank; `control.send(message, rank)`
        reaches a generator leader; `rollouts.recv()` gives the generators' messages; `early_exit` says when to
        stop before --train-iters (with a checkpoint)."""
        args = setup.args
        self.args, self.spec, self.layout, self.tokenizer = args, setup.spec, setup.trainer, setup.tokenizer
        self.trainer, self.control, self.leaders = trainer, control, leaders
        self.source = PromptSource(args)
        self.buffer = RolloutBuffer(args.n_samples_per_prompt, args.max_staleness, not args.keep_uniform_groups)
        if args.judge_model:
            from megatron_rl.rollout.sglang.judge import build_judge

            self.reward_fn = build_judge(args)
        else:
            self.reward_fn = build_reward_fn(args.reward_fn, args.reward_num_workers, args.reward_timeout,
                                             args.custom_rm_path, args.rm_url, args.rm_retries,
                                             args.rm_max_concurrency)
        self.stop_token_ids = setup.stop_token_ids
        self.agentic = uses_agents(args)
        shaping = OverlongPenalty(args.rollout_max_response_len, args.overlong_buffer_len,
                                  args.overlong_penalty_factor) if args.overlong_penalty else None
        self.stage = RewardStage(rollouts, self.tokenizer, self.reward_fn, len(leaders), self.stop_token_ids, shaping)
        self.prompts_per_step = args.global_batch_size // args.n_samples_per_prompt
        self.rl_params = {"temperature": args.rollout_temperature, "top_k": args.rollout_top_k,
                          "top_p": args.rollout_top_p, "max_new_tokens": args.rollout_max_response_len,
                          "stop_token_ids": self.stop_token_ids}
        self.inflight: dict[str, dict] = {}  # RL prompts dispatched whose group has not left the buffer, by id
        self.signal_rate = 1.0  # recent steps' fraction of the groups taken from the buffer that had signal
        self.dispatch_versions: dict[str, int] = {}  # the weight version each of them was dispatched under
        self.held: deque[HeldBatch] = deque()  # --controlled-lag: collected batches waiting to be trained
        self.dispatched: Counter = Counter()  # prompt id -> times dispatched (each prompt exactly once)
        self.eval_sets = evaluation.eval_sets(args, self.source)
        self.eval_results: dict[tuple[str, int], object] = {}  # (prompt id, sample index) -> RewardResult
        self.eval_history: list[dict] = []  # {"step", set name -> summary} per evaluation
        eval_len = args.eval_max_response_len or args.rollout_max_response_len
        dataset = self.source.dataset
        if dataset is not None:  # every prompt fits beside its response: checked now, not when it comes up
            check_prompt_lengths((dataset.record(i) for i in range(len(dataset))), self.encode_prompt,
                                 args.seq_length - args.rollout_max_response_len, f"--prompt-data {dataset.path}",
                                 "--rollout-max-response-len")
        for s in self.eval_sets:
            check_prompt_lengths(s.problems, self.encode_prompt, args.seq_length - eval_len, f"evaluation set {s.name}",
                                 "--eval-max-response-len" if args.eval_max_response_len else
                                 "--rollout-max-response-len")
        self.gen_stats: dict[int, dict] = {}  # generator rank -> its cumulative counters
        self._gen_totals: dict = {}  # their sums at the previous step
        self.version, self.consumed, self.skipped_steps, self.consecutive_skips = -1, 0, 0, 0
        self.step = 0  # the RL step under way (0 before the first)
        self.reward_failures = RewardFailures(args.max_consecutive_reward_failures)
        self.environment_failures = environment_failures(args.max_consecutive_environment_failures)
        self.early_exit = early_exit or EarlyExit()
        # generators with nothing to do wait for the next message at most --distributed-timeout-minutes, and this
        # rank for their rollouts as long: a keep-alive to every leader, which each answers, when nothing was sent
        self.keep_alive = KeepAlive(args.distributed_timeout_minutes * 60 / 4, lambda: control.last_sent,
                                    lambda: [control.send(("keep-alive", None), leader) for leader in leaders],
                                    name="generator-keep-alive")
        self._next_leader = self._stopped = 0
        os.makedirs(args.output_dir, exist_ok=True)
        if args.load:
            rl_checkpoint.truncate_logs_to_checkpoint(args.load, args.output_dir)
        self.rollout_log = RolloutLog(args.output_dir, append=bool(args.load))
        self.logger = MetricsLogger(args.output_dir, args.wandb_project, args.wandb_exp_name, args.wandb_save_dir,
                                    args.tensorboard_dir, config=run_config(args),
                                    append=bool(args.load), wandb_mode_flag=args.wandb_mode)

    # ---- generators -----------------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[dict]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.args.apply_chat_template, self.args.system_prompt)

    def dispatch(self, problems: list[dict], samples: int | list[int], params: dict, is_eval: bool = False,
                 resent: bool = False) -> None:
        """Send `samples` (a count, or the sample indices) of each problem to a generator. `resent`: samples lost
        in flight at a crash, sent again after a resume (not a new dispatch of the prompt)."""
        by_leader = defaultdict(list)
        if not is_eval and not resent:
            self.rollout_log.dispatched(self.step, [str(p["id"]) for p in problems], samples)
        for problem in problems:
            pid = str(problem["id"])
            if not is_eval and not resent:
                self.dispatched[pid] += 1
                self.inflight[pid] = problem
                self.dispatch_versions[pid] = self.version
            prompt = self.encode_prompt(problem["prompt"])
            leader = self.leaders[self._next_leader % len(self.leaders)]
            self._next_leader += 1
            for k in (range(samples) if isinstance(samples, int) else samples):
                rid = f"{'eval:' if is_eval else ''}{pid}#{k}"
                meta = RequestMeta(pid, k, problem["answer"], is_eval, time.time(), problem.get("metadata", {}),
                                   problem["prompt"] if self.agentic else None)
                by_leader[leader].append((rid, prompt, dict(params, seed=stable_seed(self.args.seed, rid)), meta))
        for leader, requests in by_leader.items():
            self.control.send(("requests", requests), leader)

    def in_flight_target(self, taken: int, ahead: bool) -> int:
        """RL prompts to keep in flight once a step has taken `taken` groups: the rest of its own and, when it
        dispatches ahead, the next step's (--staleness-control admission: as many steps' as --max-staleness lets
        every one of them be trained within that many versions of the weights it was dispatched under). Dispatching
        ahead under --staleness-control discard, it keeps as many more as dynamic sampling will drop (the recent
        fraction of groups with signal says how many): the generator then makes the replacements while the trainer
        trains, instead of the step waiting for them."""
        steps = 1
        if ahead:
            steps += self.args.max_staleness if self.args.staleness_control == "admission" else 1
        needed = steps * self.prompts_per_step - taken
        if ahead and self.args.staleness_control == "discard":
            return math.ceil(needed / self.signal_rate)
        return needed

    def due(self) -> list[str]:
        """--staleness-control admission: the prompts in flight (in dispatch order) that would be more than
        --max-staleness versions old at the next step, which this step must train."""
        if self.args.staleness_control != "admission":
            return []
        oldest = self.version - self.args.max_staleness
        return [p for p in self.inflight if self.dispatch_versions.get(p, self.version) <= oldest]

    def top_up(self, target: int) -> None:
        """Keep `target` RL prompts in flight."""
        if target > len(self.inflight):
            self.dispatch(self.source.next(target - len(self.inflight)), self.args.n_samples_per_prompt,
                          self.rl_params)

    def receive(self, times: StepTimes | None = None, block: bool = True) -> bool:
        """Buffer the rollouts of one scored message from the reward stage. `block=False`: only if one is ready;
        returns whether a message was taken."""
        start = time.perf_counter()
        try:
            scored = self.stage.get(self.args.generator_timeout if block else 0)
        except queue.Empty:
            if not block:
                return False
            raise RuntimeError(f"no rollouts from any generator for {self.args.generator_timeout:.0f} s "
                               f"(--generator-timeout) with {len(self.inflight)} prompts in flight: a generator hangs "
                               f"or died (generator leaders {self.leaders}; see their output)") from None
        self.gen_stats[scored.source] = scored.stats
        if scored.kind == "stopped":
            self._stopped += 1
            return True
        self.reward_failures.check(scored.rewards)
        self.environment_failures.check(scored.rewards)
        if times is not None:
            times.wait_s += time.perf_counter() - start
            times.reward_s += scored.reward_s
        for (output, meta), reward in zip(scored.rollouts, scored.rewards):
            if meta.is_eval:
                self.eval_results[(meta.prompt_id, meta.sample_index)] = reward
            else:
                self.buffer.add(Rollout(output, meta, reward))
        return True

    def publish(self) -> float:
        """Announce version + 1 to the generators and post the trainer's DDMA sends of it."""
        start = time.perf_counter()
        self.version += 1
        for leader in self.leaders:
            self.control.send(("sync", self.version), leader)
        self.trainer.command("publish", self.version)
        return time.perf_counter() - start

    # ---- checkpoints ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"weight_version": self.version, "consumed_samples": self.consumed, "source": self.source.state_dict(),
                "buffer": self.buffer.state_dict(), "inflight": self.inflight, "dispatched": dict(self.dispatched),
                "skipped_steps": self.skipped_steps, "reward_failures": dict(self.reward_failures.counts),
                "eval_history": self.eval_history, "controlled_lag": self.args.controlled_lag,
                "dispatch_versions": self.dispatch_versions, "signal_rate": self.signal_rate,
                "held_batches": [b.to_dict() for b in self.held]}

    def load_state_dict(self, state: dict) -> None:
        self.version, self.consumed = state["weight_version"], state["consumed_samples"]
        self.source.load_state_dict(state["source"])
        self.buffer.load_state_dict(state["buffer"])
        self.inflight, self.dispatched = state["inflight"], Counter(state["dispatched"])
        self.dispatch_versions = state.get("dispatch_versions", {})  # absent in checkpoints before admission
        self.signal_rate = state.get("signal_rate", 1.0)  # absent in checkpoints before it was kept
        self.skipped_steps, self.reward_failures.counts = state["skipped_steps"], Counter(state["reward_failures"])
        self.eval_history = state.get("eval_history", [])  # absent in checkpoints of runs without evaluations
        self.held = deque(HeldBatch.from_dict(b) for b in state.get("held_batches", []))

    def resend_lost_samples(self, step: int) -> None:
        """After a resume: samples of the prompts in flight at the checkpoint that were not in its buffer died
        with the crashed generators; send them again (same request ids and seeds) and record why."""
        lost = {pid: [k for k in range(self.args.n_samples_per_prompt) if k not in self.buffer.sample_indices(pid)]
                for pid in self.inflight}
        lost = {pid: ks for pid, ks in lost.items() if ks}
        for pid, samples in lost.items():
            self.dispatch([self.inflight[pid]], samples, self.rl_params, resent=True)
            self.rollout_log.resent(step, pid, samples)
        print(f"resumed at step {step}: {self.buffer.pending()} buffered rollouts kept, "
              f"{sum(map(len, lost.values()))} in-flight samples of {len(lost)} prompts generated again", flush=True)

    def save_checkpoint(self, step: int) -> None:
        rl_checkpoint.save_rl_checkpoint(self.args.save, step, self.trainer,
                                         {"model": self.spec.weight_fields(), **self.state_dict(),
                                          "transformer_impl": self.layout.transformer_impl},
                                         keep_last=self.args.keep_last_n_checkpoints)

    def hf_export_dir(self) -> str:
        return self.args.save_hf or os.path.join(self.args.output_dir, "hf")

    def hf_export_due(self, step: int) -> bool:
        """HF exports (--save-hf, --save-hf-interval): every interval, and at the last step (step 0 of a run
        without RL steps, --train-iters 0: the policy as RL would begin, e.g. after a shared warm-up)."""
        interval = self.args.save_hf_interval
        if not (self.args.save_hf or interval):
            return False
        return step == self.args.train_iters or bool(interval and step % interval == 0)

    # ---- phases ---------------------------------------------------------------------------------------------------
    def evaluate(self, step: int) -> dict[str, dict]:
        """Every evaluation set under the current weights: set name -> figures (`evaluation.summarize`)."""
        args, n = self.args, self.args.eval_n_samples
        self.eval_results = {}
        params = {"temperature": args.eval_temperature, "stop_token_ids": self.stop_token_ids,
                  "max_new_tokens": args.eval_max_response_len or args.rollout_max_response_len}
        for eval_set in self.eval_sets:
            self.dispatch(eval_set.problems, n, params, is_eval=True)
        while len(self.eval_results) < n * sum(len(s.problems) for s in self.eval_sets):
            self.receive()
        results = {s.name: evaluation.summarize(s, self.eval_results, n) for s in self.eval_sets}
        for name, summary in results.items():
            print(f"step {step}: {evaluation.describe(name, summary)}", flush=True)
        self.eval_history.append({"step": step, **results})
        return results

    def sft_warmup(self) -> None:
        eos = self.tokenizer.eos_token_id
        progress = Progress(0, self.args.sft_warmup_iters, "SFT warm-up", self.args.log_interval)
        for step in range(1, self.args.sft_warmup_iters + 1):
            problems = self.source.sft(self.args.sft_batch_size)
            prompts = [self.encode_prompt(p["prompt"]) for p in problems]
            answers = [self.tokenizer.encode(p["answer"], add_special_tokens=False) + [eos] for p in problems]
            batch = TrainBatch.from_sequences(prompts, answers, [[0.0] * len(a) for a in answers],
                                              [1.0] * len(problems))
            lr = self.args.sft_lr * min(1.0, step / self.args.sft_lr_warmup_iters) if self.args.sft_lr_warmup_iters \
                else self.args.sft_lr
            loss = self.trainer.command("sft", (batch, lr))["loss"]
            progress.update(step, {"loss": f"{loss:.3f}"})
        progress.close()

    def is_async_step(self, step: int) -> bool:
        if self.args.async_mode == "alternate":  # blocks of steps, the first one asynchronous
            return (step - 1) // self.args.async_alternate_steps % 2 == 0
        return self.args.async_mode == "on"

    def collect(self, step: int, times: StepTimes) -> tuple[list, dict]:
        """The step's groups from the buffer, waiting for rollouts as needed. Dynamic sampling: groups without
        signal are replaced, up to --max-oversample x the step's prompts; past that uniform groups fill the batch."""
        P, ahead = self.prompts_per_step, self.is_async_step(step)
        groups, seen = [], {"discards": Counter(), "lags": Counter(), "sampled_rewards": [], "ages": [], "outcomes": [],
                            "due_groups": 0}
        popped = 0
        due = self.due()
        seen["due_groups"] = len(due)
        while len(groups) < P or due:
            left = max(self.args.max_oversample * P - popped, 0)
            self.top_up(self.in_flight_target(len(groups), ahead))
            while self.buffer.complete_groups() == 0 or not all(map(self.buffer.is_complete, due)):
                self.receive(times)
            while self.receive(times, block=False):  # and whatever else is scored already: one take per batch
                pass
            # however the groups arrived, at most max_oversample x P are popped before uniform ones are kept; every
            # due group is taken, even past P (the window of in-flight prompts makes that rare)
            batch = self.buffer.take(max(P - len(groups), len(due)), self.version, oversample_left=left, first=due)
            popped += batch.popped
            for r, _ in batch.outcomes:
                self.inflight.pop(r.prompt_id, None)
                self.dispatch_versions.pop(r.prompt_id, None)
            due = [p for p in due if p in self.inflight]
            groups += batch.groups
            seen["discards"].update(batch.discards)
            seen["lags"].update(batch.lag_histogram)
            seen["sampled_rewards"] += batch.sampled_rewards
            seen["ages"] += [batch.age_seconds_mean] * len(batch.groups)
            seen["outcomes"] += batch.outcomes
        if popped:  # what dispatching ahead should expect of the next steps (at least 1 in --max-oversample)
            self.signal_rate = (self.signal_rate + max(len(groups) / popped, 1 / self.args.max_oversample)) / 2
        return groups, seen

    def collect_held(self, step: int, times: StepTimes) -> tuple[list, dict]:
        """--controlled-lag K: this step's groups join the FIFO of held batches (the first step's K + 1 batches,
        all under the first version), and the oldest held batch is released, K versions old after the ramp."""
        needed = self.args.controlled_lag + 1 - len(self.held)
        self.top_up(needed * self.prompts_per_step)
        for _ in range(needed):
            self.held.append(HeldBatch(self.version, *self.collect(step, times)))
        return self.held.popleft().released_at(self.version)

    def make_batch(self, groups: list) -> TrainBatch:
        """The step's batch; with --use-kl-in-reward the trainer computes the reference log-probs first and the
        KL shapes the rewards (`TrainBatch.from_groups`)."""
        args = self.args
        replay = args.use_rollout_routing_replay
        if not args.use_kl_in_reward:
            return TrainBatch.from_groups(groups, args.advantage_estimator, args.mask_truncated, routing_replay=replay)
        return TrainBatch.from_groups(groups, args.advantage_estimator, args.mask_truncated,
                                      reference=lambda batch: self.trainer.command("ref_logprobs", batch),
                                      kl_coef=args.kl_coef, kl_estimator=args.kl_loss_type, routing_replay=replay)

    def rl_step(self, step: int, run_start: float) -> dict:
        self.step = step
        ahead, times, start = self.is_async_step(step), StepTimes(), time.perf_counter()
        collect = self.collect if self.args.controlled_lag is None else self.collect_held
        groups, seen = collect(step, times)
        self.rollout_log.outcomes(step, self.version, seen["outcomes"])
        if ahead:  # the next step's prompts generate while this step trains
            self.top_up(self.in_flight_target(min(len(groups), self.prompts_per_step), ahead))
        t = time.perf_counter()
        train_metrics = self.trainer.command("train", self.make_batch(groups))
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
            self.top_up(self.prompts_per_step)
        rollouts = [r for g in groups for r in g]
        self.consumed += len(rollouts)
        totals = generator_totals(self.gen_stats)
        previous, self._gen_totals = self._gen_totals, totals
        return step_metrics(rollouts, seen, train_metrics, times, totals, previous, step_s=time.perf_counter() - start,
                            weight_version=self.version, consumed_samples=self.consumed,
                            time_s=time.time() - run_start, skipped_steps=self.skipped_steps,
                            reward_failures=dict(self.reward_failures.counts), is_async=ahead)

    def run(self) -> None:
        args = self.args
        start_step = 0
        if args.load:
            state = rl_checkpoint.load_rl_checkpoint(args.load, self.trainer)
            self.load_state_dict(state)
            start_step = state["step"]
            self.version -= 1  # publish() below re-publishes the loaded weights under their version
        self.publish()  # generators start empty: the first publish gives them the policy
        if args.load:
            self.resend_lost_samples(start_step)
        if args.sft_warmup_iters and not args.load:
            self.sft_warmup()
            self.publish()
        if args.kl_coef and not args.ref_load and not args.load:
            self.trainer.command("snapshot_reference")  # the default reference: the policy as RL begins
        if self.eval_sets and not args.load:  # a resume keeps the evaluations of its checkpoint (eval_history)
            self.logger.log(start_step, {"eval": self.evaluate(start_step)})
        run_start = time.time()
        mode = {"on": "async", "off": "sync", "alternate": "async/sync"}[args.async_mode]
        if args.controlled_lag is not None:
            mode = f"lag {args.controlled_lag}"
        progress = Progress(start_step, args.train_iters, f"{args.loss.upper()} ({mode})", args.log_interval)
        if args.train_iters == 0 and self.hf_export_due(0):
            self.trainer.command("save_hf", rl_checkpoint.iteration_dir(self.hf_export_dir(), 0))
        for step in range(start_step + 1, args.train_iters + 1):
            metrics = self.rl_step(step, run_start)
            if self.eval_sets and (args.eval_interval and step % args.eval_interval == 0 or step == args.train_iters):
                metrics["eval"] = self.evaluate(step)
            self.logger.log(step, metrics)
            saved = bool(args.save and args.save_interval and step % args.save_interval == 0)
            if saved:
                self.save_checkpoint(step)
            if self.hf_export_due(step):
                self.trainer.command("save_hf", rl_checkpoint.iteration_dir(self.hf_export_dir(), step))
            progress.update(step, console_fields(metrics))
            reason = self.early_exit.reason()
            if reason is not None:
                if args.save and not saved:
                    self.save_checkpoint(step)
                print(f"[megatron-rl] step {step}: {reason}: stopping"
                      + (f", checkpoint of step {step} in {args.save}" if args.save else " (no --save: nothing saved)"),
                      flush=True)
                break
        progress.close()
        write_json(os.path.join(args.output_dir, "eval.json"), {
            **evaluation.report(self.eval_history, args.eval_n_samples, args.eval_temperature, self.eval_sets),
            "train_iters": args.train_iters, "async_mode": args.async_mode, "rl_seconds": time.time() - run_start,
            "prompts_dispatched": len(self.dispatched), "discards": dict(self.buffer.discards),
            "prompts_dispatched_more_than_once": sum(c > 1 for c in self.dispatched.values()),
            "prompts_in_flight_at_end": len(self.inflight), "controlled_lag": args.controlled_lag,
            # kept and discarded groups alike: their ledger rows are written when their batch is released
            "prompts_held_at_end": sum(len({r.prompt_id for r, _ in b.seen["outcomes"]}) for b in self.held)})

    def shutdown(self) -> None:
        """Stop the generators, drop what they still send until each says it stopped, close the logs."""
        try:
            self.keep_alive.stop()
            for leader in self.leaders:
                self.control.send(("stop", None), leader)
            while self._stopped < len(self.leaders):
                self._stopped += self.stage.get(self.args.generator_timeout).kind == "stopped"
            self.control.flush()
        finally:
            self.logger.close()
            self.rollout_log.close()
            close = getattr(self.reward_fn, "close", None)
            if close is not None:
                close()
