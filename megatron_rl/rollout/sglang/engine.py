"""SGLangEngine: the rollout engine protocol of `LocalEngine`, served by a real SGLang server.

One SGLang server per generator replica, with `tp_size` = the rollout TP size. The replica's generator
ranks (one per SGLang TP rank, as with the built-in engine) all hold an `SGLangEngine`; the replica's
leader also talks to the server:

- requests go to `POST /generate` (token ids in, per-token log-probs and weight-version spans out), each
  on a worker thread, so `add_request` returns at once and `step` collects what has finished;
- `pause("retract")` (or `"in_place"`) / `continue_generation` bracket a weight update: in-flight requests
  go back to SGLang's queue keeping their tokens (or stay in its running batch with their KV cache) and
  resume under the new weights (partial rollouts; every token keeps the version that produced it, from
  SGLang's `weight_versions` spans);
- weight updates are fed by DDMA: each generator rank receives exactly its SGLang TP rank's shards, in
  SGLang's runtime layout (fused `qkv_proj` / `gate_up_proj`, padded vocabulary). At
  `end_weight_update` every rank serializes its own shards into shared memory (only a handle travels,
  never the data), the leader collects the replica's handles and posts them to
  `/update_weights_from_tensor` with `load_format="direct"`: SGLang TP rank i copies handle i into its
  parameters. No rank ever holds another rank's shard. Mixture-of-experts layers arrive one 2-D tensor per
  expert and go to SGLang stacked, as its FusedMoE holds them (`stack_experts`);
- with rollout routing replay (--use-rollout-routing-replay) the server runs with --enable-return-routed-experts
  and every request asks for the experts each token was routed to (`RolloutOutput.routed_experts`).

Behavior log-probs: SGLang reports log_softmax(logits / temperature) over the full vocabulary, before
top-k/top-p truncation: the project's LOGPROB_CONVENTION, which the trainer recomputes. The adapter
refuses to run when SGLANG_RETURN_ORIGINAL_LOGPROB changes that.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import os
import re
import signal
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from megatron_rl.models.spec import ModelSpec
from megatron_rl.rollout.sglang.server import SGLangServer, SGLangServerError
from megatron_rl.rollout.types import LOGPROB_CONVENTION, PAUSE_MODES, RolloutOutput, SamplingParams
from megatron_rl.runtime import failpoints

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


class RolloutContractError(ValueError):
    """A response that breaks the rollout contract (token ids, log-probs, versions, finish reason)."""


def sglang_sampling_params(params: SamplingParams) -> dict:
    out = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
           "max_new_tokens": params.max_new_tokens, "stop_token_ids": list(params.stop_token_ids),
           "ignore_eos": params.ignore_eos}
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    return out


def expand_versions(spans: list, num_tokens: int, request_id: str) -> list[int]:
    """SGLang's weight-version spans ({version, start, end} or [version, start, end]) as one int per token."""
    versions: list[int] = []
    for span in spans:
        version, start, end = (span["version"], span["start"], span["end"]) if isinstance(span, dict) else span
        if start != len(versions):
            raise RolloutContractError(f"request {request_id}: weight_versions spans {spans} do not tile its tokens")
        versions += [int(version)] * (end - start)
    if len(versions) != num_tokens:
        raise RolloutContractError(f"request {request_id}: weight_versions spans cover {len(versions)} tokens, "
                                f"the output has {num_tokens}")
    return versions


ROUTES_FLAG = "--enable-return-routed-experts"


def decode_routed_experts(request_id: str, encoded: str, num_positions: int, num_layers: int,
                          topk: int) -> torch.Tensor:
    """SGLang's `meta_info["routed_experts"]`: base64 of int32 [positions, layers, topk] (its tokenizer manager
    encodes the captured tensor's bytes), as the int16 tensor of `RolloutOutput.routed_experts`. `num_positions` =
    len(prompt) + len(output) - 1: SGLang records every token the model ran on, which is all but the last sampled
    one."""
    raw = base64.b64decode(encoded)
    want = num_positions * num_layers * topk
    if len(raw) != 4 * want:
        raise RolloutContractError(f"request {request_id}: routed_experts holds {len(raw) / 4:g} int32 values, "
                                   f"expected (len(prompt) + len(output) - 1) x num_layers x topk = {num_positions} x "
                                   f"{num_layers} x {topk} = {want}")
    return torch.frombuffer(bytearray(raw), dtype=torch.int32).view(num_positions, num_layers, topk).to(torch.int16)


