"""YAML files validated with JSON Schema, with errors that name the key and its line.

Used by sweep specs and site profiles: users edit these files by hand, so a bad
value must be reported as ``spec.yaml:12: matrix.overlap[1]: 'al' is not one of ...``,
not as a traceback. PyYAML keeps line numbers only on its node tree, so the file
is composed once for the marks and loaded once for the data.
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, Optional, Sequence, Union

import yaml

from .errors import ConfigError

PathPart = Union[str, int]


def key_path(parts: Iterable[PathPart]) -> str:
    """``("matrix", "overlap", 1)`` -> ``matrix.overlap[1]``."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


class YamlDocument:
    """The data of one YAML file plus the line of every key and item in it."""

    def __init__(self, text: str, source: str):
        self.source = source
        try:
            self.root = yaml.compose(text, Loader=yaml.SafeLoader)
            self.data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f"{source}:{mark.line + 1}" if mark is not None else source
            problem = getattr(exc, "problem", None) or str(exc)
            raise ConfigError(f"{where}: not valid YAML: {' '.join(str(problem).split())}") from None
        if self.root is not None:
            self._reject_duplicate_keys(self.root, ())

    @classmethod
    def read(cls, path: str, what: str = "file") -> "YamlDocument":
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{what} {path} is not UTF-8 text") from None
        return cls(text, path)

    def _reject_duplicate_keys(self, node, parts) -> None:
        # PyYAML silently keeps the last of two equal keys: in a spec that hides a typo.
        if isinstance(node, yaml.MappingNode):
            seen: Dict[str, int] = {}
            for key_node, value_node in node.value:
                key = key_node.value
                if key in seen:
                    raise ConfigError(f"{self.source}:{key_node.start_mark.line + 1}: "
                                      f"{key_path((*parts, key))} given twice (first at line {seen[key]})")
                seen[key] = key_node.start_mark.line + 1
                self._reject_duplicate_keys(value_node, (*parts, key))
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                self._reject_duplicate_keys(item, (*parts, index))

    def line(self, parts: Sequence[PathPart]) -> Optional[int]:
        """1-based line of the value at ``parts`` (the deepest existing one); None for an empty file."""
        node = self.root
        if node is None:
            return None
        line = node.start_mark.line + 1
        for part in parts:
            found = None
            if isinstance(node, yaml.MappingNode):
                for key_node, value_node in node.value:
                    if str(key_node.value) == str(part):
                        found, line = value_node, key_node.start_mark.line + 1
                        break
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
                found = node.value[part]
                line = found.start_mark.line + 1
            if found is None:
                break
            node = found
        return line

    def error(self, parts: Sequence[PathPart], message: str) -> ConfigError:
        line = self.line(parts)
        where = f"{self.source}:{line}" if line else self.source
        return ConfigError(f"{where}: {key_path(parts)}: {message}")

    def validate(self, schema: Dict[str, Any]) -> None:
        """Raise the first schema violation, by position in the file, as a :class:`ConfigError`."""
        import jsonschema

        validator = jsonschema.Draft202012Validator(schema)
        errors = list(validator.iter_errors(self.data))
        if not errors:
            return
        errors.sort(key=lambda e: (self.line(list(e.absolute_path)) or 0, -len(e.absolute_path)))
        first = errors[0]
        raise self.error(list(first.absolute_path), _schema_message(first))


def _schema_message(error) -> str:
    """jsonschema's message, made shorter for the usual cases."""
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        return f"unknown key {', '.join(map(repr, extra))} (known: {', '.join(allowed)})"
    if error.validator == "enum":
        return f"{error.instance!r} is not one of {', '.join(map(str, error.validator_value))}"
    if error.validator == "pattern" and "description" in error.schema:
        return f"{error.instance!r}: {error.schema['description']}"
    if error.validator in ("oneOf", "anyOf") and "description" in error.schema:
        return f"{error.instance!r}: {error.schema['description']}"
    return error.message


def load_yaml(path: str, what: str, schema: Dict[str, Any]) -> YamlDocument:
    """Read and validate ``path``; ``what`` names the kind of file in errors."""
    doc = YamlDocument.read(path, what)
    if not isinstance(doc.data, dict):
        raise ConfigError(f"{path}: a {what} must be a YAML mapping (key: value lines)")
    doc.validate(schema)
    return doc


def file_stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]
