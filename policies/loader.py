"""Read a policy directory: every `*.yaml` file in it, merged into one checked `Policy`.

The YAML is read with PyYAML's safe composer and turned into plain data by our own walk, so that every
value keeps its file, line and column, duplicate keys and non-standard tags are refused, alias expansion
is bounded, and non-finite or negative numbers never reach the model. Any problem is reported as
`file:line:column: path: message`, and nothing is returned unless the whole directory is valid.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path as FilePath
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from gpupool.policies.model import Policy
from gpupool.policies.references import Path, check_references

MAX_FILE_BYTES = 1 << 20
#: Values built from one file, aliases expanded; bounds "billion laughs" documents.
MAX_NODES = 50_000
MAX_DEPTH = 32

SECTIONS = tuple(Policy.model_fields)
MERGED_SECTIONS = ("models", "profiles", "teams")  # may be spread over several files, one key each

_STR, _INT, _FLOAT, _BOOL, _NULL, _MAP, _SEQ = (
    f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "map", "seq")
)
_SCALAR_TAGS = {_STR, _INT, _FLOAT, _BOOL, _NULL}


@dataclass(frozen=True)
class PolicyProblem:
    file: str
    line: int
    column: int
    path: Path
    message: str

    def __str__(self) -> str:
        where = ".".join(str(p) for p in self.path)
        return f"{self.file}:{self.line}:{self.column}: {where + ': ' if where else ''}{self.message}"


class PolicyError(ValueError):
    """An invalid policy directory; `problems` lists every problem found."""

    def __init__(self, problems: list[PolicyProblem]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))

    def report(self, directory: object, outcome: str) -> str:
        """Every problem on a line, then how many and what did not happen (for commands' stderr)."""
        return f"{self}\n{len(self.problems)} problem(s) in {directory}; {outcome}"


@dataclass
class _Source:
    """Where each value and each key came from."""

    values: dict[Path, tuple[str, int, int]]
    keys: dict[Path, tuple[str, int, int]]

    def locate(self, path: Path, prefer_key: bool = False) -> tuple[str, int, int]:
        for table in ((self.keys, self.values) if prefer_key else (self.values, self.keys)):
            if path in table:
                return table[path]
        for end in range(len(path) - 1, -1, -1):
            prefix = path[:end]
            if prefix in self.values:
                return self.values[prefix]
        return next(iter(self.values.values()), ("<policy>", 1, 1))


class _FileProblem(Exception):
    def __init__(self, node_or_mark: Any, path: Path, message: str):
        mark = getattr(node_or_mark, "start_mark", node_or_mark)
        self.line = mark.line + 1 if mark is not None else 1
        self.column = mark.column + 1 if mark is not None else 1
        self.path = path
        super().__init__(message)


class _Walker:
    """Turns a composed YAML node tree into plain Python data, recording where each value came from."""

    def __init__(self, file: str, loader: yaml.SafeLoader, source: _Source):
        self.file = file
        self.loader = loader
        self.source = source
        self.nodes = 0

    def mark(self, node: yaml.Node) -> tuple[str, int, int]:
        return (self.file, node.start_mark.line + 1, node.start_mark.column + 1)

    def walk(self, node: yaml.Node, path: Path, depth: int = 0) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise _FileProblem(node, path, f"document too large: more than {MAX_NODES} values once aliases "
                                           "are expanded (an alias bomb?)")
        if depth > MAX_DEPTH:
            raise _FileProblem(node, path, f"nested deeper than {MAX_DEPTH} levels (a recursive alias?)")
        self.source.values.setdefault(path, self.mark(node))
        if isinstance(node, yaml.MappingNode):
            if node.tag != _MAP:
                raise self._bad_tag(node, path)
            result: dict[str, Any] = {}
            first: dict[str, yaml.Node] = {}
            for key_node, value_node in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    raise _FileProblem(key_node, path, "merge keys (<<) are not accepted; write the keys out")
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != _STR:
                    raise _FileProblem(key_node, path, "keys must be plain strings (quote numbers used as keys)")
                key = key_node.value
                if key in first:
                    raise _FileProblem(
                        key_node, path + (key,),
                        f"duplicate key {key!r} (first at line {first[key].start_mark.line + 1})",
                    )
                first[key] = key_node
                self.source.keys[path + (key,)] = self.mark(key_node)
                result[key] = self.walk(value_node, path + (key,), depth + 1)
            return result
        if isinstance(node, yaml.SequenceNode):
            if node.tag != _SEQ:
                raise self._bad_tag(node, path)
            return [self.walk(item, path + (i,), depth + 1) for i, item in enumerate(node.value)]
        if node.tag not in _SCALAR_TAGS:
            raise self._bad_tag(node, path)
        value = self.loader.construct_object(node)
        if isinstance(value, float) and not math.isfinite(value):
            raise _FileProblem(node, path, f"{node.value!r} is not a finite number (accepted: finite numbers)")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise _FileProblem(node, path, f"negative number {node.value} (accepted: numbers ≥ 0)")
        return value

    def _bad_tag(self, node: yaml.Node, path: Path) -> _FileProblem:
        tag = node.tag.replace("tag:yaml.org,2002:", "!!")
        if tag == "!!timestamp":
            return _FileProblem(node, path, f"{node.value!r} reads as a date; quote it if it is a string")
        return _FileProblem(
            node, path, f"tag {tag} is not accepted (accepted: plain strings, numbers, booleans, null, "
                        "mappings and lists)"
        )


def _read_file(file: FilePath, display: str, source: _Source) -> dict[str, Any]:
    size = file.stat().st_size
    if size > MAX_FILE_BYTES:
        raise _FileProblem(None, (), f"file is {size} bytes (accepted: at most {MAX_FILE_BYTES})")
    raw = file.read_bytes()
    if b"\x00" in raw:
        at = raw.index(b"\x00")
        line = raw.count(b"\n", 0, at)
        raise _FileProblem(yaml.Mark(display, at, line, at - (raw.rfind(b"\n", 0, at) + 1), None, None), (),
                           "binary data (a NUL byte) where a YAML text file was expected")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw.count(b"\n", 0, error.start)
        column = error.start - (raw.rfind(b"\n", 0, error.start) + 1)
        raise _FileProblem(yaml.Mark(display, error.start, line, column, None, None), (),
                           "not UTF-8 text (accepted: a YAML file in UTF-8)") from None
    def unprintable(error: yaml.reader.ReaderError) -> _FileProblem:
        at = error.position
        mark = yaml.Mark(display, at, text.count("\n", 0, at), at - (text.rfind("\n", 0, at) + 1), None, None)
        return _FileProblem(mark, (), f"character #x{error.character:04x} is not allowed in YAML (binary data?)")

    try:
        loader = yaml.SafeLoader(text)
    except yaml.reader.ReaderError as error:
        raise unprintable(error) from None
    try:
        try:
            node = loader.get_single_node()
        except yaml.reader.ReaderError as error:
            raise unprintable(error) from None
        except yaml.MarkedYAMLError as error:
            raise _FileProblem(error.problem_mark, (), f"not valid YAML: {error.problem or error}") from None
        except yaml.YAMLError as error:
            raise _FileProblem(None, (), f"not valid YAML: {error}") from None
        if node is None:
            raise _FileProblem(None, (), "file is empty (accepted: a mapping of sections: " + ", ".join(SECTIONS) + ")")
        if not isinstance(node, yaml.MappingNode):
            raise _FileProblem(node, (), "the file must be a mapping of sections: " + ", ".join(SECTIONS))
        data = _Walker(display, loader, source).walk(node, ())
    finally:
        loader.dispose()
    for key in data:
        if key not in SECTIONS:
            raise _FileProblem(None, (key,), f"unknown section {key!r} (accepted: {', '.join(SECTIONS)})")
    return data


def _field_names(loc: tuple[Any, ...]) -> list[str] | None:
    """The keys accepted at `loc` (the model that holds the unknown key), from the schema itself."""
    annotation: Any = Policy
    for part in loc:
        origin = typing.get_origin(annotation)
        if origin in (typing.Union, types.UnionType):
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
            origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
            origin = typing.get_origin(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if part not in annotation.model_fields:
                return None
            annotation = annotation.model_fields[part].annotation
        elif origin is dict:
            annotation = typing.get_args(annotation)[1]
        elif origin is list:
            annotation = typing.get_args(annotation)[0]
        else:
            return None
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(annotation.model_fields)
    return None


def _explain(error: dict[str, Any]) -> str:
    kind = error["type"]
    loc = error["loc"]
    if kind == "extra_forbidden":
        accepted = _field_names(loc[:-1])
        return f"unknown key {loc[-1]!r}" + (f" (accepted: {', '.join(accepted)})" if accepted else "")
    if kind == "missing":
        return f"missing required key {loc[-1]!r}"
    message = error["msg"].removeprefix("Value error, ")
    value = error.get("input")
    if kind.endswith("_type") or kind.endswith("_parsing") or kind == "literal_error":
        if isinstance(value, (str, int, float, bool)) or value is None:
            message += f" (got {value!r})"
    return message


def policy_file_paths(directory: str | FilePath) -> list[FilePath]:
    """The files a policy directory consists of: `*.yaml` / `*.yml` directly inside, in name order."""
    directory = FilePath(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())


def load_policy(directory: str | FilePath) -> Policy:
    """Load and check every `*.yaml` / `*.yml` file directly inside `directory` (not its subfolders)."""
    directory = FilePath(directory)
    if not directory.is_dir():
        raise PolicyError([PolicyProblem(str(directory), 1, 1, (), "not a directory of policy files")])
    files = policy_file_paths(directory)
    if not files:
        raise PolicyError([PolicyProblem(str(directory), 1, 1, (), "no *.yaml policy files in this directory")])
    return load_policy_files(files)


def load_policy_files(files: Iterable[FilePath]) -> Policy:
    source = _Source({}, {})
    merged: dict[str, Any] = {}
    problems: list[PolicyProblem] = []
    for file in files:
        display = str(file)
        here = _Source({}, {})
        try:
            data = _read_file(file, display, here)
        except _FileProblem as problem:
            problems.append(PolicyProblem(display, problem.line, problem.column, problem.path, str(problem)))
            continue
        for section, value in data.items():
            if section not in merged:
                merged[section] = value
            elif section in MERGED_SECTIONS and isinstance(value, dict) and isinstance(merged[section], dict):
                for key in value.keys() & merged[section].keys():
                    first_file, first_line, _ = source.keys[(section, key)]
                    problems.append(PolicyProblem(
                        *here.keys[(section, key)], (section, key),
                        f"{section[:-1]} {key!r} is defined twice (also at {first_file}:{first_line})",
                    ))
                merged[section] = {**merged[section], **value}
            else:
                problems.append(PolicyProblem(
                    *here.keys[(section,)], (section,), f"section {section!r} appears in more than one file "
                    f"(also at {':'.join(map(str, source.keys[(section,)][:2]))}); only models, profiles and "
                    "teams may be spread over several files",
                ))
        for table, new in ((source.values, here.values), (source.keys, here.keys)):
            for path, mark in new.items():
                table.setdefault(path, mark)
    if problems:
        raise PolicyError(problems)

    try:
        policy = Policy.model_validate(merged)
    except ValidationError as error:
        for item in error.errors():
            loc = tuple(item["loc"])
            file, line, column = source.locate(loc, prefer_key=item["type"] == "extra_forbidden")
            problems.append(PolicyProblem(file, line, column, loc, _explain(item)))
        raise PolicyError(problems) from None

    for path, message in check_references(policy):
        file, line, column = source.locate(path, prefer_key=True)
        problems.append(PolicyProblem(file, line, column, path, message))
    if problems:
        raise PolicyError(problems)
    return policy
