"""Each RL library's default KL configuration, as a named objective: one registration each.

A preset sets what the library decides about the KL term: the estimator, where it goes, its clamps,
the weight on the KL loss and its aggregation, the coefficient, and the mismatch correction where the
library turns one on by default; and, where the KL's meaning depends on them, the advantage (the
libraries that put the KL in per-token rewards whiten it with the return) and the policy gradient's ratio
(TRL's RLOO clips a sequence ratio). Everything else (the advantage elsewhere, the aggregation, PPO's
clip) stays the run's own, so that presets compare on one footing; `notes` says where the library's own
choice differs. The Comedy paper's own runs (`paper-*`) set their whole objective, and the one run key outside it
that their objective depends on: mu's log-probs come from the trainer (`rollout`: recompute_logprobs). Every fact
was read
from the source at the commit given (`source`); docs/peers.md has the table and what each preset's
gradient is (`python -m trainer audit --presets`).

In a run config, `objective: {preset: verl, beta: 0.1}` is verl's configuration at beta 0.1: the
preset's values fill in the keys not given beside it, and `preset` stays in the config as a label; its
`rollout` values fill in the rollout keys the run config does not give (`run_defaults`).
In Python, `ObjectiveConfig.of_preset("verl", beta=0.1)`. Free of torch, and of the config it fills in
(`trainer.objective.objective_config` reads the names here, never the other way round).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from trainer.config_error import ConfigError
from trainer.objective.registry import Registry


@dataclass(frozen=True)
class Source:
    """Where a preset's facts were read: a repository at a commit, and the files."""

    repo: str
    commit: str
    files: tuple[str, ...]

    @property
    def cite(self) -> str:
        return f"{self.repo}@{self.commit[:8]}: {', '.join(self.files)}"


@dataclass(frozen=True)
class Preset:
    name: str
    library: str
    settings: str                  # how the library spells this configuration
    values: Mapping[str, Any]      # ObjectiveConfig fields
    source: Source
    notes: str = ""                # where the library's computation differs from the preset's
    rollout: Mapping[str, Any] = field(default_factory=dict)  # RolloutConfig fields the library decides too
    keys: tuple[str, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))
        object.__setattr__(self, "rollout", MappingProxyType(dict(self.rollout)))
        object.__setattr__(self, "keys", tuple(self.values))


VERL = Source("volcengine/verl", "b178a3cd56f58b2d502255daba591e92833930a7",
              ("verl/trainer/ppo/core_algos.py", "verl/workers/actor/dp_actor.py",
               "verl/trainer/config/actor/actor.yaml", "verl/trainer/config/algorithm.py",
               "verl/trainer/ppo/ray_trainer.py"))
OPENRLHF = Source("OpenRLHF/OpenRLHF", "3c3be6234e0cb353e76bb8019947db9dfe99fca7",
                  ("openrlhf/models/utils.py", "openrlhf/trainer/ppo_utils/experience_maker.py",
                   "openrlhf/cli/train_ppo_ray.py"))
TRL = Source("huggingface/trl", "f2cd57710ae345ea6428ae95363267fcf38a3dc8",
             ("trl/trainer/grpo_trainer.py", "trl/trainer/grpo_config.py"))
TRL_RLOO = Source("huggingface/trl", "f2cd57710ae345ea6428ae95363267fcf38a3dc8",
                  ("trl/trainer/rloo_trainer.py", "trl/trainer/rloo_config.py"))
NEMO_RL = Source("NVIDIA-NeMo/RL", "7ea279abfbeb698b092856d0dab61e7cf39bc909",
                 ("nemo_rl/algorithms/loss/loss_functions.py", "nemo_rl/algorithms/utils.py",
                  "examples/configs/grpo_math_1B.yaml"))
SLIME = Source("THUDM/slime", "624b824a898ab0ec1fcb4d373004c7f3852bf515",
               ("slime/utils/ppo_utils.py", "slime/backends/megatron_utils/loss.py", "slime/utils/arguments.py"))
SKYRL = Source("NovaSky-AI/SkyRL", "a9564572eb8e91076be43c1bd5e4615e3de17265",
               ("skyrl/backends/skyrl_train/utils/ppo_utils.py", "skyrl/backends/skyrl_train/workers/worker.py",
                "skyrl/train/config/config.py"))
