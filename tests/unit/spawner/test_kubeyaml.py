"""`spawner.kubeyaml`: strings that Kubernetes' YAML parser (go-yaml) would read as numbers are quoted; the text
reads back, in PyYAML, as the values written."""

from __future__ import annotations

import string

import yaml
from hypothesis import given, strategies as st

from gpupool.spawner import kubeyaml

#: go-yaml's plain-scalar number forms that PyYAML reads as strings (and so wrote plain before).
GO_NUMBERS = ["6214e9", "1e5", "1E-3", "+2e10", "0o17", "7e04"]


def test_strings_go_yaml_reads_as_numbers_are_quoted():
    text = kubeyaml.dump({"labels": {f"k{i}": value for i, value in enumerate(GO_NUMBERS)}})
    for value in GO_NUMBERS:
        assert f": '{value}'\n" in text
    assert yaml.safe_load(text) == {"labels": {f"k{i}": value for i, value in enumerate(GO_NUMBERS)}}


def test_other_names_stay_plain_and_text_stays_a_block():
    text = kubeyaml.dump_all([{"name": "vision", "team": "e13805x", "file": "a: 1\nb: 2\n"}])
    assert text.startswith("---\n") and "name: vision\n" in text and "team: e13805x\n" in text
    assert "file: |\n  a: 1\n  b: 2\n" in text


@given(st.dictionaries(st.text(string.ascii_lowercase + string.digits + "-.+", min_size=1, max_size=8),
                       st.text(string.ascii_lowercase + string.digits + "-.+eEo", max_size=10), max_size=6))
def test_every_string_reads_back_as_written(mapping):
    assert yaml.safe_load(kubeyaml.dump(mapping)) == mapping
    for line in kubeyaml.dump(mapping).splitlines():
        value = line.partition(": ")[2]
        assert not kubeyaml.GO_NUMBER.fullmatch(value), line  # never plain where go-yaml reads a number
