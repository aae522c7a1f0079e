"""LocalEngine: the built-in rollout engine, with SGLang's request semantics and weight layout.

Semantics kept identical to SGLang's: per-token behavior log-probs after temperature
and before top-k/top-p; per-token weight versions; finish reasons "stop" / "length" / "abort"; pause with
mode "abort" (in-flight requests return their partial output), "retract" (they go back to the queue, keep
what they generated, and resume under the new weights with their KV cache recomputed by them) or "in_place"
(they stay where they are and resume under the new weights on the KV cache the old weights computed: no
recomputation; the tokens after the update are sampled from the new weights attending to old-weight keys
and values, and their recorded log-probs are exactly that sampling distribution); weight updates bracketed
by begin/end_weight_update, atomic: an incomplete update raises and the previous version keeps serving.

With TP > 1 every rank of the engine's group runs the same calls in the same order (SPMD, as SGLang's TP
schedulers do); sampling uses per-request generators so all ranks pick the same tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megatron_rl.models import weight_map
from megatron_rl.models.safetensors_io import HFCheckpoint
from megatron_rl.models.spec import ModelSpec
from megatron_rl.rollout.local.decoder import TPDecoder
from megatron_rl.rollout.local.sampling import sample
from megatron_rl.rollout.types import PAUSE_MODES, RolloutOutput, SamplingParams


@dataclasses.dataclass
class _Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    generated: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    slot: int | None = None
    cached: int = 0  # tokens whose K/V are in the slot
    retractions: int = 0
    this_version: int = 0  # tokens generated under the current weights (for chunking)
    # mixture of experts: int32 [n, layers, k] blocks, the routes of positions 0, 1, ... in order (None: dense)
    routes: list[torch.Tensor] | None = None

    def output(self, reason: str) -> RolloutOutput:
        routed = None if self.routes is None else torch.cat(self.routes).to(torch.int16) if self.routes else \
            torch.empty((0, 0, 0), dtype=torch.int16)
        return RolloutOutput(self.rid, list(self.prompt), list(self.generated), list(self.logprobs),
                             list(self.versions), reason, self.retractions, routed_experts=routed)


class LocalEngine:
    def __init__(self, decoder: TPDecoder, eos_token_ids: Iterable[int] = (), seed: int = 0,
                 chunk_tokens: int | None = None, record_routes: bool | None = None):
        """`chunk_tokens`: a request that generated this many tokens under the current weights yields its slot
        (it waits, keeping its tokens, until the next weight update, or until nothing else is waiting), so
        long generations do not hold back short ones: the paper's chunked partial rollouts.

        `record_routes` (default: whether the model is a mixture of experts; a run sets it from
        --use-rollout-routing-replay): the outputs carry `routed_experts` (see `RolloutOutput`): each position's
        experts as the decoder routed them when it computed that position. A request whose KV cache is dropped
        (retract, a chunk boundary) is prefilled again on resuming, and the routes of all its positions are
        replaced by that prefill's, computed by the weights it resumes under (as SGLang does); with "in_place"
        the positions computed before the update keep the old weights' routes, as they keep their KV cache."""
        self.decoder = decoder
        self.spec = decoder.spec
        self.record_routes = self.spec.is_moe if record_routes is None else record_routes and self.spec.is_moe
        self.eos_token_ids = tuple(eos_token_ids)
        self.seed = seed
        self.weight_version = 0
        self.paused = False
        self.restarts = self.rerun_requests = 0  # the engine protocol's fault counters: an in-process engine has none
        self.reusable_receive_buffers = True  # replaced weights are dropped at install
        self._queue: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._free_slots = list(range(decoder.max_slots - 1))  # the last slot is reserved for score()
        self._ids = itertools.count()
        self._staged: dict[str, torch.Tensor] | None = None
        self.chunk_tokens = chunk_tokens
        self._deferred: list[_Request] = []

    # ---- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf_dir: str, tp_size: int = 1, group=None, dtype: torch.dtype = torch.float32,
                fp8: bool = False, max_slots: int = 64, max_seq_len: int = 512, seed: int = 0,
                chunk_tokens: int | None = None, device: torch.device | str = "cpu", ep_size: int = 1,
                kv_cache_tokens: int | None = None) -> LocalEngine:
        """Load an HF checkpoint (hub names; experts one tensor each). tp_size > 1: call on every rank of `group`
        (default: the whole world). `ep_size`: --rollout-expert-parallel-size (SGLang's --ep-size)."""
        ckpt = HFCheckpoint(hf_dir)
        spec = ModelSpec.from_hf_config(ckpt.config)
        tp_rank = 0
        if tp_size > 1:
            if not dist.is_initialized():
                raise RuntimeError(f"--rollout-tensor-parallel-size {tp_size} needs torch.distributed initialized")
            group_size = dist.get_world_size(group)
            if group_size != tp_size:
                raise ValueError(f"--rollout-tensor-parallel-size {tp_size} does not match the engine group's "
                                 f"size {group_size}")
            tp_rank = dist.get_rank(group)
        decoder = TPDecoder(spec, tp_size, tp_rank, group, dtype, fp8, max_slots, max_seq_len, device, ep_size,
                            kv_cache_tokens)
        params: dict[str, torch.Tensor] = {}
        for name, lay in decoder.layouts.items():
            decoder.load(name, weight_map.assemble(lay, ckpt.get_slice), params)
        decoder.install(params)
        eos = ckpt.config.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(decoder, eos_ids, seed, chunk_tokens)

    # ---- requests -------------------------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids is empty")
        if len(prompt_token_ids) + params.max_new_tokens > self.decoder.max_seq_len:
            raise ValueError(f"prompt ({len(prompt_token_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                             f"exceeds the engine's max_seq_len {self.decoder.max_seq_len}")
        if len(prompt_token_ids) + params.max_new_tokens > self.decoder.kv_cache_tokens:
            raise ValueError(f"prompt ({len(prompt_token_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                             f"exceeds the engine's KV cache of {self.decoder.kv_cache_tokens} tokens "
                             "(--rollout-kv-cache-tokens)")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids has ids outside the vocabulary [0, {self.spec.vocab_size}): {bad[:5]}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else hash((self.seed, rid)) & 0x7FFFFFFF
        generator = torch.Generator().manual_seed(seed)
        self._queue.append(_Request(rid, list(prompt_token_ids), params, generator,
                                    routes=[] if self.record_routes else None))
        return rid

    def has_work(self) -> bool:
        return bool(self._queue or self._running or self._deferred)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def _finish_reason(self, req: _Request) -> str | None:
        token = req.generated[-1]
        if token in req.params.stop_token_ids or (not req.params.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(req.generated) >= req.params.max_new_tokens:
            return "length"
        return None

    def _append(self, requests: list[_Request], logits: list[torch.Tensor]) -> None:
        """Sample each request's next token from its row of the concatenated logits, in one batched call."""
        if not requests:
            return
        tokens, logprobs = sample(torch.cat(logits), [r.params for r in requests], [r.generator for r in requests])
        for req, token, logprob in zip(requests, tokens, logprobs):
            req.generated.append(token)
            req.logprobs.append(logprob)
            req.versions.append(self.weight_version)
            req.this_version += 1

    def step(self) -> list[RolloutOutput]:
        """Admit queued requests into free slots (prefill), then one batched decode step. Returns the
        requests that finished in this step."""
        if self.paused or self._staged is not None:
            return []
        if self._deferred and not self._queue and not self._running:
            self._resume_deferred()  # nothing else is waiting: chunked requests go on
        finished: list[RolloutOutput] = []
        admitted, next_logits = [], []
        # Admission in queue order, while a slot and the KV positions of the request's whole sequence (prompt and
        # max_new_tokens) are free: a running request never runs out of KV cache, so nothing is preempted.
        while self._queue and self._free_slots:
            req = self._queue[0]
            slot = min(self._free_slots)
            if not self.decoder.reserve(slot, len(req.prompt) + req.params.max_new_tokens):
                break
            self._queue.popleft()
            self._free_slots.remove(slot)
            req.slot = slot
            admitted.append(req)
        if admitted:
            # One right-padded prefill for everything admitted; a resumed request recomputes its whole prefix.
            prefixes = [r.prompt + r.generated for r in admitted]
            width = max(len(t) for t in prefixes)
            tokens = torch.tensor([t + [0] * (width - len(t)) for t in prefixes])
            last = torch.tensor([len(t) - 1 for t in prefixes], device=self.decoder.device)
            logits = self.decoder.forward([r.slot for r in admitted], tokens, [0] * len(admitted),
                                          [len(t) for t in prefixes])
            next_logits.append(logits[torch.arange(len(admitted), device=last.device), last])
            routes = self._routes()
            for s, (r, t) in enumerate(zip(admitted, prefixes)):
                r.cached = len(t)
                if routes is not None:  # the prefill recomputed every position: its routes replace the old ones
                    r.routes = [routes[s, :len(t)].clone()]
        decoding = sorted(self._running, key=lambda r: r.slot)
        if decoding:
            tokens = torch.tensor([[r.generated[-1]] for r in decoding])
            starts = [r.cached for r in decoding]
            next_logits.append(self.decoder.forward([r.slot for r in decoding], tokens, starts)[:, -1])
            routes = self._routes()
            for s, r in enumerate(decoding):
                r.cached += 1
                if routes is not None:
                    r.routes.append(routes[s])
        self._running.extend(admitted)
        self._append(admitted + decoding, next_logits)
        still = []
        for r in self._running:
            reason = self._finish_reason(r)
            if reason is None and self.chunk_tokens and r.this_version >= self.chunk_tokens:
                self._free_slot(r)  # chunk boundary: yield the slot, keep the tokens
                self._deferred.append(r)
            elif reason is None:
                still.append(r)
            else:
                self._free_slot(r)
                finished.append(r.output(reason))
        self._running = still
        return finished

    def _free_slot(self, r: _Request) -> None:
        """Give back the request's slot and its KV positions; it keeps its tokens."""
        self.decoder.release(r.slot)
        self._free_slots.append(r.slot)
        r.slot, r.cached = None, 0

    def _routes(self) -> torch.Tensor | None:
        """The last forward's routes on the CPU (one small int32 copy per step), or None when not recorded."""
        if not self.record_routes:
            return None
        routes = self.decoder.last_routes
        return None if routes is None else routes.cpu()

    def _resume_deferred(self) -> None:
        for r in self._deferred:
            r.this_version = 0
        self._queue.extend(self._deferred)
        self._deferred = []

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams) -> list[RolloutOutput]:
        """Run the given prompts to completion (with whatever else is queued); outputs in prompt order."""
        rids = [self.add_request(p, params) for p in prompt_token_ids]
        wanted, done = set(rids), {}
        while wanted - set(done):
            if self.paused:
                raise RuntimeError("generate() on a paused engine: call continue_generation() first")
            for out in self.step():
                done[out.request_id] = out
        return [done[r] for r in rids]

    # ---- control --------------------------------------------------------------------------------------------------
    def pause(self, mode: str = "retract") -> list[RolloutOutput]:
        """Stop decoding. "retract": running requests return to the front of the queue with what they
        generated (their KV cache is dropped). "in_place": running requests keep their slots and KV cache.
        "abort": running and queued requests end now with finish_reason "abort" and are returned."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.paused = True
        if mode == "in_place":
            return []
        running, self._running = self._running, []
        for r in running:
            self._free_slot(r)
        if mode == "abort":
            aborted = [r.output("abort") for r in running + list(self._queue) + self._deferred]
            self._queue.clear()
            self._deferred = []
            return aborted
        for r in reversed(running):
            r.retractions += 1
            self._queue.appendleft(r)
        return []

    def continue_generation(self) -> None:
        self.paused = False

    def begin_weight_update(self) -> None:
        if self._running and not self.paused:
            raise RuntimeError(f"begin_weight_update with {len(self._running)} requests decoding: pause first")
        self._staged = {}

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], copy: bool = True) -> None:
        """Receive this rank's runtime-layout shards (between begin and end_weight_update). `copy=False`
        hands the tensors over to the engine (the caller must not modify them afterwards)."""
        if self._staged is None:
            raise RuntimeError("load_weights outside begin_weight_update / end_weight_update")
        for name, tensor in named_tensors:
            self.decoder.load(name, tensor, self._staged, copy)

    def end_weight_update(self, version: int) -> None:
        """Install the staged weights as `version`. An incomplete update raises; the old weights stay."""
        if self._staged is None:
            raise RuntimeError("end_weight_update without begin_weight_update")
        staged, self._staged = self._staged, None
        self.decoder.install(staged)
        self.weight_version = version
        for r in self._running + list(self._queue):
            r.this_version = 0
        self._resume_deferred()

    def abort_weight_update(self) -> None:
        self._staged = None

    def shutdown(self) -> None:
        """Nothing to stop: the engine lives in this process (an SGLangEngine stops its server here)."""

    # ---- scoring ----------------------------------------------------------------------------------------------------
    def score(self, token_ids: list[int], temperature: float = 1.0) -> torch.Tensor:
        """log_softmax(logits / temperature) of token_ids[1:] given their prefixes (teacher forcing)."""
        logits = self.logits(token_ids)
        logprobs = torch.log_softmax(logits[:-1] / temperature, -1)
        targets = torch.tensor(token_ids[1:], device=logprobs.device)
        return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """Full-vocabulary logits [len(token_ids), vocab] of one sequence, on the slot kept for scoring."""
        slot = self.decoder.max_slots - 1
        if not self.decoder.reserve(slot, len(token_ids)):
            raise RuntimeError(f"scoring {len(token_ids)} tokens needs that many free KV cache positions; "
                               f"{self.decoder.free_kv_tokens} of {self.decoder.kv_cache_tokens} are free "
                               "(--rollout-kv-cache-tokens)")
        try:
            return self.decoder.forward([slot], torch.tensor([token_ids]), [0])[0]
        finally:
            self.decoder.release(slot)
