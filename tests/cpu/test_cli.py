"""The Megatron-style command line: groups and flag names, clean errors, configs, --dry-run (the per-GPU
memory of the 8B layout and of the Qwen3-235B-A22B expert layout checked by hand), and every example script's
flags through the real parser."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT

from megatron_rl.config.arguments import parse_args


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "megatron_rl.train", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_help_shows_megatron_groups_and_flags():
    r = _cli("--help")
    assert r.returncode == 0
    for text in ("distributed:", "learning rate and optimizer:", "checkpointing:", "rollout:", "algorithm:",
                 "reward:", "ddma:", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--micro-batch-size", "--global-batch-size", "--save-interval", "--wandb-project",
                 "--tensorboard-dir", "--rollout-tensor-parallel-size", "--rollout-fp8", "--aipo-rho",
                 "--max-staleness", "--advantage-estimator"):
        assert text in r.stdout, text


@pytest.mark.parametrize("args,message", [
    (["--no-such-flag", "1"], "unrecognized arguments: --no-such-flag 1"),
    (["--global-batch-size", "10", "--n-samples-per-prompt", "4"], "--global-batch-size 10 is not a multiple"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be >= 1, got 0"),
    (["--config", "no-such-config"], "--config 'no-such-config': no such file"),
    (["--sglang-mem-fraction-static", "0.8"], "--sglang-mem-fraction-static need(s) --rollout-backend sglang"),
    (["--rollout-backend", "sglang", "--rollout-num-replicas", "2", "--rollout-server-urls", "http://a:1"],
     "--rollout-server-urls has 1 URL(s) for --rollout-num-replicas 2"),
    (["--async-mode", "alternate", "--max-staleness", "0"], "--max-staleness must be >= 1, got 0"),
])
def test_bad_flags_fail_with_clear_messages(args, message):
    r = _cli(*args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("flags,message", [
    (["--controlled-lag", "-1"], "--controlled-lag must be >= 0, got -1"),
    (["--controlled-lag", "2", "--async-mode", "on"], "--controlled-lag 2 generates each step's prompts after the "
                                                       "latest weights are published (synchronous dispatch): it "
                                                       "cannot run with --async-mode on"),
    (["--controlled-lag", "2", "--async-mode", "alternate"], "cannot run with --async-mode alternate"),
    (["--controlled-lag", "3", "--max-staleness", "2"], "--controlled-lag 3 trains rollouts 3 versions old: "
                                                        "--max-staleness (given, or from --config) must be >= 3, "
                                                        "got 2"),
    (["--config", "llama3-8b", "--controlled-lag", "3"], "--max-staleness (given, or from --config) must be >= 3, "
                                                         "got 1"),
])
def test_controlled_lag_contradictions_name_both_flags(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(flags)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--use-dynamic-batch-size"], "--use-dynamic-batch-size and --max-tokens-per-gpu go together"),
    (["--max-tokens-per-gpu", "512"], "--use-dynamic-batch-size and --max-tokens-per-gpu go together"),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "100", "--seq-length", "128"],
     "--max-tokens-per-gpu 100 is less than --seq-length 128: a rollout that long could not be trained"),
    (["--use-dynamic-batch-size", "--max-tokens-per-gpu", "512", "--log-probs-max-tokens-per-gpu", "0"],
     "--log-probs-max-tokens-per-gpu must be >= 1, got 0"),
])
def test_packing_flags_are_checked_together(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(flags)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("flags,message", [
    (["--task-max-digits", "1"], "--eval-size 200: the task's eval split has only 15 distinct problems (200 "
                                 "expressions in all)"),
    (["--sft-lr-warmup-iters", "-1"], "--sft-lr-warmup-iters must be >= 0, got -1"),
])
def test_task_and_warm_up_flags_are_checked_before_any_work(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(flags)
    assert e.value.code == 2 and message in capsys.readouterr().err
    parse_args(["--task-max-digits", "1", "--eval-size", "15"])  # the whole held-out split may be asked for


def _lag_flags(*flags):
    args = parse_args(list(flags))
    return args.async_mode, args.max_staleness, args.controlled_lag


def test_controlled_lag_implies_synchronous_dispatch_and_a_staleness_that_admits_it():
    assert _lag_flags("--controlled-lag", "3") == ("off", 3, 3)
    assert _lag_flags("--controlled-lag", "0") == ("off", 0, 0)
    assert _lag_flags("--controlled-lag", "2", "--async-mode", "off", "--max-staleness", "5") == ("off", 5, 2)
    # without it, as before: asynchronous with staleness 1; the synchronous baseline on-policy
    assert _lag_flags() == ("on", 1, None)
    assert _lag_flags("--async-mode", "off", "--max-staleness", "3") == ("off", 0, None)
    assert _lag_flags("--async-mode", "alternate", "--max-staleness", "2") == ("alternate", 2, None)


def test_inconsistent_layout_fails_at_start():
    r = _cli("--config", "llama3-8b", "--dry-run", "--world-size", "12", "--rollout-num-replicas", "5")
    assert r.returncode == 2
    assert "world size 12 leaves 7 trainer ranks" in r.stderr and "--tensor-model-parallel-size 2" in r.stderr
    r = _cli("--model", "llama3-8b", "--tensor-model-parallel-size", "3", "--dry-run", "--world-size", "4")
    assert r.returncode == 2 and "does not divide" in r.stderr


def test_config_by_name_is_overridden_by_flags_and_sglang_flags_pass_through():
    args = parse_args(["--config", "llama3-405b", "--lr", "1e-7", "--sglang-mem-fraction-static", "0.8",
                       "--sglang-enable-torch-compile"])
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (8, 16)
    assert args.lr == 1e-7 and args.rollout_fp8 and args.bf16
    assert args.sglang == {"mem_fraction_static": "0.8", "enable_torch_compile": True}


def test_dry_run_memory_for_8b_matches_hand_computation():
    r = _cli("--config", "llama3-8b", "--dry-run", "--world-size", "16", "--rollout-num-replicas", "8")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    # Llama-3.1 8B at TP=2: every matrix is split in two, the 2 x 32 + 1 RMSNorm weights of 4096 are
    # replicated; the vocabulary 128256 is already a multiple of 128 x 2 (no padding).
    total, norms = 8_030_261_248, (2 * 32 + 1) * 4096
    per_gpu = (total - norms) // 2 + norms
    trainer = report["memory_per_gpu"]["trainer"]
    assert trainer["params"] == per_gpu == 4_015_263_744
    # bf16 weights (2 B) + fp32 grads (4 B) + fp32 main weights and Adam moments (12 B) / DP=4
    assert trainer["total_gib"] * 2**30 == pytest.approx(per_gpu * (2 + 4 + 12 / 4))
    assert report["rank_map"]["trainer"]["data_parallel"] == 4
    assert report["rank_map"]["generators"]["ranks"][0] == [8, 8]
    assert report["ddma"]["estimated_seconds"] < report["ddma"]["baseline"]["estimated_seconds"]


def test_dry_run_names_the_transport_the_launch_would_choose_and_estimates_from_it():
    """A GPU launch (every rank on a GPU of its own) over NCCL; --device cpu over gloo; attached SGLang servers, whose
    generator ranks stay on the CPU, through host memory (staged): each estimate from that transport's links."""
    def ddma(*flags):
        r = _cli("--config", "llama3-8b", "--dry-run", "--world-size", "16", "--rollout-num-replicas", "8", *flags)
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout.strip().splitlines()[-1])["ddma"]
        assert f"DDMA over {report['transport']} (" in r.stdout
        return report

    nccl, gloo = ddma(), ddma("--device", "cpu")
    staged = ddma("--rollout-backend", "sglang", "--rollout-server-urls", *[f"http://h:{30000 + i}" for i in range(8)])
    assert (nccl["transport"], gloo["transport"], staged["transport"]) == ("nccl", "gloo", "staged")
    assert "some ranks compute on CPUs" in staged["transport_why"]
    assert nccl["estimated_seconds"] < gloo["estimated_seconds"] < staged["estimated_seconds"]
    assert nccl["max_in_flight_bytes"] <= 2 * 256 * 2**20  # two rounds of --ddma-bucket-mb 256


