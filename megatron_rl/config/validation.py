"""The flags checked together, at start, before any work: ranges, pairs that need each other, combinations that
contradict each other, and defaults that depend on other flags (filled in here). Every error names the flags and
values (argparse's `parser.error`: exit status 2). The checks that need the model or the world size are the run
setup's (`config.setup`)."""

from __future__ import annotations

import argparse
import re

from megatron_rl.algorithms import AlgorithmConfig
from megatron_rl.rewards.shaping import OverlongPenalty
from megatron_rl.rewards.verdicts import check_template, check_verdict_pattern
from megatron_rl.rollout import ENGINE_BACKENDS, uses_agents


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    def positive(flag):
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")

    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--micro-batch-size",
                 "--log-interval",
                 "--global-batch-size", "--rollout-tensor-parallel-size", "--rollout-num-replicas",
                 "--n-samples-per-prompt", "--rollout-max-response-len", "--reward-timeout",
                 "--async-alternate-steps", "--recompute-num-layers", "--lr-wsd-decay-iters",
                 "--max-position-embeddings", "--expert-model-parallel-size", "--expert-tensor-parallel-size",
                 "--rollout-expert-parallel-size", "--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size",
                 "--kv-channels", "--keep-last-n-checkpoints", "--max-tokens-per-gpu",
                 "--log-probs-max-tokens-per-gpu", "--rollout-max-running"):
        positive(flag)
    if args.rollout_kv_cache_tokens is not None and args.rollout_kv_cache_tokens < args.seq_length:
        parser.error(f"--rollout-kv-cache-tokens {args.rollout_kv_cache_tokens} is less than --seq-length "
                     f"{args.seq_length}: one sequence of full length would not fit")
    if not 0 < args.rollout_mem_fraction_static < 1:
        parser.error(f"--rollout-mem-fraction-static must be in (0, 1), got {args.rollout_mem_fraction_static}")
    if args.use_dynamic_batch_size != (args.max_tokens_per_gpu is not None):
        parser.error("--use-dynamic-batch-size and --max-tokens-per-gpu go together (packed micro-batches of at "
                     "most that many tokens)")
    if args.log_probs_max_tokens_per_gpu is not None and not args.use_dynamic_batch_size:
        parser.error("--log-probs-max-tokens-per-gpu needs --use-dynamic-batch-size")
    for flag in ("--max-tokens-per-gpu", "--log-probs-max-tokens-per-gpu"):
        budget = getattr(args, flag.lstrip("-").replace("-", "_"))
        if budget is not None and budget < args.seq_length:
            parser.error(f"{flag} {budget} is less than --seq-length {args.seq_length}: a rollout that long could "
                         "not be trained (rollouts are never split)")
    if args.use_rollout_routing_replay and args.recompute_granularity == "full" and \
            args.pipeline_model_parallel_size > 1:
        parser.error("--use-rollout-routing-replay with --recompute-granularity full needs "
                     "--pipeline-model-parallel-size 1 (a recomputed layer would replay the routes of a later "
                     "micro-batch)")
    if args.moe_aux_loss_coeff < 0:
        parser.error(f"--moe-aux-loss-coeff must be >= 0, got {args.moe_aux_loss_coeff}")
    if args.global_batch_size % args.n_samples_per_prompt:
        parser.error(f"--global-batch-size {args.global_batch_size} is not a multiple of --n-samples-per-prompt "
                     f"{args.n_samples_per_prompt}")
    if args.n_samples_per_prompt < 2:
        parser.error(f"--n-samples-per-prompt must be >= 2 for a group baseline, got {args.n_samples_per_prompt}")
    validate_lag(args, parser)
    if args.sft_lr_warmup_iters < 0:
        parser.error(f"--sft-lr-warmup-iters must be >= 0, got {args.sft_lr_warmup_iters}")
    if not args.prompt_data and args.eval_size:  # the task's held-out set: distinct problems, as many as asked
        from megatron_rl.data.tasks.arithmetic import ArithmeticTask

        try:
            ArithmeticTask(seed=args.seed, min_digits=args.task_min_digits, max_digits=args.task_max_digits,
                           num_operands=args.task_operands).check_distinct_count(args.eval_size)
        except ValueError as e:
            parser.error(str(e))
    if args.sft_warmup_iters and args.prompt_data and not args.sft_data:
        parser.error("--sft-warmup-iters with --prompt-data needs --sft-data (conversations to imitate), or drop "
                     "--sft-warmup-iters")
    if not args.prompt_data and (args.input_key, args.label_key, args.metadata_key) != ("prompt", "answer", None):
        parser.error("--input-key, --label-key and --metadata-key name fields of --prompt-data records; the "
                     "arithmetic task has none (give --prompt-data)")
    if args.apply_chat_template and not (args.tokenizer or args.load_hf):
        parser.error("--apply-chat-template needs an HF tokenizer with a chat template (--tokenizer, or --load-hf "
                     "with its tokenizer files); the character tokenizer has none")
    if args.system_prompt is not None and not args.apply_chat_template:
        parser.error("--system-prompt needs --apply-chat-template (a system message is part of a chat)")
    validate_kl(args, parser)
    if args.num_query_groups is not None and not args.group_query_attention:
        parser.error(f"--num-query-groups {args.num_query_groups} needs --group-query-attention (as in Megatron-LM)")
    if args.group_query_attention and args.num_query_groups is None:
        parser.error("--group-query-attention needs --num-query-groups")
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        parser.error("--sequence-parallel shards over the tensor-parallel group: it needs "
                     "--tensor-model-parallel-size > 1")
    if args.recompute_method and args.recompute_granularity != "full":
        parser.error(f"--recompute-method {args.recompute_method} needs --recompute-granularity full")
    if (args.recompute_method is None) != (args.recompute_num_layers is None):
        parser.error("--recompute-method and --recompute-num-layers go together (Megatron-Core needs both)")
    if args.lr_decay_style == "WSD" and not args.lr_wsd_decay_iters:
        parser.error("--lr-decay-style WSD needs --lr-wsd-decay-iters (the steps of its decay phase)")
    if args.eval_prompt_data and len(args.eval_prompt_data) % 2:
        parser.error(f"--eval-prompt-data takes NAME PATH pairs, got {len(args.eval_prompt_data)} value(s)")
    names = (args.eval_prompt_data or [])[::2]
    if len(set(names)) != len(names) or "arithmetic" in names and not args.prompt_data:
        parser.error(f"--eval-prompt-data: set names must be unique (and not 'arithmetic' while the run trains on "
                     f"the task, whose held-out set has that name), got {names}")
    if args.eval_n_samples < 1 or args.eval_interval < 0 or args.eval_temperature < 0:
        parser.error("--eval-n-samples must be >= 1, --eval-interval >= 0 and --eval-temperature >= 0")
    if args.save_interval and not args.save:
        parser.error("--save-interval needs --save")
    if args.keep_last_n_checkpoints is not None and not args.save:
        parser.error("--keep-last-n-checkpoints needs --save (it deletes old iterations of that directory)")
    if args.load_hf and args.load_megatron:
        parser.error("--load-hf and --load-megatron both give the initial weights: pass one")
    if args.save_hf_interval < 0:
        parser.error(f"--save-hf-interval must be >= 0, got {args.save_hf_interval}")
    if args.device != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        parser.error(f"--device must be auto, cpu, cuda or cuda:N, got {args.device!r}")
    validate_reward_shaping(args, parser)
    validate_agent(args, parser)
    validate_remote_reward(args, parser)
    if args.rollout_temperature <= 0:
        parser.error(f"--rollout-temperature must be > 0 for RL sampling, got {args.rollout_temperature}")
    for backend in ENGINE_BACKENDS.values():  # each refuses its own flags when another backend was chosen
        backend.validate(args, parser)
    try:
        AlgorithmConfig.from_args(args)
    except ValueError as e:
        parser.error(str(e))


