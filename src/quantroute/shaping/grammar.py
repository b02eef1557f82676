"""Grammars for constrained decoding: JSON mode, JSON schemas and forced tool calls, as
GBNF text for llama.cpp's grammar sampler (the worker runs it, ``engines/llamacpp/constrained.py``).

The schema-to-GBNF conversion is llama.cpp's own (``llama_cpp.llama_grammar``, a
pure-Python port of ``json_schema_to_grammar``), loaded here from its file so that the
gateway does not load ``libllama``. Three things are added around it:

- :func:`check_schema` refuses, before any conversion, every keyword the converter
  would silently ignore (``minimum``, ``oneOf``, ``uniqueItems``...): a schema it
  accepts is one whose every instance the grammar produces validates;
- its ``char`` rule admits raw control characters inside strings, which JSON forbids:
  the rule is tightened to ``[^"\\\\\\x7F\\x00-\\x1F]`` (escapes stay allowed);
- it copies a ``pattern``'s classes, ``.`` and literals into the grammar as they are, so
  ``[^a]`` could write a raw ``"`` (ending the string) or ``\\``: each pattern is first
  rewritten so that the grammar is that of the JSON text of values it matches
  (``shaping/pattern.py``).

A forced tool call is the default tool format of :mod:`quantroute.api.tools`::

    <tool_call>{"name": "get_weather", "arguments": {...its parameters...}}</tool_call>

once, or (with ``parallel_tool_calls``) one or more times separated by newlines.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from types import ModuleType
from typing import Any

from quantroute.shaping.pattern import SchemaError, pattern_in_json, pattern_size, spend

__all__ = [
    "SURROGATES",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "SchemaError",
    "check_schema",
    "check_strings",
    "json_object_grammar",
    "lone_surrogates",
    "schema_grammar",
    "tool_call_grammar",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

#: Keywords the converter turns into grammar (each instance it allows validates).
_ENFORCED = frozenset(
    {
        "type", "properties", "required", "additionalProperties", "items", "prefixItems",
        "minItems", "maxItems", "enum", "const", "anyOf", "$ref", "minLength", "maxLength",
        "pattern", "format",
    }
)  # fmt: skip
#: Keywords that describe and constrain nothing.
_ANNOTATIONS = frozenset(
    {
        "$schema", "$id", "$comment", "$defs", "definitions", "title", "description",
        "default", "examples", "deprecated", "readOnly", "writeOnly",
    }
)  # fmt: skip
_FORMATS = frozenset({"date", "time", "date-time", "uuid"})
_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
#: The other keywords and formats of JSON Schema (drafts 4 to 2020-12): a message may name
#: one of these, the server's own words; any other key or format is the client's and is
#: never quoted back.
_REFUSED = frozenset(
    {
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "oneOf", "allOf", "not", "if", "then", "else", "uniqueItems", "contains",
        "minContains", "maxContains", "additionalItems", "unevaluatedItems",
        "unevaluatedProperties", "patternProperties", "propertyNames", "minProperties",
        "maxProperties", "dependencies", "dependentRequired", "dependentSchemas",
        "contentEncoding", "contentMediaType", "contentSchema", "$anchor", "$dynamicRef",
        "$dynamicAnchor", "$recursiveRef", "$recursiveAnchor", "$vocabulary",
    }
)  # fmt: skip
_OTHER_FORMATS = frozenset(
    {
        "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6", "uri",
        "uri-reference", "iri", "iri-reference", "uri-template", "json-pointer",
        "relative-json-pointer", "regex",
    }
)  # fmt: skip
_ONE_OF_TYPES = ", ".join(sorted(_TYPES))
_ONLY_FORMATS = f"only {', '.join(sorted(_FORMATS))}"
_MAX_SCHEMA_NODES = 2000
# Bounds on counts, checked before any grammar is built. The converter nests one rule per
# unit of a length or item count (llama.cpp's grammar parser crashed its process at a
# maxLength of 20,000), and a minimum makes every sampled token walk the closing path
# that long: these keep a grammar small and each token's check cheap.
_MAX_MINIMUM = 256  # minLength, minItems, a pattern's {n}
_MAX_MAXIMUM = 512  # maxLength, maxItems, a pattern's {n,m} (llama.cpp refuses ~1000)
_MAX_GRAMMAR_CHARS = 1 << 20
_MAX_SCHEMA_CHARS = 1 << 20  # a request's schemas' JSON text, in all: checked before any work
_MAX_GRAMMAR_RULES = 8192
# Bounds on what llama.cpp's grammar sampler must follow at once. It keeps one stack per
# way the text so far can be read, checks every candidate token against each, and dedups
# them pairwise: a grammar that allows many readings at once costs each token that many
# times over (a pattern ((a?){256}){256}, 65,536 readings, never finished a token; a
# 30,000-way alternation took 56 s). Real schemas stay far below these.
_MAX_PATTERN_SIZE = 2048  # a pattern's positions, nested {n,m} multiplied (one "a{n}" = n)
_MAX_PATTERN_READINGS = 256  # a pattern's positions open at once: (a?){256} has 256
_MAX_ENUM = 500  # an enum's values
_MAX_VALUE_CHARS = 1 << 16  # the JSON text of every enum and const value of a schema
_MAX_BREADTH = 1024  # alternatives open at once: anyOf, type lists, enum, through $ref
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_SURROGATE = re.compile("[\ud800-\udfff]")
_LOOSE_CHAR = r'char ::= [^"\\] | '
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] | '


@cache
def _converter_module() -> ModuleType:
    spec = importlib.util.find_spec("llama_cpp")  # finds the package, imports nothing
    assert spec is not None and spec.submodule_search_locations
    path = f"{next(iter(spec.submodule_search_locations))}/llama_grammar.py"
    module_spec = importlib.util.spec_from_file_location("_qr_llama_grammar", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)  # stdlib imports only
    return module


def json_object_grammar() -> str:
    """Any JSON object (``response_format: json_object``)."""
    grammar: str = _converter_module().JSON_GBNF
    return grammar


def check_schema(schema: Any, where: str = "schema") -> None:
    """Raise :class:`SchemaError` naming the first keyword of ``schema`` that the grammar
    would not enforce, anything that is not a JSON schema object, and any schema whose
    grammar would be too large or too slow for llama.cpp's sampler to follow."""
    check_strings(schema, where)
    value_chars = 0
    for count, (path, node) in enumerate(_nodes(schema, where), 1):
        if count > _MAX_SCHEMA_NODES:
            raise SchemaError(f"{where} has more than {_MAX_SCHEMA_NODES} subschemas")
        if not count % 64:
            spend(where)
        if not isinstance(node, dict):
            raise SchemaError(f"{path} must be an object (a JSON schema)")
        for key in node:
            if key in _ENFORCED or key in _ANNOTATIONS:
                continue
            if key in _REFUSED:  # one of JSON Schema's words, not the client's: name it
                raise SchemaError(f"{path}: the keyword {key!r} is not supported")
            raise SchemaError(
                f'{path}: a key that is not a JSON schema keyword (a property goes in "properties")'
            )
        types = node.get("type")
        for i, t in enumerate(types if isinstance(types, list) else [types]):
            if t is not None and not (isinstance(t, str) and t in _TYPES):
                at = f"{path}.type[{i}]" if isinstance(types, list) else f"{path}.type"
                raise SchemaError(f"{at}: not a JSON schema type (one of {_ONE_OF_TYPES})")
        fmt = node.get("format")
        if fmt is not None and not (isinstance(fmt, str) and fmt in _FORMATS):
            if isinstance(fmt, str) and fmt in _OTHER_FORMATS:  # JSON Schema's: name it
                raise SchemaError(f"{path}.format: {fmt!r} is not supported ({_ONLY_FORMATS})")
            raise SchemaError(f"{path}.format: not a supported format ({_ONLY_FORMATS})")
        ref = node.get("$ref")
        if ref is not None and not (isinstance(ref, str) and ref.startswith("#/")):
            raise SchemaError(f"{path}.$ref: only local references (#/...) are supported")
        pattern = node.get("pattern")
        if pattern is not None and not (
            isinstance(pattern, str) and pattern.startswith("^") and pattern.endswith("$")
        ):
            raise SchemaError(f"{path}.pattern: only anchored patterns (^...$) are supported")
        _counts(path, node)
        if isinstance(pattern, str):  # what the converter is handed: refused here, by path
            pattern_in_json(f"{path}.pattern", pattern)
        value_chars += _values(path, node)
        if value_chars > _MAX_VALUE_CHARS:
            raise SchemaError(
                f"{where}: its enum and const values may hold at most {_MAX_VALUE_CHARS} "
                "characters of JSON in all"
            )
        _combination(path, node)
    if _breadth(schema) > _MAX_BREADTH:
        raise SchemaError(
            f"{where}: at most {_MAX_BREADTH} alternatives may be open at once (the values "
            "of an enum, anyOf branches, types in a list and a pattern's | branches add up, "
            "through $ref too)"
        )