def test_dry_run_memory_for_235b_holds_only_the_ranks_experts():
    from megatron_rl.config.memory import trainer_memory
    from megatron_rl.config.setup import layouts
    from megatron_rl.models.spec import get_model_spec
    from megatron_rl.models.weight_map import megatron_shards

    # configs/qwen3-235b-a22b.json at the example's world size: trainer TP=4 PP=8 DP=8 (256), 8 generators x TP=8.
    trainer, generator = layouts(parse_args(["--config", "qwen3-235b-a22b", "--rollout-num-replicas", "8"]), 320)
    spec = get_model_spec("qwen3-235b-a22b")
    assert (trainer.expert_model_parallel_size, trainer.expert_tp, generator.expert_parallel_size) == (16, 1, 8)
    assert trainer.stage_sizes(spec) == [11] + [12] * 6 + [11]
    # A middle stage (12 layers, no embedding) is the busiest. Per layer on one TP=4 rank: QKV of 16 query heads and
    # 1 of the 4 KV heads, o_proj's 2048 columns, the q/k norms, two RMSNorms, the replicated router, and 128 / 16
    # whole experts (ETP=1) of gate, up and down.
    h, d, fe = spec.hidden_size, spec.head_dim, spec.moe_ffn_hidden_size
    dense = 12 * ((16 + 2) * d * h + h * 16 * d + 2 * d + 2 * h + spec.num_experts * h)
    experts = 12 * (spec.num_experts // 16) * 3 * h * fe
    m = trainer_memory(spec, trainer, bf16=True, distributed_optimizer=True)
    assert (m["params"], m["expert_params"]) == (dense + experts, experts)
    # The distributed optimizer splits the dense parameters' Adam state over DP = 8, the experts' over the
    # expert-data-parallel group: TP x DP / (EP x ETP) = 4 x 8 / 16 = 2 ranks hold the same experts.
    assert m["expert_data_parallel"] == 2
    assert m["total_gib"] * 2**30 == pytest.approx((dense + experts) * (2 + 4) + dense * 12 / 8 + experts * 12 / 2)
    # Every rank of that stage holds the same amount: 8 experts of its own, whichever EP rank it is.
    assert {sum(x.numel for x in megatron_shards(spec, trainer, tp, 3, dp).values())
            for tp in range(4) for dp in range(4)} == {dense + experts}


def test_expert_parallel_size_that_does_not_divide_the_experts_fails_naming_the_flag():
    r = _cli("--config", "qwen3-30b-a3b", "--dry-run", "--world-size", "32", "--rollout-num-replicas", "8",
             "--expert-model-parallel-size", "12", "--tensor-model-parallel-size", "2")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "--expert-model-parallel-size 12 does not divide model 'qwen3-30b-a3b' num_experts 128" in r.stderr


# The Qwen3 scripts take 10-30 s each (the 235B-A22B one's memory is also checked in-process above): the slow tier
# (tests/cpu/run_slow.sh) runs them, and the chat-program recipe's (its program runs in a default-suite launch).
@pytest.mark.parametrize("script", ["run_tiny_aipo.sh", "run_tiny_moe.sh", "run_math_chat.sh", "run_tool_aipo.sh",
                                    "run_8b_aipo.sh",
                                    "run_70b_aipo.sh", "run_405b_aipo.sh",
                                    pytest.param("run_qwen3_235b_a22b_aipo.sh", marks=pytest.mark.slow),
                                    pytest.param("run_qwen3_8b_aipo.sh", marks=pytest.mark.slow),
                                    pytest.param("run_qwen3_30b_a3b_aipo.sh", marks=pytest.mark.slow),
                                    pytest.param("run_chat_program.sh", marks=pytest.mark.slow)])
def test_example_scripts_parse_and_dry_run(script):
    r = subprocess.run(["bash", os.path.join(ROOT, "examples", script), "--dry-run"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "memory per GPU" in r.stdout and "DDMA" in r.stdout and "trainer ranks" in r.stdout
    report = json.loads(r.stdout.strip().splitlines()[-1])
    trainer = report["memory_per_gpu"]["trainer"]
    if "tiny" not in report["model"]:  # a real model's script fits an 80 GB GPU at its longest micro-batch
        assert "A100/H100 80GB" in trainer["fits"], (trainer, r.stdout[-3000:])
        assert trainer["peak_gib"] > trainer["total_gib"] + trainer["activations_gib"] * 0.99
        # its SGLang servers leave their generator ranks room, and still hold their weights
        memory = report["sglang_memory"]
        room = (1 - memory["fraction"]) * memory["gpu_bytes"]
        assert room >= memory["sglang_reserve_bytes"] + memory["receive_bytes"] + memory["nccl_bytes"]
        assert memory["fraction"] * memory["gpu_bytes"] > report["memory_per_gpu"]["generator"]["weights_gib"] * 2**30
        assert "SGLang --mem-fraction-static" in r.stdout
    if script in ("run_8b_aipo.sh", "run_qwen3_8b_aipo.sh"):  # one 8-GPU node unless NNODES says otherwise
        assert report["world_size"] == 8 and report["rank_map"]["generators"]["replicas"] == 4
    if report["experts"]:  # the Qwen3 mixtures: active parameters, EP in the rank map, the expert comparison
        t, g = report["rank_map"]["trainer"], report["rank_map"]["generators"]
        assert report["active_parameters"] < report["parameters"]
        assert f"EP={t['expert_parallel']} ETP={t['expert_tensor_parallel']}" in r.stdout
        assert t["expert_data_parallel"] * t["expert_parallel"] * t["expert_tensor_parallel"] == \
            t["tensor_parallel"] * t["data_parallel"]
        full = report["ddma"]["full_experts"]
        if g["tensor_parallel"] == 1:  # the tiny example: one generator rank holds every expert anyway
            assert full["max_recv_bytes"] == full["sharded_recv_bytes"] == report["ddma"]["max_recv_bytes"]
            return
        assert g["expert_parallel"] > 1 and f"TP={g['tensor_parallel']} EP={g['expert_parallel']}" in r.stdout
        assert full["max_recv_bytes"] > full["sharded_recv_bytes"] == report["ddma"]["max_recv_bytes"]
