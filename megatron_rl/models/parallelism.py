"""The parallel layouts of a run: how the trainer (Megatron-Core TP x PP x DP, experts EP x expert-TP) and the
generators (SGLang TP x replicas, expert groups) split the model over ranks, and whether they can.

`TrainerLayout` and `GeneratorLayout` are built once per run (`config.setup`) and read by every consumer. Which rows
of which HF tensor a rank holds under them is `models.weight_map`'s business.
"""

from __future__ import annotations

import dataclasses
import math

from megatron_rl.models.spec import ModelSpec

SGLANG_VOCAB_PADDING = 64  # SGLang pads the vocabulary to a multiple of this, then splits it evenly over TP


def validate_tp(spec: ModelSpec, tp: int, who: str, allow_kv_replication: bool) -> None:
    problems = []
    if spec.num_attention_heads % tp:
        problems.append(f"num_attention_heads {spec.num_attention_heads}")
    if spec.ffn_hidden_size % tp and not spec.is_moe:
        problems.append(f"ffn_hidden_size {spec.ffn_hidden_size}")
    kv = spec.num_key_value_heads
    if allow_kv_replication:
        if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
            problems.append(f"num_key_value_heads {kv} (must divide TP or be divisible by it)")
    elif kv % tp:
        problems.append(f"num_key_value_heads {kv}")
    if problems:
        flag = "--tensor-model-parallel-size" if who == "trainer" else "--rollout-tensor-parallel-size"
        raise ValueError(f"{who} TP={tp} ({flag}) does not divide model {spec.name!r}: {', '.join(problems)}")


def validate_experts(spec: ModelSpec, ep: int, etp: int, ep_flag: str, etp_flag: str) -> None:
    if ep < 1 or etp < 1:
        raise ValueError(f"{ep_flag} and {etp_flag} must be >= 1, got {ep} and {etp}")
    if not spec.is_moe:
        if ep > 1:
            raise ValueError(f"{ep_flag} {ep}: model {spec.name!r} has no experts")
        return
    if spec.num_experts % ep:
        raise ValueError(f"{ep_flag} {ep} does not divide model {spec.name!r} num_experts {spec.num_experts}")
    if spec.moe_ffn_hidden_size % etp:
        raise ValueError(f"{etp_flag} {etp} does not divide model {spec.name!r} moe_ffn_hidden_size "
                         f"{spec.moe_ffn_hidden_size}")


def experts_of(spec: ModelSpec, ep: int, ep_rank: int) -> range:
    per = spec.num_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)


