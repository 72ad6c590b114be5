"""Each RL library's default KL configuration, as a named objective: one registration each.

A preset sets what the library decides about the KL term: the estimator, where it goes, its clamps,
the weight on the KL loss, the coefficient, and the mismatch correction where the library turns one
on by default. Everything else (the advantage, the aggregation, PPO's clip) stays the run's own, so
that presets compare on one footing; `notes` says where the library's own choice differs. Every
fact was read from the library's source at the commit given (`source`); docs/peers.md has the
table and what each preset's gradient is (`python -m trainer audit --presets`).

In a run config, `objective: {preset: verl, beta: 0.1}` is verl's configuration at beta 0.1: the
preset's values fill in the keys not given beside it, and `preset` stays in the config as a label.
In Python, `objective("verl", beta=0.1)`. Free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Mapping

from trainer.objective.registry import Registry

if TYPE_CHECKING:
    from trainer.objective.objective_config import ObjectiveConfig


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
    keys: tuple[str, ...] = field(default=(), init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))
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
OPEN_INSTRUCT = Source("allenai/open-instruct", "e6c3044aa6201c8bfa4573c1b03142af599e730d",
                       ("open_instruct/grpo_utils.py", "open_instruct/model_utils.py", "open_instruct/grpo_fast.py"))

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
    "algorithm.use_kl_in_reward=true, kl_penalty=kl, kl_ctrl.type=fixed, kl_ctrl.kl_coef=0.001",
    {"estimator": "k1", "placement": "reward-to-go", "reward_kl": "sampler", "beta": 0.001}, VERL,
    "Per-token rewards from the sampler's log-probs (old_log_probs); returned by GAE and REINFORCE++ (to go, "
    "as here), but summed over the response by GRPO and RLOO (placement reward). kl_ctrl.type=adaptive "
    "(target_kl 0.1, horizon 10000) is objective.kl_target and kl_horizon."))
REGISTRY.register(Preset(
    "openrlhf", "OpenRLHF",
    "--algo.kl.estimator k1 --algo.kl.init_coef 0.01 (KL in the reward unless --algo.kl.use_loss)",
    {"estimator": "k1", "placement": "reward-to-go", "kl_value_clamp": 10.0, "reward_kl": "sampler",
     "beta": 0.01}, OPENRLHF,
    "compute_approx_kl clamps every estimate to +-10; compute_reward puts it per token and get_cumulative_returns "
    "returns it, the baseline (rloo, reinforce_baseline, group_norm) applying to the task reward only. "
    "--algo.kl.target with --algo.kl.horizon makes the coefficient adaptive."))
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
    {"estimator": "k1", "placement": "reward", "reward_kl": "sampler", "beta": 0.05}, TRL_RLOO,
    "From old_per_token_logps, the policy that sampled."))
REGISTRY.register(Preset(
    "nemo-rl", "NeMo-RL",
    "loss_fn: reference_policy_kl_type=k3, reference_policy_kl_penalty=0.01, kl_input_clamp_value=20, "
    "kl_output_clamp_value=10",
    {**K3_LOSS, **CLAMPS_20_10, "kl_loss_ratio": "score", "beta": 0.01}, NEMO_RL,
    "The KL loss is weighted by exp(logp - sg(logp)), 1 in value; the output clamp bounds the weighted value, "
    "and the weight is detached where the input clamp binds (as klstudy clamps a weighted KL loss). "
    "use_kl_in_reward (REINFORCE++) gives each token its own KL (placement reward-token)."))
REGISTRY.register(Preset(
    "nemo-rl-on-policy-kl", "NeMo-RL",
    "the same with use_on_policy_kl_approximation=true",
    {**K3_LOSS, **CLAMPS_20_10, "kl_loss_ratio": "engine", "beta": 0.01}, NEMO_RL,
    "The weight is exp(logp - generation_logprobs), differentiable: pi over the engine's own distribution."))
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
    {**K3_LOSS, **CLAMPS_20_10, "beta": 0.001}, SKYRL,
    "Only k3 is clamped. use_kl_in_reward instead puts it per token (summed by GRPO and RLOO, returned by "
    "REINFORCE++ and GAE), and only then is kl_ctrl.type=adaptive used."))
REGISTRY.register(Preset(
    "open-instruct", "open-instruct",
    "grpo_fast: beta=0.05, kl_estimator=2; use_rho_correction=true (rho clamped to [0, 2])",
    {**K3_LOSS, "kl_log_ratio_clamp": 40.0, "beta": 0.05, "tis_cap": 2.0}, OPEN_INSTRUCT,
    "kl_estimator=3 is ratio x k1 (the differentiable ratio on k1). ref_policy_update_freq with alpha 0.6 "
    "(Polyak) is objective.ref_refresh_every and ref_refresh_alpha."))

NAMES = REGISTRY.names


def expand(section: Mapping[str, Any]) -> dict[str, Any]:
    """A run config's objective section with its preset's values under the keys it gives itself."""
    name = section.get("preset")
    if name is None:
        return dict(section)
    return {**REGISTRY[name].values, **section}


def objective(name: str, **overrides: Any) -> "ObjectiveConfig":
    """The ObjectiveConfig of preset `name`, with `overrides` (beta, the advantage, ...) on top."""
    from trainer.objective.objective_config import ObjectiveConfig

    return ObjectiveConfig(**expand({"preset": name, **overrides}))
