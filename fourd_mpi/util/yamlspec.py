"""YAML files validated with JSON Schema, with errors that name the key and its line.

Used by sweep specs and site profiles: users edit these files by hand, so a bad
value must be reported as ``spec.yaml:12: matrix.overlap[1]: 'al' is not one of ...``,
not as a traceback. PyYAML keeps line numbers only on its node tree, so the file
is composed once for the marks and loaded once for the data.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import yaml

from fourd_mpi.errors import ConfigError

PathPart = Union[str, int]


def key_path(parts: Iterable[PathPart]) -> str:
    """``("matrix", "overlap", 1)`` -> ``matrix.overlap[1]``."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


#: a spec or profile with more nodes than this once its aliases are expanded is refused: aliases
#: nested k levels deep multiply, so a few hundred bytes can expand to billions of nodes
MAX_EXPANDED_NODES = 100_000
#: largest file read (bytes): specs, profiles and configs are a few kB; parsing is about 1 s per MB
MAX_FILE_BYTES = 1 << 20
#: deepest nesting of mappings and lists (the schemas need 4; PyYAML's composer recurses per level)
MAX_DEPTH = 32
#: most nodes written in the file (before alias expansion)
MAX_NODES = 100_000


def check_shape(text: str, source: str) -> None:
    """Refuse a YAML text that is too large, too deep or has too many nodes, before it is composed:
    PyYAML's event parser is iterative, so this pass is bounded by the limits themselves
    (:data:`MAX_FILE_BYTES`, :data:`MAX_DEPTH`, :data:`MAX_NODES`)."""
    if len(text) > MAX_FILE_BYTES:
        raise ConfigError(f"{source}: {len(text):,} bytes, more than the {MAX_FILE_BYTES:,} a spec, profile or "
                          "config may have")
    # libyaml first (~50x faster on a 1 MB file); its scanner looks ahead over a run of flow openers
    # and, from libyaml 0.2.6 (PyYAML 6.0.4), refuses one deeper than 1,000 levels before it yields a
    # single event. The pure-Python parser has no such limit and is iterative, so on any libyaml error
    # the shape pass is repeated with it: the limits below are then the ones reported, in our words,
    # whatever libyaml version is installed.
    loaders = [yaml.SafeLoader]
    if hasattr(yaml, "CSafeLoader"):
        loaders.insert(0, yaml.CSafeLoader)
    for loader in loaders:
        try:
            _check_events(yaml.parse(text, Loader=loader), source)
            return
        except yaml.YAMLError:
            continue  # the next parser; if none accepts the text, the composer reports it in PyYAML's words


def _check_events(events, source: str) -> None:
    """Count nesting depth and nodes over a stream of PyYAML parser events; raise at the first limit."""
    depth = nodes = 0
    for event in events:
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_DEPTH:
                raise ConfigError(f"{source}:{event.start_mark.line + 1}: nested more than {MAX_DEPTH} levels "
                                  "deep")
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1
        if isinstance(event, yaml.NodeEvent):
            nodes += 1
            if nodes > MAX_NODES:
                raise ConfigError(f"{source}:{event.start_mark.line + 1}: more than {MAX_NODES:,} YAML nodes")


def _syntax_error(exc, source: str) -> ConfigError:
    mark = getattr(exc, "problem_mark", None)
    where = f"{source}:{mark.line + 1}" if mark is not None else source
    problem = getattr(exc, "problem", None) or str(exc)
    context, start = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and start is not None:
        problem = f"{problem} ({context} at line {start.line + 1})"
    return ConfigError(f"{where}: not valid YAML: {' '.join(str(problem).split())}")


def _compose(text: str):
    """``yaml.compose(text)`` with libyaml's parser where PyYAML has it (``CSafeLoader``: the same nodes and
    marks, about 20 times faster); a document it refuses is composed again by the pure-Python parser, so
    an error reads the same with or without libyaml."""
    fast = getattr(yaml, "CSafeLoader", None)
    if fast is not None:
        try:
            return yaml.compose(text, Loader=fast)
        except yaml.YAMLError:
            pass
    return yaml.compose(text, Loader=yaml.SafeLoader)


