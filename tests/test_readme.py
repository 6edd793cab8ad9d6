"""The README's policy reference and the docs' reason codes are the ones generated from the code."""

from pathlib import Path

from gpupool.hub.accounting.admission import reason_reference
from gpupool.policies.reference import policy_reference

README = Path(__file__).resolve().parent.parent / "README.md"


def test_policy_reference_in_readme_is_current():
    text = README.read_text()
    start = text.index("<!-- policy-reference:start")
    body = text[text.index("\n", start) + 1 : text.index("<!-- policy-reference:end -->")]
    assert body == policy_reference() + "\n", "regenerate with `gpupool policy reference`"


def test_readme_starts_with_the_two_commands():
    head = README.read_text().split("\n\n", 2)[1]
    assert "make up" in head and "make test" in head


def test_reason_codes_in_the_docs_are_current():
    text = (README.parent / "docs" / "admission.md").read_text()
    start = text.index("<!-- reason-codes:start")
    body = text[text.index("\n", start) + 1 : text.index("<!-- reason-codes:end -->")]
    assert body == reason_reference() + "\n", "regenerate the table with reason_reference()"
