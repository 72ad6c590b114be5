"""Where beta x the KL estimate goes: one registration per placement
(docs/concepts/theory.md, "Placements").

In the reward, the estimate is subtracted from each response's reward (detached), so it reaches
the gradient through the advantages, as a score-function term; in the loss, its own gradient is
added. Free of torch.

A placement with the KL in the reward says how far each token's score reaches (`reward_span`):

    sequence  every token's score is weighted by the whole response's KL, which goes through the
              advantage estimator with the reward (R - beta K: RLOO's baseline covers it too)
    to-go     per-token KL rewards, returned: token t's score is weighted by the KL at and after
              t, sum_{s>=t} k_s (after t for an estimator whose term does not depend on its own
              token, `full`), without a baseline, beside the advantage of R: what the PPO-style
              libraries compute (OpenRLHF, verl's and slime's REINFORCE++ and GAE)
    token     per-token KL rewards, not returned: token t's score is weighted by k_t alone
              (NeMo-RL's REINFORCE++, slime's REINFORCE++-baseline)

A placement may also centre the KL in the reward (`centred`): each response's KL minus the mean KL of
its group, subtracted beside the advantage of R (the task reward alone goes through the advantage
estimator), the group's mean from the log-probs of the policy that sampled (`reward-centred`: the prime-rl
fork of "A Comedy of Estimators", bbartoldson/tba-prime@59c2f8ae src/zeroband/training/loss.py, tba_loss:
`advantages += -beta * (kl_est - mean_KL)`, with mean_KL from the recomputed behaviour log-probs in
src/zeroband/train.py). On-policy and with drgrpo's centring of R, it is drgrpo of R - beta K.

docs/peers.md derives what each one's expected gradient is.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.objective.registry import Registry

REWARD_SPANS = ("sequence", "to-go", "token")


@dataclass(frozen=True)
class Placement:
    name: str
    in_reward: bool
    in_loss: bool
    reward_span: str = "sequence"  # with the KL in the reward: how far each token's score reaches
    centred: bool = False          # the KL in the reward minus its group's mean, beside the advantage of R

    def __post_init__(self) -> None:
        if self.reward_span not in REWARD_SPANS:
            raise ValueError(f"placement {self.name!r}: reward_span {self.reward_span!r} is not one of "
                             f"{', '.join(REWARD_SPANS)}")
        if self.centred and (not self.in_reward or self.reward_span != "sequence"):
            raise ValueError(f"placement {self.name!r}: only a sequence's KL in the reward is centred")

    @property
    def per_token_reward(self) -> bool:
        """Whether the KL in the reward is per token ([B, T]) rather than one number per response."""
        return self.in_reward and self.reward_span != "sequence"


REGISTRY: Registry[Placement] = Registry("KL placement")
REGISTRY.register(Placement("none", in_reward=False, in_loss=False))
REGISTRY.register(Placement("reward", in_reward=True, in_loss=False))
REGISTRY.register(Placement("loss", in_reward=False, in_loss=True))
REGISTRY.register(Placement("reward+loss", in_reward=True, in_loss=True))
REGISTRY.register(Placement("reward-to-go", in_reward=True, in_loss=False, reward_span="to-go"))
REGISTRY.register(Placement("reward-to-go+loss", in_reward=True, in_loss=True, reward_span="to-go"))
REGISTRY.register(Placement("reward-token", in_reward=True, in_loss=False, reward_span="token"))
REGISTRY.register(Placement("reward-centred", in_reward=True, in_loss=False, centred=True))



def kl_placements() -> tuple[str, ...]:
    """Every placement with a KL term, read from the registry when asked (so that a plugin's count)."""
    return tuple(p.name for p in REGISTRY if p.in_reward or p.in_loss)
