"""The RL algorithm of a run as one value: the loss and its hyperparameters, the aggregation, the KL penalty, the
entropy bonus and the sampling temperature the trainer recomputes log-probs at. Built from the flags
(`AlgorithmConfig.from_args`) or directly; it checks itself, naming the flags."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

from megatron_rl.algorithms.aggregation import AGGREGATIONS
from megatron_rl.algorithms.kl import KL_ESTIMATORS
from megatron_rl.algorithms.losses import LOSSES, hyperparameters


@dataclasses.dataclass(frozen=True)
class AlgorithmConfig:
    loss: str = "aipo"
    # The loss's hyperparameters by name (`Hyperparameter.name`); the ones left out take their defaults. Read them
    # as `params.<name>`.
    loss_params: Mapping[str, float | None] = dataclasses.field(default_factory=dict)
    aggregation: str = "token-mean"
    kl_coef: float = 0.0  # weight of the KL to the reference policy (0: no reference)
    kl_estimator: str = "k3"  # --kl-loss-type
    kl_in_reward: bool = False  # True: the KL was subtracted from the rewards; the loss only reports it
    entropy_coef: float = 0.0
    temperature: float = 1.0
    # seq-sum-constant's divisor per sequence (--rollout-max-response-len); None: the batch's padded width
    seq_sum_constant: float | None = None

    def __post_init__(self):
        for flag, value, registry in (("--loss", self.loss, LOSSES), ("--loss-aggregation", self.aggregation,
                                                                        AGGREGATIONS)):
            if value not in registry:
                raise ValueError(f"{flag} {value!r} is unknown; choose one of {sorted(registry)}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"--kl-loss-type {self.kl_estimator!r} is unknown; choose one of {list(KL_ESTIMATORS)}")
        if self.kl_coef < 0:
            raise ValueError(f"--kl-coef must be >= 0, got {self.kl_coef}")
        if self.temperature <= 0:
            raise ValueError(f"--rollout-temperature must be > 0 for training, got {self.temperature}")
        loss = LOSSES[self.loss]
        declared = {h.name: h for h in loss.hyperparameters}
        unknown = sorted(set(self.loss_params) - set(declared))
        if unknown:
            raise ValueError(f"--loss {self.loss} has no hyperparameter {', '.join(unknown)} (it has: "
                             f"{', '.join(declared) or 'none'})")
        params = {name: self.loss_params.get(name, h.default) for name, h in declared.items()}
        for name, h in declared.items():
            problem = h.problem(params[name])
            if problem:
                raise ValueError(problem)
        object.__setattr__(self, "loss_params", types.MappingProxyType(params))
        problem = loss.check(self.params) if loss.check else None
        if problem:
            raise ValueError(problem)

    @property
    def params(self) -> types.SimpleNamespace:
        """The loss's hyperparameters as attributes (what its compute function reads)."""
        return types.SimpleNamespace(**self.loss_params)

    @classmethod
    def from_args(cls, args) -> AlgorithmConfig:
        """The algorithm the flags describe. A hyperparameter that is off unless given (default None) may be given
        only with a loss that uses it; the error names the flag and those losses."""
        flags = hyperparameters()
        for flag, (h, users) in flags.items():
            if h.default is None and getattr(args, h.dest) is not None and args.loss not in users:
                raise ValueError(f"{flag} applies to --loss {', '.join(sorted(users))}, not {args.loss}")
        params = {h.name: getattr(args, h.dest) for h in LOSSES[args.loss].hyperparameters}
        return cls(loss=args.loss, loss_params=params, aggregation=args.loss_aggregation, kl_coef=args.kl_coef,
                   kl_estimator=args.kl_loss_type, kl_in_reward=args.use_kl_in_reward, entropy_coef=args.entropy_coef,
                   temperature=args.rollout_temperature, seq_sum_constant=args.rollout_max_response_len)