def _expanded_nodes(root) -> int:
    """How many nodes the composed tree ``root`` has with every alias expanded (shared nodes
    counted once per use; each distinct node visited once; capped just above the limit)."""
    sizes: Dict[int, int] = {}
    stack = [(root, False)]
    while stack:  # iterative post-order over the node graph (aliases make it a DAG)
        node, children_done = stack.pop()
        if children_done:
            total = 1 + sum(sizes[id(c)] for c in _children(node))
            sizes[id(node)] = min(total, MAX_EXPANDED_NODES + 1)
        elif id(node) not in sizes:
            sizes[id(node)] = -1  # entered; its size is set when its children are done
            stack.append((node, True))
            for child in _children(node):
                if sizes.get(id(child)) == -1:  # an alias to a node that contains it: infinite
                    return MAX_EXPANDED_NODES + 1
                if id(child) not in sizes:
                    stack.append((child, False))
    return sizes[id(root)]


def _children(node):
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


class YamlDocument:
    """The data of one YAML file plus the line of every key and item in it."""

    def __init__(self, text: str, source: str):
        self.source = source
        check_shape(text, source)  # size, depth and node count first: composing recurses per level
        try:
            self.root = _compose(text)
            # the data from the composed tree (what yaml.safe_load(text) returns, without parsing again)
            self.data = None if self.root is None else yaml.SafeLoader("").construct_document(self.root)
        except yaml.YAMLError as exc:
            raise _syntax_error(exc, source) from None
        except (RecursionError, ValueError, OverflowError) as exc:  # e.g. a huge integer literal
            raise ConfigError(f"{source}: not valid YAML: {' '.join(str(exc).split())[:200]}") from None
        if self.root is not None:
            expanded = _expanded_nodes(self.root)
            if expanded > MAX_EXPANDED_NODES:
                raise ConfigError(f"{source}: its aliases (*name) expand to more than {MAX_EXPANDED_NODES:,} YAML "
                                  "nodes (an alias bomb?); write the values out")
            self._reject_duplicate_keys(self.root, ())

    @classmethod
    def read(cls, path: str, what: str = "file") -> "YamlDocument":
        from fourd_mpi.util.files import read_regular_file

        try:  # a FIFO or device is refused, not waited on; check_shape refuses anything longer
            text = read_regular_file(path, MAX_FILE_BYTES + 1, what).decode("utf-8")
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
        return self._locate(parts)[0]

    def _locate(self, parts: Sequence[PathPart]):
        """``(line, label)``: the label writes mapping keys as ``.key`` and list items as ``[i]``."""
        node = self.root
        if node is None:
            return None, key_path(parts)
        line, label = node.start_mark.line + 1, ""
        for depth, part in enumerate(parts):
            found = None
            if isinstance(node, yaml.MappingNode):
                label += f".{part}" if label else str(part)
                for key_node, value_node in node.value:
                    if str(key_node.value) == str(part):
                        found, line = value_node, key_node.start_mark.line + 1
                        break
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
                label += f"[{part}]"
                found = node.value[part]
                line = found.start_mark.line + 1
            if found is None:
                rest = key_path(parts[depth + 1:]) if depth + 1 < len(parts) else ""
                return line, label + (("." + rest) if rest else "")
            node = found
        return line, label or "(top level)"

    def node(self, parts: Sequence[PathPart]):
        """The YAML node at ``parts``, or None where the file has none (a value merged in from elsewhere)."""
        node = self.root
        for part in parts:
            if isinstance(node, yaml.MappingNode):
                node = next((v for k, v in node.value if str(k.value) == str(part)), None)
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
                node = node.value[part]
            else:
                return None
        return node

    def read_numbers(self, schema: Dict[str, Any]) -> None:
        """Read as numbers the plain scalars the schema wants as numbers but YAML 1.1 (PyYAML) reads as
        strings: ``1e30``, ``5E-6`` (YAML 1.2 and JSON floats; YAML 1.1 needs ``1.0e+30``). A quoted
        value stays a string (and is refused as one), and so does any text that is not a float literal."""
        for _ in range(_MAX_NUMBER_PASSES):
            changed = False
            for path, wants in _string_type_errors(self.data, schema):
                node = self.node(path)
                plain = isinstance(node, yaml.ScalarNode) and not node.style  # style None or "": unquoted
                value = _number_literal(node.value) if plain else None
                if value is None or (wants == {"integer"} and not float(value).is_integer()):
                    continue
                if "number" not in wants:
                    value = int(value)
                changed |= _set_at(self.data, path, value)
            if not changed:
                return

    def error(self, parts: Sequence[PathPart], message: str) -> ConfigError:
        line, label = self._locate(parts)
        where = f"{self.source}:{line}" if line else self.source
        return ConfigError(f"{where}: {label}: {message}")

    def validate(self, schema: Dict[str, Any]) -> None:
        """Raise the first schema violation, by position in the file, as a :class:`ConfigError`.
        A plain (unquoted) scalar such as ``1e30`` where the schema wants a number is read as that
        number first (:meth:`read_numbers`)."""
        self.read_numbers(schema)
        located = schema_violations(self.data, schema)
        if located:
            located.sort(key=lambda item: (self.line(item[0]) or 0, -len(item[0])))
            raise self.error(*located[0])


