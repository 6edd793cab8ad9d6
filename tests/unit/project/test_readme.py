"""The README and docs/: the two commands first, a page per component linked from the README, no broken link,
and the generated references (policies, reason codes) current."""

import re
from pathlib import Path

import pytest

from gpupool.policies.admission import reason_reference
from gpupool.policies.reference import policy_reference

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))


def generated(path: Path, marker: str) -> str:
    text = path.read_text()
    start = text.index(f"<!-- {marker}:start")
    return text[text.index("\n", start) + 1 : text.index(f"<!-- {marker}:end -->")]


def test_policy_reference_in_the_docs_is_current():
    assert generated(DOCS / "policies.md", "policy-reference") == policy_reference() + "\n", (
        "regenerate with `gpupool policy reference`")


def test_readme_starts_with_the_two_commands():
    head = README.read_text().split("\n\n", 2)[1]
    assert "make up" in head and "make test" in head


def test_reason_codes_in_the_docs_are_current():
    assert generated(DOCS / "admission.md", "reason-codes") == reason_reference() + "\n", (
        "regenerate the table with reason_reference()")


def test_the_readme_links_every_docs_page():
    linked = set(re.findall(r"\]\(docs/([^)#]+\.md)", README.read_text()))
    assert linked == {page.name for page in PAGES}


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)  # no headings inside code
    return {anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(path):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, fragment = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists() or (fragment and linked.suffix == ".md" and fragment not in anchors(linked)):
            broken.append(target)
    assert broken == []


def test_the_readme_says_how_to_stop_and_what_keeps_running():
    text = README.read_text()
    stopping = text[text.index("## Starting and stopping"):text.index("## Running as root or not")]
    assert "`gpupool down`" in stopping and "Ctrl-C" in stopping and "`gpupool down --servers`" in stopping
    assert "keep running" in stopping
