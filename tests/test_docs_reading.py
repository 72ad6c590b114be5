"""What the documentation costs its reader, held as numbers: the prose of README.md and docs/ (the
changelog and the pages written from the code aside) at most 30,000 words; each task page at most 1,200
words, opening with its whole recipe as a block of commands; no klstudy commit hash in the guides or
docs/testing.md (history is the changelog's); and each glossary term linked to the glossary at its first
use on a page. Model-free."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify
from test_docs_history import TERMS, glossary_entries, markdown_files

REPO = Path(__file__).resolve().parent.parent
PROSE_BUDGET = 30_000
TASK_PAGE_WORDS, RECIPE_WITHIN_LINES = 1_200, 40
# The four task pages: a reader copies the block at the top and runs it (a test runs each of them).
TASK_PAGES = ("docs/guides/slurm.md", "docs/guides/own_objective.md", "docs/guides/resuming.md",
              "docs/mlflow_ui.md")
# Pages written from the code (docs/gen_reference.py): looked up, not read through; they say so in their
# second line, and a test keeps them current.
GENERATED = "by `python docs/gen_reference.py --write`"
LEFT_OUT = {"docs/changelog.md"}

# How each glossary term (TERMS: a term -> its heading) is written in prose; acronyms by their case.
SPELLINGS = {
    "sg(": r"\bsg\(",
    "TIS": r"\bTIS\b",
    "IcePop": r"\bIcePop\b",
    "FSDP2": r"\bFSDP2?\b",
    "external-launcher mode": r"(?i)\bexternal[- ]launcher\b",
    "lease generation": r"(?i)\blease generations?\b",
    "follower": r"(?i)\bfollowers?\b",
    "k1/k2/k3": r"\bk[123]\b",
    "placement": r"(?i)\bplacements?\b",
    "grid point": r"(?i)\bgrid points?\b",
    "run id": r"(?i)\brun ids?\b",
    "bundle": r"(?i)\bbundles?\b",
    "preset": r"(?i)\bpresets?\b",
    "reward-to-go": r"(?i)\breward-to-go\b",
    "RLOO/GRPO advantages": r"\b(?:RLOO|GRPO)\b",
    "pass@1": r"(?i)\bpass@1\b",
    "objective gap": r"(?i)\bobjective gaps?\b",
}
SPELLINGS = {term: spelling.replace(" ", r"\s+") for term, spelling in SPELLINGS.items()}  # a term may wrap
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]*)\)")


def words(page: str) -> int:
    return len((REPO / page).read_text(encoding="utf-8").split())


def prose_pages() -> list[str]:
    return [page for page in markdown_files() if (page == "README.md" or page.startswith("docs/"))
            and page not in LEFT_OUT and GENERATED not in (REPO / page).read_text(encoding="utf-8")[:400]]


def test_the_prose_is_within_its_budget():
    counts = {page: words(page) for page in prose_pages()}
    total = sum(counts.values())
    largest = ", ".join(f"{page} {n}" for page, n in sorted(counts.items(), key=lambda kv: -kv[1])[:5])
    assert total <= PROSE_BUDGET, \
        f"README and docs hold {total} words of prose (at most {PROSE_BUDGET}); the largest: {largest}"


@pytest.mark.parametrize("page", TASK_PAGES)
def test_a_task_page_is_short_and_opens_with_its_recipe(page):
    assert words(page) <= TASK_PAGE_WORDS, f"{page}: {words(page)} words (a task page holds at most {TASK_PAGE_WORDS})"
    opening = "\n".join((REPO / page).read_text(encoding="utf-8").splitlines()[:RECIPE_WITHIN_LINES])
    assert re.search(r"^```bash\n(?:.*\n){2,}", opening, re.M), \
        f"{page}: no block of commands in its first {RECIPE_WITHIN_LINES} lines"


def klstudy_commits(text: str) -> set[str]:
    """The hex words of `text` that name a commit of this repository (a peer's commit is no history of ours)."""
    found = set()
    for word in set(re.findall(r"\b[0-9a-f]{7,40}\b", text)):
        known = subprocess.run(["git", "cat-file", "-e", f"{word}^{{commit}}"], cwd=REPO, capture_output=True)
        if known.returncode == 0 and re.search(r"[a-f]", word) and re.search(r"\d", word):
            found.add(word)
    return found


@pytest.mark.parametrize("page", [p for p in markdown_files()
                                  if p.startswith("docs/guides/") or p == "docs/testing.md"])
def test_no_guide_names_a_klstudy_commit(page):
    assert not klstudy_commits((REPO / page).read_text(encoding="utf-8")), \
        f"{page} names klstudy commits (history belongs in docs/changelog.md)"


def test_a_commit_of_this_repository_is_found_and_a_peers_is_not():
    head = subprocess.run(["git", "rev-parse", "--short=8", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()
    if not re.search(r"[a-f]", head) or not re.search(r"\d", head):
        pytest.skip("HEAD's short hash is all digits or all letters")
    assert klstudy_commits(f"measured at {head}, against verl at 1dda039b") == {head}


def prose_mask(text: str) -> str:
    """`text` with what is not prose blanked, at the same offsets: fenced blocks, inline code, HTML
    comments, headings and link targets."""
    def blank(match: re.Match) -> str:
        return re.sub(r"[^\n]", " ", match.group(0))

    for pattern in (r"(?ms)^```.*?^```", r"(?s)<!--.*?-->", r"`[^`\n]*`", r"(?m)^#.*$"):
        text = re.sub(pattern, blank, text)
    return re.sub(r"(\]\()([^)\s]*)(\))", lambda m: m.group(1) + " " * len(m.group(2)) + m.group(3), text)


def explained_on(body: str, glossary_page: Path) -> set[str]:
    """The pages (from the repository root) that a glossary entry names as explaining its term."""
    return {str((glossary_page.parent / target.split("#")[0]).resolve().relative_to(REPO))
            for target in re.findall(r"\]\(([^)#\s][^)\s]*)\)", body)}


def unlinked_first_uses(page: str) -> list[str]:
    """The glossary terms whose first use in `page`'s prose is not a link to their glossary entry."""
    glossary = REPO / "docs" / "glossary.md"
    entries = glossary_entries()
    text = (REPO / page).read_text(encoding="utf-8")
    prose = prose_mask(text)
    links = [(m.start(), m.end(), m.group(2)) for m in LINK.finditer(text)]
    missing = []
    for term, heading in TERMS.items():
        if page in explained_on(entries[heading], glossary):
            continue
        first = re.search(SPELLINGS[term], prose)
        if not first:
            continue
        target = next((t for start, end, t in links if start <= first.start() < end), "")
        if not target.endswith(f"glossary.md#{slugify(heading, '-')}"):
            line = text[:first.start()].count("\n") + 1
            missing.append(f"{term} (line {line}: link it to glossary.md#{slugify(heading, '-')})")
    return missing


def test_every_glossary_term_has_a_spelling():
    assert set(SPELLINGS) == set(TERMS)


@pytest.mark.parametrize("page", [p for p in prose_pages() if p != "docs/glossary.md"])
def test_each_term_is_linked_to_the_glossary_at_its_first_use(page):
    assert not unlinked_first_uses(page), f"{page}: " + "; ".join(unlinked_first_uses(page))


def test_the_first_use_check_sees_a_link_and_skips_code():
    assert re.search(SPELLINGS["bundle"], prose_mask("`bundle.train`\n```\nbundle\n```\n# A bundle\n")) is None
    assert re.search(SPELLINGS["bundle"], prose_mask("# A heading\n\nthe bundle\n"))
    text = "Each [bundle](glossary.md#bundle) and a bundle."
    first = re.search(SPELLINGS["bundle"], prose_mask(text))
    assert text[first.start() - 1] == "["