def schema_violations(data: Any, schema: Dict[str, Any], finite: bool = True) -> List[Tuple[List[PathPart], str]]:
    """Every violation of ``schema`` as ``(key path, short message)``; unknown keys point at the key.
    ``finite``: a ``number`` is a finite one (files users write: profiles, specs, sites); False for data
    that records NaN on purpose (a trace's metadata: a peak that was never measured)."""
    import jsonschema

    located = []
    validator = _validator_class() if finite else jsonschema.Draft202012Validator
    for error in validator(schema).iter_errors(data):
        # best_match descends into oneOf/anyOf to the branch the value nearly matched
        try:
            error = jsonschema.exceptions.best_match([error])
        except TypeError:  # jsonschema ranks sub-errors by path; mixed str/int path parts do not compare
            pass
        located.append((list(error.absolute_path) + _offending_key(error), schema_message(error)))
    return located


#: passes of :meth:`YamlDocument.read_numbers` (one each time a fixed value uncovers another under oneOf)
_MAX_NUMBER_PASSES = 8
#: a YAML 1.2 / JSON float literal (YAML 1.1's resolver wants a dot and a signed exponent: ``1.0e+30``)
_FLOAT_LITERAL = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def _number_literal(text) -> Optional[float]:
    """The finite float ``text`` spells as a YAML 1.2 float literal, else None."""
    if not isinstance(text, str) or not _FLOAT_LITERAL.fullmatch(text):
        return None
    value = float(text)
    return value if math.isfinite(value) else None


def _string_type_errors(data: Any, schema: Dict[str, Any]):
    """``(key path, {"number"|"integer", ...})`` of each string the schema wanted as a number (oneOf and
    anyOf branches included)."""
    found: Dict[Tuple, set] = {}
    stack = list(_validator_class()(schema).iter_errors(data))
    while stack:
        error = stack.pop()
        stack.extend(error.context or ())
        if error.validator == "type" and isinstance(error.instance, str):
            types = {error.validator_value} if isinstance(error.validator_value, str) else set(error.validator_value)
            if types & {"number", "integer"}:
                found.setdefault(tuple(error.absolute_path), set()).update(types & {"number", "integer"})
    return sorted(found.items(), key=lambda item: [str(p) for p in item[0]])