def check_strings(value: Any, where: str) -> None:
    """Raise :class:`SchemaError` when a key or a string anywhere in ``value`` (a JSON
    value) holds a lone surrogate (JSON's ``"\\ud800"``): no encoder can write it out,
    and a worker handed one could not read its command."""
    if lone_surrogates(value):
        raise SchemaError(f"{where}: {SURROGATES}")


SURROGATES = "keys and strings must not hold lone surrogates (\\ud800-\\udfff)"


def lone_surrogates(value: Any) -> bool:
    """Whether a key or a string anywhere in ``value`` (a JSON value, or a string) holds a
    lone surrogate; anything ``json`` cannot write counts as one."""
    try:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):
        return True
    return _SURROGATE.search(text) is not None


def _values(path: str, node: dict[str, Any]) -> int:
    """Check ``enum`` (a list of values, not too many); the characters of JSON its values
    and ``const`` make (the grammar spells each one out)."""
    values = []
    if "enum" in node:
        enum = node["enum"]
        if not isinstance(enum, list) or not enum:
            raise SchemaError(f"{path}.enum must be a non-empty list of values")
        if len(enum) > _MAX_ENUM:
            raise SchemaError(f"{path}.enum may have at most {_MAX_ENUM} values")
        values += enum
    if "const" in node:
        values.append(node["const"])
    try:
        return sum(len(json.dumps(value)) for value in values)
    except (TypeError, ValueError, RecursionError):
        raise SchemaError(f"{path}: enum and const values must be JSON values") from None


