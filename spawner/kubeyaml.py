"""YAML for Kubernetes and its engines: text that their Go parsers read back as the values written.

PyYAML writes a string plain unless PyYAML itself would read it as another type (YAML 1.1). Kubernetes
(`sigs.k8s.io/yaml`, over go-yaml) and Volcano's and YuniKorn's configuration readers resolve more plain
scalars as numbers: `6214e9` (an exponent without a dot or sign, a Philly virtual cluster's name and so a
team's) and `0o17` (YAML 1.2's octal). Written plain, a label value or a queue name of that form comes back a
number, and `kubectl apply` refuses the object ("cannot unmarshal number into … of type string"). Such
strings are quoted here; everything else is PyYAML's safe dump, sorted keys, no anchors, block literals for
text of several lines (policy files, device plugin configs), the same bytes for the same input.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

#: Plain scalars that go-yaml resolves as numbers and PyYAML as strings (its own number forms it quotes already).
GO_NUMBER = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|0o[0-7]+")


class Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else "'" if GO_NUMBER.fullmatch(value) else None
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
