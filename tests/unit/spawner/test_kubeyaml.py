"""`spawner.kubeyaml`: strings that Kubernetes' YAML parser (go-yaml v2) would read as another type are quoted;
the text reads back, in PyYAML, as the values written."""

from __future__ import annotations

import string

import yaml
from hypothesis import given, settings, strategies as st

from gpupool.spawner import kubeyaml

#: Plain scalars go-yaml v2 reads as numbers or booleans (its resolve.go: Go's integers of any base prefix once
#: `_` is dropped, YAML-style floats, y/n) and PyYAML as strings: PyYAML's safe dump wrote them plain.
GO_NOT_STRINGS = ["6214e9", "1e5", "1E-3", "+2e10", "7e04", "0o17", "0O17", "-0o17", "0X1F", "0B11", "0o1_7",
                  "1_0e5", "y", "Y", "n", "N"]


def test_strings_go_yaml_reads_as_another_type_are_quoted():
    values = {f"k{i}": value for i, value in enumerate(GO_NOT_STRINGS)}
    plain_before = yaml.safe_dump(values)
    text = kubeyaml.dump(values)
    for value in GO_NOT_STRINGS:
        assert f": {value}\n" in plain_before  # what PyYAML alone writes, and go-yaml misreads
        assert f": '{value}'\n" in text
    assert yaml.safe_load(text) == values


def test_other_names_stay_plain_and_text_stays_a_block():
    text = kubeyaml.dump_all([{"name": "vision", "team": "e13805x", "cpu": "16Gi", "file": "a: 1\nb: 2\n"}])
    assert text.startswith("---\n") and "name: vision\n" in text and "team: e13805x\n" in text
    assert "cpu: 16Gi\n" in text and "file: |\n  a: 1\n  b: 2\n" in text


@settings(deadline=None)
@given(st.dictionaries(st.text(string.ascii_letters + string.digits + "-.+_~", min_size=1, max_size=8),
                       st.text(string.ascii_letters + string.digits + "-.+_~", max_size=10), max_size=6))
def test_every_string_reads_back_as_written(mapping):
    assert yaml.safe_load(kubeyaml.dump(mapping)) == mapping