def _counts(path: str, node: dict[str, Any]) -> None:
    """Refuse counts whose grammar would be too large, or too slow to sample."""
    for key, limit in (
        ("minLength", _MAX_MINIMUM),
        ("minItems", _MAX_MINIMUM),
        ("maxLength", _MAX_MAXIMUM),
        ("maxItems", _MAX_MAXIMUM),
    ):
        value = node.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise SchemaError(f"{path}.{key} must be a non-negative integer")
        if value > limit:
            raise SchemaError(f"{path}.{key} may be at most {limit}")
    for low, high in (("minLength", "maxLength"), ("minItems", "maxItems")):
        if node.get(low, 0) > node.get(high, _MAX_MAXIMUM):  # no value could have both
            raise SchemaError(f"{path}.{low} is more than {high}")
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        # first: it bounds the pattern's length, and refuses what is no regular expression
        size, readings = pattern_size(f"{path}.pattern", pattern[1:-1])
        for low, high in _REPEAT.findall(pattern):
            if _over(low, _MAX_MINIMUM) or (high and _over(high, _MAX_MAXIMUM)):
                raise SchemaError(
                    f"{path}.pattern: a repetition count may be at most {_MAX_MINIMUM} "
                    f"(a minimum) or {_MAX_MAXIMUM} (a maximum)"
                )
        if size > _MAX_PATTERN_SIZE:
            raise SchemaError(
                f"{path}.pattern may spell out at most {_MAX_PATTERN_SIZE} characters with "
                "every repetition expanded to its largest count (nested counts multiply)"
            )
        if readings > _MAX_PATTERN_READINGS:
            raise SchemaError(
                f"{path}.pattern may leave at most {_MAX_PATTERN_READINGS} positions open at "
                "once (optional items in a row, each repetition of them multiplying)"
            )


def _over(digits: str, limit: int) -> bool:
    """Whether the count ``digits`` is over ``limit`` (read without ``int``'s digit limit:
    a count of 5,000 digits is over, not an error)."""
    return len(digits.lstrip("0")) > len(str(limit)) or int(digits) > limit