def parse_generate_response(request_id: str, prompt: list[int], response: dict,
                            routes: tuple[int, int] | None = None) -> RolloutOutput:
    """One /generate answer as a RolloutOutput. `routes`: (num_layers, topk) when the request asked for its
    routed experts (rollout routing replay); a finished request without them is an error naming the server flag."""
    meta = response["meta_info"]
    token_ids = list(response["output_ids"])
    entries = meta["output_token_logprobs"]
    if [e[1] for e in entries] != token_ids:
        raise RolloutContractError(f"request {request_id}: output_token_logprobs do not match output_ids")
    versions = expand_versions(meta.get("weight_versions") or [], len(token_ids), request_id)
    if any(v < 0 for v in versions):
        raise RolloutContractError(f"request {request_id} was served by weight version {min(versions)}: the server's "
                                "start-up weights, never the policy's (a server restarted without a weight sync?)")
    reason = meta["finish_reason"]
    reason = reason.get("type") if isinstance(reason, dict) else reason
    if reason not in FINISH_REASONS:
        raise RolloutContractError(f"request {request_id}: unknown finish_reason {meta['finish_reason']!r}")
    routed = None
    if routes is not None:
        if meta.get("routed_experts") is not None:
            routed = decode_routed_experts(request_id, meta["routed_experts"], len(prompt) + len(token_ids) - 1,
                                           *routes)
        elif reason != "abort":
            raise RolloutContractError(f"request {request_id}: the SGLang server returned no routed_experts, which "
                                       f"--use-rollout-routing-replay needs; start it with {ROUTES_FLAG}")
    return RolloutOutput(request_id, list(prompt), token_ids, [float(e[0]) for e in entries], versions,
                         FINISH_REASONS[reason], int(meta.get("num_retractions", 0)), LOGPROB_CONVENTION,
                         routed_experts=routed)


_EXPERT = re.compile(r"(?P<module>.+)\.experts\.(?P<e>\d+)\.(?P<proj>gate_up_proj|down_proj)\.(?P<param>weight\w*)")
_STACKED = {"gate_up_proj": "w13", "down_proj": "w2"}


def stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The runtime layout's per-expert tensors (`{module}.experts.{e}.gate_up_proj.weight` [2 I_tp, H], rows
    [gate; up], and `.down_proj.weight` [H, I_tp], `e` global; FP8's `weight_scale_inv` likewise) as SGLang's
    FusedMoE parameters: `{module}.experts.w13_weight` [E_local, 2 I_tp, H] and `.w2_weight` [E_local, H, I_tp]
    (`w13_weight_scale_inv`, ...), local expert j = the rank's j-th expert in global order, since with --ep-size
    EP rank k holds global experts k E_local .. (k+1) E_local - 1 (FusedMoE._map_global_expert_id_to_local_expert_id).
    Other tensors pass through. Raises ValueError when a module's experts are not one run of consecutive ids."""
    out, groups = {}, {}
    for name, tensor in tensors.items():
        m = _EXPERT.fullmatch(name)
        if m is None:
            out[name] = tensor
        else:
            key = f"{m['module']}.experts.{_STACKED[m['proj']]}_{m['param']}"
            groups.setdefault(key, {})[int(m["e"])] = tensor
    for key, experts in groups.items():
        ids = sorted(experts)
        if ids != list(range(ids[0], ids[0] + len(ids))):
            raise ValueError(f"{key}: this rank's experts {ids} are not consecutive global ids (SGLang's --ep-size "
                             "gives each expert-parallel rank one run of experts)")
        out[key] = torch.stack([experts[e] for e in ids])
    return out


def _split_ready(staged: dict[str, torch.Tensor], experts_per_rank: int) -> tuple[dict, dict]:
    """(the staged tensors SGLang can take now, the rest): all but experts of a module and projection of which
    fewer than `experts_per_rank` arrived."""
    groups: dict[str, list[str]] = {}
    for name in staged:
        m = _EXPERT.fullmatch(name)
        if m is not None:
            groups.setdefault(f"{m['module']}.{m['proj']}.{m['param']}", []).append(name)
    waiting = {n for names in groups.values() if len(names) < experts_per_rank for n in names}
    return ({n: t for n, t in staged.items() if n not in waiting}, {n: t for n, t in staged.items() if n in waiting})


