"""Run setup: everything a launch decides before any weight exists, built once and read by every role.

`build_run_setup(args, world_size)` loads the tokenizer and the model architecture, builds the trainer's and
the generators' layouts from the flags and the world size, and validates them all: the layouts against the
model, Megatron-Core's own TransformerConfig checks (uneven pipeline stages included), the DDMA plan between
the two layouts, a `--load` or `--load-megatron` checkpoint against the model, and the generator backend's own
checks (SGLang's `--sglang-<flag>` server flags: `rollout.sglang.flags`). `--dry-run` and a real launch call this
same function, so whatever the dry run accepts the run accepts, and the other way round.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import zlib

from megatron_rl.models.megatron_config import check_megatron_config
from megatron_rl.models.parallelism import KERNEL_FUSIONS, GeneratorLayout, TrainerLayout
from megatron_rl.models.spec import ModelSpec, get_model_spec


@dataclasses.dataclass(frozen=True)
class RunSetup:
    args: object  # the parsed flags (argparse.Namespace)
    tokenizer: object
    spec: ModelSpec
    trainer: TrainerLayout
    generator: GeneratorLayout
    # --sglang-<flag> values, checked and typed (rollout.sglang.flags.check_server_flags): what each launched SGLang
    # server gets on top of the run's own server arguments. Empty for the built-in engine.
    sglang_flags: dict = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The ids that end a response: the tokenizer's EOS and those of the model's generation_config.json."""
        from megatron_rl.data.prompts import stop_token_ids

        return stop_token_ids(self.tokenizer, dict.fromkeys((tokenizer_directory(self.args),
                                                             model_directory(self.args))))

    @property
    def world_size(self) -> int:
        return self.trainer.world_size + self.generator.world_size

    def plan(self):
        """The DDMA plan between the two layouts (computed once per process, cached by `make_plan`)."""
        from megatron_rl.ddma import make_plan

        return make_plan(self.spec, self.trainer, self.generator)


def stable_seed(*parts) -> int:
    """A seed that depends only on `parts` (the same on every rank and every run)."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # any one of these makes an HF tokenizer


def model_directory(args) -> str | None:
    """The directory the run's model comes from, whose generation_config.json (and tokenizer) belong to it:
    --load-hf, --load-megatron's weights, or the iteration a resume (--load) starts from; None for a new model."""
    from megatron_rl.checkpoint import rl_checkpoint

    if args.load_hf:
        return args.load_hf
    if args.load_megatron:
        return rl_checkpoint.weights_directory(args.load_megatron, flag="--load-megatron")
    if args.load:
        return rl_checkpoint.iteration_dir(args.load, rl_checkpoint.latest_checkpoint_step(args.load))
    return None


def tokenizer_directory(args) -> str | None:
    """--tokenizer, else the --load-hf checkpoint's own directory, else --load-megatron's weights when they carry a
    tokenizer; None: the character tokenizer."""
    if args.tokenizer or args.load_hf:
        return args.tokenizer or args.load_hf
    directory = model_directory(args) if args.load_megatron else None
    if directory and any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES):
        return directory
    return None


def load_tokenizer(args):
    """The HF tokenizer of `tokenizer_directory(args)`, or the character tokenizer. With --apply-chat-template
    it must have a chat template."""
    directory = tokenizer_directory(args)
    if directory is None:
        from megatron_rl.data.tokenizer import build_char_tokenizer

        return build_char_tokenizer()
    flag = f"--tokenizer {directory!r}" + ("" if args.tokenizer else " (by default the model's directory)")
    if not os.path.isdir(directory):
        raise ValueError(f"{flag}: no such directory")
    if not any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES):
        raise ValueError(f"{flag}: no tokenizer files (one of {list(TOKENIZER_FILES)}); give --tokenizer the "
                         "directory of the model's tokenizer")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag}: the tokenizer cannot be loaded ({e})") from None
    if args.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"--apply-chat-template: the tokenizer in {directory!r} has no chat template "
                         "(tokenizer_config.json 'chat_template' or chat_template.jinja)")
    return tokenizer