def sglang_padded_vocab(spec: ModelSpec, tp: int) -> int:
    step = SGLANG_VOCAB_PADDING
    padded = -(-spec.vocab_size // step) * step
    if padded % tp:
        raise ValueError(f"generator TP={tp} does not divide the padded vocabulary {padded} of model {spec.name!r}")
    return padded


def generator_experts(spec: ModelSpec, tp: int, tp_rank: int, ep: int = 1) -> tuple[range, int, int]:
    """(the global experts of generator TP rank `tp_rank`, its expert-TP size, its expert-TP rank) with SGLang's
    --ep-size `ep`: consecutive groups of TP / EP ranks share E / EP experts, each split TP / EP ways."""
    if tp % ep:
        raise ValueError(f"--rollout-expert-parallel-size {ep} must divide --rollout-tensor-parallel-size {tp}")
    moe_tp = tp // ep
    return experts_of(spec, ep, tp_rank // moe_tp), moe_tp, tp_rank % moe_tp




TRANSFORMER_IMPLS = ("local", "transformer_engine")  # Megatron-LM's --transformer-impl
# TransformerConfig's kernel fusions by Megatron-LM's flag that turns each off (on by default there too)
KERNEL_FUSIONS = {"--no-gradient-accumulation-fusion": "gradient_accumulation_fusion",
                  "--no-bias-swiglu-fusion": "bias_activation_fusion",
                  "--no-masked-softmax-fusion": "masked_softmax_fusion",
                  "--no-rope-fusion": "apply_rope_fusion",
                  "--no-bias-dropout-fusion": "bias_dropout_fusion"}
MOE_TOKEN_DISPATCHERS = ("alltoall", "allgather")  # Megatron-LM's --moe-token-dispatcher-type (not "flex": DeepEP)


@dataclasses.dataclass(frozen=True)
class TrainerLayout:
    """The trainer's Megatron-Core layout, built once per run and read by every consumer: process groups,
    TransformerConfig, the layer spec, HF loading, the DDMA plan, checkpoints and --dry-run.

    TP x PP x DP ranks; vocabulary padding; the layer spec (`local`, or `transformer_engine` whose linear layers
    carry the norms before them); layers split evenly over PP stages unless the first and/or last stage get their
    own count (Megatron's --decoder-first/last-pipeline-num-layers, e.g. 126 layers over 16 stages as
    7 + 14 x 8 + 7); the bytes per element of the trainer's weights (what DDMA sends); and the memory-for-compute
    choices that Megatron-Core's TransformerConfig takes with them (sequence parallelism, activation recompute),
    which change no weight's shape or place. With experts: expert parallelism (EP, expert TP) and Megatron-Core's
    token dispatcher (how tokens travel to their experts' ranks).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    make_vocab_size_divisible_by: int = 128
    transformer_impl: str = "local"
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None
    dtype_bytes: int = 2
    sequence_parallel: bool = False
    recompute_granularity: str | None = None  # "full" | "selective"
    recompute_method: str | None = None  # "uniform" | "block" (full recompute)
    recompute_num_layers: int | None = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: the TP size (Megatron-Core's default)
    moe_token_dispatcher_type: str = "alltoall"  # Megatron-Core's token dispatcher (--moe-token-dispatcher-type)
    # the kernel fusions the flags leave on (Megatron-LM's --no-*-fusion turn them off); they run on GPUs with
    # Transformer Engine only (`megatron_config.transformer_config(fused=...)`)
    kernel_fusions: tuple[str, ...] = ()

    @property
    def expert_tp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_parallel_size

    def expert_ranks(self, dp: int, tp: int) -> tuple[int, int]:
        """(EP rank, expert-TP rank) of the trainer rank (dp, tp) of any stage: Megatron-Core lays the expert
        groups over the same TP x DP ranks of a stage, expert-TP fastest, then EP."""
        local = tp + self.tensor_parallel_size * dp
        return (local // self.expert_tp) % self.expert_model_parallel_size, local % self.expert_tp

    @property
    def expert_replica_span(self) -> int:
        """How many data-parallel ranks (dp = 0, 1, ...) it takes, with all TP ranks, to hold every expert
        shard once (the period of `expert_ranks` in dp): 1 without expert parallelism."""
        return math.lcm(self.tensor_parallel_size, self.expert_model_parallel_size * self.expert_tp) \
            // self.tensor_parallel_size

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        return self.model_parallel_size * self.data_parallel_size

    @property
    def transformer_engine(self) -> bool:
        return self.transformer_impl == "transformer_engine"

    def rank(self, dp: int, pp: int, tp: int) -> int:
        """Global rank in Megatron-Core's default order (tp fastest, then dp, then pp)."""
        return (pp * self.data_parallel_size + dp) * self.tensor_parallel_size + tp

    def describe(self) -> str:
        experts = ""
        if self.expert_model_parallel_size > 1 or self.expert_tp != self.tensor_parallel_size:
            experts = f" EP={self.expert_model_parallel_size} ETP={self.expert_tp}"
        return (f"trainer TP={self.tensor_parallel_size} PP={self.pipeline_parallel_size} "
                f"DP={self.data_parallel_size}{experts}")

    def stage_sizes(self, spec: ModelSpec) -> list[int]:
        """Decoder layers of each pipeline stage, Megatron-Core's rule: the stages without a count of their own
        share the remaining layers evenly."""
        pp, first, last = self.pipeline_parallel_size, self.decoder_first_pipeline_num_layers, \
            self.decoder_last_pipeline_num_layers
        flags = "".join(f" --decoder-{k}-pipeline-num-layers {v}" for k, v in (("first", first), ("last", last))
                        if v is not None)
        if pp == 1 and flags:
            raise ValueError(f"{flags.strip()} need(s) --pipeline-model-parallel-size > 1")
        if pp == 1:
            return [spec.num_layers]
        fixed = [x for x in (first, last) if x is not None]
        if any(x < 1 for x in fixed):
            raise ValueError(f"{flags.strip()}: a pipeline stage needs at least one layer")
        middle_stages = pp - len(fixed)
        rest = spec.num_layers - sum(fixed)
        if rest < 0 or (middle_stages == 0 and rest != 0) or (middle_stages and (rest < middle_stages or
                                                                               rest % middle_stages)):
            raise ValueError(f"--pipeline-model-parallel-size {pp}{flags} does not divide model {spec.name!r} "
                             f"num_layers {spec.num_layers} (set --decoder-first/last-pipeline-num-layers)")
        per = rest // middle_stages if middle_stages else 0
        sizes = [per] * pp
        if first is not None:
            sizes[0] = first
        if last is not None:
            sizes[-1] = last
        return sizes

    def layers(self, spec: ModelSpec, pp_rank: int) -> range:
        """Global layer indices held by pipeline stage `pp_rank`."""
        sizes = self.stage_sizes(spec)
        start = sum(sizes[:pp_rank])
        return range(start, start + sizes[pp_rank])

    def validate(self, spec: ModelSpec) -> None:
        """Raise ValueError naming the flag and the numbers if this layout cannot hold the model."""
        for flag, value in (("--tensor-model-parallel-size", self.tensor_parallel_size),
                            ("--pipeline-model-parallel-size", self.pipeline_parallel_size),
                            ("data-parallel size", self.data_parallel_size),
                            ("--make-vocab-size-divisible-by", self.make_vocab_size_divisible_by)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            raise ValueError(f"--transformer-impl {self.transformer_impl!r}: choose one of {TRANSFORMER_IMPLS}")
        if self.moe_token_dispatcher_type not in MOE_TOKEN_DISPATCHERS:
            raise ValueError(f"--moe-token-dispatcher-type {self.moe_token_dispatcher_type!r}: choose one of "
                             f"{MOE_TOKEN_DISPATCHERS}")
        if spec.is_moe and self.moe_token_dispatcher_type == "allgather" and self.pipeline_parallel_size > 1:
            raise ValueError("--moe-token-dispatcher-type allgather cannot run with --pipeline-model-parallel-size > 1:"
                             " micro-batches have their own lengths, which Megatron-Core's allgather dispatcher does "
                             "not support; use alltoall")
        validate_tp(spec, self.tensor_parallel_size, "trainer", allow_kv_replication=False)
        validate_experts(spec, self.expert_model_parallel_size, self.expert_tp, "--expert-model-parallel-size",
                          "--expert-tensor-parallel-size")
        group = self.expert_model_parallel_size * self.expert_tp
        if (self.tensor_parallel_size * self.data_parallel_size) % group:
            raise ValueError(f"--expert-model-parallel-size {self.expert_model_parallel_size} x "
                             f"--expert-tensor-parallel-size {self.expert_tp} must divide TP x DP = "
                             f"{self.tensor_parallel_size} x {self.data_parallel_size} ({self.describe()})")
        self.stage_sizes(spec)


@dataclasses.dataclass(frozen=True)
class GeneratorLayout:
    """The generators' layout: `num_replicas` engines of TP `tensor_parallel_size` each (SGLang's runtime
    layout), optionally block-FP8, on global ranks from `first_rank` on."""

    tensor_parallel_size: int = 1
    num_replicas: int = 1
    fp8: bool = False
    first_rank: int = 0  # global rank of replica 0, TP rank 0
    expert_parallel_size: int = 1  # SGLang's --ep-size: experts split over groups of TP / EP ranks

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.num_replicas

    def rank(self, replica: int, tp: int) -> int:
        return self.first_rank + replica * self.tensor_parallel_size + tp

    def replica_of(self, rank: int) -> int:
        return (rank - self.first_rank) // self.tensor_parallel_size

    def describe(self) -> str:
        return (f"generator TP={self.tensor_parallel_size}"
                f"{f' EP={self.expert_parallel_size}' if self.expert_parallel_size > 1 else ''} x "
                f"{self.num_replicas} replicas{' FP8' if self.fp8 else ''}")

    def validate(self, spec: ModelSpec) -> None:
        for flag, value in (("--rollout-tensor-parallel-size", self.tensor_parallel_size),
                            ("--rollout-num-replicas", self.num_replicas)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        validate_tp(spec, tp, "generator", allow_kv_replication=True)
        validate_experts(spec, ep, tp // ep if tp % ep == 0 else 1, "--rollout-expert-parallel-size",
                         "--rollout-tensor-parallel-size / --rollout-expert-parallel-size")
        sglang_padded_vocab(spec, tp)
        if spec.is_moe:
            generator_experts(spec, tp, 0, ep)


def balanced_edge_stages(num_layers: int, pipeline_parallel_size: int) -> tuple[int | None, int | None]:
    """(first, last) stage layer counts that make an uneven split work: middle stages get ceil(L / PP)
    layers and the two edge stages share the rest (126 over 16 -> 7, 14 x 8, 7). (None, None) if even."""
    pp = pipeline_parallel_size
    if pp == 1 or num_layers % pp == 0:
        return None, None
    per = -(-num_layers // pp)
    rest = num_layers - per * (pp - 2)
    if rest < 2:
        raise ValueError(f"cannot split {num_layers} layers over {pp} pipeline stages")
    return rest - rest // 2, rest // 2