NEMO_RL_REWARD = Source("NVIDIA-NeMo/RL", "7ea279abfbeb698b092856d0dab61e7cf39bc909",
                        ("nemo_rl/algorithms/advantage_estimator.py", "nemo_rl/algorithms/utils.py",
                         "nemo_rl/algorithms/grpo.py", "examples/configs/grpo_math_1B.yaml"))
OPEN_INSTRUCT = Source("allenai/open-instruct", "e6c3044aa6201c8bfa4573c1b03142af599e730d",
                       ("open_instruct/grpo_utils.py", "open_instruct/model_utils.py", "open_instruct/grpo_fast.py"))
VERL_DPPO = Source("verl-project/verl", "1dda039b9c6311889a9c9a26040677e1254814f9",
                   ("verl/trainer/ppo/core_algos.py", "verl/workers/config/actor.py", "verl/workers/utils/losses.py",
                    "verl/trainer/ppo/ray_trainer.py"))
OPENRLHF_UNBIASED = Source("OpenRLHF/OpenRLHF", "d3d1920349588f3ee419ef6883efd8e09a77360c",
                           ("openrlhf/models/utils.py", "openrlhf/trainer/ray/ppo_actor.py",
                            "openrlhf/cli/train_ppo_ray.py"))
PRIME_RL = Source("PrimeIntellect-ai/prime-rl", "559b44772e471d1538537b8805cc77f3824a5e64",
                  ("src/prime_rl/trainer/rl/loss.py", "packages/prime-rl-configs/src/prime_rl/configs/trainer.py",
                   "src/prime_rl/trainer/rl/train.py"))

PAPER_COMMIT = "59c2f8ae923123afaa42c801c33ffb5e2c4e51cc"
PAPER_CODE = ("src/zeroband/training/loss.py", "src/zeroband/train.py", "src/zeroband/training/config.py",
              "multinode_launch.sh")


def paper_source(config: str) -> Source:
    """The Comedy paper's prime-rl fork at the commit of its KL runs, with the run's config file."""
    return Source("bbartoldson/tba-prime", PAPER_COMMIT, (*PAPER_CODE, config))


K3_LOSS = {"estimator": "k3", "placement": "loss", "kl_loss_ratio": "none"}
CLAMPS_20_10 = {"kl_log_ratio_clamp": 20.0, "kl_value_clamp": 10.0}

REGISTRY: Registry[Preset] = Registry("preset")
REGISTRY.register(Preset(
    "verl", "verl",
    "actor.use_kl_loss=true, kl_loss_type=low_var_kl, kl_loss_coef=0.001",
    {**K3_LOSS, **CLAMPS_20_10, "beta": 0.001}, VERL,
    "verl aggregates the loss with token-mean by default (loss_agg_mode); the KL loss has no importance weight."))
REGISTRY.register(Preset(
    "verl-k3+", "verl",
    "actor.use_kl_loss=true, kl_loss_type=k3+ (low_var_kl+), kl_loss_coef=0.001",
    {**K3_LOSS, **CLAMPS_20_10, "estimator": "k3+", "beta": 0.001}, VERL,
    "The clamps bound k3's value only; the k2 term that carries the gradient is unclamped (klstudy's k3+ too). "
    "What kl_penalty's docstring and code intend: at this commit its kl_penalty_forward is given the name with "
    "its '+' and raises NotImplementedError, so verl itself cannot run k3+ yet."))
REGISTRY.register(Preset(
    "verl-reward", "verl",
    "algorithm.use_kl_in_reward=true, kl_penalty=kl, kl_ctrl.kl_coef=0.001, adv_estimator=gae (gamma = lam = 1)",
    {"estimator": "k1", "placement": "reward-to-go", "reward_kl": "sampler", "beta": 0.001,
     "advantage": "reinforce-whiten"}, VERL,
    "Per-token rewards from the sampler's log-probs (old_log_probs), returned and whitened over the batch's tokens "
    "with the task reward (masked_whiten, core_algos.py:261 for GAE, :615 for REINFORCE++): with no critic, GAE is "
    "the return. A critic's values, subtracted before the whitening, are not modelled. reinforce_plus_plus_baseline "
    "sums the KL over the response, subtracts the group mean and whitens (placement reward, advantage "
    "drgrpo-whiten); GRPO and RLOO sum it and do not whiten (placement reward). kl_ctrl.type=adaptive (target_kl "
    "0.1, horizon 10000) is objective.kl_target and kl_horizon."))