def model_spec(args, tokenizer) -> ModelSpec:
    """The architecture: --load-hf's config.json, the built-in tiny model, or a named spec; then --num-layers
    and the other shape flags override it. A model started from scratch has the vocabulary of its tokenizer
    (a named spec keeps its published one with the character tokenizer, which the dry run stands in with)."""
    if args.load_hf:
        with open(os.path.join(args.load_hf, "config.json")) as f:
            spec = ModelSpec.from_hf_config(json.load(f), name=os.path.basename(os.path.normpath(args.load_hf)))
    elif args.model == "tiny-arith":
        spec = ModelSpec("tiny-arith", "llama", hidden_size=128, num_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, ffn_hidden_size=384, vocab_size=len(tokenizer),
                         max_position_embeddings=args.seq_length)
    else:
        spec = get_model_spec(args.model)
        # A new model for this tokenizer (Megatron pads the vocabulary for the layout); weights from --load-megatron
        # keep the vocabulary they were trained with.
        if args.tokenizer and not args.load_megatron:
            spec = spec.replace(vocab_size=len(tokenizer))
    overrides = {k: v for k, v in (("num_layers", args.num_layers), ("hidden_size", args.hidden_size),
                                   ("ffn_hidden_size", args.ffn_hidden_size),
                                   ("num_attention_heads", args.num_attention_heads),
                                   ("num_key_value_heads", args.num_query_groups),
                                   ("max_position_embeddings", args.max_position_embeddings),
                                   ("kv_channels", args.kv_channels), ("num_experts", args.num_experts),
                                   ("moe_router_topk", args.moe_router_topk),
                                   ("moe_ffn_hidden_size", args.moe_ffn_hidden_size)) if v is not None}
    if args.num_experts and spec.arch in MOE_VARIANT:
        overrides["arch"] = MOE_VARIANT[spec.arch]
    if args.num_experts and not spec.is_moe:  # a dense architecture becomes a mixture: defaults for the rest
        overrides.setdefault("moe_router_topk", min(2, args.num_experts))
        overrides.setdefault("moe_ffn_hidden_size", spec.ffn_hidden_size)
    try:
        spec = spec.replace(**overrides) if overrides else spec
    except ValueError as e:
        raise ValueError(f"--model {spec.name!r} with the architecture flags given: {e}") from None
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but model {spec.name!r} has vocab_size "
                         f"{spec.vocab_size}")
    return spec


# The mixture-of-experts form of each dense architecture, for --num-experts.
MOE_VARIANT = {"llama": "mixtral", "mistral": "mixtral", "qwen3": "qwen3_moe"}


