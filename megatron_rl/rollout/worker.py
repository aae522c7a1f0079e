"""The generator worker: one per generator rank, driving this rank's engine (from the backend registry).

The replica's leader takes messages from the controller: "requests" (add them to the engine), "sync" (pause,
receive the new weights by DDMA, continue), "keep-alive" (answered with "alive"),
"stop". It shares them with the replica's other TP ranks, which
make exactly the same engine calls (SPMD, as SGLang's TP schedulers do). With agent rollouts (a rollout program,
`rollout.agent`) the leader runs the programs, and their policy calls are what it shares and the engine decodes;
finished trajectories are the rollouts. Finished rollouts go back to the
controller a group at a time: the controller can use only complete groups, and each message wakes a thread on
the trainer's rank 0, so one message per engine step with complete groups beats one per finished sample.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict

import torch
import torch.distributed as dist

from megatron_rl.config.setup import RunSetup
from megatron_rl.ddma.sync import publish
from megatron_rl.ddma.transport import make_transport
from megatron_rl.rollout import ENGINE_BACKENDS
from megatron_rl.rollout.agent import rollout_program
from megatron_rl.rollout.types import RequestMeta, RolloutOutput, SamplingParams
from megatron_rl.runtime import failpoints
from megatron_rl.runtime.channels import TAG_CONTROL, TAG_ROLLOUTS, Channel
from megatron_rl.runtime.roles import Roles


class GeneratorWorker:
    def __init__(self, setup: RunSetup, roles: Roles):
        self.args, self.roles = setup.args, roles
        self.dtype = torch.bfloat16 if self.args.bf16 else torch.float32
        self.engine = ENGINE_BACKENDS[self.args.rollout_backend].build(setup, roles)
        self.plan = setup.plan()
        self.transport = make_transport(roles)
        self.control = Channel(roles.sync_group, TAG_CONTROL, last_kind="stop")
        self.rollouts = Channel(roles.sync_group, TAG_ROLLOUTS)
        self.stats = {"busy_s": 0.0, "idle_s": 0.0, "sync_s": 0.0, "tokens": 0}
        self.meta: dict[str, RequestMeta] = {}
        self.unfinished: Counter = Counter()  # group -> samples still generating
        self.held: dict[tuple, list] = defaultdict(list)  # group -> finished samples waiting for the rest
        self.version = -1  # of the weights the engine holds
        program = rollout_program(self.args, setup.tokenizer, setup.stop_token_ids)
        self.agents = None  # the leader's rollout programs (None: one engine request per sample)
        self.agentic = program is not None
        if self.agentic and roles.is_leader:
            from megatron_rl.rollout.agent.runner import AgentRunner

            self.agents = AgentRunner(program, setup.tokenizer, self.args.seq_length, setup.spec.vocab_size,
                                      setup.stop_token_ids, self.args.rollout_program_timeout)

    def run(self) -> None:
        try:
            while self._handle(self._messages()):
                if self.engine.has_work() and not self.engine.paused:
                    self._step()
                if self.agents is not None:
                    self._finished(self.agents.take_finished())
        finally:
            if self.agents is not None:
                self.agents.shutdown()
            self.engine.shutdown()

    def _messages(self) -> list:
        """The leader reads control messages (blocking only when there is nothing to decode) and shares them
        with the replica's other TP ranks."""
        msgs = []
        if self.roles.is_leader:
            if not self.engine.has_work():
                start = time.perf_counter()
                if self.agents is not None and self.agents.active:
                    self.agents.wait(0.01)  # programs between policy calls (tools running): poll both sides
                else:
                    msgs.append(self.control.recv(0)[0])
                self.stats["idle_s"] += time.perf_counter() - start
            while (m := self.control.poll(0)) is not None:
                msgs.append(m[0])
            if self.agents is not None and (calls := self.agents.take_calls()):
                msgs.append(("policy-calls", [(rid, ids, dataclasses.asdict(p)) for rid, ids, p in calls]))
        if self.roles.rollout_tp > 1:
            box = [msgs]
            group = self.roles.replica_control_group  # gloo: the other TP ranks wait in host memory
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
            msgs = box[0]
        return msgs

    def _handle(self, messages: list) -> bool:
        """Apply the controller's messages; False once told to stop."""
        for kind, payload in messages:
            if kind == "requests" and not (self.agentic and self.agents is None):  # (the leader runs programs)
                for rid, prompt, params, meta in payload:
                    self.meta[rid] = meta
                    self.unfinished[meta.group] += 1
                    if self.agents is not None:
                        from megatron_rl.rollout.agent.client import AgentSample

                        self.agents.start(AgentSample(rid, meta.prompt, prompt, meta.reference, meta.metadata,
                                                      meta.is_eval), SamplingParams(**params))
                    elif not self.agentic:
                        self.engine.add_request(prompt, SamplingParams(**params), rid)
            elif kind == "policy-calls":  # the rollout programs' calls, made by every TP rank of the replica
                for rid, prompt, params in payload:
                    self.engine.add_request(prompt, SamplingParams(**params), rid)
            elif kind == "sync":
                start = time.perf_counter()
                self.engine.pause(self.args.rollout_pause_mode)
                publish(self.plan, self.roles.rank, payload, engine=self.engine, transport=self.transport,
                        dtype=self.dtype, device=self.roles.device, bucket_bytes=self.args.ddma_bucket_mb * 2**20,
                        debug_checksums=self.args.ddma_debug_checksums)
                self.engine.continue_generation()
                self.version = payload
                self.stats["sync_s"] += time.perf_counter() - start
            elif kind == "keep-alive":  # the controller had nothing to say for a while: answer, so that its wait for
                if self.roles.is_leader:  # rollouts does not time out either
                    self.rollouts.send(("alive", None), 0)
            elif kind == "stop":
                if self.roles.is_leader:
                    self.rollouts.send(("stopped", dict(self.stats)), 0)
                    self.rollouts.flush()
                return False
        return True

    def _step(self) -> None:
        start = time.perf_counter()
        finished = self.engine.step()
        failpoints.crash("generate", self.version)
        self.stats["busy_s"] += time.perf_counter() - start
        self.stats["engine_restarts"] = self.engine.restarts
        self.stats["rerun_requests"] = self.engine.rerun_requests
        if self.agents is not None:
            self.agents.resolve(finished)  # policy calls: their programs go on
        elif not self.agentic:
            self._finished(finished)

    def _finished(self, outputs: list[RolloutOutput]) -> None:
        """Hold finished rollouts until their group is complete, then send the complete groups (the leader)."""
        complete = []
        for output in outputs:
            meta = self.meta.pop(output.request_id)
            self.held[meta.group].append((output, meta))
            self.unfinished[meta.group] -= 1
            if not self.unfinished[meta.group]:
                del self.unfinished[meta.group]
                complete += self.held.pop(meta.group)
        if complete and self.roles.is_leader:
            self.stats["tokens"] += sum(len(o.policy_versions) for o, _ in complete)  # the tokens it sampled
            self.rollouts.send(("rollouts", (complete, dict(self.stats))), 0)
