"""The run setup that a launch and `--dry-run` share: layouts from the flags and the world size, validated
against the model and Megatron-Core's own TransformerConfig checks, with errors that name the flag."""

import pytest

from megatron_rl.config.arguments import parse_args
from megatron_rl.config.setup import build_run_setup
from megatron_rl.data.tokenizer import build_char_tokenizer

TINY = ["--model", "tiny-llama"]  # 4 heads, 2 KV heads, 2 layers


def _setup(world, *flags):
    return build_run_setup(parse_args([*TINY, *flags]), world, tokenizer=build_char_tokenizer())


@pytest.mark.parametrize("world,flags,pattern", [
    (4, ["--tensor-model-parallel-size", "2"], r"world size 4 leaves 3 trainer ranks .* multiple of "
                                               r"--tensor-model-parallel-size 2"),
    (5, ["--tensor-model-parallel-size", "4"], r"trainer TP=4 \(--tensor-model-parallel-size\) does not divide "
                                               r"model 'tiny-llama': num_key_value_heads 2"),
    (5, ["--pipeline-model-parallel-size", "4"], r"--pipeline-model-parallel-size 4 does not divide model "
                                                 r"'tiny-llama' num_layers 2"),
    (3, ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2"],
     r"--pipeline-model-parallel-size 2 --decoder-first-pipeline-num-layers 2 does not divide"),
    (2, ["--decoder-last-pipeline-num-layers", "1"], r"--decoder-last-pipeline-num-layers 1 need\(s\) "
                                                     r"--pipeline-model-parallel-size > 1"),
    (3, ["--rollout-tensor-parallel-size", "3"], r"world size 3 leaves 0 trainer ranks"),
    (4, ["--rollout-tensor-parallel-size", "3"], r"generator TP=3 \(--rollout-tensor-parallel-size\) does not "
                                                 r"divide"),
])
def test_bad_layouts_name_the_flag_and_numbers(world, flags, pattern):
    with pytest.raises(ValueError, match=pattern):
        _setup(world, *flags)


def test_layouts_take_every_flag_and_the_world_size():
    setup = _setup(9, "--tensor-model-parallel-size", "2", "--rollout-num-replicas", "1", "--bf16",
                   "--transformer-impl", "transformer_engine", "--make-vocab-size-divisible-by", "64")
    t, g = setup.trainer, setup.generator
    assert (t.tensor_parallel_size, t.pipeline_parallel_size, t.data_parallel_size) == (2, 1, 4)
    assert (t.transformer_impl, t.make_vocab_size_divisible_by, t.dtype_bytes) == ("transformer_engine", 64, 2)
    assert (g.tensor_parallel_size, g.num_replicas, g.first_rank) == (1, 1, 8) and setup.world_size == 9