def required_server_flags(spec: ModelSpec, expert_parallel_size: int = 1, in_place: bool = False,
                          routing_replay: bool = False) -> dict:
    """The SGLang server arguments a run needs: given to the servers it launches, checked on attached ones.
    --rollout-expert-parallel-size is SGLang's --ep-size (the expert layout DDMA sends, see layout.py); rollout
    routing replay needs --enable-return-routed-experts; in-place pauses need IN_PLACE_SERVER_FLAGS."""
    flags = dict(IN_PLACE_SERVER_FLAGS) if in_place else {}
    if spec.is_moe:
        flags["ep_size"] = expert_parallel_size
    if routing_replay:
        flags["enable_return_routed_experts"] = True
    return flags


class SGLangEngine:
    def __init__(self, spec: ModelSpec, server: SGLangServer | None, group=None, max_concurrency: int = 256,
                 stall_timeout_s: float = 300.0, max_restarts: int = 3, return_routed_experts: bool = False,
                 install_in_buckets: bool = False, expert_parallel_size: int = 1):
        """`server`: on the replica's leader; None on its other ranks (they only take part in weight
        updates). `group`: the replica's process group (None when the replica has one rank).
        `return_routed_experts` (--use-rollout-routing-replay, a mixture-of-experts model): every output carries
        the experts each token was routed to; the server must run with --enable-return-routed-experts.

        Faults: a server that exits, drops a request, or finishes nothing for `stall_timeout_s` while
        requests are pending and then fails a health check is restarted (launched servers only), given the
        current weights again (the leader keeps every rank's last shards mapped for that) and sent the unfinished
        requests again from their prompts; replies that arrived before the fault are kept. After `max_restarts`
        restarts the next fault is raised.

        `install_in_buckets` (generator ranks on their SGLang TP worker's GPU): DDMA's `commit_bucket` calls hand
        each bucket of received tensors to SGLang as it completes (CUDA IPC handles; the tensors are freed once
        SGLang copied them), so an update needs about a bucket of extra GPU memory instead of a second copy of the
        shards. Such an update keeps nothing to give a restarted server: a server that fails after one is an error
        (the job's checkpoint resumes it), where a one-bucket update (the CPU default) is given to it again."""
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "0").lower() in ("1", "true"):
            raise ValueError("SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would report log-probs before "
                             f"temperature, but the trainer's importance weights assume {LOGPROB_CONVENTION!r}")
        if spec.is_moe and os.environ.get("SGLANG_OPT_FUSE_SWIGLU_INTERLEAVED", "0").lower() in ("1", "true"):
            raise ValueError("SGLANG_OPT_FUSE_SWIGLU_INTERLEAVED is set: SGLang would interleave the gate and up rows "
                             "of its experts after loading, but weight updates copy [gate; up] rows into them")
        if return_routed_experts and not spec.is_moe:
            raise ValueError(f"--use-rollout-routing-replay: model {spec.name!r} has no experts to route")
        self.spec, self.server, self.group = spec, server, group
        self.routes = (spec.num_layers, spec.moe_router_topk) if return_routed_experts else None
        self.is_leader = server is not None
        self.stall_timeout_s, self.max_restarts = stall_timeout_s, max_restarts
        self.weight_version = -1
        self.pause_mode: str | None = None  # while paused: how (PAUSE_MODES)
        self.restarts = 0
        self.rerun_requests = 0  # requests sent again after a restart
        # Received shards go to the server through shared memory, which it may read after the next update began:
        # DDMA gives every update fresh tensors.
        self.reusable_receive_buffers = False
        self.installs_in_buckets = install_in_buckets
        self.experts_per_rank = spec.num_experts // expert_parallel_size if spec.is_moe else 0
        self._buckets = 0  # committed in the update in progress
        self._pool = cf.ThreadPoolExecutor(max_concurrency, thread_name_prefix="sglang-request")
        self._pending: dict[cf.Future, tuple[str, list[int], dict]] = {}
        self._staged: dict[str, torch.Tensor] | None = None
        # What a restarted server is given (see `end_weight_update`): this rank's serving shards, and on the leader
        # every rank's, each as a handle to send again (CUDA) or as shards to make new handles from (CPU).
        self._own_shards: list[tuple[str, torch.Tensor]] | None = None
        self._serving: list[str | list[tuple[str, torch.Tensor]]] | None = None
        self._last_progress = time.monotonic()
        # CPU tensors travel as shared-memory file names, which a process that is not our child can open.
        torch.multiprocessing.set_sharing_strategy("file_system")

    # ---- requests (leader) ----------------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> str:
        if not self.is_leader:
            return request_id
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: prompt_token_ids is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(f"request {request_id}: prompt_token_ids has ids outside the vocabulary "
                             f"[0, {self.spec.vocab_size}): {bad[:5]}")
        body = {"input_ids": list(prompt_token_ids), "sampling_params": sglang_sampling_params(params),
                "return_logprob": True, "rid": request_id}
        if self.routes is not None:
            body["return_routed_experts"] = True
        self._submit(request_id, list(prompt_token_ids), body)
        return request_id

    def _submit(self, request_id: str, prompt: list[int], body: dict) -> None:
        future = self._pool.submit(self.server.post, "/generate", body, None)
        self._pending[future] = (request_id, prompt, body)

    def has_work(self) -> bool:
        return bool(self._pending)

    @property
    def num_running(self) -> int:
        return len(self._pending)

    def step(self, timeout_s: float = 0.05) -> list[RolloutOutput]:
        """Outputs of the requests that finished (waiting at most `timeout_s` for the first one). A server
        fault restarts the server and re-runs the unfinished requests (see __init__)."""
        if not self._pending:
            self._last_progress = time.monotonic()
            return []
        done, _ = cf.wait(list(self._pending), timeout=timeout_s, return_when=cf.FIRST_COMPLETED)
        if not done and not self.paused:
            try:
                self._check_alive()
            except SGLangServerError as fault:
                self._recover(fault)
                return []
        outputs = self._collect_done(done)
        if outputs:
            self._last_progress = time.monotonic()
        return outputs

    def _check_alive(self) -> None:
        self.server.raise_if_dead("while requests were pending")
        if time.monotonic() - self._last_progress > self.stall_timeout_s:
            try:
                self.server.get("/health", timeout=30.0)
            except SGLangServerError as e:
                raise SGLangServerError(f"no request finished for {self.stall_timeout_s:.0f} s and the server fails "
                                        f"its health check: {e}") from e
            self._last_progress = time.monotonic()  # slow but healthy: look again after another timeout

    def _collect_done(self, futures) -> list[RolloutOutput]:
        """The outputs of finished requests. Replies that arrived are kept even when others among them failed
        (a server killed after answering some): the server is then restarted and only the failed requests run
        again (see `_recover`)."""
        outputs, fault = [], None
        for future in futures:
            request_id, prompt, _ = self._pending[future]
            try:
                response = future.result()
            except SGLangServerError as e:
                fault = fault or e  # the request stays pending, to run again
                continue
            del self._pending[future]
            outputs.append(parse_generate_response(request_id, prompt, response, self.routes))
        if fault is not None:
            self._recover(fault)
        return outputs

    def _survive(self, call) -> bool:
        """Run a control call to the server; if the server died meanwhile, restart it (see `_recover`) and
        return False. Errors of a live server are raised."""
        try:
            call()
            return True
        except SGLangServerError as fault:
            if self.server.alive():
                raise
            self._recover(fault)
            return False

    def _recover(self, fault: SGLangServerError) -> None:
        """Restart the server, give it the serving weights again, re-run every unfinished request."""
        if self.restarts >= self.max_restarts:
            raise SGLangServerError(f"SGLang server {self.server.url} failed again after {self.restarts} restart(s); "
                                    f"giving up: {fault}") from fault
        self.restarts += 1
        print(f"[megatron-rl] SGLang server {self.server.url} failed ({str(fault).splitlines()[0]}); restart "
              f"{self.restarts}/{self.max_restarts}, then {len(self._pending)} unfinished request(s) run again",
              flush=True)
        pending = list(self._pending.values())
        self._pending.clear()
        if self._serving is None and self.weight_version >= 0:
            raise SGLangServerError(f"SGLang server {self.server.url} failed ({fault}); its weights were installed in "
                                    "buckets (--ddma-bucket-mb), which are not kept to give a restarted server: the "
                                    "run stops, and resumes from its last checkpoint when started again") from fault
        self.server.start()
        if self._serving is not None:
            self._post_weights(_handles(self._serving), self.weight_version)
        if self.paused:  # mid weight update: the requests wait in SGLang's queue for continue_generation
            self.server.post("/pause_generation", {"mode": "retract"})
        for request_id, prompt, body in pending:
            self._submit(request_id, prompt, body)
        self.rerun_requests += len(pending)
        self._last_progress = time.monotonic()

    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams,
                 request_ids: list[str] | None = None) -> list[RolloutOutput]:
        """Run the given prompts to completion; outputs in prompt order."""
        rids = request_ids or [f"generate-{id(self)}-{i}" for i in range(len(prompt_token_ids))]
        for rid, prompt in zip(rids, prompt_token_ids):
            self.add_request(prompt, params, rid)
        done: dict[str, RolloutOutput] = {}
        while set(rids) - set(done):
            for out in self.step(timeout_s=1.0):
                done[out.request_id] = out
        return [done[r] for r in rids]

    # ---- control --------------------------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return self.pause_mode is not None

    def pause(self, mode: str = "retract") -> list[RolloutOutput]:
        """"retract": in-flight requests go back to SGLang's queue with their tokens, to resume after
        `continue_generation`. "in_place": they stay in SGLang's running batch with their KV cache. "abort": they
        end now; their partial outputs are returned (those a dying server lost run again from their prompts after
        `continue_generation`)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.pause_mode = mode
        if not self.is_leader:
            return []
        # A server that died meanwhile is restarted, and paused in retract mode (its requests are re-queued).
        self._survive(lambda: self.server.post("/pause_generation", {"mode": mode}))
        if mode != "abort":
            return []
        return self._collect_done(cf.wait(list(self._pending)).done)

    def continue_generation(self) -> None:
        self.pause_mode = None
        if self.is_leader:
            self._survive(lambda: self.server.post("/continue_generation", {}))

    def begin_weight_update(self) -> None:
        if self.is_leader and self._pending and not self.paused:
            raise RuntimeError(f"begin_weight_update with {len(self._pending)} requests decoding: pause first")
        self._staged = {}
        self._buckets = 0

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], copy: bool = True) -> None:
        """This rank's shards, by SGLang runtime name (between begin and end_weight_update)."""
        if self._staged is None:
            raise RuntimeError("load_weights outside begin_weight_update / end_weight_update")
        for name, tensor in named_tensors:
            self._staged[name] = tensor.clone() if copy else tensor

    def commit_bucket(self) -> None:
        """Hand the staged tensors that are ready to SGLang now (every rank of the replica calls it at the same
        point; DDMA's schedule says when), as part of the update in progress: its version is not served before
        `end_weight_update`. Experts wait until all of a layer's experts on this rank arrived (SGLang takes them
        stacked)."""
        ready, self._staged = _split_ready(self._staged, self.experts_per_rank)
        self._install(list(stack_experts(ready).items()), version=None)

    def end_weight_update(self, version: int) -> None:
        """Hand every rank's remaining staged shards to its SGLang TP rank and serve them as `version`. The
        replica's ranks all return, or all raise with the server's message; on failure the engine keeps no
        promise about which weights it serves (SGLang loads in place), so the caller must not generate before a
        successful update."""
        if self._staged is None:
            raise RuntimeError("end_weight_update without begin_weight_update")
        shards, self._staged = list(stack_experts(self._staged).items()), None
        self._install(shards, version)
        self.weight_version = version
        if self.is_leader and self.server.process is not None and failpoints.armed("sglang-server-crash", version):
            os.killpg(self.server.process.pid, signal.SIGKILL)  # crash tests: a launched server dies here

    def _install(self, shards: list[tuple[str, torch.Tensor]], version: int | None) -> None:
        """One `update_weights_from_tensor` of every rank's `shards` (the last of an update when `version` is
        given)."""
        from sglang.srt.utils import MultiprocessingSerializer

        first = self._buckets == 0
        self._buckets += 1
        # A one-bucket update is kept for a restarted server. A CUDA handle (IPC) can be opened again while the
        # shards live. A CPU handle (a shared-memory file name) holds one reference to the file, taken over by the
        # process that opens it: so every rank makes a second one, which the leader opens to keep the shards mapped
        # (no copy) and make new handles from at each restart.
        keep = first and version is not None
        on_cpu = all(tensor.device.type == "cpu" for _, tensor in shards)
        handles = [MultiprocessingSerializer.serialize(shards, output_str=True)
                   for _ in range(2 if keep and on_cpu else 1)]
        gathered = self._gather(handles)
        status = [None]
        if self.is_leader:
            serving = [MultiprocessingSerializer.deserialize(h[1]) if len(h) == 2 else h[0] for h in gathered] \
                if keep else None
            try:
                if not self._survive(lambda: self._post_weights([h[0] for h in gathered], version, first)):
                    if serving is None:
                        raise SGLangServerError("the server restarted during an update installed in buckets")
                    self._post_weights(_handles(serving), version)  # into the restarted server
            except SGLangServerError as e:
                status[0] = str(e)
        _share_from_leader(status, self.group)
        if status[0] is not None:
            raise SGLangServerError(f"SGLang weight update to version {version} failed: {status[0]}")
        if version is not None:
            self._own_shards = shards if keep else None
            if self.is_leader:
                self._serving = serving

    def _post_weights(self, handles: list[str], version: int | None, first: bool = True) -> None:
        """One bucket of an update: the first opens SGLang's weight-update session, the last (with `version`)
        closes it and flushes the cache. Requests paused in place keep their KV cache, so it is then not flushed
        (SGLang refuses while they run)."""
        if first:
            self.server.post("/begin_weight_update", {})
        body = {"serialized_named_tensors": handles, "load_format": "direct", "flush_cache": False}
        if version is not None:
            body.update(flush_cache=self.pause_mode != "in_place", weight_version=str(version))
        result = self.server.post("/update_weights_from_tensor", body)
        if version is not None:
            self.server.post("/end_weight_update", {})
        if not result.get("success"):
            raise SGLangServerError(f"update_weights_from_tensor: {result.get('message', result)}")

    def _gather(self, obj):
        """Every rank's `obj`, in rank order, on the leader (None on the other ranks)."""
        if self.group is None or dist.get_world_size(self.group) == 1:
            return [obj]
        out = [None] * dist.get_world_size(self.group) if self.is_leader else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return out

    def abort_weight_update(self) -> None:
        self._staged = None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.shutdown()


