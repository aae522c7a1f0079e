"""Request and response types shared by every rollout engine (the built-in one and the SGLang adapter), and the
request metadata that travels with each request."""

from __future__ import annotations

import dataclasses

import torch

# The behavior log-prob convention of every engine here (and SGLang's default): the log-prob of the sampled
# token under log_softmax(logits / temperature) over the full vocabulary, i.e. AFTER temperature and BEFORE
# top-k / top-p truncation. Greedy decoding (temperature 0) reports log_softmax(logits) (temperature 1).
LOGPROB_CONVENTION = "temperature-scaled, before top-k/top-p"

# How an engine stops for a weight update (SGLang's /pause_generation modes): "retract" drops in-flight
# requests' KV caches and recomputes them under the new weights, "in_place" keeps them, "abort" ends the requests.
PAUSE_MODES = ("retract", "in_place", "abort")

NOT_SAMPLED = -1  # the weight version recorded for a trajectory token that no policy sampled (a tool's output)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = -1  # -1: all tokens
    top_p: float = 1.0
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None  # per-request sampling seed; None: derived from the engine seed and request id

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (all) or >= 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))


@dataclasses.dataclass(frozen=True)
class RequestMeta:
    """What the controller knows of a request it dispatched, carried with it to the generator and back."""

    prompt_id: str
    sample_index: int
    reference: str  # the answer the reward function compares with
    is_eval: bool
    dispatched_at: float  # wall time
    metadata: dict = dataclasses.field(default_factory=dict)  # the dataset record's "metadata", for the reward
    prompt: str | list[dict] | None = None  # the record's prompt as written (text or messages), for agent programs

    @property
    def group(self) -> tuple[bool, str]:
        """The samples of one prompt form a group (eval and RL dispatches of a prompt never mix)."""
        return self.is_eval, self.prompt_id


@dataclasses.dataclass
class RolloutOutput:
    """One finished (or aborted) request: the trajectory contract's generator-side fields."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated ids
    logprobs: list[float]  # behavior log-prob of each generated token (LOGPROB_CONVENTION)
    versions: list[int]  # weight version that produced each generated token
    finish_reason: str  # "stop" | "length" | "abort"
    num_retractions: int = 0
    logprob_convention: str = LOGPROB_CONVENTION
    # per generated token; None: every token is a policy action. False marks the tokens of an agent trajectory that
    # the policy did not sample (tool output, environment text, a user turn): their log-probs are 0, their versions
    # NOT_SAMPLED, and they are never trained on.
    loss_mask: list[bool] | None = None
    # Mixture-of-experts models (None for dense ones): the experts the generator routed each position to, for
    # rollout routing replay (R3). routed_experts[t][l] = the top-k expert ids (global numbers, in the router's
    # descending-probability order) chosen at layer l for the token at position t of prompt_token_ids +
    # token_ids, i.e. the route that computed position t's hidden state; t covers every position the engine
    # computed: prompt + generated - 1 positions for a finished request (the last generated token is sampled,
    # never fed back, as in SGLang's return_routed_experts), possibly fewer for an aborted one. Shape
    # [positions, num_layers, moe_router_topk], an int16 tensor (compact: a long response of a big MoE has
    # millions of entries). The routes of a resumed (retracted) request are those of its re-prefill, by the weights
    # it resumed under.
    routed_experts: torch.Tensor | None = None
    # An agent trajectory's summary (`rollout.agent.Trajectory.summary`): reward or reward input, turns, tool calls
    # and errors, an environment failure; None for a plain single-call rollout.
    trajectory: dict | None = None

    @property
    def policy_versions(self) -> list[int]:
        """The weight versions of the tokens the policy sampled (its staleness is the oldest of them)."""
        if self.loss_mask is None:
            return self.versions
        return [v for v, sampled in zip(self.versions, self.loss_mask) if sampled]