def test_megatron_lm_model_and_memory_flags_reach_the_trainer():
    from megatron_rl.models.megatron_config import transformer_config

    setup = _setup(2, "--group-query-attention", "--num-query-groups", "1", "--max-position-embeddings", "512",
                   "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
    assert (setup.spec.num_key_value_heads, setup.spec.max_position_embeddings) == (1, 512)
    config = transformer_config(setup.spec, setup.trainer)
    assert (config.num_query_groups, config.recompute_granularity, config.recompute_method,
            config.recompute_num_layers) == (1, "full", "uniform", 1)


def test_uneven_stages_reach_megatron_and_the_405b_config_passes_a_launchs_validation():
    from megatron_rl.models.megatron_config import transformer_config

    setup = _setup(3, "--num-layers", "5", "--pipeline-model-parallel-size", "2",
                   "--decoder-first-pipeline-num-layers", "1")
    assert setup.trainer.stage_sizes(setup.spec) == [1, 4]
    config = transformer_config(setup.spec, setup.trainer)
    assert (config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage) == (1, None)
    # 126 layers over 16 stages: 7 + 14 x 8 + 7, the configs/llama3-405b.json layout, at the example's world size
    # (trainer 8 x 16 x 8 = 1024 ranks, generators 8 x 64 = 512).
    big = build_run_setup(parse_args(["--config", "llama3-405b", "--rollout-num-replicas", "64"]), 1536,
                          tokenizer=build_char_tokenizer())
    assert big.trainer.stage_sizes(big.spec) == [7] + [8] * 14 + [7] and big.trainer.data_parallel_size == 8
    assert transformer_config(big.spec, big.trainer).num_layers_in_last_pipeline_stage == 7


@pytest.mark.parametrize("flags,message", [
    (["--log-interval", "0"], "--log-interval must be >= 1, got 0"),
    (["--kl-coef", "-0.1"], "--kl-coef must be >= 0, got -0.1"),
    (["--kl-loss-type", "k2", "--use-kl-in-reward"], "--kl-loss-type, --use-kl-in-reward need(s) a KL penalty: "
                                                     "--kl-coef > 0"),
    (["--ref-load", "ref"], "--ref-load need(s) a KL penalty: --kl-coef > 0"),
    (["--sft-warmup-iters", "2", "--data-path", "x.jsonl"], "--sft-warmup-iters with --prompt-data needs --sft-data"),
    (["--num-query-groups", "2"], "--num-query-groups 2 needs --group-query-attention"),
    (["--group-query-attention"], "--group-query-attention needs --num-query-groups"),
    (["--sequence-parallel"], "--sequence-parallel shards over the tensor-parallel group"),
    (["--recompute-method", "uniform", "--recompute-num-layers", "1"], "needs --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-method", "block"], "go together"),
    (["--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (["--apply-chat-template"], "--apply-chat-template needs an HF tokenizer with a chat template"),
    (["--system-prompt", "Be brief."], "--system-prompt needs --apply-chat-template"),
    (["--input-key", "question"], "--input-key, --label-key and --metadata-key name fields of --prompt-data"),
])
def test_flags_that_cannot_work_together_are_refused_by_the_parser(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*TINY, *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("world,flags,pattern", [
    (3, ["--global-batch-size", "8", "--micro-batch-size", "8"],
     r"--global-batch-size 8 is not a multiple of the data-parallel size 2 x --micro-batch-size 8"),
    (2, ["--reward-fn", "nope"], r"--reward-fn 'nope': not a registered name"),
    (2, ["--custom-rm-path", "json:no_such_function"], r"--custom-rm-path 'json:no_such_function': 'json' has no "
                                                        r"function 'no_such_function'"),
    (2, ["--data-path", "/no/such/prompts.jsonl"], r"--prompt-data '/no/such/prompts.jsonl': no such file"),
    (2, ["--prompt-data", __file__], r"--prompt-data '.*test_run_setup.py': unknown extension '.py'; use one of"),
    (3, ["--tensor-model-parallel-size", "2", "--sequence-parallel"], r"--sequence-parallel needs norms"),
])
def test_what_would_fail_later_in_the_run_fails_in_the_setup(world, flags, pattern):
    with pytest.raises(ValueError, match=pattern):
        _setup(world, *flags)


@pytest.mark.parametrize("model,flags,expected", [
    ("tiny-llama", ["--num-experts", "4"], ("mixtral", 4, 2, 128)),  # Llama -> Mixtral-style, defaults for the rest
    ("tiny-mistral", ["--num-experts", "8", "--moe-router-topk", "1", "--moe-ffn-hidden-size", "32"],
     ("mixtral", 8, 1, 32)),
    ("tiny-qwen3", ["--num-experts", "4", "--moe-ffn-hidden-size", "64"], ("qwen3_moe", 4, 2, 64)),
])
def test_num_experts_makes_the_mixture_of_a_dense_architecture(model, flags, expected):
    from megatron_rl.config.setup import model_spec

    spec = model_spec(parse_args(["--model", model, *flags]), build_char_tokenizer())
    assert (spec.arch, spec.num_experts, spec.moe_router_topk, spec.moe_ffn_hidden_size) == expected
    dense = model_spec(parse_args(["--model", model]), build_char_tokenizer())
    assert (spec.sliding_window, spec.qk_layernorm, spec.head_dim) == \
        (dense.sliding_window, dense.qk_layernorm, dense.head_dim)  # attention unchanged


def test_architecture_flags_an_architecture_cannot_hold_are_refused():
    from megatron_rl.config.setup import model_spec

    with pytest.raises(ValueError, match=r"--model 'tiny-qwen2' with the architecture flags given: .*no head size"):
        model_spec(parse_args(["--model", "tiny-qwen2", "--kv-channels", "32"]), build_char_tokenizer())
    with pytest.raises(ValueError, match=r"--model 'tiny-qwen2' .* arch 'qwen2' takes no num_experts"):
        model_spec(parse_args(["--model", "tiny-qwen2", "--num-experts", "4"]), build_char_tokenizer())