def _target(root: Any, ref: str) -> Any:
    """What the local reference ``ref`` (``#/$defs/a``) names in ``root``, or ``None``."""
    target = root
    for part in ref.split("#")[-1].split("/")[1:]:
        if not isinstance(target, dict) or part not in target:
            return None
        target = target[part]
    return target


def _breadth(schema: Any) -> int:
    """How many alternatives of ``schema`` may be open at once, at most: the sampler keeps
    a stack for each. The branches of an ``anyOf`` (and the types of a list, the values
    of an enum, a pattern's ``|`` branches) may share a beginning, so they add up; the
    properties of an object and the items of an array follow one another, so the widest
    counts (an additional property may read as any named one: it adds)."""
    memo: dict[int, int] = {}
    open_refs: set[str] = set()

    def visit(node: Any) -> int:
        if not isinstance(node, dict):
            return 1
        if id(node) in memo:
            return memo[id(node)]
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref in open_refs:  # recursion: the stack grows deeper, not wider
                return 1
            open_refs.add(ref)
            width = visit(_target(schema, ref))
            open_refs.discard(ref)
        elif isinstance(node.get("anyOf"), list):
            width = sum(visit(branch) for branch in node["anyOf"])
        elif isinstance(node.get("type"), list):
            width = len(node["type"])
        elif isinstance(node.get("enum"), list):
            width = len(node["enum"])
        elif isinstance(node.get("pattern"), str):  # checked by _counts already
            width = pattern_size("pattern", node["pattern"][1:-1])[1]
        else:
            width = 1
            properties = node.get("properties")
            if isinstance(properties, dict):
                width = max([width, *map(visit, properties.values())])
            for key in ("items", "prefixItems"):
                child = node.get(key)
                for item in child if isinstance(child, list) else [child]:
                    if isinstance(item, dict):
                        width = max(width, visit(item))
            extra = node.get("additionalProperties")
            if isinstance(extra, dict):
                width += visit(extra)
        memo[id(node)] = width
        return width

    try:
        return visit(schema)
    except RecursionError:
        raise SchemaError("the schema is nested too deep") from None


#: Keywords the converter reads only when another one is there (else it drops them).
_NEEDS = {
    "minItems": "items",
    "maxItems": "items",
    "required": "properties",
}
_ALONE = ("$ref", "anyOf", "enum", "const")  # the converter reads these and nothing beside


def _combination(path: str, node: dict[str, Any]) -> None:
    """Refuse keyword combinations the converter would enforce only in part."""
    keys = set(node) - _ANNOTATIONS
    for key, needed in _NEEDS.items():
        if key in node and not isinstance(node.get(needed), dict):
            raise SchemaError(f"{path}.{key} is only supported beside {needed!r}")
    if ("minLength" in node or "maxLength" in node) and node.get("type") != "string":
        raise SchemaError(f'{path}: minLength/maxLength need "type": "string"')
    if "required" in node:
        required = node["required"]
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{path}.required must be a list of property names")
        for i, name in enumerate(required):
            if name not in node["properties"]:
                raise SchemaError(f"{path}.required[{i}]: names no property in properties")
    for key in _ALONE:
        # check_schema refused every other key: these are all keywords of _ENFORCED
        beside = sorted((keys - {key, "type"}) & _ENFORCED)
        if key in node and beside:
            raise SchemaError(f"{path}: {beside[0]!r} beside {key!r} is not supported")
    if isinstance(node.get("type"), list) and keys - {"type"}:
        raise SchemaError(f"{path}: a list of types beside other keywords is not supported")
    if "prefixItems" in node and keys & {"items", "minItems", "maxItems"}:
        raise SchemaError(f"{path}: prefixItems beside items/minItems/maxItems is not supported")
    if "pattern" in node and keys & {"minLength", "maxLength", "format"}:
        raise SchemaError(f"{path}: pattern beside minLength/maxLength/format is not supported")
    if "format" in node and keys & {"minLength", "maxLength"}:
        raise SchemaError(f"{path}: format beside minLength/maxLength is not supported")


