"""--sglang-<flag> against the installed SGLang's own server command line (no server is launched): names, aliases,
types, choices and switches checked at run setup with errors naming the flag, and a launch command (GPU placement
included, as on a CUDA machine) that SGLang's own parser accepts with the values the user gave."""

import argparse

import pytest

from megatron_rl.config.arguments import parse_args
from megatron_rl.config.setup import build_run_setup
from megatron_rl.data.tokenizer import build_char_tokenizer
from megatron_rl.rollout.sglang.flags import RUN_CONTROLLED, check_server_flags, sglang_cli_actions
from megatron_rl.rollout.sglang.server import launch_command


def _sglang_parser():
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser


def test_values_are_typed_by_sglangs_own_flags():
    flags = check_server_flags({"mem_fraction_static": "0.8", "chunked_prefill_size": "512",
                                "attention_backend": "torch_native", "enable_torch_compile": True,
                                "disable_radix_cache": "false", "max_prefill_tokens": "4k",
                                "cuda_graph_bs_decode": "1 2 4"})
    assert flags == {"mem_fraction_static": 0.8, "chunked_prefill_size": 512, "attention_backend": "torch_native",
                     "enable_torch_compile": True, "max_prefill_tokens": "4k", "cuda_graph_bs_decode": [1, 2, 4]}
    assert type(flags["mem_fraction_static"]) is float and type(flags["chunked_prefill_size"]) is int


@pytest.mark.parametrize("flags,message", [
    ({"mem_fraction_statik": "0.8"}, "--sglang-mem-fraction-statik: SGLang's server has no --mem-fraction-statik; "
                                     "did you mean --sglang-mem-fraction-static"),
    ({"mem_fraction_static": "lots"}, "--sglang-mem-fraction-static 'lots': SGLang's --mem-fraction-static takes "
                                      "float"),
    ({"chunked_prefill_size": "0.5"}, "--sglang-chunked-prefill-size '0.5': SGLang's --chunked-prefill-size takes "
                                      "int"),
    ({"max_prefill_tokens": "many"}, "--sglang-max-prefill-tokens 'many': SGLang's --max-prefill-tokens takes "
                                     "human_readable_int"),
    ({"attention_backend": "nope"}, "--sglang-attention-backend 'nope': SGLang's --attention-backend takes one of "
                                    "['triton', 'torch_native'"),
    ({"mem_fraction_static": True}, "--sglang-mem-fraction-static needs a value: SGLang's --mem-fraction-static "
                                    "takes float"),
    ({"enable_torch_compile": "maybe"}, "--sglang-enable-torch-compile 'maybe': SGLang's --enable-torch-compile is "
                                        "a switch (true/false)"),
    ({"tp_size": "2"}, "--sglang-tp-size (--rollout-tensor-parallel-size sets it)"),
    ({"max_total_tokens": "4k"}, "--sglang-max-total-tokens (--rollout-kv-cache-tokens sets it)"),
])
def test_bad_flags_are_refused_naming_the_flag_and_what_it_takes(flags, message):
    with pytest.raises(ValueError) as error:
        check_server_flags(flags)
    assert message in str(error.value)


def test_every_run_controlled_name_is_an_sglang_flag_and_covers_its_aliases():
    actions = sglang_cli_actions()
    for name in RUN_CONTROLLED:
        assert "--" + name.replace("_", "-") in actions, name
    controlled = {action.dest for name, action in actions.items() if name[2:].replace("-", "_") in RUN_CONTROLLED}
    aliases = {option[2:].replace("-", "_") for option, action in actions.items() if action.dest in controlled}
    assert aliases <= set(RUN_CONTROLLED)


def test_a_boolean_optional_switch_turned_off_takes_its_no_form():
    actions = sglang_cli_actions()
    option, action = next((o, a) for o, a in actions.items() if isinstance(a, argparse.BooleanOptionalAction))
    key = option[2:].replace("-", "_")
    assert check_server_flags({key: "false"}) == {"no_" + key: True}
    assert check_server_flags({key: True}) == {key: True}


def test_run_setup_types_the_flags_and_refuses_unknown_ones():
    def setup(*flags):
        args = parse_args(["--model", "tiny-llama", "--rollout-backend", "sglang", *flags])
        return build_run_setup(args, 2, tokenizer=build_char_tokenizer())

    assert setup("--sglang-mem-fraction-static", "0.7").sglang_flags == {"mem_fraction_static": 0.7}
    with pytest.raises(ValueError, match="--sglang-no-such-flag: SGLang's server has no --no-such-flag"):
        setup("--sglang-no-such-flag", "1")


def test_sglang_parses_the_launch_command_with_the_users_values_and_the_replicas_gpus():
    flags = check_server_flags({"mem_fraction_static": "0.7", "enable_torch_compile": True,
                                "cuda_graph_bs_decode": "1 2 4", "max_prefill_tokens": "4k"})
    environ = {"LOCAL_RANK": "4", "LOCAL_WORLD_SIZE": "8", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    argv, _ = launch_command("/models/m", 4, 31000, environ=environ, cuda_available=True, device_count=8,
                             extra_flags={"max_running_requests": 64, "context_length": 4096, "random_seed": 7,
                                          **flags})
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    parsed = _sglang_parser().parse_args(argv[3:])
    assert (parsed.base_gpu_id, parsed.tp_size, parsed.port, parsed.skip_tokenizer_init) == (4, 4, 31000, True)
    assert (parsed.mem_fraction_static, parsed.enable_torch_compile, parsed.cuda_graph_bs_decode) == (0.7, True,
                                                                                                     [1, 2, 4])
    assert (parsed.max_prefill_tokens, parsed.max_running_requests, parsed.random_seed) == (4000, 64, 7)
    assert parsed.max_total_tokens is None  # on GPUs SGLang sizes its KV cache from memory
    assert parsed.load_format == "dummy" and parsed.weight_version == "-1"
