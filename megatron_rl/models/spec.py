"""Decoder architectures as data: the Llama-3 family, Qwen2/2.5, and tiny test sizes.

A `ModelSpec` is everything needed to build the Megatron-Core model, the HF config, and the generator's
runtime layout. The real sizes are those of the public HF `config.json` files of each model.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str  # "llama" or "qwen2"
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

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"model {self.name!r}: unknown arch {self.arch!r}; known: {sorted(ARCHITECTURES)}")
        if self.hidden_size % self.num_attention_heads:
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
        return self.hidden_size // self.num_attention_heads

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def padded_vocab_size(self, tensor_parallel_size: int = 1, divisible_by: int = 128) -> int:
        """Megatron pads the vocabulary to a multiple of `divisible_by * TP` (--make-vocab-size-divisible-by)."""
        multiple = divisible_by * tensor_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_parameters(self) -> int:
        """Parameter count of the unpadded HF model."""
        h, f, v = self.hidden_size, self.ffn_hidden_size, self.vocab_size
        kv = self.num_key_value_heads * self.head_dim
        attn = h * h * 2 + h * kv * 2 + (h + 2 * kv if self.qkv_bias else 0)
        layer = attn + 3 * h * f + 2 * h
        return self.num_layers * layer + v * h * (1 if self.tie_word_embeddings else 2) + h

    WEIGHT_FIELDS = ("arch", "hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                     "ffn_hidden_size", "vocab_size", "qkv_bias", "tie_word_embeddings")

    def weight_fields(self) -> dict[str, Any]:
        """The fields that decide every weight's name and shape: two models whose weights can replace each
        other's agree on all of them (checkpoints, generators and DDMA plans compare these)."""
        return {f: getattr(self, f) for f in self.WEIGHT_FIELDS}

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
        if self.arch == "llama":
            config["attention_bias"] = self.qkv_bias
            config["mlp_bias"] = False
            config["head_dim"] = self.head_dim
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
        if head_dim * heads != config["hidden_size"]:
            raise ValueError(
                f"config.json field 'head_dim' = {head_dim}: only head_dim * num_attention_heads == hidden_size "
                f"({config['hidden_size']}) is supported"
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
        )


ARCHITECTURES = {
    "llama": {"model_type": "llama", "hf_class": "LlamaForCausalLM"},
    "qwen2": {"model_type": "qwen2", "hf_class": "Qwen2ForCausalLM"},
}

_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Sizes from the public HF configs (meta-llama/Llama-3.1-{8B,70B,405B}, Qwen/Qwen2.5-{0.5B,7B}).
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
        # Test and CPU-demo sizes.
        ModelSpec("tiny-llama", "llama", 64, 2, 4, 2, 128, 128, max_position_embeddings=256),
        ModelSpec("tiny-qwen2", "qwen2", 64, 2, 4, 2, 128, 128, norm_eps=1e-6, qkv_bias=True,
                  max_position_embeddings=256),
    ]
}


def get_model_spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}") from None
