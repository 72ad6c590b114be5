"""The objective's registries beyond the estimators: the policy-gradient ratio, the KL-loss ratio and the
aggregation. Each choice is one registered function whose docstring is its theory note; the config, the loss
and the audit all pick a registration up."""

from __future__ import annotations

import pytest
import torch

from trainer.audits import peers_audit
from trainer.audits.audit import audit_configs
from trainer.objective import kl_loss_ratios, loss_aggs, pg_ratios
from trainer.objective.loss import aggregate
from trainer.objective.objective_config import ObjectiveConfig

REGISTRIES = {"pg_ratio": pg_ratios.REGISTRY, "kl_loss_ratio": kl_loss_ratios.REGISTRY, "loss_agg": loss_aggs.REGISTRY}


@pytest.mark.parametrize("key", REGISTRIES)
def test_every_registered_choice_has_its_theory_note_and_its_audit_row(key):
    registry = REGISTRIES[key]
    assert all(spec.theory for spec in registry), [spec.name for spec in registry if not spec.theory]
    configs = [case.config for case in peers_audit.addition_cases()]
    audited = {getattr(config, key) for config in configs if key != "kl_loss_ratio" or config.kl_in_loss}
    if key != "loss_agg":  # the gradient audit's rows: (sampling, estimator, placement, kl_loss_ratio, pg_ratio)
        audited |= {row[3 if key == "kl_loss_ratio" else 4] for row in audit_configs()}
    assert set(registry.names) <= audited, set(registry.names) - audited


def _isolate(monkeypatch, registry) -> None:
    monkeypatch.setattr(registry, "_specs", dict(registry._specs))  # undone after the test


def test_a_new_aggregation_is_one_registration_that_the_config_the_loss_and_the_audit_pick_up(monkeypatch):
    _isolate(monkeypatch, loss_aggs.REGISTRY)

    @loss_aggs.register("seq-sum")
    def seq_sum(masked, mask, rows, tokens, norm_length):
        """The batch's token sum: the sum of its responses' (a plugin's aggregation)."""
        return masked.sum()

    config = ObjectiveConfig(loss_agg="seq-sum")
    per_token, mask = torch.ones(2, 3, dtype=torch.float64), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert float(aggregate(per_token, mask, config.loss_agg)) == 3.0
    assert "norm_length" in config.inert_fields()
    labels = [case.label for case in peers_audit.addition_cases()]
    assert "k3 loss, seq-sum" in labels


def test_a_new_ratio_gets_its_own_audit_rows(monkeypatch):
    _isolate(monkeypatch, kl_loss_ratios.REGISTRY)
    _isolate(monkeypatch, pg_ratios.REGISTRY)

    @kl_loss_ratios.register("half")
    def half(logp, ratio, sequence, engine_logp):
        """beta * 0.5 * k: half the coefficient (a plugin's weight)."""
        return ratio.detach().new_full(ratio.shape, 0.5)

    pg_ratios.register("token-again")(pg_ratios.token_ratio)
    rows = {(r.label, r.sampling): r for r in peers_audit.additions_audit(seeds=(0,), progress=False)
            if r.label in ("k3 loss, half", "token-again ratio")}
    assert set(rows) == {("k3 loss, half", "on-policy"), ("k3 loss, half", "off-policy"),
                         ("token-again ratio", "off-policy")}
    assert rows["k3 loss, half", "on-policy"].verdict == "scaled per-prefix forward"


def test_an_unknown_choice_is_named_with_the_registered_ones():
    with pytest.raises(ValueError, match=r"objective.loss_agg: 'sum' is not one of seq-mean-token-sum, "):
        ObjectiveConfig(loss_agg="sum")
