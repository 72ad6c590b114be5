"""A file shown in a page (docs/includes.py's blocks) is the file as it is in the repository."""

from __future__ import annotations

from pathlib import Path

from docs import includes

REPO = Path(__file__).resolve().parents[1]


def test_every_included_block_is_its_file():
    assert includes.stale() == [], "run: python docs/includes.py --write"
    pages = {page.name for page in includes.pages() if includes.included(page)}
    assert "own_objective.md" in pages  # the blocks were found


def test_a_changed_file_shows_as_a_stale_block(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("")
    (tmp_path / "shown.py").write_text("x = 1\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text("text\n<!-- include: shown.py -->\n```python\nx = 1\n```\n<!-- /include -->\n")
    monkeypatch.setattr(includes, "REPO", tmp_path)
    assert includes.stale() == []
    (tmp_path / "shown.py").write_text("x = 2\n")
    assert includes.stale() == ["docs/page.md: shown.py"]
    assert includes.write() == ["docs/page.md"] and "x = 2\n```" in page.read_text() and includes.stale() == []