VERL_DPPO_NOTES = ("-A sg(min(pi / pi_old, clip_ratio_c)) log pi on the tokens its mask keeps (core_algos.py: "
                   "compute_policy_loss_dppo_{tv,kl}): the gradient of dppo-{tv,kl} with ratio_cap 3.0 (ActorConfig's "
                   "clip_ratio_c; the code's 20.0 is a fallback), whose value is -A sg(w) instead; pi_old the actor's "
                   "recomputed log-probs, not the engine's (recompute_logprobs). No KL to pi_old: the KL is "
                   "use_kl_loss's low_var_kl, as preset verl. The example script runs 0.15 (tv) or 0.05 (kl), "
                   "clip_ratio_c 10000 and seq-mean-token-sum-norm.")
for kind in ("tv", "kl"):
    REGISTRY.register(Preset(
        f"verl-dppo-{kind}", "verl",
        f"actor.policy_loss.loss_mode=dppo_{kind} (clip_ratio 0.2, clip_ratio_c 3.0), use_kl_loss=true, "
        "kl_loss_type=low_var_kl, kl_loss_coef=0.001",
        {**K3_LOSS, **CLAMPS_20_10, "beta": 0.001, "pg_ratio": f"dppo-{kind}", "clip_eps": 0.2, "ratio_cap": 3.0},
        VERL_DPPO, VERL_DPPO_NOTES, {"recompute_logprobs": True}))
REGISTRY.register(Preset(
    "openrlhf", "OpenRLHF",
    "--algo.kl.estimator k1 --algo.kl.init_coef 0.01 --algo.advantage.estimator gae (KL in the reward unless "
    "--algo.kl.use_loss)",
    {"estimator": "k1", "placement": "reward-to-go", "kl_value_clamp": 10.0, "reward_kl": "sampler",
     "beta": 0.01, "advantage": "reinforce-whiten-pop"}, OPENRLHF,
    "compute_approx_kl clamps every estimate to +-10; compute_reward puts it per token, the returns carry it, and "
    "gae (the default, gamma = lambd = 1; with no critic, the return), reinforce and reinforce_baseline whiten the "
    "advantages over the batch's tokens with the population variance (reinforce_baseline after subtracting the "
    "group mean of R: drgrpo-whiten-pop); rloo, group_norm and dr_grpo do not whiten (their baselines on R only). "
    "--algo.kl.target with --algo.kl.horizon makes the coefficient adaptive."))
REGISTRY.register(Preset(
    "openrlhf-unbiased", "OpenRLHF",
    "--algo.kl.use_loss --algo.kl.unbiased_gradient --algo.kl.estimator k1 --algo.kl.init_coef 0.01 (PR 1309)",
    {"estimator": "k2", "placement": "loss", "kl_loss_ratio": "detached", "kl_loss_ratio_cap": 10.0, "beta": 0.01,
     "kl_loss_agg": "token-mean"}, OPENRLHF_UNBIASED,
    "compute_approx_kl's straight-through gradient, sg(min(pi / pi_old, 10)) (log pi - log pi_ref) grad log pi, "
    "with pi_old the actor's log-probs at experience time (recompute_logprobs): k2's gradient with the detached, "
    "truncated weight, whatever --algo.kl.estimator; its value is the estimator's, clamped to +-10 and detached "
    "(klstudy's: sg(w) k2). The KL loss is a token mean over the step (aggregate_loss), whatever the policy "
    "loss's.", {"recompute_logprobs": True}))
REGISTRY.register(Preset(
    "trl-grpo", "TRL GRPOTrainer",
    "beta=0.0 (k3 in the loss when beta > 0); vllm_importance_sampling_mode=sequence_mask, clip_max=3.0",
    {**K3_LOSS, "beta": 0.0, "tis_cap": 3.0, "tis_mode": "mask", "tis_level": "sequence"}, TRL,
    "TRL's default beta is 0: no KL term and no reference model; the docs cite 0.001 (DeepSeek-R1). The "
    "sequence-mask correction applies with vLLM rollouts. sync_ref_model (Polyak alpha 0.6 every 512 steps) "
    "is objective.ref_refresh_every and ref_refresh_alpha."))
