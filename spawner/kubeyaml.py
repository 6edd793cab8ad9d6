"""YAML for Kubernetes and its engines: text that their Go parsers read back as the values written.

PyYAML writes a string plain unless PyYAML itself would read it as another type (YAML 1.1). Kubernetes
(`sigs.k8s.io/yaml`, over go-yaml v2) and the engines' configuration readers resolve more plain scalars:
`6214e9` (an exponent without a dot or sign: a Philly virtual cluster's name, and so a team's), `0o17`, `0X1F`,
`1_000` (Go's base prefixes and digit separators) as numbers, `y` and `n` as booleans. Written plain, a label
value or a queue name of that form comes back as another type, and `kubectl apply` refuses the object ("cannot
unmarshal number into … of type string"). Such strings are quoted here; everything else is PyYAML's safe dump,
no anchors, block literals for text of several lines (policy files, device plugin configs), the same bytes for
the same input.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

#: go-yaml v2's words for booleans, nulls and special floats (its `resolve.go`), PyYAML's among them.
GO_WORDS = frozenset({
    "y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON",
    "n", "N", "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF",
    "", "~", "null", "Null", "NULL", ".nan", ".NaN", ".NAN", "<<",
    *(f"{sign}{inf}" for sign in ("", "+", "-") for inf in (".inf", ".Inf", ".INF")),
})
#: What go-yaml v2 reads as a number once it has dropped every `_`: Go's integers of any base prefix
#: (`strconv.ParseInt(s, 0, 64)`) and its YAML-style floats.
GO_NUMBER = re.compile(r"[-+]?(0[xX][0-9a-fA-F]+|0[oO][0-7]+|0[bB][01]+|[0-9]+"
                       r"|(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?)")


def go_reads_as_another_type(value: str) -> bool:
    """Whether go-yaml v2 reads `value`, written plain, as something other than this string."""
    return value in GO_WORDS or bool(GO_NUMBER.fullmatch(value.replace("_", "")))


class Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else "'" if go_reads_as_another_type(value) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


Dumper.add_representer(str, _text)


def dump_all(documents: list[Any]) -> str:
    """Multi-document YAML (`---` before each), as `kubectl apply -f` reads it."""
    return yaml.dump_all(documents, Dumper=Dumper, sort_keys=True, allow_unicode=True, explicit_start=True,
                         default_flow_style=False, width=120)


def dump(document: Any, sort_keys: bool = True) -> str:
    """One document (a ConfigMap key's text); `sort_keys` False keeps the mappings' own order."""
    return yaml.dump(document, Dumper=Dumper, sort_keys=sort_keys, allow_unicode=True, default_flow_style=False,
                     width=120)