def validate_lag(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """--async-mode, --max-staleness and --controlled-lag together: fills in their defaults (asynchronous with
    staleness 1; synchronous with staleness 0; --controlled-lag K: synchronous dispatch, staleness K) and refuses
    combinations that contradict each other."""
    lag = args.controlled_lag
    if lag is not None:
        if lag < 0:
            parser.error(f"--controlled-lag must be >= 0, got {lag}")
        if args.async_mode not in (None, "off"):
            parser.error(f"--controlled-lag {lag} generates each step's prompts after the latest weights are "
                         f"published (synchronous dispatch): it cannot run with --async-mode {args.async_mode} "
                         "(leave --async-mode out)")
        if args.max_staleness is not None and args.max_staleness < lag:
            parser.error(f"--controlled-lag {lag} trains rollouts {lag} versions old: --max-staleness (given, or "
                         f"from --config) must be >= {lag}, got {args.max_staleness}")
        args.async_mode = "off"
        args.max_staleness = lag if args.max_staleness is None else args.max_staleness
        return
    args.async_mode = args.async_mode or "on"
    if args.async_mode == "off":
        args.max_staleness = 0  # the synchronous baseline is on-policy by construction
    elif args.max_staleness is None:
        args.max_staleness = 1
    elif args.max_staleness < 1:
        parser.error(f"--async-mode {args.async_mode} trains on rollouts one version old: --max-staleness must be "
                     f">= 1, got {args.max_staleness} (or use --async-mode off)")


def validate_agent(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Agent rollouts: one program (the built-in tool loop or yours), its options only with it, ranges."""
    multi_turn = args.rollout_function == "multi-turn"
    if multi_turn and args.custom_generate_function_path:
        parser.error("--rollout-function multi-turn and --custom-generate-function-path both give the rollout "
                     "program: pass one")
    if multi_turn and not args.apply_chat_template:
        parser.error("--rollout-function multi-turn needs --apply-chat-template (tool turns are the chat "
                     "template's)")
    if not multi_turn:
        given = [f for f, v in (("--tool-config", args.tool_config), ("--max-tokens-per-turn",
                                                                      args.max_tokens_per_turn)) if v is not None]
        if given:
            parser.error(f"{', '.join(given)} need(s) --rollout-function multi-turn")
    if uses_agents(args) and args.use_rollout_routing_replay:
        parser.error("--use-rollout-routing-replay records the routes of one policy call per rollout; agent "
                     "rollouts (--rollout-function multi-turn, --custom-generate-function-path) do not carry them")
    for flag in ("--max-turns", "--max-tokens-per-turn", "--max-observation-len", "--sandbox-memory-mb",
                 "--max-consecutive-environment-failures"):
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None and value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if args.tool_timeout <= 0:
        parser.error(f"--tool-timeout must be > 0, got {args.tool_timeout}")
    if uses_agents(args) and not 0 < args.rollout_program_timeout < args.generator_timeout:
        parser.error(f"--rollout-program-timeout must be > 0 and below --generator-timeout "
                     f"{args.generator_timeout:g} (a hung program is one sample's failure, not a hung generator), "
                     f"got {args.rollout_program_timeout:g}")


def validate_remote_reward(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """One of --custom-rm-path, --rm-url and --judge-model; their options in range, the judge's template and
    verdict pattern usable."""
    given = [f for f, v in (("--custom-rm-path", args.custom_rm_path), ("--rm-url", args.rm_url),
                            ("--judge-model", args.judge_model)) if v]
    if len(given) > 1:
        parser.error(f"{' and '.join(given)} each give the reward function: pass one")
    if args.judge_model:
        try:
            check_template(args.judge_prompt_template)
            check_verdict_pattern(args.judge_verdict_pattern)
        except ValueError as e:
            parser.error(str(e))
        for flag in ("--judge-tensor-parallel-size", "--judge-max-new-tokens"):
            value = getattr(args, flag.lstrip("-").replace("-", "_"))
            if value < 1:
                parser.error(f"{flag} must be >= 1, got {value}")
        if args.judge_max_restarts < 0:
            parser.error(f"--judge-max-restarts must be >= 0, got {args.judge_max_restarts}")
    if args.rm_retries < 0:
        parser.error(f"--rm-retries must be >= 0, got {args.rm_retries}")
    if args.rm_max_concurrency < 1:
        parser.error(f"--rm-max-concurrency must be >= 1, got {args.rm_max_concurrency}")


def validate_reward_shaping(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The overlong penalty's options: used only with --overlong-penalty, defaults filled in, ranges checked."""
    if not args.overlong_penalty:
        given = [f for f, v in (("--overlong-buffer-len", args.overlong_buffer_len),
                                ("--overlong-penalty-factor", args.overlong_penalty_factor)) if v is not None]
        if given:
            parser.error(f"{', '.join(given)} need(s) --overlong-penalty")
        return
    limit = args.rollout_max_response_len
    if args.overlong_buffer_len is None:
        args.overlong_buffer_len = max(limit // 4, 1)
    if args.overlong_penalty_factor is None:
        args.overlong_penalty_factor = 1.0
    try:
        OverlongPenalty(limit, args.overlong_buffer_len, args.overlong_penalty_factor)
    except ValueError as e:
        parser.error(str(e))


def validate_kl(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The KL flags: a coefficient >= 0; --kl-loss-type, --use-kl-in-reward and --ref-load only with a KL penalty.
    Sets the default --kl-loss-type (k3 in the loss, k1 in the reward)."""
    if args.kl_coef < 0:
        parser.error(f"--kl-coef must be >= 0, got {args.kl_coef}")
    if not args.kl_coef:
        given = [flag for flag, value in (("--kl-loss-type", args.kl_loss_type), ("--ref-load", args.ref_load),
                                          ("--use-kl-in-reward", args.use_kl_in_reward)) if value]
        if given:
            parser.error(f"{', '.join(given)} need(s) a KL penalty: --kl-coef > 0")
    if args.kl_loss_type is None:
        args.kl_loss_type = "k1" if args.use_kl_in_reward else "k3"
