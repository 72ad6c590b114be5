"""What the loss computes: the objective's config, validated without torch.

Kept apart from `trainer.objective` (which needs torch) so that run configs validate fast.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from trainer import advantages, estimators, placements
from trainer.choices import KL_LOSS_RATIOS, LOSS_AGGS, PG_RATIOS, REWARD_KL_POLICIES


def _choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"ObjectiveConfig.{key}: {value!r} is not one of {', '.join(choices)}")


@dataclass(frozen=True)
class ObjectiveConfig:
    """What the loss computes. Invalid values raise ValueError naming the field.

    estimator       k1 | k2 | k3 | full (see trainer.estimators; full is the exact next-token KL
                    over the whole vocabulary, trainer.full_kl)
    placement       none | reward | loss | reward+loss: where beta x the estimate goes
    beta            KL coefficient, >= 0 (ignored for placement none)
    reward_kl       whose log-probs the KL in the reward is computed from:
                    sampler  the policy that sampled the batch, once per batch, as verl does: a
                             reward does not change while the policy learns from it
                    current  the policy being updated, again for each minibatch (one forward pass
                             without gradient once the policy has moved): what exact
                             unbiasedness off-policy (pg_ratio sequence) needs, since with the
                             sampler mu's log-ratio the reward term's expected gradient is off by
                             beta x grad KL(pi || mu) (docs/full_kl.md)
                    the same on-policy (one minibatch, one epoch, no async)
    advantage       rloo | grpo | drgrpo | reinforce | reinforce++ (see trainer.advantages;
                    reinforce++ normalises over the whole minibatch)
    grpo_scale      grpo only: divide by the group std (False gives Dr. GRPO's centring)
    loss_agg        how per-token losses become one number:
                    seq-mean-token-sum       mean over responses of their token sums (the
                                             aggregation under which KL_THEORY.md's identities
                                             are exact)
                    seq-mean-token-mean      mean over responses of their token means
                    token-mean               mean over every response token of the batch
                    seq-mean-token-sum-norm  token sums divided by the fixed `norm_length`
                                             (Dr. GRPO), then the mean over responses
    norm_length     the constant of seq-mean-token-sum-norm (e.g. the maximum response length)
    clip_eps        PPO ratio clipping to [1 - clip_eps, 1 + clip_eps_high]; None = no clipping
    clip_eps_high   upper clip (DAPO's clip-higher); None = clip_eps
    clip_ratio_c    dual-clip bound (Ye et al. 2020; verl's clip_ratio_c, typically 3): where the
                    advantage is negative, a token's policy-gradient loss is at most
                    clip_ratio_c x |A|, so a stale token with a huge ratio cannot blow the update
                    up; its gradient there is 0. None = off. > 1. On-policy (ratio 1) the identity;
                    off-policy it drops those tokens' gradient: biased, and with the KL in the
                    reward (which reaches the gradient through the advantages) so is the KL term
    kl_loss_ratio   off-policy importance weight on the KL loss term, rho = pi_theta / mu:
                    none            beta * k                (ignores the behaviour policy)
                    detached        beta * sg(rho) * k      on-policy meaning under samples of
                                                            mu, token level; on-policy a no-op
                    differentiable  beta * rho * k          DeepSeek-V3.2 / TRL
                                                            use_bias_correction_kl; NOT a no-op
                                                            on-policy (turns k3 into k2)
                    sequence        beta * sg(w_t) * k_t    w_t = prod_{u<=t} rho_u, the prefix
                                                            ratio: exactly the on-policy meaning
                                                            for any length (token ratios are not)
    pg_ratio        how the policy-gradient term corrects for samples of mu:
                    token           PPO's per-token ratio rho_t (clipped with clip_eps): what the
                                    RL libraries do; biased for responses of more than one token
                    sequence        the detached sequence ratio w = pi(y) / mu(y) on every token's
                                    score, sg(w) * A * grad log pi_t: exactly unbiased (REINFORCE
                                    with importance sampling) when the advantage's baseline is a
                                    mean of rewards (not grpo's std scaling). No clip_eps /
                                    clip_ratio_c (they clip token ratios): bound the weights with
                                    sequence_ratio_cap
    sequence_ratio_cap  truncates the sequence and prefix ratios at this value (>= 1, so on-policy
                    weights of 1 are untouched): bounds their variance, which grows with the
                    response length, at the price of bias wherever a weight is cut. None = exact
    tis_cap         truncated importance sampling of the policy-gradient term against the
                    rollout engine: each token's term is weighted by
                    sg(min(pi_old / mu_engine, tis_cap)), where mu_engine is the distribution the
                    engine really sampled from and pi_old the trainer's own log-probs of the
                    policy that sampled (pi_theta itself on-policy). None = off. The identity
                    when the engine is exact (weight 1); >= 1, so an exact engine is never
                    down-weighted (verl, slime and OpenRLHF ship this correction)
    """

    estimator: str = "k1"
    placement: str = "reward"
    beta: float = 0.05
    advantage: str = "rloo"
    grpo_scale: bool = True
    loss_agg: str = "seq-mean-token-sum"
    norm_length: int | None = None
    clip_eps: float | None = None
    clip_eps_high: float | None = None
    clip_ratio_c: float | None = None
    kl_loss_ratio: str = "none"
    tis_cap: float | None = None
    pg_ratio: str = "token"
    sequence_ratio_cap: float | None = None
    reward_kl: str = "sampler"

    def __post_init__(self) -> None:
        for key, registry in (("estimator", estimators.REGISTRY), ("placement", placements.REGISTRY),
                              ("advantage", advantages.REGISTRY)):  # what is registered now
            _choice(key, getattr(self, key), registry.names)
        _choice("loss_agg", self.loss_agg, LOSS_AGGS)
        _choice("kl_loss_ratio", self.kl_loss_ratio, KL_LOSS_RATIOS)
        _choice("pg_ratio", self.pg_ratio, PG_RATIOS)
        _choice("reward_kl", self.reward_kl, REWARD_KL_POLICIES)
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)):
            raise ValueError(f"ObjectiveConfig.beta: must be a number, got {self.beta!r}")
        if not self.beta >= 0 or self.beta == float("inf"):
            raise ValueError(f"ObjectiveConfig.beta: must be a finite number >= 0, got {self.beta}")
        if self.loss_agg == "seq-mean-token-sum-norm":
            if not isinstance(self.norm_length, int) or self.norm_length < 1:
                raise ValueError(
                    "ObjectiveConfig.norm_length: seq-mean-token-sum-norm needs a positive "
                    f"integer norm_length (e.g. the maximum response length), got {self.norm_length!r}"
                )
        for key in ("clip_eps", "clip_eps_high"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value):
                raise ValueError(f"ObjectiveConfig.{key}: must be None or a number > 0, got {value!r}")
        if self.tis_cap is not None and not (isinstance(self.tis_cap, (int, float)) and self.tis_cap >= 1):
            raise ValueError(f"ObjectiveConfig.tis_cap: must be None or a number >= 1, got {self.tis_cap!r}")
        c = self.clip_ratio_c
        if c is not None and not (isinstance(c, (int, float)) and not isinstance(c, bool) and c > 1):
            raise ValueError(f"ObjectiveConfig.clip_ratio_c: must be None or a number > 1, got {self.clip_ratio_c!r}")
        if self.clip_eps is not None and self.clip_eps >= 1:
            raise ValueError(f"ObjectiveConfig.clip_eps: must be < 1, got {self.clip_eps}")
        if self.clip_eps_high is not None and self.clip_eps is None:
            raise ValueError("ObjectiveConfig.clip_eps_high: set clip_eps too (clip_eps_high only widens it)")
        if self.pg_ratio == "sequence":
            for key in ("clip_eps", "clip_ratio_c"):
                if getattr(self, key) is not None:
                    raise ValueError(f"ObjectiveConfig.{key}: clips token ratios, and pg_ratio sequence weights whole "
                                     "sequences; bound those weights with sequence_ratio_cap instead")
        cap = self.sequence_ratio_cap
        if cap is not None and not (isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap >= 1):
            raise ValueError(f"ObjectiveConfig.sequence_ratio_cap: must be None or a number >= 1, got {cap!r}")

    @property
    def kl_in_reward(self) -> bool:
        return placements.REGISTRY[self.placement].in_reward

    @property
    def kl_in_loss(self) -> bool:
        return placements.REGISTRY[self.placement].in_loss

    @property
    def needs_full_kl(self) -> bool:
        """Whether the loss needs the exact KL over the vocabulary (an estimator with inputs "full")."""
        return self.placement != "none" and estimators.REGISTRY[self.estimator].inputs == estimators.FULL

    def inert_fields(self) -> frozenset[str]:
        """The fields this objective never reads: without a KL term its estimator, beta and ratio;
        with the KL only in the reward, the KL loss term's ratio; without it in the reward, reward_kl;
        grpo_scale outside grpo;
        norm_length outside its aggregation; sequence_ratio_cap without a sequence ratio. A study crosses an axis
        only where it is not inert, so that no two of its runs compute the same thing."""
        inert = set()
        if self.placement == "none":
            inert |= {"estimator", "beta"}
        if not self.kl_in_loss:
            inert.add("kl_loss_ratio")
        if not self.kl_in_reward:
            inert.add("reward_kl")
        if not advantages.REGISTRY[self.advantage].scaled:
            inert.add("grpo_scale")
        if self.loss_agg != "seq-mean-token-sum-norm":
            inert.add("norm_length")
        if self.pg_ratio != "sequence" and (self.kl_loss_ratio != "sequence" or not self.kl_in_loss):
            inert.add("sequence_ratio_cap")
        return frozenset(inert)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