REGISTRY.register(Preset(
    "trl-grpo-bias-corrected", "TRL GRPOTrainer",
    "beta > 0, use_bias_correction_kl=true",
    {**K3_LOSS, "kl_loss_ratio": "differentiable", "beta": 0.0, "tis_cap": 3.0, "tis_mode": "mask",
     "tis_level": "sequence"}, TRL,
    "per_token_kl * coef_1 with coef_1 = exp(logp - old_logp), not detached (DeepSeek-V3.2's unbiased KL)."))
REGISTRY.register(Preset(
    "trl-rloo", "TRL RLOOTrainer",
    "beta=0.05: k1 summed over the response, subtracted from the reward",
    {"estimator": "k1", "placement": "reward", "reward_kl": "sampler", "beta": 0.05, "advantage": "rloo",
     "pg_ratio": "sequence", "clip_eps": 0.2, "loss_agg": "seq-mean-token-sum"}, TRL_RLOO,
    "The KL from old_per_token_logps, the policy that sampled. The policy loss is sequence-level: the ratio "
    "exp(sum_t log pi - old_logps) PPO-clipped at epsilon 0.2 and averaged over sequences "
    "(rloo_trainer.py:1686-1695); normalize_advantages is off by default."))
REGISTRY.register(Preset(
    "nemo-rl", "NeMo-RL",
    "loss_fn: reference_policy_kl_type=k3, reference_policy_kl_penalty=0.01, kl_input_clamp_value=20, "
    "kl_output_clamp_value=10",
    {**K3_LOSS, **CLAMPS_20_10, "kl_loss_ratio": "score", "beta": 0.01}, NEMO_RL,
    "The KL loss is weighted by exp(logp - sg(logp)), 1 in value; the output clamp bounds the weighted value, "
    "and the weight is detached where the input clamp binds (as klstudy clamps a weighted KL loss). "
    "use_kl_in_reward with REINFORCE++ is preset nemo-rl-reward."))
REGISTRY.register(Preset(
    "nemo-rl-on-policy-kl", "NeMo-RL",
    "the same with use_on_policy_kl_approximation=true",
    {**K3_LOSS, **CLAMPS_20_10, "kl_loss_ratio": "engine", "beta": 0.01}, NEMO_RL,
    "The weight is exp(logp - generation_logprobs), differentiable: pi over the engine's own distribution."))
REGISTRY.register(Preset(
    "nemo-rl-reward", "NeMo-RL",
    "adv_estimator.name=reinforce_plus_plus, minus_baseline=true, loss_fn.use_kl_in_reward=true, "
    "reference_policy_kl_type=k3, reference_policy_kl_penalty=0.01",
    {"estimator": "k3", "placement": "reward-token", **CLAMPS_20_10, "reward_kl": "sampler", "beta": 0.01,
     "advantage": "drgrpo-whiten-pop"}, NEMO_RL_REWARD,
    "ReinforcePlusPlusAdvantageEstimator (advantage_estimator.py:193-267): R minus its group mean, minus each "
    "token's own KL (not returned), calculate_kl with its default clamps (input 20, output 10) on the sampler's "
    "log-probs (prev_logprobs): k3, not k1. Then whitened over the batch's tokens with the population variance. The "
    "loss's KL coefficient is 0 with use_kl_in_reward. With the default estimator, grpo, the KL is dropped: no KL "
    "at all (as slime-grpo-reward-kl)."))
REGISTRY.register(Preset(
    "slime", "slime",
    "--use-kl-loss --kl-loss-type low_var_kl --kl-loss-coef 0.00 (as its example scripts)",
    {**K3_LOSS, "kl_value_clamp": 10.0, "beta": 0.0}, SLIME,
    "Only low_var_kl is clamped (its value, to +-10; k3 is the same estimate unclamped). The default "
    "--kl-loss-type is k1, which in the loss does not regularize. --use-unbiased-kl is kl_loss_ratio "
    "differentiable; --ref-update-interval N is objective.ref_refresh_every N (a hard copy)."))