def _set_at(data: Any, path: Sequence[PathPart], value: Any) -> bool:
    """Replace the string at ``path`` of ``data`` by ``value``; False when there is none."""
    for part in path[:-1]:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return False
    try:
        if not path or not isinstance(data[path[-1]], str):
            return False
        data[path[-1]] = value
    except (KeyError, IndexError, TypeError):
        return False
    return True


def _finite_number(checker, instance) -> bool:
    return (isinstance(instance, (int, float)) and not isinstance(instance, bool)
            and (isinstance(instance, int) or math.isfinite(instance)))


def _validator_class():
    """Draft 2020-12 whose ``number`` is a finite number: NaN and infinities (YAML ``.nan``, ``.inf``)
    are never a value of any schema of the project (a profile's ``alpha_s: .inf`` changed ``tune``'s winner)."""
    import jsonschema

    checker = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("number", _finite_number)
    return jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=checker)


def _offending_key(error) -> List[PathPart]:
    """An unknown key is reported at the key, not at the mapping that holds it."""
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})), key=str)
        return extra[:1]
    return []


def schema_message(error) -> str:
    """One short line for a schema violation, in the project's own words for every validator the
    project's schemas use (so the text does not change when jsonschema rewords its messages; the
    tests pin these lines); jsonschema's own message only for a validator none of them uses."""
    value = error.validator_value
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed), key=str)
        return f"unknown key {extra[0]!r} (known: {', '.join(allowed)})"
    if error.validator == "enum":
        return f"{error.instance!r} is not one of {', '.join(map(str, error.validator_value))}"
    if error.validator == "pattern" and "description" in error.schema:
        return f"{error.instance!r}: {error.schema['description']}"
    if error.validator in ("oneOf", "anyOf") and "description" in error.schema:
        return f"{error.instance!r}: {error.schema['description']}"
    if error.validator == "type" and isinstance(error.instance, float) and not _finite_number(None, error.instance):
        return f"{error.instance!r} is not a finite number"
    if error.validator == "type":
        types = [value] if isinstance(value, str) else list(value)
        quoted = ({"number", "integer"} & set(types) and _number_literal(error.instance) is not None)
        return (f"{error.instance!r} is not of type {', '.join(repr(t) for t in types)}"
                + (" (a quoted number is text: write it without quotes)" if quoted else ""))
    if error.validator == "required":
        missing = [name for name in value if isinstance(error.instance, dict) and name not in error.instance]
        return f"{(missing or value)[0]!r} is a required property"
    if error.validator == "const":
        return f"{value!r} was expected"
    bounds = {"minimum": "less than the minimum of", "maximum": "greater than the maximum of",
              "exclusiveMinimum": "less than or equal to the minimum of",
              "exclusiveMaximum": "greater than or equal to the maximum of"}
    if error.validator in bounds:
        return f"{error.instance!r} is {bounds[error.validator]} {value!r}"
    if error.validator in ("minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"):
        kind = "few" if error.validator.startswith("min") else "many"
        unit = {"Items": "items", "Length": "characters", "Properties": "keys"}[error.validator[3:]]
        return f"{error.instance!r} has too {kind} {unit} ({error.validator[:3]} {value})"
    if error.validator == "uniqueItems":
        return f"{error.instance!r} has repeated items"
    return error.message


def load_yaml(path: str, what: str, schema: Dict[str, Any], shipped: bool = False) -> YamlDocument:
    """Read and validate ``path``; ``what`` names the kind of file in errors. ``shipped``: a file of the
    package itself (a built-in machine profile), whose schema check a test makes instead
    (``tests/perf/test_perfmodel.py::test_builtin_profiles_validate``): skipped here, it would import
    jsonschema (about 50 ms of an offline command's 0.5 s)."""
    doc = YamlDocument.read(path, what)
    if not isinstance(doc.data, dict):
        raise ConfigError(f"{path}: a {what} must be a YAML mapping (key: value lines)")
    if not shipped:
        doc.validate(schema)
    return doc


def file_stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]
