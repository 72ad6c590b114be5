"""The names a run config chooses from, free of torch.

`trainer.config` validates with these alone, so that a study validates every run's config in
milliseconds before Snakemake builds its DAG. The objective's axes (estimators, placements,
advantages) are registries (`trainer.objective.registry`): their names here are read from them.
"""

from trainer.objective import advantages, estimators, placements

ESTIMATORS = estimators.REGISTRY.names
PLACEMENTS = placements.REGISTRY.names
ADVANTAGES = advantages.REGISTRY.names
REWARD_KL_POLICIES = ("sampler", "current")
LOSS_AGGS = ("seq-mean-token-sum", "seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")
KL_LOSS_RATIOS = ("none", "detached", "differentiable", "sequence", "engine", "score")
TIS_MODES = ("truncate", "mask")
TIS_LEVELS = ("token", "sequence", "geometric")
PG_RATIOS = ("token", "sequence")
TASK_NAMES = ("arithmetic", "countdown", "math")
ENGINES = ("hf", "vllm")
HF_DECODINGS = ("auto", "eager", "compiled")
LR_SCHEDULES = ("constant", "linear", "cosine")
MIXED_PRECISIONS = ("no", "bf16")
