"""Each preset's library, as its source computes the loss: written here from the sources' semantics (no peer code
is copied), in their own order of operations (per-token rewards, returns, whitening, clamps, weights), to check
`trainer.objective.presets` against by value and gradient (tests/test_presets_fidelity.py).

Every function takes one batch, `Batch`, and returns the loss that its library minimises, with the parts a preset
leaves to the run (the advantage, PPO's clip, the aggregation) as `RUN` sets them: RLOO, clip 0.2, token-mean.
Sources, at the commits trainer/objective/presets.py cites:

- verl: verl/trainer/ppo/core_algos.py (kl_penalty, compute_reinforce_plus_plus_outcome_advantage,
  compute_gae_advantage_return), verl/utils/torch_functional.py (masked_whiten), ray_trainer.py (apply_kl_penalty)
- OpenRLHF: openrlhf/models/utils.py (compute_approx_kl, compute_reward),
  openrlhf/trainer/ppo_utils/experience_maker.py (compute_advantages_and_returns)
- TRL: trl/trainer/grpo_trainer.py (_compute_loss, the vLLM importance sampling), trl/trainer/rloo_trainer.py
- NeMo-RL: nemo_rl/algorithms/utils.py (calculate_kl), advantage_estimator.py (ReinforcePlusPlusAdvantageEstimator)
- slime: slime/utils/ppo_utils.py (compute_approx_kl, low_var_kl)
- SkyRL: skyrl/backends/skyrl_train/workers/worker.py:1077 (the KL loss per sequence)
- open-instruct: open_instruct/grpo_utils.py (compute_rho_correction)
- prime-rl: src/prime_rl/trainer/rl/loss.py (default_loss_fn), src/prime_rl/trainer/rl/train.py (loss_scale)
- verl's DPPO (verl-project/verl): verl/trainer/ppo/core_algos.py (compute_policy_loss_dppo_tv, _dppo_kl)
- OpenRLHF's unbiased_gradient (PR 1309's head): openrlhf/models/utils.py (compute_approx_kl)
- the Comedy paper's fork, bbartoldson/tba-prime@59c2f8ae: src/zeroband/training/loss.py (tba_loss, get_token_kl,
  grpo_loss_ratio, icepop_loss, _apply_mask), src/zeroband/train.py (logZ and mean_KL per group of 16, max_tokens
  and the division by num_grad_acc_steps), src/zeroband/training/data.py (seq_lens: len(input_ids), the prompt's
  and the response's tokens; not stored at 59c2f8ae, the same at 115573dc, before tba_loss existed, and at 0d26fa06,
  whose batches carry the problem_ids that 59c2f8ae's train.py reads)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

RUN = {"advantage": "rloo", "clip_eps": 0.2, "loss_agg": "token-mean"}  # the run's own parts, where a preset is silent
EPS = 0.2


@dataclass(frozen=True)
class Batch:
    logp: Tensor     # [B, T] log pi_theta, with grad
    ref: Tensor      # [B, T] log pi_ref
    old: Tensor      # [B, T] log mu, the policy that sampled, as the trainer computes it
    engine: Tensor   # [B, T] the rollout engine's log-probs
    rewards: Tensor  # [B]
    mask: Tensor     # [B, T]
    group: int
    prompt: Tensor   # [B] each row's prompt tokens


def fixed_batch() -> Batch:
    """Two groups of two responses of up to four tokens, where every clamp of every preset binds somewhere: log-ratios
    to the reference of -25 and +45 (beyond 20 and 40), k3 values above 10 at l = -3.5, k1 values above 10 at
    l = +12, token ratios to mu of e^3 and e^-3 (beyond [0.125, 8]) and some beyond PPO's 0.2, sequence ratios beyond
    TRL's clip, engine ratios of e^-12 (below open-instruct's e^-10) and e^1 (above its 2); mu's log-probs below 0
    (DPPO's regions read its probabilities). Prompts of 5, 2, 7 and 3 tokens: the fork's divisor counts them."""
    d = torch.float64
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=d)
    ref = torch.tensor([[-1.0, -46.0, -2.0, -0.7], [-15.5, -1.2, -0.3, -1.0],
                        [-0.4, -2.2, -1.0, -1.0], [-0.9, -1.5, -0.6, -2.5]], dtype=d)
    l = torch.tensor([[-25.0, 45.0, 0.3, -0.2], [12.0, -3.5, 0.1, 0.0],
                      [0.5, 0.25, 0.0, 0.0], [-0.6, 1.1, -0.05, 2.0]], dtype=d)
    logp = (ref + l).clamp(max=-1e-3)
    to_mu = torch.tensor([[0.1, 3.0, -0.3, 0.05], [-3.0, 0.25, 0.1, 0.0],
                          [0.15, -0.1, 0.0, 0.0], [2.2, 0.5, -0.4, 0.1]], dtype=d)  # log pi / mu
    old = logp - to_mu
    assert bool((old < 0).all())
    to_engine = torch.tensor([[-12.0, 0.0, 1.0, 0.1], [0.2, -0.1, 0.0, 0.0],
                              [0.05, 1.2, 0.0, 0.0], [-0.3, 0.0, 0.2, -11.0]], dtype=d)  # log mu / engine
    engine = old - to_engine
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=d)
    prompt = torch.tensor([5.0, 2.0, 7.0, 3.0], dtype=d)
    return Batch(logp.clone().requires_grad_(), ref, old, engine, rewards, mask, 2, prompt)


# --- building blocks, each as the sources compute it ---------------------------------------------------------------

def group_mean(x: Tensor, g: int) -> Tensor:
    return x.view(-1, g).mean(1, keepdim=True).expand(-1, g).reshape(-1)


def rloo(x: Tensor, g: int) -> Tensor:
    groups = x.view(-1, g)
    return (groups - (groups.sum(1, keepdim=True) - groups) / (g - 1)).reshape(-1)


def ppo(b: Batch, adv: Tensor) -> Tensor:
    """-min(r A, clip(r) A) per token, r = pi / mu; adv [B] or [B, T]."""
    adv = adv.unsqueeze(-1) if adv.dim() == 1 else adv
    ratio = torch.exp(b.logp - b.old)
    return torch.maximum(-ratio * adv, -ratio.clamp(1 - EPS, 1 + EPS) * adv)


def token_mean(x: Tensor, m: Tensor) -> Tensor:
    return (x * m).sum() / m.sum()


def seq_mean_token_mean(x: Tensor, m: Tensor) -> Tensor:
    return ((x * m).sum(-1) / m.sum(-1)).mean()


def returns(token_rewards: Tensor, m: Tensor) -> Tensor:
    """sum_{s >= t} r_s, gamma 1, resetting after each response's end."""
    out, running = torch.zeros_like(token_rewards), torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + running
        out[:, t] = running
        running = running * m[:, t]
    return out


def at_last_token(r: Tensor, m: Tensor) -> Tensor:
    last = m.sum(-1).long() - 1
    out = torch.zeros_like(m)
    out[torch.arange(m.shape[0]), last] = r
    return out


def whiten_verl(x: Tensor, m: Tensor) -> Tensor:
    """masked_whiten: masked_mean divides by (count + 1e-8); the unbiased variance; rsqrt(var + 1e-8)."""
    mean = (x * m).sum() / (m.sum() + 1e-8)
    var = ((x - mean) ** 2 * m).sum() / (m.sum() + 1e-8) * (m.sum() / (m.sum() - 1))
    return (x - mean) * torch.rsqrt(var + 1e-8)


def whiten_population(x: Tensor, m: Tensor) -> Tensor:
    """OpenRLHF's and NeMo-RL's: the population variance, rsqrt(max(var, 1e-8))."""
    mean = (x * m).sum() / m.sum()
    var = ((x - mean) ** 2 * m).sum() / m.sum()
    return (x - mean) * var.clamp(min=1e-8).rsqrt()


def k3_of(neg_log_ratio: Tensor) -> Tensor:
    """exp(log_r) - 1 - log_r with log_r = log pi_ref - log pi (the sources' spelling)."""
    return torch.exp(neg_log_ratio) - 1 - neg_log_ratio


# --- the libraries ---------------------------------------------------------------------------------------------------

def verl(b: Batch, beta: float, plus: bool = False) -> Tensor:
    kl = (b.ref - b.logp).clamp(-20, 20)              # low_var_kl
    value = k3_of(kl).clamp(-10, 10)
    if plus:                                           # k3+: k2's gradient, the value detached
        k2 = 0.5 * (b.logp - b.ref) ** 2
        value = k2 - k2.detach() + value.detach()
    return token_mean(ppo(b, rloo(b.rewards, b.group)), b.mask) + beta * token_mean(value, b.mask)


def verl_dppo(b: Batch, beta: float, kind: str) -> Tensor:
    """compute_policy_loss_dppo_{tv,kl}: -A sg(min(r, clip_ratio_c 3)) log pi on the tokens the mask keeps (the
    region 0.2 in the advantage's direction), r = pi / pi_old; token-mean; plus use_kl_loss's low_var_kl."""
    adv = rloo(b.rewards, b.group).unsqueeze(-1)
    ratio = torch.exp((b.logp - b.old).clamp(-20, 20))
    prob, old_prob = torch.exp(b.logp), torch.exp(b.old)
    if kind == "tv":
        valid = torch.where(adv > 0, prob - old_prob <= EPS, prob - old_prob >= -EPS)
    else:
        binary = old_prob * (b.old - b.logp) + (1 - old_prob) * torch.log((1 - old_prob + 1e-8) / (1 - prob + 1e-8))
        valid = torch.where(adv > 0, (binary <= EPS) | (prob <= old_prob), (binary <= EPS) | (prob >= old_prob))
    pg = -adv * torch.clamp(ratio, max=3.0).detach() * b.logp * valid.detach().to(b.logp.dtype)
    value = k3_of((b.ref - b.logp).clamp(-20, 20)).clamp(-10, 10)
    return token_mean(pg, b.mask) + beta * token_mean(value, b.mask)


def verl_reward(b: Batch, beta: float) -> Tensor:
    """use_kl_in_reward, kl_penalty kl (old - ref), GAE with no critic (gamma = lam = 1): the return, whitened."""
    token_rewards = at_last_token(b.rewards, b.mask) - beta * (b.old - b.ref) * b.mask
    adv = whiten_verl(returns(token_rewards, b.mask), b.mask) * b.mask
    return token_mean(ppo(b, adv), b.mask)


def openrlhf(b: Batch, beta: float) -> Tensor:
    kl = (b.old - b.ref).clamp(-10, 10)
    token_rewards = -beta * kl * b.mask + at_last_token(b.rewards, b.mask)
    adv = whiten_population(returns(token_rewards, b.mask), b.mask)
    return token_mean(ppo(b, adv), b.mask)


def openrlhf_unbiased(b: Batch, beta: float) -> Tensor:
    """--algo.kl.use_loss with unbiased_gradient: compute_approx_kl's value (k1, clamped to +-10), detached, plus the
    straight-through surrogate w l^2 / 2 minus its value, w = min(pi / pi_old, 10) detached; a token mean."""
    log_ratio = b.logp - b.ref
    value = log_ratio.clamp(-10, 10)
    w = torch.exp(b.logp - b.old).clamp(max=10.0).detach()
    surrogate = w * log_ratio ** 2 / 2
    kl = value.detach() + surrogate - surrogate.detach()
    return token_mean(ppo(b, rloo(b.rewards, b.group)), b.mask) + beta * token_mean(kl, b.mask)


def trl_grpo(b: Batch, beta: float, bias_corrected: bool = False) -> Tensor:
    seq = torch.exp(((b.old - b.engine) * b.mask).sum(-1, keepdim=True))  # vllm sequence_mask, clip_max 3
    is_weight = seq.masked_fill(seq > 3.0, 0.0)
    kl = k3_of(b.ref - b.logp)
    if bias_corrected:
        kl = kl * torch.exp(b.logp - b.old)
    per_token = ppo(b, rloo(b.rewards, b.group)) * is_weight + beta * kl
    return token_mean(per_token, b.mask)


def trl_rloo(b: Batch, beta: float) -> Tensor:
    shaped = b.rewards - beta * ((b.old - b.ref) * b.mask).sum(-1)
    adv = rloo(shaped, b.group)
    w = torch.exp((b.logp * b.mask).sum(-1) - (b.old * b.mask).sum(-1))
    return (-torch.minimum(w * adv, w.clamp(1 - EPS, 1 + EPS) * adv)).mean()


def nemo_kl(b: Batch, weight: Tensor | None) -> Tensor:
    """calculate_kl(k3, input clamp 20, output clamp 10, importance weights)."""
    logr = b.ref - b.logp
    clamped = logr.clamp(-20, 20)
    kl = k3_of(clamped)
    if weight is not None:
        kl = torch.where(logr == clamped, weight, weight.detach()) * kl
    return kl.clamp(-10, 10)


def nemo_rl(b: Batch, beta: float, engine: bool = False) -> Tensor:
    weight = torch.exp(b.logp - b.engine) if engine else torch.exp(b.logp - b.logp.detach())
    return token_mean(ppo(b, rloo(b.rewards, b.group)), b.mask) + beta * token_mean(nemo_kl(b, weight), b.mask)


def nemo_rl_reward(b: Batch, beta: float) -> Tensor:
    """REINFORCE++ with minus_baseline: R - group mean, minus each token's own KL of prev_logprobs, whitened."""
    kl = k3_of((b.ref - b.old).clamp(-20, 20)).clamp(-10, 10)
    adv = (b.rewards - group_mean(b.rewards, b.group)).unsqueeze(-1).expand_as(b.mask) - beta * kl
    return token_mean(ppo(b, whiten_population(adv, b.mask)), b.mask)


def slime(b: Batch, beta: float) -> Tensor:
    value = k3_of(b.ref - b.logp).clamp(-10, 10)       # low_var_kl: only the value is clamped
    return token_mean(ppo(b, rloo(b.rewards, b.group)), b.mask) + beta * token_mean(value, b.mask)


def slime_grpo(b: Batch, beta: float) -> Tensor:
    return token_mean(ppo(b, rloo(b.rewards, b.group)), b.mask)  # the reward KL is dropped


def skyrl(b: Batch, beta: float) -> Tensor:
    value = k3_of((b.ref - b.logp).clamp(-20, 20)).clamp(-10, 10)
    return token_mean(ppo(b, rloo(b.rewards, b.group)), b.mask) + beta * seq_mean_token_mean(value, b.mask)


def open_instruct(b: Batch, beta: float) -> Tensor:
    diff = (b.logp - b.ref).clamp(-40, 40)
    rho = torch.exp((b.old - b.engine).clamp(-10, 10)).clamp(max=2.0)
    per_token = ppo(b, rloo(b.rewards, b.group)) * rho
    return token_mean(per_token, b.mask) + beta * token_mean(k3_of(-diff), b.mask)


def _fork_kl(kind: str, logp: Tensor, ref: Tensor, m: Tensor) -> Tensor:
    """get_token_kl on masked log-probs: k1 = l, k3 = r - log r - 1, each clamped to +-10."""
    logp, ref = logp * m, ref * m
    value = logp - ref if kind == "k1" else k3_of(ref - logp)
    return value.clamp(-10, 10)


def _fork_steps(per_token: Tensor, b: Batch) -> Tensor:
    """train.py's gradient accumulation, one response per micro-batch (micro_bs 1, collate_mode padding): each
    micro-batch's loss is _apply_mask's (per-token loss x mask).sum() / max_tokens, max_tokens = sum(seq_lens) with
    normalize_batch_to_token_count, the response's prompt and response tokens (data.py: seq_lens is
    len(input_ids), the prompt's tokens and the output's, unpadded), divided by num_grad_acc_steps and summed
    by backward (FSDP then averages the processes' gradients: over processes of equal rows, the same mean)."""
    steps = per_token.shape[0]
    total = per_token.new_zeros(())
    for i in range(steps):
        max_tokens = int(b.prompt[i]) + int(b.mask[i].sum())
        total = total + (per_token[i] * b.mask[i]).sum() / max_tokens / steps
    return total


def paper(b: Batch, beta: float, kind: str | None, where: str | None) -> Tensor:
    """tba_loss: advantage R - log Z (log Z the group's mean reward), the token ratio clamped to [0, 8], each response's
    token sum over its prompt's and its response's tokens (_fork_steps), averaged over responses."""
    adv = b.rewards - group_mean(b.rewards, b.group)
    if where == "reward":
        current = _fork_kl(kind, b.logp.detach(), b.ref, b.mask).sum(-1)
        mean_kl = group_mean(_fork_kl(kind, b.old, b.ref, b.mask).sum(-1), b.group)  # train.py: kl_avg_list, mu's
        adv = adv - beta * (current - mean_kl)
    per_token = -torch.clamp(torch.exp(b.logp - b.old), 0, 8) * adv.unsqueeze(-1)
    if where == "loss":
        per_token = per_token + beta * _fork_kl(kind, b.logp, b.ref, b.mask)
    return _fork_steps(per_token, b)


def paper_icepop(b: Batch, beta: float) -> Tensor:
    """icepop_loss: each response's kept terms summed, over loss_scale (train.py's max_tokens, as _fork_steps)."""
    ratio = torch.exp(b.logp - b.old)
    keep = (ratio >= 0.125) & (ratio <= 8.0)
    adv = (b.rewards - group_mean(b.rewards, b.group)).unsqueeze(-1)
    return _fork_steps(torch.where(keep, -ratio * adv, 0.0), b)


def prime_rl(b: Batch, beta: float) -> Tensor:
    """default_loss_fn: -keep A r + kl_tau (log pi - log mu)^2 per loss token, r = pi / mu (mu the engine's log-probs,
    the trainer's mu here), keep dropping tokens whose probability moved beyond 0.2 in the advantage's direction;
    summed and divided by the loss tokens (train.py's loss_scale). The preset's beta is 2 kl_tau."""
    adv = rloo(b.rewards, b.group).unsqueeze(-1)
    log_ratio = b.logp - b.old
    moved = torch.exp(b.logp) - torch.exp(b.old)
    invalid = torch.where(adv > 0, moved > 0.2, moved < -0.2)
    keep = (~invalid).to(b.logp.dtype)
    per_token = -keep * adv * torch.exp(log_ratio) + (beta / 2) * log_ratio ** 2
    return token_mean(per_token, b.mask)


# The presets whose library minimises another value with the same gradient (a surrogate): their losses are compared
# by gradient only. verl's DPPO: -A sg(w) log pi, klstudy's -A sg(w); OpenRLHF's unbiased_gradient: the chosen
# estimator's detached value, klstudy's sg(w) k2.
SURROGATE_VALUES = {"verl-dppo-tv", "verl-dppo-kl", "openrlhf-unbiased"}

LIBRARIES = {
    "verl": verl, "verl-k3+": lambda b, beta: verl(b, beta, plus=True), "verl-reward": verl_reward,
    "verl-dppo-tv": lambda b, beta: verl_dppo(b, beta, "tv"), "verl-dppo-kl": lambda b, beta: verl_dppo(b, beta, "kl"),
    "openrlhf": openrlhf, "openrlhf-unbiased": openrlhf_unbiased, "trl-grpo": trl_grpo,
    "trl-grpo-bias-corrected": lambda b, beta: trl_grpo(b, beta, bias_corrected=True), "trl-rloo": trl_rloo,
    "nemo-rl": nemo_rl, "nemo-rl-on-policy-kl": lambda b, beta: nemo_rl(b, beta, engine=True),
    "nemo-rl-reward": nemo_rl_reward, "slime": slime, "slime-grpo-reward-kl": slime_grpo, "skyrl": skyrl,
    "open-instruct": open_instruct,
    "paper-k1-reward": lambda b, beta: paper(b, beta, "k1", "reward"),
    "paper-k3-reward": lambda b, beta: paper(b, beta, "k3", "reward"),
    "paper-k1-loss": lambda b, beta: paper(b, beta, "k1", "loss"),
    "paper-k3-loss": lambda b, beta: paper(b, beta, "k3", "loss"),
    "paper-grpo": lambda b, beta: paper(b, beta, None, None),
    "paper-icepop": paper_icepop,
    "paper-k1-reward-reset50": lambda b, beta: paper(b, beta, "k1", "reward"),
    "prime-rl": prime_rl,
}
