"""Agent programs on a generator: an asyncio loop in a thread of the replica's leader runs one program per sample.

The generator worker hands each sample to `start`; the program's policy calls come out of `take_calls` as engine
requests, which the worker shares with the replica's other TP ranks and adds to the engine; the engine's outputs go
back through `resolve`. Tools run on the loop meanwhile, so tool calls overlap decoding. A finished program's
trajectory comes out of `take_finished` as one `RolloutOutput`.

A program is user code: whatever goes wrong in it or its environment is that sample's failure (`AgentFailure`,
with its kind and reason), never the run's. An `EnvironmentFailure`, an input the boundary refuses (`InvalidInput`:
a bad policy call, a trajectory that cannot be trained on), any `BaseException` the program raises (its traceback
printed once per reason) and a program that runs past --rollout-program-timeout each exclude the sample: it is
counted, never a reward. Only the runner's own faults stop the generator.
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import traceback
from collections.abc import Awaitable, Callable

from megatron_rl.rollout.agent.boundary import InvalidInput, TrajectoryLimits, check_trajectory
from megatron_rl.rollout.agent.client import AgentSample, GenerationClient
from megatron_rl.rollout.agent.openai_server import OpenAIEndpoint
from megatron_rl.rollout.agent.trajectory import AgentFailure, Trajectory
from megatron_rl.rollout.types import RolloutOutput, SamplingParams
from megatron_rl.tools import EnvironmentFailure

Program = Callable[[AgentSample, GenerationClient], Awaitable[Trajectory]]


class AgentRunner:
    def __init__(self, program: Program, tokenizer, max_context: int, vocab_size: int, end_of_turn_ids=(),
                 program_timeout_s: float | None = None):
        """`max_context`: the most tokens a trajectory may have (--seq-length); `end_of_turn_ids`: the run's stop
        tokens (the OpenAI endpoint's turns end with them); `program_timeout_s`: the wall-clock limit of one
        program (--rollout-program-timeout; None: none)."""
        self.program, self.tokenizer = program, tokenizer
        self.endpoint = OpenAIEndpoint(tokenizer, end_of_turn_ids)  # its server starts with the first session
        self.max_context, self.vocab_size, self.program_timeout_s = max_context, vocab_size, program_timeout_s
        self.active = 0  # programs started and not yet taken back
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # (request id, token ids, SamplingParams)
        self._finished: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: dict[str, asyncio.Future] = {}  # policy calls in the engine (touched on the loop only)
        # the programs' tasks: the loop keeps only weak references, and a program waiting on something nothing else
        # references would be collected mid-await (GeneratorExit) without these
        self._tasks: set[asyncio.Task] = set()
        self._reported: set[str] = set()  # failure reasons whose traceback was printed
        self._wake = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="agent-programs")
        self._thread.start()

    # ---- the worker's side ----------------------------------------------------------------------------------------
    def start(self, sample: AgentSample, params: SamplingParams) -> None:
        self.active += 1
        self._loop.call_soon_threadsafe(self._spawn, sample, params)

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
    def _serve(self) -> None:
        """The loop's thread, until `shutdown` stops the loop. asyncio lets a SystemExit or KeyboardInterrupt of a
        task out of the loop: one raised in a task a program started reaches the program awaiting it (its own
        failure), and the loop runs on."""
        while True:
            try:
                self._loop.run_forever()
                return
            except (SystemExit, KeyboardInterrupt) as e:
                print(f"[megatron-rl] generator: a task of a rollout program raised {type(e).__name__}; the other "
                      "programs go on", file=sys.stderr, flush=True)

    def _spawn(self, sample: AgentSample, params: SamplingParams) -> None:
        task = self._loop.create_task(self._run(sample, params), name=f"rollout program {sample.request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, sample: AgentSample, params: SamplingParams) -> None:
        try:
            self._finished.put(await self._trajectory(sample, params))
        except asyncio.CancelledError:  # the runner's shutdown: nothing takes finished programs any more
            raise
        except BaseException as e:  # noqa: BLE001 - a fault of the runner itself: raised again in the worker
            self._finished.put(e)
        finally:
            self._wake.set()

    async def _trajectory(self, sample: AgentSample, params: SamplingParams) -> RolloutOutput:
        """The program's trajectory as a rollout, or an empty one that carries why it cannot be trained on."""
        limits = TrajectoryLimits(self.vocab_size, self.max_context, params.max_new_tokens)
        client = GenerationClient(self._submit, sample.request_id, params, self.tokenizer, limits, self.endpoint)
        deadline = asyncio.timeout(self.program_timeout_s)
        try:
            async with deadline:
                trajectory = await self.program(sample, client)
            if deadline.expired():  # the program caught the cancellation and returned late
                raise TimeoutError
            failure = _unusable(trajectory, limits)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # the runner's shutdown
                raise
            failure = self._program_error(sample)  # the program raised it itself
        except TimeoutError:
            if not deadline.expired():
                failure = self._program_error(sample)
            else:
                failure = AgentFailure("timeout", f"the rollout program ran longer than --rollout-program-timeout "
                                                  f"{self.program_timeout_s:g} s")
        except InvalidInput as e:
            failure = AgentFailure("invalid-input", f"the rollout program's input was refused: {e}")
        except EnvironmentFailure as e:
            failure = AgentFailure("environment", str(e))
        except BaseException:  # noqa: BLE001 - any exception of the program (SystemExit, GeneratorExit too) is its own
            failure = self._program_error(sample)
        finally:
            for session in client.sessions:  # a late call of the agent finds no session
                self.endpoint.close(session)
        if failure is not None:
            trajectory = Trajectory(list(sample.prompt_token_ids))
        return trajectory.to_output(sample.request_id, failure)

    def _program_error(self, sample: AgentSample) -> AgentFailure:
        """The exception being handled as the sample's failure; its traceback goes to the log, once per reason."""
        error = sys.exc_info()[1]
        reason = f"the rollout program raised {type(error).__name__}: {error}"
        if reason not in self._reported:
            self._reported.add(reason)
            print(f"[megatron-rl] generator: sample {sample.request_id} is excluded: {reason}\n"
                  f"{traceback.format_exc().rstrip()}", file=sys.stderr, flush=True)
        return AgentFailure("program-error", reason)

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


def _unusable(trajectory, limits: TrajectoryLimits) -> AgentFailure | None:
    """Why the program's trajectory cannot be trained on, or None."""
    try:
        check_trajectory(trajectory, limits)
    except InvalidInput as e:
        return AgentFailure("invalid-input", f"the rollout program's trajectory cannot be trained on: {e}")
    return None


def _drain(q: queue.SimpleQueue) -> list:
    items = []
    while True:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            return items
