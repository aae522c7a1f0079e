"""The KL penalty to a frozen reference policy: the loss term's gradient against the hand derivative of each
estimator, the reference model's log-probs under every layout and from HF and Megatron checkpoint directories, the
default reference (the starting policy: KL 0 before any update), and its restoration from a checkpoint.

fp32 throughout. Tolerances: gradients 1e-7 absolute (they are ~1e-3; the two computations differ only in float
summation order, ~1e-9); log-probs across layouts 1e-5 (TP and PP change the order of the softmax and matmul
sums); the KL metric rel 1e-5; the same layout and weights are compared exactly."""

import json
import math

import pytest
import torch
from test_trainer import SPEC, TEMPERATURE, _batch, _merge, _params

from megatron_rl.models.parallelism import TrainerLayout
from megatron_rl.runtime.spawn import run_on_ranks
from megatron_rl.trainer import parallel

VOCAB_PADDED = 256  # SPEC's vocabulary 200, padded to a multiple of 128


def _trainer(tp, pp, seed_weights=0, kl_coef=0.1, kl_estimator="k3"):
    import torch.distributed as dist
    from helpers import random_hf_weights

    from megatron_rl.algorithms import AlgorithmConfig
    from megatron_rl.trainer.policy import build_policy
    from megatron_rl.trainer.reference import ReferenceModel
    from megatron_rl.trainer.train_step import PolicyTrainer
    from megatron_rl.trainer.weights import load_hf_weights

    layout = TrainerLayout(tp, pp, dist.get_world_size() // (tp * pp), dtype_bytes=4)
    parallel.initialize(layout, SPEC)
    policy = build_policy(SPEC, layout, lr=1e-3, adam_eps=1e-4,
                          init_weights=lambda m: load_hf_weights(m, SPEC, layout,
                                                                 random_hf_weights(SPEC, seed=seed_weights)))
    algo = AlgorithmConfig(loss="aipo", loss_params={"rho": 2.0}, temperature=TEMPERATURE, kl_coef=kl_coef,
                           kl_estimator=kl_estimator)
    return PolicyTrainer(policy, algo, batching=1, reference=ReferenceModel(policy))


def _write_hf_dir(directory, seed):
    """An HF checkpoint directory of SPEC: config.json and model.safetensors."""
    from helpers import random_hf_weights
    from safetensors.torch import save_file

    directory.mkdir()
    save_file(random_hf_weights(SPEC, seed=seed), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(SPEC.to_hf_config()))
    return str(directory)


# ---- the loss term against the hand derivative ---------------------------------------------------------------------

def _kl_gradient_rank():
    """policy_loss on leaf logits, with and without the KL term: the difference of the logits' gradients."""
    from megatron_rl.algorithms import AlgorithmConfig
    from megatron_rl.trainer.train_step import policy_loss

    parallel.initialize(TrainerLayout(1, 1, 1, dtype_bytes=4), SPEC)
    batch = _batch()
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(*batch.tokens.shape, VOCAB_PADDED, generator=g) * 2
    logp = torch.log_softmax(logits[:, :-1, :SPEC.vocab_size] / TEMPERATURE, -1).gather(
        -1, batch.tokens[:, 1:, None]).squeeze(-1)
    ref = logp + 0.5 * torch.randn(logp.shape, generator=g)  # a reference near the policy, as in training
    mb = {"tokens": batch.tokens, "loss_mask": batch.loss_mask, "advantages": batch.advantages,
          "behavior_logprobs": batch.behavior_logprobs, "ref_logprobs": ref, "batch_width": batch.tokens.shape[1] - 1}
    normalizer = float(batch.loss_mask.sum())
    out = {}
    for name, algo in [("none", AlgorithmConfig(temperature=TEMPERATURE))] + [
            (est, AlgorithmConfig(temperature=TEMPERATURE, kl_coef=0.3, kl_estimator=est)) for est in ("k1", "k2", "k3")
    ] + [("in-reward", AlgorithmConfig(temperature=TEMPERATURE, kl_coef=0.3, kl_estimator="k3", kl_in_reward=True))]:
        leaf = logits.clone().requires_grad_()
        loss, stats = policy_loss(algo, leaf, mb, SPEC.vocab_size, normalizer)
        loss.backward()
        out[name] = (leaf.grad, stats.get("kl_ref"))
    parallel.destroy()
    return logits, mb, normalizer, out


@pytest.fixture(scope="module")
def kl_gradients():
    return run_on_ranks(_kl_gradient_rank, 1)[0]


@pytest.mark.parametrize("estimator,per_token_derivative,value", [
    ("k1", lambda d: torch.ones_like(d), lambda d: d),
    ("k2", lambda d: d, lambda d: 0.5 * d ** 2),
    ("k3", lambda d: 1 - torch.exp(-d), lambda d: torch.exp(-d) + d - 1),
])
def test_kl_term_adds_the_hand_derivative_of_its_estimator(kl_gradients, estimator, per_token_derivative, value):
    logits, mb, normalizer, out = kl_gradients
    # By hand: log pi(target) = log_softmax(logits / T) over the true vocabulary; d log pi / d logits =
    # (onehot(target) - softmax) / T; the KL term adds kl_coef / normalizer x dKL/d(log pi) on every trained token.
    x = logits[:, :-1, :SPEC.vocab_size] / TEMPERATURE
    targets = mb["tokens"][:, 1:]
    logp = torch.log_softmax(x.double(), -1).gather(-1, targets[..., None]).squeeze(-1)
    d = logp - mb["ref_logprobs"].double()  # log pi - log ref
    mask = mb["loss_mask"]
    weight = torch.where(mask, 0.3 / normalizer * per_token_derivative(d), torch.zeros((), dtype=torch.float64))
    dlogp = (torch.nn.functional.one_hot(targets, SPEC.vocab_size) - torch.softmax(x.double(), -1)) / TEMPERATURE
    expected = torch.zeros(logits.shape, dtype=torch.float64)
    expected[:, :-1, :SPEC.vocab_size] = weight[..., None] * dlogp
    grad, kl = out[estimator]
    torch.testing.assert_close((grad - out["none"][0]).double(), expected, atol=1e-7, rtol=0)
    assert float(kl) == pytest.approx(float(value(d)[mask].sum() / normalizer), rel=1e-5)


def test_kl_in_the_reward_is_reported_but_not_in_the_loss(kl_gradients):
    _, _, _, out = kl_gradients
    assert torch.equal(out["in-reward"][0], out["none"][0])
    assert float(out["in-reward"][1]) == float(out["k3"][1]) > 0


# ---- the reference model under every layout, from HF and Megatron directories -------------------------------------

def _layouts_rank(hf_dir, megatron_dir):
    """One launch on 2 ranks: TP=2, PP=2, then TP=1 x DP=2. Each builds a policy of other weights (seed 99) and a
    reference from --ref-load; a TP=1 policy of the reference's own weights (seed 0) is the independent check."""
    from megatron.core import parallel_state as ps

    results = {}
    for name, (tp, pp), directory in [("tp2", (2, 1), hf_dir), ("pp2", (1, 2), hf_dir), ("tp1", (1, 1), hf_dir),
                                      ("tp1-megatron-dir", (1, 1), megatron_dir)]:
        trainer = _trainer(tp, pp, seed_weights=99)
        trainer.reference.load(directory)
        batch = _batch()
        results[name] = {"ref": trainer.compute_logprobs(batch, reference=True),
                         "policy": trainer.compute_logprobs(batch),
                         "kl_ref": trainer.train_step(batch)["kl_ref"]}
        parallel.destroy()
    same_weights = _trainer(1, 1, seed_weights=0)
    results["policy-of-the-reference-weights"] = same_weights.compute_logprobs(_batch())
    results["rank"] = ps.get_data_parallel_rank()
    parallel.destroy()
    return results


def test_reference_logprobs_are_the_same_under_every_layout_and_checkpoint_format(tmp_path):
    from megatron_rl.checkpoint.hf_conversion import hf_to_megatron

    hf_dir = _write_hf_dir(tmp_path / "hf", seed=0)
    megatron_dir = str(tmp_path / "megatron")
    hf_to_megatron(hf_dir, megatron_dir, TrainerLayout(2, 1), progress=False)  # served at TP=1 by get_slice
    ranks = run_on_ranks(_layouts_rank, 2, hf_dir, megatron_dir, timeout_s=600)
    mask = _batch().loss_mask
    truth = ranks[0]["policy-of-the-reference-weights"]
    for r in ranks:
        for name in ("tp2", "pp2", "tp1", "tp1-megatron-dir"):
            torch.testing.assert_close(r[name]["ref"][mask], truth[mask], atol=1e-5, rtol=0, msg=name)
            # the reference is not the policy: its log-probs come from --ref-load's weights
            assert (r[name]["ref"] - r[name]["policy"])[mask].abs().max() > 1e-2
            assert r[name]["kl_ref"] == pytest.approx(ranks[0]["tp1"]["kl_ref"], rel=1e-5), name
        assert torch.equal(r["tp1"]["ref"], r["tp1-megatron-dir"]["ref"])
    # the metric is the token mean of k3 between the policy's and the reference's log-probs, before the update
    d = ranks[0]["tp1"]["policy"][mask].double() - ranks[0]["tp1"]["ref"][mask].double()
    assert ranks[0]["tp1"]["kl_ref"] == pytest.approx(float((torch.exp(-d) + d - 1).mean()), rel=1e-5)


# ---- the default reference, and its checkpoint ---------------------------------------------------------------------

def _default_reference_rank(directory, plain_directory):
    """Save at TP=2 (after the reference is the starting policy and the policy took two steps), load at TP=1 x
    DP=2 into a policy and reference of other weights."""
    from megatron_rl.trainer.checkpoint import load_trainer_checkpoint, save_trainer_checkpoint

    batch = _batch()
    trainer = _trainer(2, 1)
    out = {}
    try:
        trainer.train_step(batch)
    except RuntimeError as e:  # no reference weights yet: refused, not silently zero
        out["unset"] = str(e)
    trainer.reference.copy_from(trainer.policy)
    out["first"] = trainer.train_step(batch)["kl_ref"]
    out["second"] = trainer.train_step(batch)["kl_ref"]
    out["ref"] = trainer.compute_logprobs(batch, reference=True)
    out["policy"] = trainer.compute_logprobs(batch)
    save_trainer_checkpoint(trainer.policy, directory, reference=trainer.reference.module)
    save_trainer_checkpoint(trainer.policy, plain_directory)
    out["saved"] = _params(trainer) | {"ref_params": {n: p.detach().clone()
                                                      for n, p in trainer.reference.module.named_parameters()}}
    parallel.destroy()

    resumed = _trainer(1, 1, seed_weights=99)
    load_trainer_checkpoint(resumed.policy, directory, reference=resumed.reference.module)
    resumed.reference.restored()
    out["resumed_ref"] = resumed.compute_logprobs(batch, reference=True)
    out["resumed_policy"] = resumed.compute_logprobs(batch)
    out["resumed_kl"] = resumed.train_step(batch)["kl_ref"]
    out["loaded"] = _params(resumed) | {"ref_params": {n: p.detach().clone()
                                                       for n, p in resumed.reference.module.named_parameters()}}
    load_trainer_checkpoint(resumed.policy, directory)  # a run without the KL penalty ignores the saved reference
    try:
        load_trainer_checkpoint(resumed.policy, plain_directory, reference=resumed.reference.module)
    except ValueError as e:
        out["no_reference"] = str(e)
    parallel.destroy()
    return out


def test_default_reference_is_the_starting_policy_and_a_resume_restores_it(tmp_path):
    from megatron_rl.trainer.weights import merge_to_hf

    ranks = run_on_ranks(_default_reference_rank, 2, str(tmp_path / "ckpt"), str(tmp_path / "plain"),
                         timeout_s=600)
    r = ranks[0]
    mask = _batch().loss_mask
    assert "no weights yet" in r["unset"] and "snapshot_reference" in r["unset"]
    assert r["first"] == 0.0  # the same weights and computation: log-probs bit-identical, k3 exactly 0
    d = r["policy"][mask].double() - r["ref"][mask].double()
    assert r["second"] > 1e-6  # the policy moved; the reference stayed
    assert d.abs().max() > 1e-4
    # the reference weights of the checkpoint, saved at TP=2, come back at TP=1 (merged to HF names to compare)
    saved = merge_to_hf(SPEC, TrainerLayout(2, 1), {(x["saved"]["tp_rank"], 0): x["saved"]["ref_params"]
                                                    for x in ranks})
    loaded = merge_to_hf(SPEC, TrainerLayout(1, 1), {(0, 0): r["loaded"]["ref_params"]})
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), name
    assert any(not torch.equal(a, b) for a, b in zip(_merge([x["saved"] for x in ranks], 2, 1).values(),
                                                      saved.values()))  # the policy's weights are other weights
    torch.testing.assert_close(r["resumed_ref"][mask], r["ref"][mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(r["resumed_policy"][mask], r["policy"][mask], atol=1e-5, rtol=0)
    # after the resume the KL is the one to the reference of before the crash, not 0
    resumed_d = r["resumed_policy"][mask].double() - r["resumed_ref"][mask].double()
    assert r["resumed_kl"] == pytest.approx(float((torch.exp(-resumed_d) + resumed_d - 1).mean()), rel=1e-5)
    assert "holds no reference model" in r["no_reference"] and "--ref-load" in r["no_reference"]
    assert math.isfinite(r["resumed_kl"]) and r["resumed_kl"] > 1e-6


# ---- the controller: the snapshot before RL, the KL in the reward --------------------------------------------------

def _run_controller(tmp_path, *flags):
    from test_controller_loop import _controller

    controller, generator, trainer = _controller(tmp_path, "--async-mode", "off", "--train-iters", "1",
                                                 "--sft-warmup-iters", "1", "--sft-batch-size", "2", *flags)
    controller.run()
    controller.shutdown()
    generator.join(timeout=30)
    return [name for name, _ in trainer.commands]


def test_the_default_reference_is_taken_after_the_warm_up_right_before_rl(tmp_path):
    commands = _run_controller(tmp_path / "a", "--kl-coef", "0.1")
    assert commands == ["publish", "sft", "publish", "snapshot_reference", "train", "publish"]
    # --ref-load names the reference: nothing to copy
    assert "snapshot_reference" not in _run_controller(tmp_path / "b", "--kl-coef", "0.1", "--ref-load", "ref")
    assert "snapshot_reference" not in _run_controller(tmp_path / "c")  # no KL penalty, no reference


def test_kl_in_the_reward_shapes_the_advantages_as_verl_does(tmp_path):
    from test_controller_loop import RecordingTrainer, _controller

    class ReferenceTrainer(RecordingTrainer):
        """Answers "ref_logprobs" with -1.5 for every token (the scripted rollouts' log-probs are -1.0)."""

        def command(self, name, payload=None):
            if name == "ref_logprobs":
                self.commands.append((name, payload))
                return torch.full(payload.behavior_logprobs.shape, -1.5)
            return super().command(name, payload)

    controller, generator, _ = _controller(tmp_path, "--async-mode", "off", "--kl-coef", "0.2",
                                           "--use-kl-in-reward")
    controller.trainer = trainer = ReferenceTrainer()
    controller.publish()
    controller.rl_step(1, 0.0)
    controller.shutdown()
    generator.join(timeout=30)
    names = [name for name, _ in trainer.commands]
    assert names == ["publish", "ref_logprobs", "train", "publish"]
    batch = trainer.trained()[0]
    assert torch.equal(batch.ref_logprobs, torch.full(batch.behavior_logprobs.shape, -1.5))
    # By hand (k1, the default in the reward): each trained token's KL is -1.0 - (-1.5) = 0.5, so a response of n
    # tokens loses 0.2 x 0.5 x n of its reward. The scripted answers: the right one is the shorter of its group
    # (reward 1), the wrong one has a digit more (reward 0). Group baseline: minus the group's mean.
    n = batch.loss_mask.sum(-1).double().view(-1, 4)
    reward = (n == n.min(-1, keepdim=True).values).double()
    shaped = reward - 0.2 * 0.5 * n
    expected = (shaped - shaped.mean(-1, keepdim=True)).flatten()
    torch.testing.assert_close(batch.advantages.double(), expected, atol=1e-6, rtol=0)
    assert (reward.sum(-1) == 2).all()  # two right answers per group, as scripted


# ---- flags, the run setup and the dry run --------------------------------------------------------------------------

def test_kl_loss_type_defaults_to_k3_in_the_loss_and_k1_in_the_reward():
    from megatron_rl.config.arguments import parse_args

    assert parse_args(["--kl-coef", "0.1"]).kl_loss_type == "k3"
    assert parse_args(["--kl-coef", "0.1", "--use-kl-in-reward"]).kl_loss_type == "k1"
    assert parse_args(["--kl-coef", "0.1", "--use-kl-in-reward", "--kl-loss-type", "k2"]).kl_loss_type == "k2"


def _setup_with(*flags):
    from megatron_rl.config.arguments import parse_args
    from megatron_rl.config.setup import build_run_setup
    from megatron_rl.data.tokenizer import build_char_tokenizer

    return build_run_setup(parse_args(["--model", "tiny-llama", "--kl-coef", "0.1", *flags]), 2,
                           tokenizer=build_char_tokenizer())


def test_a_bad_ref_load_fails_in_the_setup_naming_the_flag(tmp_path):
    from megatron_rl.models.spec import get_model_spec

    with pytest.raises(ValueError, match=r"--ref-load '/no/such/dir': no such directory"):
        _setup_with("--ref-load", "/no/such/dir")
    other = _write_hf_dir(tmp_path / "other", seed=0)  # SPEC: vocabulary 200, not tiny-llama's 128
    with pytest.raises(ValueError, match=r"--ref-load .*: the reference model has vocab_size 200, the policy's is "
                                         r"128"):
        _setup_with("--ref-load", other)
    (tmp_path / "torch_dist").mkdir()
    (tmp_path / "torch_dist" / "megatron_rl.json").write_text(json.dumps({"format": "torch_dist"}))
    with pytest.raises(ValueError, match=r"--ref-load .*: megatron_rl.json has no field 'hf_config'"):
        _setup_with("--ref-load", str(tmp_path / "torch_dist"))
    tiny = get_model_spec("tiny-llama")
    good = tmp_path / "good"
    good.mkdir()
    from helpers import random_hf_weights
    from safetensors.torch import save_file

    save_file(random_hf_weights(tiny), str(good / "model.safetensors"))
    (good / "config.json").write_text(json.dumps(tiny.to_hf_config()))
    assert _setup_with("--ref-load", str(good)).spec.weight_fields() == tiny.weight_fields()


def test_dry_run_counts_the_reference_weights(capsys):
    from megatron_rl.config.arguments import parse_args
    from megatron_rl.config.dry_run import dry_run, main

    flags = ["--config", "llama3-8b", "--rollout-num-replicas", "8"]
    plain = dry_run(parse_args(flags), 16)["memory_per_gpu"]["trainer"]
    with_kl = dry_run(parse_args([*flags, "--kl-coef", "0.01"]), 16)["memory_per_gpu"]["trainer"]
    assert plain["reference_gib"] == 0
    # the reference holds the trainer's shard in the training dtype: bf16, 2 bytes per parameter
    assert with_kl["reference_gib"] * 2**30 == with_kl["params"] * 2 == 4_015_263_744 * 2
    assert with_kl["total_gib"] == pytest.approx(plain["total_gib"] + with_kl["reference_gib"])
    main(parse_args([*flags, "--kl-coef", "0.01", "--world-size", "16"]))
    assert "KL reference weights 7.5" in capsys.readouterr().out


# ---- end to end: a run with the KL penalty, saved and resumed ------------------------------------------------------

@pytest.mark.slow
def test_a_run_with_a_kl_penalty_resumes_with_its_reference(tmp_path):
    """The real executors (trainer TP=2, one generator): the default reference is the starting policy (KL 0 at step
    1), the policy moves away from it (KL != 0 at step 2), and the resumed run's KL is again to that reference, not
    to a copy of the resumed policy (which would give exactly 0). The untrained model's rewards are all 0: k1, whose
    gradient is not 0 at pi = ref, moves the policy. The resumed step puts the KL in the reward."""
    from test_controller import _train

    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    metrics, _, _ = _train(out, "--train-iters", "2", "--async-mode", "off", "--kl-coef", "0.05", "--kl-loss-type",
                           "k1", "--save", str(ckpt), "--save-interval", "2")
    kl = [m["train"]["kl_ref"] for m in metrics]
    assert kl[0] == 0.0 and kl[1] != 0
    metrics, _, _ = _train(out, "--train-iters", "3", "--async-mode", "off", "--kl-coef", "0.05",
                           "--use-kl-in-reward", "--load", str(ckpt))
    assert [m["step"] for m in metrics] == [1, 2, 3] and metrics[2]["train"]["kl_ref"] != 0