REGISTRY.register(Preset(
    "slime-grpo-reward-kl", "slime",
    "--advantage-estimator grpo --kl-coef > 0 (the reward KL)",
    {"estimator": "k1", "placement": "none", "beta": 0.0}, SLIME,
    "get_grpo_returns ignores the KL it is given: with GRPO (the default), GSPO or CISPO the reward KL is computed "
    "and dropped (slime issue 397, PR 399). reinforce_plus_plus returns it (reward-to-go); "
    "reinforce_plus_plus_baseline gives each token its own (reward-token)."))
REGISTRY.register(Preset(
    "skyrl", "SkyRL",
    "trainer.algorithm.use_kl_loss=true, kl_estimator_type=k3, kl_loss_coef=0.001",
    {**K3_LOSS, **CLAMPS_20_10, "beta": 0.001, "kl_loss_agg": "seq-mean-token-mean"}, SKYRL,
    "Only k3 is clamped. The KL loss is averaged per response, then over responses (worker.py:1077), whatever "
    "the policy loss's loss_reduction (token_mean by default, config.py:876): kl_loss_agg seq-mean-token-mean. "
    "use_kl_in_reward instead puts it per token (summed by GRPO and RLOO, returned by REINFORCE++ and GAE), "
    "and only then is kl_ctrl.type=adaptive used."))
REGISTRY.register(Preset(
    "open-instruct", "open-instruct",
    "grpo_fast: beta=0.05, kl_estimator=2; use_rho_correction=true (log rho clamped to [-10, 10], rho to [0, 2])",
    {**K3_LOSS, "kl_log_ratio_clamp": 40.0, "beta": 0.05, "tis_cap": 2.0, "tis_floor": math.exp(-10.0)},
    OPEN_INSTRUCT,
    "compute_rho_correction clamps log rho to [-10, 10] before exponentiating (grpo_utils.py:418-420), so the "
    "weight never falls below e^-10 (tis_floor). kl_estimator=3 is ratio x k1 (the differentiable ratio on k1). "
    "ref_policy_update_freq with alpha 0.6 (Polyak) is objective.ref_refresh_every and ref_refresh_alpha."))
REGISTRY.register(Preset(
    "prime-rl", "prime-rl",
    "loss type=default: dppo_mask_low=dppo_mask_high=0.2, kl_tau=1e-3 (default_loss_fn)",
    {"estimator": "k2", "placement": "loss", "kl_to": "behaviour", "kl_loss_ratio": "none", "beta": 2e-3,
     "pg_ratio": "dppo-tv", "clip_eps": 0.2}, PRIME_RL,
    "kl_tau * (log pi - log mu)^2 on every loss token, unweighted, toward mu = the engine's sampling log-probs "
    "(inference_logprobs): k2 toward mu at beta = 2 kl_tau. No KL to a reference. DPPO drops a token's policy "
    "gradient, -A pi/mu, where p - p_mu > 0.2 (A > 0) or < -0.2 (A <= 0). The step's loss is divided by its loss "
    "tokens over all ranks (loss_agg token-mean)."))

# "A Comedy of Estimators", off-policy (async level 10, beta 0.005): its prime-rl fork's objectives. The fork's
# "trajectory balance" loss (tba_loss) is a policy gradient with the advantage R - log Z, log Z the mean reward of
# the prompt's 16 samples (train.py: logZ_list): drgrpo's. The token ratio pi / mu (mu recomputed by the trainer,
# recompute_logprobs) is clamped to [0, 8], differentiable, with no PPO clip. Each response's loss is its token
# sum divided by its prompt's and its response's tokens (normalize_batch_to_token_count with micro_bs 1: the
# divisor max_tokens is the micro-batch's sum of seq_lens, len(input_ids), prompt included), then averaged over
# responses (over grad_acc steps, and FSDP over processes): seq-mean-token-sum-seq-len. get_token_kl clamps k1 and
# k3 to +-10.
PAPER_TB = {"advantage": "drgrpo", "ratio_cap": 8.0, "clip_eps": None, "loss_agg": "seq-mean-token-sum-seq-len"}
# The fork's recompute_logprobs (config.py, default true) recomputes mu's log-probs with a copy of the policy that
# sampled (train.py: model_for_logprob_only, the checkpoint of max_async_level steps before): the ratio's clamp,
# IcePop's mask and mean_KL act on the trainer's log-probs, never on the engine's.
PAPER_ROLLOUT = {"recompute_logprobs": True}
PAPER_REWARD = ("The KL in the reward is each response's KL under the policy being updated (detached), minus its "
                "group's mean KL under the behaviour policy (mean_KL, from the recomputed log-probs): placement "
                "reward-centred, reward_kl current.")
