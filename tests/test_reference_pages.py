"""The reference pages (docs/reference/*.md, the shipped studies, the benchmarks index) are files in the
repository, written from the code by docs/gen_reference.py: each one is what its source makes now."""

from __future__ import annotations

from pathlib import Path

from docs import gen_reference

REPO = Path(__file__).resolve().parents[1]


def test_every_reference_page_is_what_its_source_makes():
    assert gen_reference.stale() == [], "run: python docs/gen_reference.py --write"


def test_a_changed_source_shows_as_a_stale_page(monkeypatch):
    page = "reference/run-config.md"
    monkeypatch.setitem(gen_reference.PAGES, page, lambda: gen_reference.run_config_page().replace("`> 0`", "`>= 0`"))
    assert gen_reference.stale() == [page]


def test_the_run_config_reference_shows_each_keys_bound_and_choices():
    """Read in the repository: the bounds and choices that trainer/config.py declares beside its fields."""
    text = (REPO / "docs" / "reference" / "run-config.md").read_text()
    assert "| `train.lr` | `float` | `0.0001` | `> 0` |" in text
    assert "| `rollout.engine` | `str` | `hf` | one of `hf`, `vllm` |" in text