# Server flags that in-place pauses need. The prefix cache is not flushed at an in-place update (requests keep
# their KV), so a new request could reuse prefixes cached by old weights. The overlap scheduler processes the
# batch in flight at an in-place pause after the update, labelling its token (sampled by the old weights) with
# the new version (found by tests/sglang/test_sglang_engine.py).
IN_PLACE_SERVER_FLAGS = {"disable_radix_cache": True, "disable_overlap_schedule": True}


def _handles(serving: list[str | list[tuple[str, torch.Tensor]]]) -> list[str]:
    """update_weights_from_tensor's handles, one per TP rank, for a server started again: a CUDA handle as it
    was, a new one to CPU shards (see `SGLangEngine.end_weight_update`)."""
    from sglang.srt.utils import MultiprocessingSerializer

    return [rank if isinstance(rank, str) else MultiprocessingSerializer.serialize(rank, output_str=True)
            for rank in serving]


def _share_from_leader(box: list, group) -> None:
    """Give every rank of a replica the leader's `box` contents (in place); nothing to do for one rank."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)


def start_replica_engine(spec: ModelSpec, tp_size: int, group, is_leader: bool, model_dir: str, log_path: str,
                         port: int | None = None, url: str | None = None, extra_flags: dict | None = None,
                         dtype: str = "float32", load_format: str = "dummy",
                         timeout_s: float = 600.0, required_flags: dict | None = None, replica: int | None = None,
                         api_key: str | None = None, **engine_options) -> SGLangEngine:
    """Called on every rank of a generator replica (`replica`: its index, for messages). The leader launches its
    SGLang server on its own GPUs (or attaches to `url`) and checks that it serves `spec` at `tp_size` with
    `required_flags` (given to a server it launches); every rank learns whether that worked and raises the
    leader's error if not, so no rank is left waiting on a replica that never came up. `api_key`: the server's
    --api-key (given to a launched one), sent with every request; an attached server that refuses it is an error
    here, before any work."""
    from megatron_rl.runtime.spawn import free_port

    server, error = None, [None]
    if is_leader:
        try:
            if url:
                server = SGLangServer.attach(url, timeout_s, api_key=api_key)
            else:
                server = SGLangServer.launch(model_dir, tp_size, port or free_port(), log_path, dtype=dtype,
                                             extra_flags={**(extra_flags or {}), **(required_flags or {})},
                                             load_format=load_format, timeout_s=timeout_s, replica=replica,
                                             api_key=api_key)
            server.check(spec, tp_size, required_flags)
        except Exception as e:  # noqa: BLE001 - reported to every rank of the replica, then raised
            error[0] = f"{type(e).__name__}: {e}"
            if server is not None and not url:
                server.shutdown()
    _share_from_leader(error, group)
    if error[0] is not None:
        raise SGLangServerError(f"generator replica failed to start its SGLang engine: {error[0]}")
    return SGLangEngine(spec, server if is_leader else None, group, **engine_options)
