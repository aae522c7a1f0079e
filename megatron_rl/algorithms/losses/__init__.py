"""The policy losses by name: the registry behind --loss, and the flags of their hyperparameters.

mu is the behavior policy (the log-probs the generator sampled with), pi the policy being trained, A the advantage,
sg a stop-gradient; all per token:
- aipo (the default): -sg(min(pi/mu, rho)) A log pi (aipo.py); aipo-clamp: -clamp(pi/mu, max=rho) A;
- reinforce: -A log pi, no correction (reinforce.py); icepop: -sg(pi/mu) A log pi where low <= pi/mu <= high,
  0 outside; cispo: -sg(clip(pi/mu, 1 - eps_low, 1 + eps_high)) A log pi;
- ppo: PPO's clipped surrogate of pi/mu, optionally dual-clipped (ppo.py); tis: the surrogate of pi/pi_prox times
  sg(min(pi_prox/mu, C)); decoupled-ppo: the surrogate of pi/pi_prox times sg(pi_prox/mu), masked above a cap;
- gspo: the clipped surrogate of each sequence's geometric-mean ratio, in GSPO-token form (gspo.py).

pi_prox, the proximal policy, is the policy at the start of the optimizer step (`LossInputs.proximal_logprobs`; the
current log-probs held constant when None). The trainer takes exactly one optimizer step per rollout batch, so
pi_prox is the current policy and pi/pi_prox = 1: tis reduces to a truncated importance weight, the same gradient
as aipo with rho = the tis clip, and decoupled-ppo to a masked behavior weight, the same gradient as icepop with
bounds [0, cap].

Every entry turns one micro-batch's log-probs into an aggregated loss and its statistics: per-token boolean
indicators of what it did to each valid token (clip_high, clip_low, dual_clip, tis_clip, masked), which the
trainer reports as the fractions `<name>_fraction` of the valid tokens of the batch. A new loss is a file that
declares its hyperparameters with their flags and one line in `LOSSES`; --loss offers it, the parser takes its
flags and the run checks their ranges at start. For example:

    # my_loss.py
    RHO = Hyperparameter("rho", "--my-rho", 4.0, "my clip", lambda v: v > 0, "must be > 0")

    def my_loss(x: LossInputs, p):
        ratio = torch.exp(x.logprobs.detach() - x.behavior_logprobs)
        per_token = -ratio.clamp(max=p.rho) * x.advantages[:, None] * x.logprobs
        return aggregate(per_token, x.loss_mask, **x.aggregation), {"clip_high": ratio > p.rho}

    MY_LOSS = Loss(my_loss, (RHO,), "AIPO written again")

    # here
    "my-loss": my_loss.MY_LOSS,
"""

from __future__ import annotations

from megatron_rl.algorithms.losses import aipo, gspo, ppo, reinforce, sft
from megatron_rl.algorithms.losses.base import Hyperparameter, Indicators, Loss, LossInputs

LOSSES: dict[str, Loss] = {
    "aipo": aipo.AIPO,
    "aipo-clamp": aipo.AIPO_CLAMP,
    "reinforce": reinforce.REINFORCE,
    "ppo": ppo.PPO,
    "tis": ppo.TIS,
    "icepop": reinforce.ICEPOP,
    "gspo": gspo.GSPO,
    "cispo": reinforce.CISPO,
    "decoupled-ppo": ppo.DECOUPLED_PPO,
    "sft": sft.SFT,
}


def policy_losses() -> list[str]:
    """The names --loss offers (every registered RL loss), sorted."""
    return sorted(name for name, loss in LOSSES.items() if loss.policy_gradient)


def hyperparameters() -> dict[str, tuple[Hyperparameter, list[str]]]:
    """Every registered loss hyperparameter by flag, with the losses that use it. One flag is one object: a second
    declaration of the same flag is a registry error."""
    out: dict[str, tuple[Hyperparameter, list[str]]] = {}
    for name, loss in LOSSES.items():
        for h in loss.hyperparameters:
            known, users = out.setdefault(h.flag, (h, []))
            if known is not h:
                raise RuntimeError(f"loss {name!r} declares {h.flag} again: share the first declaration")
            users.append(name)
    return out


def add_loss_arguments(group) -> None:
    """--loss (choices and help from the registry) and every loss's hyperparameter flags, into an argparse group."""
    summaries = "; ".join(f"{name}: {LOSSES[name].summary}" for name in policy_losses())
    group.add_argument("--loss", choices=policy_losses(), default="aipo",
                       help=f"mu: the behavior policy, pi: the trained one, per token. {summaries}. pi_prox, the "
                            "policy at the start of the step, is the current policy (one optimizer step per batch)")
    for flag, (h, _) in hyperparameters().items():
        group.add_argument(flag, type=float, default=h.default, help=h.help)


__all__ = ["LOSSES", "Hyperparameter", "Indicators", "Loss", "LossInputs", "add_loss_arguments", "hyperparameters",
           "policy_losses"]
