"""One source for each number the docs repeat: docs/numbers.yaml states it once, and every page that
quotes it says it in those words; the studies a guide lists and the install extras the pages name come
from the repository itself (workflow/config/, the Makefile)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
NUMBERS = yaml.safe_load((REPO / "docs" / "numbers.yaml").read_text())


@pytest.mark.parametrize("name", sorted(NUMBERS))
def test_every_page_quotes_the_number_as_stated(name):
    fact = NUMBERS[name]
    assert len(fact["quoted"]) >= 2, f"{name}: a number on one page needs no entry"
    for page in fact["quoted"]:
        text = " ".join((REPO / page).read_text().split())  # a phrase may break across lines
        assert fact["says"] in text, f"{page} should say {fact['says']!r} ({name}, docs/numbers.yaml)"


def test_the_fast_tier_time_is_the_measured_one():
    """The tiers' table in docs/testing.md is where `make test-fast` was timed: the pages' "about N
    minutes" is that time, rounded."""
    row = next(line for line in (REPO / "docs" / "testing.md").read_text().splitlines()
               if line.startswith("| `make test-fast`"))
    minutes, seconds = map(int, re.search(r"(\d+) min (\d+) s", row).groups())
    said = int(re.search(r"about (\d+) minutes", NUMBERS["test_fast"]["says"]).group(1))
    assert round(minutes + seconds / 60) == said, row


def test_the_study_guide_lists_every_study_config():
    guide = (REPO / "docs" / "guides" / "study.md").read_text()
    section = guide[guide.index("### The study configs"):]
    section = section[:section.index("\n#", 1)]
    shipped = {path.name for path in (REPO / "workflow" / "config").glob("*.yaml")} - {"schema.yaml"}
    listed = set(re.findall(r"`([\w-]+\.yaml)`", section))
    assert shipped - listed == set(), "docs/guides/study.md, The study configs, leaves out these"
    assert listed - shipped == set(), "docs/guides/study.md, The study configs, names files that do not exist"
    assert not re.search(r"\b(two|three|four|five|six|seven|eight|nine|ten|\d+) studies\b", section)


def test_the_pages_name_the_extras_that_make_setup_installs():
    makefile = (REPO / "Makefile").read_text()
    extras = re.search(r'^\t\$\(BIN\)/python -m pip install --quiet -e "(\.\[[\w,-]+\])"$', makefile, re.M).group(1)
    for page in ("README.md", "docs/index.md"):
        named = re.findall(r'pip install -e "(\.\[[\w,-]*\])"', (REPO / page).read_text())
        assert named and set(named) == {extras}, (page, named, extras)
