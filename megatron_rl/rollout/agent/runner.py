"""Agent programs on a generator: an asyncio loop in a thread of the replica's leader runs one program per sample.

The generator worker hands each sample to `start`; the program's policy calls come out of `take_calls` as engine
requests, which the worker shares with the replica's other TP ranks and adds to the engine; the engine's outputs go
back through `resolve`. Tools run on the loop meanwhile, so tool calls overlap decoding. A finished program's
trajectory comes out of `take_finished` as one `RolloutOutput`. Whatever goes wrong in the environment (an
`EnvironmentFailure`, an exception of the program, a trajectory that breaks the limits) becomes that sample's
environment failure, with the reason: excluded from training and counted, never a reward.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Awaitable, Callable

from megatron_rl.rollout.agent.client import AgentSample, GenerationClient
from megatron_rl.rollout.agent.openai_server import OpenAIEndpoint
from megatron_rl.rollout.agent.trajectory import Trajectory
from megatron_rl.rollout.types import RolloutOutput, SamplingParams
from megatron_rl.tools import EnvironmentFailure

Program = Callable[[AgentSample, GenerationClient], Awaitable[Trajectory]]


class AgentRunner:
    def __init__(self, program: Program, tokenizer, max_context: int, vocab_size: int, end_of_turn_ids=()):
        """`max_context`: the most tokens a trajectory may have (--seq-length); `end_of_turn_ids`: the run's stop
        tokens (the OpenAI endpoint's turns end with them)."""
        self.program, self.tokenizer = program, tokenizer
        self.endpoint = OpenAIEndpoint(tokenizer, end_of_turn_ids)  # its server starts with the first session
        self.max_context, self.vocab_size = max_context, vocab_size
        self.active = 0  # programs started and not yet taken back
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # (request id, token ids, SamplingParams)
        self._finished: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: dict[str, asyncio.Future] = {}  # policy calls in the engine (touched on the loop only)
        self._wake = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="agent-programs")
        self._thread.start()

    # ---- the worker's side ----------------------------------------------------------------------------------------
    def start(self, sample: AgentSample, params: SamplingParams) -> None:
        self.active += 1
        asyncio.run_coroutine_threadsafe(self._run(sample, params), self._loop)

    def take_calls(self) -> list[tuple[str, list[int], SamplingParams]]:
        return _drain(self._calls)

    def resolve(self, outputs: list[RolloutOutput]) -> None:
        """The engine's outputs of policy calls."""
        for output in outputs:
            self._loop.call_soon_threadsafe(self._resolve, output)

    def take_finished(self) -> list[RolloutOutput]:
        done = _drain(self._finished)
        self.active -= len(done)
        for item in done:
            if isinstance(item, BaseException):
                raise item
        return done

    def wait(self, timeout_s: float) -> None:
        """Until a program makes a call or finishes, at most `timeout_s`."""
        self._wake.wait(timeout_s)
        self._wake.clear()

    def shutdown(self) -> None:
        """Cancel the programs still running (their tools' processes die with them) and stop the loop."""
        async def cancel():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.endpoint.stop()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(cancel(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    # ---- the loop's side ------------------------------------------------------------------------------------------
    async def _run(self, sample: AgentSample, params: SamplingParams) -> None:
        try:
            self._finished.put(await self._trajectory(sample, params))
        except BaseException as e:  # noqa: BLE001 - a fault of the runner itself: raised again in the worker
            self._finished.put(e)
            raise
        finally:
            self._wake.set()

    async def _trajectory(self, sample: AgentSample, params: SamplingParams) -> RolloutOutput:
        budget = params.max_new_tokens
        client = GenerationClient(self._submit, sample.request_id, params, self.tokenizer, self.max_context, budget,
                                  self.endpoint)
        try:
            trajectory = await self.program(sample, client)
            failure = self._check(trajectory, budget)
        except EnvironmentFailure as e:
            failure, trajectory = str(e), None
        except Exception as e:  # noqa: BLE001 - the program is the environment: its bug excludes the sample
            failure, trajectory = f"the rollout program raised {type(e).__name__}: {e}", None
        finally:
            for session in client.sessions:  # a late call of the agent finds no session
                self.endpoint.close(session)
        if trajectory is None or failure and not isinstance(trajectory, Trajectory):
            trajectory = Trajectory(list(sample.prompt_token_ids))
        return trajectory.to_output(sample.request_id, failure)

    def _check(self, trajectory, budget: int) -> str | None:
        """Why the program's trajectory cannot be trained on, or None."""
        if not isinstance(trajectory, Trajectory):
            return f"the rollout program returned {type(trajectory).__name__}, not a Trajectory"
        if not trajectory.prompt_token_ids:
            return "the trajectory has no prompt tokens"
        if trajectory.num_response_tokens > budget:
            return (f"the trajectory has {trajectory.num_response_tokens} tokens after its prompt, more than "
                    f"--rollout-max-response-len {budget}")
        if len(trajectory.token_ids) > self.max_context:
            return f"the trajectory has {len(trajectory.token_ids)} tokens, more than --seq-length {self.max_context}"
        bad = [t for t in trajectory.token_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"the trajectory has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
        return None

    async def _submit(self, request_id: str, token_ids: list[int], params: SamplingParams) -> RolloutOutput:
        future = self._loop.create_future()
        self._waiting[request_id] = future
        self._calls.put((request_id, token_ids, params))
        self._wake.set()
        try:
            return await future
        finally:
            self._waiting.pop(request_id, None)

    def _resolve(self, output: RolloutOutput) -> None:
        future = self._waiting.get(output.request_id)
        if future is not None and not future.done():
            future.set_result(output)


def _drain(q: queue.SimpleQueue) -> list:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