def _nodes(schema: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Every subschema of ``schema`` with its path, depth first (iteratively)."""
    stack = [(path, schema)]
    while stack:
        here, node = stack.pop()
        yield here, node
        if not isinstance(node, dict):
            continue
        for key in ("properties", "$defs", "definitions"):
            children = node.get(key)
            if isinstance(children, dict):
                # by position: a property's name is the client's
                stack += [(f"{here}.{key}[{i}]", v) for i, v in enumerate(children.values())]
            elif children is not None:
                raise SchemaError(f"{here}.{key} must be an object")
        for key in ("anyOf", "prefixItems"):
            children = node.get(key)
            if isinstance(children, list) and children:
                stack += [(f"{here}.{key}[{i}]", v) for i, v in enumerate(children)]
            elif children is not None:
                raise SchemaError(f"{here}.{key} must be a non-empty list")
        for key in ("items", "additionalProperties"):
            child = node.get(key)
            if isinstance(child, dict):
                stack.append((f"{here}.{key}", child))
            elif isinstance(child, list) and key == "items":
                stack += [(f"{here}.items[{i}]", v) for i, v in enumerate(child)]
            elif child is not None and not isinstance(child, bool):
                raise SchemaError(f"{here}.{key} must be a schema")


def _convert(schemas: Sequence[tuple[str, Any]]) -> str:
    """The GBNF rules of each ``(rule name, schema)``, in one converter."""
    module = _converter_module()
    converter = module.SchemaConverter(
        prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False
    )
    try:
        for name, schema in schemas:
            spend("the schema")  # between schemas: the converter itself cannot look
            prepared, refs = _prepared(copy.deepcopy(schema), name)
            resolved = converter.resolve_refs(prepared, name)
            for ref in refs:  # each definition's rule first: no other takes its name
                converter._resolve_ref(ref)
            converter.visit(resolved, name)
        grammar: str = converter.format_grammar()
        rules = len(converter._rules)
    except SchemaError:
        raise  # ours, worded already
    except (AssertionError, KeyError, TypeError, ValueError, RecursionError, IndexError):
        # the converter's message quotes the schema: say what, not what it held
        raise SchemaError("the schema cannot be turned into a grammar") from None
    if len(grammar) > _MAX_GRAMMAR_CHARS:
        raise SchemaError(f"the schema's grammar is over {_MAX_GRAMMAR_CHARS >> 10} KiB")
    if rules > _MAX_GRAMMAR_RULES:
        raise SchemaError(f"the schema's grammar has over {_MAX_GRAMMAR_RULES} rules")
    return grammar.replace(_LOOSE_CHAR, _JSON_CHAR)


_REFS = "$quantroute-refs"  # where _prepared puts what each reference names


def _prepared(schema: Any, name: str) -> tuple[Any, list[str]]:
    """``schema`` (checked; changed in place) for the converter, and its references as
    the converter knows them: each ``pattern`` as JSON text (``shaping/pattern.py``);
    each ``$ref`` to a definition of a name of its own (``ref0``, ``fn1-ref0``: the
    converter names a definition's rule by the last part of its reference, and took the
    rule of a property, or its ``space``, that had that name already); and each ``$ref``
    beside other keys inside an ``anyOf`` of one (the converter resolves no reference
    beside a ``$ref``, so none in the ``$defs`` beside one at a schema's root)."""
    nodes = [node for _, node in _nodes(schema, "schema")]  # subschemas, not values
    targets = {ref: _target(schema, ref) for n in nodes if isinstance(ref := n.get("$ref"), str)}
    own = [ref for ref, target in targets.items() if isinstance(target, dict)]
    keys = {ref: f"{name}-ref{i}" if name else f"ref{i}" for i, ref in enumerate(own)}
    if keys:  # a missing one is left for the converter to refuse
        schema[_REFS] = {key: targets[ref] for ref, key in keys.items()}
    for node in nodes:
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            node["pattern"] = pattern_in_json("pattern", pattern)
        ref = node.get("$ref")
        if isinstance(ref, str) and ref in keys:
            node["$ref"] = f"#/{_REFS}/{keys[ref]}"
        if isinstance(ref, str) and len(node) > 1:
            node["anyOf"] = [{"$ref": node.pop("$ref")}]
    return schema, [f"{name}#/{_REFS}/{key}" for key in keys.values()]


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` (checked; changed in place) with each local ``$ref`` (``#/...``) read
    from ``base`` (``#/properties/arguments``), where it is put inside another schema."""
    for _, node in _nodes(schema, "schema"):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/"):
            node["$ref"] = base + ref[1:]
    return schema


class _Memo:
    """What the last schemas seen made, by their JSON text, within ``budget`` characters
    (keys, grammars and refusals): a client sends the same schema on every request, and
    checking and converting it again took 0.2-0.7 ms each time; a schema that is refused
    is refused again from here, without its work (a client that sends a costly one again
    and again costs a lookup). Threads share it (schemas are compiled in threads)."""

    def __init__(self, budget: int):
        self._budget = budget
        self._used = 0
        self._lock = threading.Lock()
        self._grammars: OrderedDict[str, str | _Refused] = OrderedDict()

    def get(self, key: str, build: Callable[[], str]) -> str:
        with self._lock:
            kept = self._grammars.get(key)
            if kept is not None:
                self._grammars.move_to_end(key)
        if isinstance(kept, _Refused):
            raise SchemaError(kept.message)
        if kept is not None:
            return kept
        try:
            grammar = build()
        except ValueError as exc:  # SchemaError, or a value no check foresaw: a 400 either way
            message = str(exc) if isinstance(exc, SchemaError) else _UNCONVERTIBLE
            self._keep(key, _Refused(message), len(message))
            raise SchemaError(message) from None
        self._keep(key, grammar, len(grammar))
        return grammar

    def _keep(self, key: str, value: str | _Refused, size: int) -> None:
        size += len(key)
        if size > self._budget // 4:  # one huge schema does not flush the rest
            return
        with self._lock:
            if key in self._grammars:  # another thread built it meanwhile
                return
            self._grammars[key] = value
            self._used += size
            while self._used > self._budget:
                old_key, old = self._grammars.popitem(last=False)
                self._used -= len(old_key) + len(old.message if isinstance(old, _Refused) else old)


class _Refused:
    """A schema's refusal, as the memo keeps it."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


_UNCONVERTIBLE = "the schema cannot be turned into a grammar"
_MEMO = _Memo(budget=16 << 20)


def _key(where: str, *parts: Any) -> str:
    """JSON text of ``parts``, order kept (a schema's property order is its grammar's);
    refused past :data:`_MAX_SCHEMA_CHARS`, before any other work."""
    try:
        key = json.dumps(parts, separators=(",", ":"), allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        raise SchemaError(f"{where} must be JSON values") from None
    if len(key) > _MAX_SCHEMA_CHARS:
        raise SchemaError(f"{where} may be at most {_MAX_SCHEMA_CHARS >> 10} KiB of JSON")
    return key


def schema_grammar(schema: Any, where: str = "json_schema.schema") -> str:
    """The grammar of the JSON values ``schema`` allows (checked by :func:`check_schema`)."""

    def build() -> str:
        check_schema(schema, where)
        return _convert([("", schema)])

    return _MEMO.get(_key(where, "schema", where, schema), build)  # its words name where


def tool_call_grammar(functions: Sequence[tuple[str, Any]], *, parallel: bool) -> str:
    """Tool calls to one of ``functions`` (``(name, parameters schema)``), in the default
    format; with ``parallel``, one or more of them."""
    key = _key("tools", "tools", parallel, [[name, params] for name, params in functions])
    return _MEMO.get(key, lambda: _tool_call_grammar(functions, parallel=parallel))


def _tool_call_grammar(functions: Sequence[tuple[str, Any]], *, parallel: bool) -> str:
    schemas = []
    for i, (name, params) in enumerate(functions):
        check_schema(params, f"tools[{i}].function.parameters")
        # its references, read from the parameters' root, are read from where they go
        arguments = _rebased(copy.deepcopy(params), "#/properties/arguments")
        call = {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": arguments},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        schemas.append((f"fn{i}", call))
    rules = _convert(schemas)
    open_, close = json.dumps(TOOL_CALL_OPEN), json.dumps(TOOL_CALL_CLOSE)
    alternatives = " | ".join(f"fn{i}" for i in range(len(schemas)))
    call_rule = f"call ::= {open_} ( {alternatives} ) {close}"
    root = 'root ::= call ( "\\n" call )*' if parallel else "root ::= call"
    return f"{root}\n{call_rule}\n{rules}"
