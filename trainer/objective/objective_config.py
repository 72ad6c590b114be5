"""What the loss computes: the objective's config, validated without torch.

Kept apart from `trainer.objective.loss` (which needs torch) so that run configs validate fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from trainer.choices import KL_TARGETS, REWARD_KL_POLICIES, TIS_LEVELS, TIS_MODES
from trainer.config_error import ConfigError
from trainer.objective import (
    advantages,
    estimators,
    kl_loss_ratios,
    loss_aggs,
    pg_ratios,
    placements,
    presets,
)


def _choice(key: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"objective.{key}", f"{value!r} is not one of {', '.join(choices)}")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _optional(key: str, value: object, check, what: str) -> None:
    """None, or a finite number that `check` accepts; else a ConfigError naming the key."""
    if value is not None and not (_number(value) and check(value)):
        raise ConfigError(f"objective.{key}", f"must be None or {what}, got {value!r}")


# The fields whose choices are registries, by field (kl_loss_agg, optional, is checked on its own).
REGISTRIES = {"estimator": estimators.REGISTRY, "placement": placements.REGISTRY, "advantage": advantages.REGISTRY,
              "loss_agg": loss_aggs.REGISTRY, "kl_loss_ratio": kl_loss_ratios.REGISTRY, "pg_ratio": pg_ratios.REGISTRY}


@dataclass(frozen=True)
class ObjectiveConfig:
    """What the loss computes. An invalid value raises a ConfigError (a ValueError) whose key names the field.

    estimator       k1 | k2 | k3 | full (see trainer.objective.estimators; full is the exact next-token KL
                    over the whole vocabulary, trainer.objective.full_kl)
    placement       none | reward | loss | reward+loss | reward-to-go | reward-to-go+loss |
                    reward-token: where beta x the estimate goes (trainer.objective.placements; the last three
                    put it into per-token rewards, returned or not, as the PPO-style libraries do)
    beta            KL coefficient, >= 0 (ignored for placement none)
    kl_to           the policy the KL pulls toward (docs/concepts/theory.md, "A KL to the behaviour policy"):
                    reference  pi_ref (the default: the KL of the papers)
                    behaviour  mu, the policy that sampled the batch (prime-rl's default, Kimi K2.5): a
                               trust region, in the loss only (placement loss), whose gradient vanishes
                               in expectation at pi = mu; exactly on-policy it adds noise or nothing
                    both       the reference's KL as configured, plus a KL to mu in the loss with its
                               own coefficient, behaviour_beta
                    The KL to mu uses the estimator (behaviour_estimator under both), kl_loss_ratio and the
                    KL clamps as configured (not full: no engine returns mu's whole next-token distribution)
    behaviour_beta  the coefficient of the KL to mu under kl_to both, >= 0 (kl_to behaviour uses beta;
                    ignored outside both, as beta is without a KL term)
    behaviour_estimator  the estimator of the KL to mu under kl_to both, when not `estimator` (k2: prime-rl's
                    trust region beside a reference KL estimated otherwise); a sampled one; ignored outside both
    reward_kl       whose log-probs the KL in the reward is computed from:
                    sampler  the policy that sampled the batch, once per batch, as verl does: a
                             reward does not change while the policy learns from it
                    current  the policy being updated, again for each minibatch (one forward pass
                             without gradient once the policy has moved): what exact
                             unbiasedness off-policy (pg_ratio sequence) needs, since with the
                             sampler mu's log-ratio the reward term's expected gradient is off by
                             beta x grad KL(pi || mu) (docs/full_kl.md)
                    the same on-policy (one minibatch, one epoch, no async)
    advantage       rloo (leave-one-out baseline) | grpo (group mean / std) | drgrpo (group mean) | reinforce
                    (none) | reinforce++ (group mean, then the minibatch's std) | reinforce-whiten, drgrpo-whiten
                    (no baseline or the group mean, then the per-token return, KL included, whitened over
                    the minibatch's tokens with the sample variance; -pop: the population variance;
                    docs/peers.md, "Whitening the return") (trainer.objective.advantages)
    grpo_scale      grpo only: divide by the group std (False gives Dr. GRPO's centring)
    loss_agg        how per-token losses become one number: seq-mean-token-sum | seq-mean-token-mean |
                    token-mean | seq-mean-token-sum-norm | seq-mean-token-sum-seq-len (trainer.objective.loss_aggs,
                    each one's docstring says what it computes; seq-mean-token-sum is the one under which the KL
                    identities are exact: docs/concepts/theory.md, "When the identities are exact")
    norm_length     the constant of seq-mean-token-sum-norm (e.g. the maximum response length)
    kl_loss_agg     how the KL-loss term's per-token values become one number, where it differs from the
                    policy gradient's: one of loss_agg's choices; None = loss_agg. SkyRL averages its KL
                    loss per response (seq-mean-token-mean) and its policy loss over tokens (token-mean)
    clip_eps        PPO ratio clipping to [1 - clip_eps, 1 + clip_eps_high]; None = no clipping
    clip_eps_high   upper clip (DAPO's clip-higher); None = clip_eps
    clip_ratio_c    dual-clip bound (Ye et al. 2020; verl's clip_ratio_c, typically 3): where the
                    advantage is negative, a token's policy-gradient loss is at most
                    clip_ratio_c x |A|, so a stale token with a huge ratio cannot blow the update
                    up; its gradient there is 0. None = off. > 1. On-policy (ratio 1) the identity;
                    off-policy it drops those tokens' gradient: biased, and with the KL in the
                    reward (which reaches the gradient through the advantages) so is the KL term
    kl_loss_ratio   off-policy importance weight on the KL loss term, rho = pi_theta / mu: none | detached |
                    differentiable | sequence | engine | score (trainer.objective.kl_loss_ratios, each one's
                    docstring says what it weighs and what that means on- and off-policy; engine needs
                    engine_logp)
    kl_loss_ratio_cap  truncates a detached KL-loss weight (kl_loss_ratio detached) at this value (>= 1, so
                    on-policy weights of 1 are untouched; OpenRLHF's unbiased_gradient: 10). None = exact
    pg_ratio        how the policy-gradient term corrects for samples of mu: token (PPO's per-token ratio,
                    what the RL libraries do) | sequence (the detached sequence ratio, exactly unbiased) |
                    dppo-tv, dppo-kl (DPPO's trust regions) (trainer.objective.pg_ratios, each one's docstring
                    says what it computes)
    ratio_cap, ratio_floor, ratio_mode  bound the token ratio rho_t = pi / mu before PPO's clip:
                    truncate  rho_t clamped to [ratio_floor, ratio_cap] (no gradient beyond; the Comedy
                              paper's prime-rl fork: [0, 8]; under dppo-*, the detached weight is
                              truncated: verl's clip_ratio_c)
                    mask      tokens whose rho_t leaves [ratio_floor, ratio_cap] contribute nothing
                              (IcePop as that fork runs it: [0.125, 8])
                    ratio_cap >= 1 (on-policy ratios of 1 are untouched), ratio_floor in (0, 1] (None = 0)
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
    tis_floor       the lower bound of those weights (OpenRLHF, slime, NeMo-RL): in (0, 1]. None = 0
    tis_mode        truncate  clamp the weight to [tis_floor, tis_cap]
                    mask      keep it where it lies in [tis_floor, tis_cap], 0 elsewhere (IcePop)
    tis_level       token      each token's own ratio
                    sequence   the product over the response, on every token (verl, SkyRL, TRL)
                    geometric  masks whole responses whose geometric-mean ratio leaves
                               [tis_floor, tis_cap], weighting the others' tokens by their own
                               ratios (OpenRLHF's and NeMo-RL's seq-mask-tis); tis_mode mask
    kl_log_ratio_clamp  clamps the log-ratio l to [-c, c] before the estimator (verl and SkyRL 20,
                    NeMo-RL 20, open-instruct 40); None = only the overflow bound (trainer.objective.kl)
    kl_value_clamp  clamps each token's estimate to [-v, v] (verl, SkyRL, NeMo-RL 10, OpenRLHF 10,
                    slime's low_var_kl 10); None = off. A clamp that binds has no gradient, which
                    changes what the configuration differentiates; stats count the clamped tokens.
                    Where the KL loss has a weight, the value clamp bounds the weighted term, and a
                    token whose log-ratio clamp binds gets no gradient through its weight either
                    (NeMo-RL, slime); k3+ keeps k2's unclamped gradient (verl)
    kl_target, kl_horizon  the adaptive coefficient of Ziegler et al. (verl, OpenRLHF, SkyRL): after
                    each step, beta *= 1 + clip(KL / kl_target - 1, -0.2, 0.2) * responses / kl_horizon,
                    KL the batch's mean per-token estimate (trainer.objective.kl_coefficient). Both or neither;
                    beta is the starting value
    ref_refresh_every  replace the reference by the policy every N steps (slime's
                    --ref-update-interval), or mix it in (TRL's sync_ref_model, open-instruct):
    ref_refresh_alpha  pi_ref <- alpha pi_theta + (1 - alpha) pi_ref, parameter by parameter; 1 = a
                    hard copy (trainer.objective.reference_refresh). The KL becomes a proximal term
    entropy_coef    an entropy bonus: minus entropy_coef x the aggregated exact next-token entropy
                    (over the vocabulary, differentiated with the prefix distribution held fixed)
    preset          the library default these values came from (trainer.objective.presets): a run config's
                    objective.preset fills in that preset's values under the keys given beside it
    """

    estimator: str = "k1"
    placement: str = "reward"
    beta: float = 0.05
    kl_to: str = "reference"
    behaviour_beta: float | None = None
    behaviour_estimator: str | None = None
    advantage: str = "rloo"
    grpo_scale: bool = True
    loss_agg: str = "seq-mean-token-sum"
    norm_length: int | None = None
    kl_loss_agg: str | None = None
    clip_eps: float | None = None
    clip_eps_high: float | None = None
    clip_ratio_c: float | None = None
    kl_loss_ratio: str = "none"
    kl_loss_ratio_cap: float | None = None
    tis_cap: float | None = None
    pg_ratio: str = "token"
    sequence_ratio_cap: float | None = None
    ratio_cap: float | None = None
    ratio_floor: float | None = None
    ratio_mode: str = "truncate"
    reward_kl: str = "sampler"
    tis_floor: float | None = None
    tis_mode: str = "truncate"
    tis_level: str = "token"
    kl_log_ratio_clamp: float | None = None
    kl_value_clamp: float | None = None
    kl_target: float | None = None
    kl_horizon: int | None = None
    ref_refresh_every: int | None = None
    ref_refresh_alpha: float = 1.0
    entropy_coef: float = 0.0
    preset: str | None = None

    def __post_init__(self) -> None:
        for key, registry in REGISTRIES.items():  # what is registered now
            _choice(key, getattr(self, key), registry.names)
        _choice("reward_kl", self.reward_kl, REWARD_KL_POLICIES)
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)):
            raise ConfigError("objective.beta", f"must be a number, got {self.beta!r}")
        if not self.beta >= 0 or self.beta == float("inf"):
            raise ConfigError("objective.beta", f"must be a finite number >= 0, got {self.beta}")
        if self.kl_loss_agg is not None:
            _choice("kl_loss_agg", self.kl_loss_agg, loss_aggs.REGISTRY.names)
        for agg in self._norm_length_readers(self.kl_loss_agg):
            if not isinstance(self.norm_length, int) or self.norm_length < 1:
                raise ConfigError(
                    "objective.norm_length", f"{agg} needs a positive "
                    f"integer norm_length (e.g. the maximum response length), got {self.norm_length!r}"
                )
        for key in ("clip_eps", "clip_eps_high"):
            value = getattr(self, key)
            if value is not None and not (isinstance(value, (int, float)) and 0 < value):
                raise ConfigError(f"objective.{key}", f"must be None or a number > 0, got {value!r}")
        if self.tis_cap is not None and not (isinstance(self.tis_cap, (int, float)) and self.tis_cap >= 1):
            raise ConfigError("objective.tis_cap", f"must be None or a number >= 1, got {self.tis_cap!r}")
        c = self.clip_ratio_c
        if c is not None and not (isinstance(c, (int, float)) and not isinstance(c, bool) and c > 1):
            raise ConfigError("objective.clip_ratio_c", f"must be None or a number > 1, got {self.clip_ratio_c!r}")
        if self.clip_eps is not None and self.clip_eps >= 1:
            raise ConfigError("objective.clip_eps", f"must be < 1, got {self.clip_eps}")
        if self.clip_eps_high is not None and self.clip_eps is None:
            raise ConfigError("objective.clip_eps_high", "set clip_eps too (clip_eps_high only widens it)")
        if pg_ratios.REGISTRY[self.pg_ratio].trust_region:
            if self.clip_eps is None:
                raise ConfigError("objective.clip_eps", f"pg_ratio {self.pg_ratio} drops the tokens that leave its "
                                  "trust region, whose width clip_eps gives (prime-rl and verl: 0.2)")
            if self.clip_ratio_c is not None:
                raise ConfigError("objective.clip_ratio_c", f"is PPO's dual clip, and pg_ratio {self.pg_ratio} bounds "
                                  "the policy by its own trust region (clip_eps); verl's clip_ratio_c under DPPO "
                                  "truncates the ratio's weight: set ratio_cap")
        if pg_ratios.REGISTRY[self.pg_ratio].sequence:
            for key in ("clip_ratio_c", "ratio_cap"):
                if getattr(self, key) is not None:
                    raise ConfigError(f"objective.{key}", f"bounds token ratios, and pg_ratio {self.pg_ratio} "
                                     "weights whole sequences; clip them with clip_eps or truncate them with "
                                     "sequence_ratio_cap")
        self._check_ratio_bounds()
        self._check_kl_loss_ratio_cap()
        self._check_kl_to()
        cap = self.sequence_ratio_cap
        if cap is not None and not (isinstance(cap, (int, float)) and not isinstance(cap, bool) and cap >= 1):
            raise ConfigError("objective.sequence_ratio_cap", f"must be None or a number >= 1, got {cap!r}")
        self._check_peers_keys()

    def _check_ratio_bounds(self) -> None:
        _optional("ratio_cap", self.ratio_cap, lambda v: v >= 1, "a number >= 1")
        _optional("ratio_floor", self.ratio_floor, lambda v: 0 < v <= 1, "a number in (0, 1]")
        _choice("ratio_mode", self.ratio_mode, TIS_MODES)
        if self.ratio_cap is None and (self.ratio_floor is not None or self.ratio_mode != "truncate"):
            key = "ratio_floor" if self.ratio_floor is not None else "ratio_mode"
            raise ConfigError(f"objective.{key}", "shapes the bounds of the token ratio; set ratio_cap too")

    def _check_kl_loss_ratio_cap(self) -> None:
        _optional("kl_loss_ratio_cap", self.kl_loss_ratio_cap, lambda v: v >= 1, "a number >= 1")
        if self.kl_loss_ratio_cap is not None and not kl_loss_ratios.REGISTRY[self.kl_loss_ratio].truncatable:
            raise ConfigError("objective.kl_loss_ratio_cap", f"truncates a detached token weight (kl_loss_ratio "
                              f"detached), not kl_loss_ratio {self.kl_loss_ratio}'s; sequence weights have "
                              "sequence_ratio_cap")

    def _check_kl_to(self) -> None:
        """The combinations of kl_to that mean something; each refusal says why the others do not."""
        _choice("kl_to", self.kl_to, KL_TARGETS)
        if self.kl_to == "both":
            if not (_number(self.behaviour_beta) and self.behaviour_beta >= 0):
                raise ConfigError("objective.behaviour_beta", "kl_to both needs the coefficient of the KL to the "
                                  f"behaviour policy: a finite number >= 0, got {self.behaviour_beta!r}")
        elif self.behaviour_beta is not None:  # inert outside kl_to both (a study crosses kl_to with it), but a number
            _optional("behaviour_beta", self.behaviour_beta, lambda v: v >= 0, "a number >= 0")
        if self.behaviour_estimator is not None:
            _choice("behaviour_estimator", self.behaviour_estimator, estimators.REGISTRY.names)
            mine, theirs = (estimators.REGISTRY[name] for name in (self.behaviour_estimator, self.estimator))
            if (self.kl_to == "both" and kl_loss_ratios.REGISTRY[self.kl_loss_ratio].sequence
                    and mine.token_dependent != theirs.token_dependent):
                raise ConfigError("objective.behaviour_estimator", f"weighs its terms by prefix ratios other than "
                                  f"{self.estimator}'s (kl_loss_ratio {self.kl_loss_ratio}); use an estimator like it")
        if self.kl_to == "reference" or self.placement == "none":
            return
        if self.kl_to == "behaviour" and self.placement != "loss":
            raise ConfigError("objective.placement", f"{self.placement}: a KL to the behaviour policy (kl_to "
                              "behaviour) goes in the loss: in the reward it is a constant of the batch (under the "
                              "sampler's log-probs, log mu/mu = 0 on every token). Use placement loss, or kl_to "
                              f"both to keep the reference's KL in the {self.placement}")
        if estimators.REGISTRY[self.behaviour_kl_estimator].inputs == estimators.FULL:
            key = "behaviour_estimator" if self.behaviour_kl_estimator != self.estimator else "estimator"
            raise ConfigError(f"objective.{key}", f"{self.behaviour_kl_estimator} needs the whole next-token "
                              f"distribution of the policy the KL pulls toward, and kl_to {self.kl_to} pulls toward "
                              "mu, whose distribution no engine returns; use a sampled estimator (k1, k2, k3)"
                              + ("" if self.kl_to == "behaviour" else ", or behaviour_estimator for mu's alone"))
        if self.kl_to == "behaviour":
            for key in ("kl_target", "ref_refresh_every"):
                if getattr(self, key) is not None:
                    raise ConfigError(f"objective.{key}", "acts on the KL to the reference, and kl_to behaviour "
                                      "has none; use kl_to both")

    def _check_peers_keys(self) -> None:
        """The settings that reproduce the RL libraries (docs/peers.md)."""
        _choice("tis_mode", self.tis_mode, TIS_MODES)
        _choice("tis_level", self.tis_level, TIS_LEVELS)
        _optional("tis_floor", self.tis_floor, lambda v: 0 < v <= 1, "a number in (0, 1]")
        if self.tis_cap is None:
            for key, default in (("tis_floor", None), ("tis_mode", "truncate"), ("tis_level", "token")):
                if getattr(self, key) != default:
                    raise ConfigError(f"objective.{key}", "shapes the engine weights of tis_cap; set tis_cap too")
        if self.tis_level == "geometric" and self.tis_mode != "mask":
            raise ConfigError("objective.tis_level", "geometric masks whole responses by their geometric-mean "
                             "ratio; set tis_mode mask")
        for key in ("kl_log_ratio_clamp", "kl_value_clamp"):
            _optional(key, getattr(self, key), lambda v: v > 0, "a number > 0")
            if getattr(self, key) is not None and estimators.REGISTRY[self.estimator].inputs == estimators.FULL:
                raise ConfigError(f"objective.{key}", f"clamps a sampled token's log-ratio or estimate, and "
                                 f"estimator {self.estimator} has none")
        _optional("kl_target", self.kl_target, lambda v: v > 0, "a number > 0 (nats per token)")
        horizon = self.kl_horizon
        if horizon is not None and not (isinstance(horizon, int) and not isinstance(horizon, bool) and horizon >= 1):
            raise ConfigError("objective.kl_horizon", f"must be None or an integer >= 1, got {horizon!r}")
        if (self.kl_target is None) != (horizon is None):
            missing = "kl_horizon" if horizon is None else "kl_target"
            raise ConfigError(f"objective.{missing}", "the adaptive coefficient needs both kl_target and "
                              "kl_horizon (verl's defaults: 0.1 and 10000)")
        every = self.ref_refresh_every
        if every is not None and not (isinstance(every, int) and not isinstance(every, bool) and every >= 1):
            raise ConfigError("objective.ref_refresh_every", f"must be None or an integer >= 1 (steps between "
                             f"refreshes of the reference), got {every!r}")
        if not (_number(self.ref_refresh_alpha) and 0 < self.ref_refresh_alpha <= 1):
            raise ConfigError("objective.ref_refresh_alpha", f"must be in (0, 1] (1: a hard copy), got "
                             f"{self.ref_refresh_alpha!r}")
        if every is None and self.ref_refresh_alpha != 1:
            raise ConfigError("objective.ref_refresh_alpha", "mixes the policy into the reference every "
                             "ref_refresh_every steps; set ref_refresh_every too")
        if not (_number(self.entropy_coef) and self.entropy_coef >= 0):
            raise ConfigError("objective.entropy_coef", f"must be a finite number >= 0, got {self.entropy_coef!r}")
        if self.preset is not None:
            _choice("preset", self.preset, presets.REGISTRY.names)

    @classmethod
    def of_preset(cls, name: str, **overrides: Any) -> "ObjectiveConfig":
        """The objective of preset `name`, with `overrides` (beta, the advantage, ...) on top."""
        return cls(**presets.expand({"preset": name, **overrides}))

    @property
    def kl_in_reward(self) -> bool:
        return placements.REGISTRY[self.placement].in_reward

    @property
    def kl_in_loss(self) -> bool:
        return placements.REGISTRY[self.placement].in_loss

    @property
    def reference_kl_in_loss(self) -> bool:
        """Whether the loss holds a KL to the reference (its placement's, unless kl_to is behaviour alone)."""
        return self.kl_in_loss and self.kl_to != "behaviour"

    @property
    def behaviour_kl_beta(self) -> float | None:
        """The coefficient of the loss's KL to the behaviour policy mu (kl_to behaviour or both), None without one."""
        if self.placement == "none" or self.kl_to == "reference":
            return None
        return self.beta if self.kl_to == "behaviour" else self.behaviour_beta

    @property
    def behaviour_kl_estimator(self) -> str:
        """The estimator of the KL to mu: behaviour_estimator under kl_to both, else estimator."""
        return self.behaviour_estimator if self.kl_to == "both" and self.behaviour_estimator else self.estimator

    @property
    def any_kl_in_loss(self) -> bool:
        """Whether the loss holds a KL term at all (to the reference, to mu, or both): what reads kl_loss_ratio and
        kl_loss_agg."""
        return self.kl_in_loss or self.behaviour_kl_beta is not None

    @property
    def kl_in_token_rewards(self) -> bool:
        """Whether the KL in the reward is per token ([B, T]: reward-to-go, reward-token)."""
        return placements.REGISTRY[self.placement].per_token_reward

    @property
    def needs_engine_logp(self) -> bool:
        """Whether the loss reads the rollout engine's own log-probs (tis_cap, or the engine ratio)."""
        return self.tis_cap is not None or (self.any_kl_in_loss
                                            and kl_loss_ratios.REGISTRY[self.kl_loss_ratio].needs_engine_logp)

    @property
    def needs_prompt_lengths(self) -> bool:
        """Whether the loss reads each row's prompt length: an aggregation (loss_agg, or kl_loss_agg where the KL is
        in the loss) that divides by the whole sequence's length."""
        return any(agg is not None and loss_aggs.REGISTRY[agg].needs_prompt_lengths
                   for agg in (self.loss_agg, self.kl_loss_agg if self.any_kl_in_loss else None))

    @property
    def reads_sequence_ratios(self) -> bool:
        """Whether the loss weights by sequence or prefix ratios (the policy gradient's, or the KL loss's)."""
        return pg_ratios.REGISTRY[self.pg_ratio].sequence or (
            self.any_kl_in_loss and kl_loss_ratios.REGISTRY[self.kl_loss_ratio].sequence)

    @property
    def adaptive(self) -> bool:
        """Whether beta adapts to a target KL as the run trains (kl_target, kl_horizon)."""
        return self.kl_target is not None and self.placement != "none"

    @property
    def needs_full_kl(self) -> bool:
        """Whether the loss needs the exact KL over the vocabulary (an estimator with inputs "full")."""
        return self.placement != "none" and estimators.REGISTRY[self.estimator].inputs == estimators.FULL

    def inert_fields(self) -> frozenset[str]:
        """The fields this objective never reads: without a KL term its estimator, beta, ratio and kl_to;
        behaviour_beta and behaviour_estimator outside kl_to both;
        with the KL only in the reward, the KL loss term's ratio and its cap; without it in the reward, reward_kl;
        the engine weights' shape without tis_cap; grpo_scale outside grpo;
        norm_length outside its aggregation; sequence_ratio_cap without a sequence ratio. A study crosses an axis
        only where it is not inert, so that no two of its runs compute the same thing."""
        inert = set()
        if self.placement == "none":
            inert |= {"estimator", "beta", "kl_log_ratio_clamp", "kl_value_clamp", "kl_target", "kl_horizon",
                      "ref_refresh_every", "ref_refresh_alpha", "kl_to"}
        if self.kl_to != "both" or self.placement == "none":
            inert |= {"behaviour_beta", "behaviour_estimator"}
        if self.tis_cap is None:
            inert |= {"tis_floor", "tis_mode", "tis_level"}
        if self.ref_refresh_every is None:
            inert.add("ref_refresh_alpha")
        if not self.any_kl_in_loss:
            inert |= {"kl_loss_ratio", "kl_loss_ratio_cap"}
        if not self.kl_in_reward:
            inert.add("reward_kl")
        if not advantages.REGISTRY[self.advantage].scaled:
            inert.add("grpo_scale")
        if not self.any_kl_in_loss:
            inert.add("kl_loss_agg")
        if not self._norm_length_readers(self.kl_loss_agg if self.any_kl_in_loss else None):
            inert.add("norm_length")
        if self.ratio_cap is None:
            inert |= {"ratio_floor", "ratio_mode"}
        if not self.reads_sequence_ratios:
            inert.add("sequence_ratio_cap")
        return frozenset(inert)

    def _norm_length_readers(self, kl_loss_agg: str | None) -> list[str]:
        """The aggregations among loss_agg and `kl_loss_agg` that read norm_length."""
        return [agg for agg in dict.fromkeys((self.loss_agg, kl_loss_agg))
                if agg is not None and loss_aggs.REGISTRY[agg].needs_norm_length]

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))
