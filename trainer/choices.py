"""The names a run config chooses from, free of torch.

`trainer.config` validates with these alone, so that a study validates every run's config in
milliseconds before Snakemake builds its DAG. The objective's axes (estimators, placements,
advantages, the ratios and the aggregations) are registries (`trainer.objective.registry`), read
when asked, never here: a plugin registers into them (`trainer.objective.plugins`).
"""

REWARD_KL_POLICIES = ("sampler", "current")
KL_TARGETS = ("reference", "behaviour", "both")  # objective.kl_to: the policy a KL pulls toward
TIS_MODES = ("truncate", "mask")
TIS_LEVELS = ("token", "sequence", "geometric")
TASK_NAMES = ("arithmetic", "countdown", "math")
ENGINES = ("hf", "vllm")
HF_DECODINGS = ("auto", "eager", "compiled")
LR_SCHEDULES = ("constant", "linear", "cosine")
MIXED_PRECISIONS = ("no", "bf16")
