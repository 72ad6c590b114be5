"""The table of what has run where is one source (docs/what_has_run.yaml) shown on three pages: each
page's table is the YAML's, its links relative to the page and resolving in the repository."""

from __future__ import annotations

import os
import re
from pathlib import Path

from docs import what_has_run

REPO = Path(__file__).resolve().parents[1]


def test_every_pages_table_is_the_sources():
    assert what_has_run.stale() == [], "run: python docs/what_has_run.py --write"


def test_the_tables_links_resolve_from_each_page():
    for page in what_has_run.PAGES:
        targets = re.findall(r"\]\(([^)#\s]+)", what_has_run.table(page))
        assert targets, page
        for target in targets:
            assert (REPO / os.path.dirname(page) / target).is_file(), (page, target)


def test_a_changed_source_shows_as_a_stale_page(tmp_path, monkeypatch):
    source = tmp_path / "what_has_run.yaml"
    source.write_text(what_has_run.SOURCE.read_text().replace('gpu: "', 'gpu: "changed: ', 1))
    monkeypatch.setattr(what_has_run, "SOURCE", source)
    assert what_has_run.stale() == list(what_has_run.PAGES)
