"""Rollout engines and the backend registry behind --rollout-backend.

Every engine has the request semantics and runtime weight layout of SGLang (`Engine`): the built-in `local` engine
(the CPU default, tests) and `sglang`, one real SGLang server per replica. A backend entry builds a generator rank's
engine from the run setup and the rank's role, and may add its own flags, check them at parse time and check the
run setup; `worker.GeneratorWorker` drives whichever engine the run chose.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

import torch

from megatron_rl.rollout import local, sglang
from megatron_rl.rollout.agent import ROLLOUT_FUNCTIONS, rollout_program, uses_agents
from megatron_rl.rollout.local.engine import LocalEngine
from megatron_rl.rollout.sglang import arguments as sglang_arguments
from megatron_rl.rollout.sglang import replica_memory
from megatron_rl.rollout.sglang.arguments import collect_server_flags
from megatron_rl.rollout.types import LOGPROB_CONVENTION, RolloutOutput, SamplingParams

if TYPE_CHECKING:
    from megatron_rl.config.setup import RunSetup
    from megatron_rl.models.spec import ModelSpec
    from megatron_rl.runtime.roles import Roles


class Engine(Protocol):
    """What the generator worker and DDMA need of a rollout engine (see `LocalEngine` for the semantics)."""

    restarts: int  # times its server was restarted after a fault (0 for an in-process engine)
    rerun_requests: int  # requests sent again after such restarts
    # True when the engine is done with a set of tensors it took from load_weights(copy=False) once a later update is
    # installed, so DDMA may receive into that set again; False when they leave the process (shared memory).
    reusable_receive_buffers: bool

    @property
    def paused(self) -> bool: ...

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> str: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[RolloutOutput]: ...

    def pause(self, mode: str) -> list[RolloutOutput]: ...

    def continue_generation(self) -> None: ...

    def begin_weight_update(self) -> None: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], copy: bool = True) -> None: ...

    def end_weight_update(self, version: int) -> None: ...

    def abort_weight_update(self) -> None: ...

    def shutdown(self) -> None: ...


def _no_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def _nothing_to_validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    pass


def _no_setup_checks(args: argparse.Namespace, spec: ModelSpec) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class Backend:
    """A generator backend: `build(setup, roles)` makes a generator rank's engine; `add_arguments(parser)` adds its
    flags; `validate(args, parser)` runs for every backend at parse time (it refuses its own flags when another
    backend was chosen); `check_setup(args, spec)` runs in the run setup when the backend is chosen and returns its
    server flags (`RunSetup.sglang_flags`)."""

    build: Callable[[RunSetup, Roles], Engine]
    add_arguments: Callable[[argparse.ArgumentParser], None] = _no_arguments
    validate: Callable[[argparse.Namespace, argparse.ArgumentParser], None] = _nothing_to_validate
    check_setup: Callable[[argparse.Namespace, ModelSpec], dict] = _no_setup_checks


__all__ = ["ENGINE_BACKENDS", "LOGPROB_CONVENTION", "ROLLOUT_FUNCTIONS", "Backend", "Engine", "LocalEngine",
           "RolloutOutput", "SamplingParams", "collect_server_flags", "replica_memory", "rollout_program",
           "uses_agents"]


ENGINE_BACKENDS: dict[str, Backend] = {
    "local": Backend(local.build_engine),
    "sglang": Backend(sglang.build_engine, sglang_arguments.add_arguments, sglang_arguments.validate,
                      sglang.check_setup),
}