for estimator in ("k1", "k3"):
    REGISTRY.register(Preset(
        f"paper-{estimator}-reward", "A Comedy of Estimators",
        f"type=tb, kl_type={estimator}, kl_loc=reward, beta=0.005, async_level=10",
        {**PAPER_TB, "estimator": estimator, "placement": "reward-centred", "reward_kl": "current",
         "kl_value_clamp": 10.0, "beta": 0.005},
        paper_source(f"MATH_experiments/KL{estimator}r_qwen_b005_async10"), PAPER_REWARD, PAPER_ROLLOUT))
    REGISTRY.register(Preset(
        f"paper-{estimator}-loss", "A Comedy of Estimators",
        f"type=tb, kl_type={estimator}, kl_loc=loss, beta=0.005, async_level=10",
        {**PAPER_TB, "estimator": estimator, "placement": "loss", "kl_loss_ratio": "none", "kl_value_clamp": 10.0,
         "beta": 0.005},
        paper_source(f"MATH_experiments/KL{estimator}l_qwen_b005_async10"),
        "beta x the clamped per-token KL added to each token's loss, with no importance weight.", PAPER_ROLLOUT))
REGISTRY.register(Preset(
    "paper-grpo", "A Comedy of Estimators",
    "type=ratio (clip_ratio 8), no KL, async_level=10",
    {**PAPER_TB, "estimator": "k1", "placement": "none", "beta": 0.0},
    paper_source("MATH_experiments/GRPO_qwen_async10"),
    "The paper's GRPO: grpo_loss_ratio, the token ratio clamped to [0, 8] on the inference side's dr_grpo "
    "advantages (rewards.py, advantage_estimation_method); the config file is at 71c17168.", PAPER_ROLLOUT))
REGISTRY.register(Preset(
    "paper-icepop", "A Comedy of Estimators",
    "type=icepop (mask_ratio_low 0.125, mask_ratio_high 8, kl_tau 0), no KL, async_level=10",
    {**PAPER_TB, "ratio_floor": 0.125, "ratio_mode": "mask", "estimator": "k1", "placement": "none", "beta": 0.0},
    paper_source("MATH_experiments/IcePop_qwen_async10"),
    "icepop_loss: tokens whose ratio pi / mu leaves [0.125, 8] are dropped; the config file is at e0fe44ae.",
    PAPER_ROLLOUT))
REGISTRY.register(Preset(
    "paper-k1-reward-reset50", "A Comedy of Estimators",
    "type=tb (k1 in the reward), beta=0.005, reference reset every 50 steps (reset=50), async_level=10",
    {**REGISTRY["paper-k1-reward"].values, "ref_refresh_every": 50},
    paper_source("MATH_experiments/TBA_qwen_b005_async10_reset50_IS"),
    "grpo.reference_reset_interval 50: the reference becomes a copy of the policy (copy_model_weights_fsdp). The "
    "config file and its loss (grpo_loss_tb: k1 in the reward, importance-sampled) are at 71c17168. "
    + PAPER_REWARD, PAPER_ROLLOUT))

NAMES = REGISTRY.names


def expand(section: Mapping[str, Any]) -> dict[str, Any]:
    """A run config's objective section with its preset's values under the keys it gives itself: the one
    expansion, which the run config, `ObjectiveConfig.of_preset` and the studies' axes all call."""
    name = section.get("preset")
    if name is None:
        return dict(section)
    if name not in REGISTRY:
        raise ConfigError("objective.preset", f"{name!r} is not one of {', '.join(REGISTRY.names)}")
    return {**REGISTRY[name].values, **section}


def run_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """A run config (plain sections) with its objective preset's `rollout` values under the rollout keys it gives
    itself; as it is without a preset, or with a preset that is not one (the objective's check names it)."""
    objective = config.get("objective")
    rollout = config.get("rollout") or {}
    name = objective.get("preset") if isinstance(objective, Mapping) else None
    preset = REGISTRY[name] if isinstance(name, str) and name in REGISTRY else None
    if preset is None or not preset.rollout or not isinstance(rollout, Mapping):
        return dict(config)
    return {**config, "rollout": {**preset.rollout, **rollout}}