def layouts(args, world_size: int) -> tuple[TrainerLayout, GeneratorLayout]:
    """The trainer gets the first ranks, the generators (rollout TP x replicas) the rest; DP is what the
    trainer's ranks leave after TP x PP. Errors name the flags."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    gtp, replicas = args.rollout_tensor_parallel_size, args.rollout_num_replicas
    trainer_world = world_size - gtp * replicas
    if trainer_world < 1 or trainer_world % (tp * pp):
        raise ValueError(f"world size {world_size} leaves {trainer_world} trainer ranks after {gtp * replicas} "
                         f"generator ranks (--rollout-tensor-parallel-size {gtp} x --rollout-num-replicas "
                         f"{replicas}); it must be a positive multiple of --tensor-model-parallel-size {tp} x "
                         f"--pipeline-model-parallel-size {pp}")
    trainer = TrainerLayout(tp, pp, trainer_world // (tp * pp), args.make_vocab_size_divisible_by,
                            args.transformer_impl, args.decoder_first_pipeline_num_layers,
                            args.decoder_last_pipeline_num_layers, dtype_bytes=2 if args.bf16 else 4,
                            sequence_parallel=args.sequence_parallel, recompute_granularity=args.recompute_granularity,
                            recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
                            expert_model_parallel_size=args.expert_model_parallel_size,
                            expert_tensor_parallel_size=args.expert_tensor_parallel_size,
                            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
                            kernel_fusions=tuple(f for f in KERNEL_FUSIONS.values() if getattr(args, f, True)))
    generator = GeneratorLayout(gtp, replicas, args.rollout_fp8, first_rank=trainer_world,
                                expert_parallel_size=args.rollout_expert_parallel_size)
    return trainer, generator


def build_run_setup(args, world_size: int, tokenizer=None) -> RunSetup:
    """Validate the launch and return its setup. `tokenizer`: use this one instead of loading --tokenizer (the
    dry run plans without tokenizer files)."""
    from megatron_rl.checkpoint import rl_checkpoint
    from megatron_rl.data.readers import file_format
    from megatron_rl.ddma import validate_plan
    from megatron_rl.rewards.registry import reward_factory
    from megatron_rl.rollout import ENGINE_BACKENDS, rollout_program

    rl_checkpoint.resume_or_start(args, clean=not getattr(args, "dry_run", False))
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(args)
    spec = model_spec(args, tokenizer)
    trainer, generator = layouts(args, world_size)
    if args.moe_aux_loss_coeff and not spec.is_moe:
        raise ValueError(f"--moe-aux-loss-coeff {args.moe_aux_loss_coeff}: model {spec.name!r} has no experts "
                         "(--num-experts)")
    validate_plan(spec, trainer, generator)  # both layouts against the model, and against each other
    if getattr(args, "use_rollout_routing_replay", False) and not spec.is_moe:
        raise ValueError(f"--use-rollout-routing-replay: model {spec.name!r} has no experts to route")
    # the generator backend's own checks; SGLang's: can it serve the model, and the --sglang-<flag> server flags
    server_flags = ENGINE_BACKENDS[getattr(args, "rollout_backend", "local")].check_setup(args, spec)
    check_megatron_config(spec, trainer)
    if args.use_dynamic_batch_size:
        if args.global_batch_size < trainer.data_parallel_size:
            raise ValueError(f"--global-batch-size {args.global_batch_size} is less than the data-parallel size "
                             f"{trainer.data_parallel_size}: a rank would have no rollout to train on")
    elif args.global_batch_size % (trainer.data_parallel_size * args.micro_batch_size):
        raise ValueError(f"--global-batch-size {args.global_batch_size} is not a multiple of the data-parallel size "
                         f"{trainer.data_parallel_size} x --micro-batch-size {args.micro_batch_size} (or use "
                         "--use-dynamic-batch-size)")
    if getattr(args, "rm_url", None):
        from megatron_rl.rewards.remote import check_url

        check_url(args.rm_url)
    elif getattr(args, "judge_model", None):
        if importlib.util.find_spec("sglang") is None:
            raise RuntimeError("--judge-model: the judge is served by SGLang, which is not installed in this "
                               "environment (docs/sglang.md)")
        if not os.path.isfile(os.path.join(args.judge_model, "config.json")):
            raise ValueError(f"--judge-model {args.judge_model!r}: no config.json there (an HF model directory)")
    else:
        reward_factory(args.reward_fn, args.custom_rm_path)
    eval_files = (getattr(args, "eval_prompt_data", None) or [])[1::2]
    files = [("--prompt-data", args.prompt_data), ("--sft-data", getattr(args, "sft_data", None))]
    for flag, path in [(f, p) for f, p in files if p] + [("--eval-prompt-data", p) for p in eval_files]:
        if not os.path.isfile(path):
            raise ValueError(f"{flag} {path!r}: no such file")
        file_format(path, flag)
    if args.load:  # before any work: a damaged or foreign checkpoint fails here, naming what is wrong
        rl_checkpoint.check_checkpoint(args.load, spec, trainer.transformer_impl,
                                       needs_reference=bool(args.kl_coef) and not args.ref_load,
                                       expert_model_parallel_size=trainer.expert_model_parallel_size,
                                       controlled_lag=getattr(args, "controlled_lag", None))
    if args.kl_coef and args.ref_load:  # the reference's files and architecture, before any weight is built
        rl_checkpoint.check_reference_checkpoint(args.ref_load, spec, trainer.transformer_impl)
    if args.load_megatron:  # the initial weights: the model in them is this run's
        rl_checkpoint.check_initial_weights(args.load_megatron, spec, trainer.transformer_impl)
    setup = RunSetup(args, tokenizer, spec, trainer, generator, server_flags)
    setup.stop_token_ids  # noqa: B018 - reads generation_config.json now: a bad one fails here, not mid-run
    # the rollout program, its tools and its chat turns: a bad function, tool file or template fails here
    rollout_program(args, tokenizer, setup.stop_token_ids)
    return setup
