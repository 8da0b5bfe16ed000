"""A YAML reader that remembers where every key and value came from.

``load_yaml(path)`` returns plain ``dict``/``list`` subclasses (``MarkedDict``, ``MarkedList``)
carrying ``Where`` marks, resolves scalars the way OmegaConf does (vLLM-Omni reads deploy files
with OmegaConf), refuses duplicate keys, and raises ``ConfigUnreadable`` for anything unparsable.
Its limits are part of the contract: only regular files of at most ``MAX_YAML_BYTES`` are read, and
nesting deeper than ``MAX_YAML_DEPTH`` is refused before any node is built.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

from sidecar.errors import Where
from sidecar.errors import FileNotFound, FileUnreadable, YamlInvalid
from sidecar.files import FileProblem, read_bounded

_BaseLoader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

# A deploy YAML is a few KB and a Hydra dump of a verl config a few hundred; anything near this is
# the wrong file, and reading it whole would take the memory of the process.
MAX_YAML_BYTES = 16 * 1024 * 1024
# Real deploy and verl configs nest fewer than 10 levels. Composing nodes recurses once per level
# (in C under CSafeLoader, where a deep document overflows the stack: a segfault, not an error).
MAX_YAML_DEPTH = 64

def yaml_type(value: Any) -> str:
    """The YAML kind of a loaded value in a user's words ("a mapping", "a list", ...), never the
    loader's class name."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return f"a {type(value).__name__}"


class MarkedDict(dict):
    """A mapping that knows its own place and the place of each key and value."""

    where: Where | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.key_where: dict[Any, Where] = {}
        self.value_where: dict[Any, Where] = {}

    def where_of(self, key: Any, *, value: bool = False) -> Where | None:
        marks = self.value_where if value else self.key_where
        return marks.get(key) or self.key_where.get(key) or self.where

    def __deepcopy__(self, memo: dict[int, Any]) -> MarkedDict:
        new = MarkedDict({copy.deepcopy(k, memo): copy.deepcopy(v, memo) for k, v in self.items()})
        new.where = self.where
        new.key_where = dict(self.key_where)
        new.value_where = dict(self.value_where)
        return new


class MarkedList(list):
    where: Where | None = None

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.item_where: list[Where | None] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> MarkedList:
        new = MarkedList(copy.deepcopy(v, memo) for v in self)
        new.where = self.where
        new.item_where = list(self.item_where)
        return new


def where_of(obj: Any) -> Where | None:
    return getattr(obj, "where", None)


class _MarkedLoader(_BaseLoader):  # type: ignore[misc, valid-type]
    file_name: str = "<input>"

    def _where(self, node: yaml.Node) -> Where:
        return Where(file=self.file_name, line=node.start_mark.line + 1, column=node.start_mark.column + 1)

    def construct_yaml_map(self, node: yaml.MappingNode) -> Any:  # type: ignore[override]
        data = MarkedDict()
        data.where = self._where(node)
        yield data
        # A key written in this mapping overrides one a merge key (`<<: *anchor`) brings in, as
        # YAML's merge rule and OmegaConf's loader (what vLLM-Omni reads deploy files with) have it;
        # only a key written twice here is a duplicate. flatten_mapping puts the merged pairs first.
        explicit = {id(k) for k, _ in node.value if k.tag != "tag:yaml.org,2002:merge"}
        self.flatten_mapping(node)
        written: set[Any] = set()
        for key_node, value_node in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, "found an unhashable key", key_node.start_mark
                ) from None
            if id(key_node) not in explicit:
                pass  # merged: a later merge, or a key written here, wins
            elif key in written:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            else:
                written.add(key)
            data[key] = self.construct_object(value_node, deep=True)
            data.key_where[key] = self._where(key_node)
            data.value_where[key] = self._where(value_node)

    def construct_yaml_seq(self, node: yaml.SequenceNode) -> Any:  # type: ignore[override]
        data = MarkedList()
        data.where = self._where(node)
        yield data
        for child in node.value:
            data.append(self.construct_object(child, deep=True))
            data.item_where.append(self._where(child))


_MarkedLoader.add_constructor("tag:yaml.org,2002:map", _MarkedLoader.construct_yaml_map)
_MarkedLoader.add_constructor("tag:yaml.org,2002:seq", _MarkedLoader.construct_yaml_seq)
# OmegaConf's loader: YAML 1.2-style floats ("1e-3" is a float) and no timestamp parsing.
_MarkedLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:
     [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)
_MarkedLoader.yaml_implicit_resolvers = {
    key: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for key, resolvers in _MarkedLoader.yaml_implicit_resolvers.items()
}


def _check_depth(text: str, file_name: str) -> None:
    """Refuse nesting deeper than ``MAX_YAML_DEPTH`` from the event stream (a flat loop: the check
    itself never recurses), before the composer can recurse into it."""
    loader = _BaseLoader(text)
    depth = 0
    try:
        while (event := loader.get_event()) is not None:
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_YAML_DEPTH:
                    mark = event.start_mark
                    raise YamlInvalid(
                        f"nesting deeper than {MAX_YAML_DEPTH} levels of mappings and lists (a deploy or verl "
                        "config nests fewer than 10); pass the right file, or flatten it",
                        where=Where(file=file_name, line=mark.line + 1, column=mark.column + 1),
                        details={"max_depth": MAX_YAML_DEPTH},
                    )
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
    finally:
        loader.dispose()


def load_yaml_text(text: str, *, file_name: str = "<input>") -> Any:
    """Parse YAML text with marks; ``ConfigUnreadable`` (with line:col) when it is not YAML or
    nests deeper than ``MAX_YAML_DEPTH``."""
    loader = _MarkedLoader(text)
    loader.file_name = file_name
    try:
        _check_depth(text, file_name)
        return loader.get_single_data()
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = Where(file=file_name, line=mark.line + 1, column=mark.column + 1) if mark else Where(file=file_name)
        problem = " ".join(p for p in (err.context, err.problem) if p)
        raise YamlInvalid(
            f"not valid YAML: {problem}; fix the syntax at this line",
            where=where,
        ) from None
    except yaml.YAMLError as err:
        raise YamlInvalid(f"not valid YAML: {err}", where=Where(file=file_name)) from None
    finally:
        loader.dispose()


def load_yaml(path: str | Path) -> Any:
    """Read a YAML file with marks; ``ConfigUnreadable`` when missing, not a regular file, larger
    than ``MAX_YAML_BYTES``, unreadable or not YAML."""
    p = Path(path)
    where = Where(file=str(p))
    try:
        data = read_bounded(p, MAX_YAML_BYTES)
    except FileProblem as exc:
        if exc.kind == "missing":
            raise FileNotFound(f"file not found: {p}; check the path", where=where) from None
        if exc.kind == "not_a_file":
            raise FileUnreadable(f"{p} is {exc.what}, not a YAML file; pass the path of a YAML file", where=where,
                                 details={"kind": exc.what}) from None
        if exc.kind == "too_large":
            raise FileUnreadable(
                f"{p} is larger than {MAX_YAML_BYTES // (1024 * 1024)} MB, the most a YAML file read here may be (a "
                "deploy YAML is a few KB); pass the right file",
                where=where,
                details={"max_bytes": MAX_YAML_BYTES},
            ) from None
        raise FileUnreadable(f"{p} {exc.why}", where=where) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise YamlInvalid(f"{p} is not UTF-8 text; pass a YAML file", where=where) from None
    return load_yaml_text(text, file_name=str(p))
