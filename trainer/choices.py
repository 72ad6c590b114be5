"""The names a run config chooses from, free of torch.

`trainer.config` validates with these alone, so that a study validates every run's config in
milliseconds before Snakemake builds its DAG. The modules that implement each choice (kl,
advantages, objective, tasks, rollout) take their names from here.
"""

ESTIMATORS = ("k1", "k2", "k3")
PLACEMENTS = ("none", "reward", "loss", "reward+loss")
ADVANTAGES = ("rloo", "grpo", "drgrpo", "reinforce")
LOSS_AGGS = ("seq-mean-token-sum", "seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
KL_LOSS_RATIOS = ("none", "detached", "differentiable", "sequence")
PG_RATIOS = ("token", "sequence")
TASK_NAMES = ("arithmetic", "countdown", "math")
ENGINES = ("hf", "vllm")
LR_SCHEDULES = ("constant", "linear", "cosine")
MIXED_PRECISIONS = ("no", "bf16")
