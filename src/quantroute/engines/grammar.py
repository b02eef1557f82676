"""Grammars for constrained decoding: JSON mode, JSON schemas and forced tool calls, as
GBNF text for llama.cpp's grammar sampler (the worker runs it, ``engines/constrained.py``).

The schema-to-GBNF conversion is llama.cpp's own (``llama_cpp.llama_grammar``, a
pure-Python port of ``json_schema_to_grammar``), loaded here from its file so that the
gateway does not load ``libllama``. Two things are added around it:

- :func:`check_schema` refuses, before any conversion, every keyword the converter
  would silently ignore (``minimum``, ``oneOf``, ``uniqueItems``...): a schema it
  accepts is one whose every instance the grammar produces validates;
- its ``char`` rule admits raw control characters inside strings, which JSON forbids:
  the rule is tightened to ``[^"\\\\\\x7F\\x00-\\x1F]`` (escapes stay allowed).

A forced tool call is the default tool format of :mod:`quantroute.api.tools`::

    <tool_call>{"name": "get_weather", "arguments": {...its parameters...}}</tool_call>

once, or (with ``parallel_tool_calls``) one or more times separated by newlines.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from collections.abc import Iterator, Sequence
from functools import cache
from types import ModuleType
from typing import Any

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "SchemaError",
    "check_schema",
    "json_object_grammar",
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
_REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
_LOOSE_CHAR = r'char ::= [^"\\] | '
_JSON_CHAR = r'char ::= [^"\\\x7F\x00-\x1F] | '


class SchemaError(ValueError):
    """A schema the grammar cannot enforce; ``str`` says what is wrong and where.

    It quotes nothing the client wrote: a keyword or format is named only when it is one
    of JSON Schema's, a property (or a ``$defs`` entry) by its position among its
    siblings (``schema.properties[2]``, from 0), never by its name, and a value never.
    """


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
    would not enforce, or anything that is not a JSON schema object."""
    for count, (path, node) in enumerate(_nodes(schema, where), 1):
        if count > _MAX_SCHEMA_NODES:
            raise SchemaError(f"{where} has more than {_MAX_SCHEMA_NODES} subschemas")
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
        _combination(path, node)


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
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        for low, high in _REPEAT.findall(pattern):
            if int(low) > _MAX_MINIMUM or (high and int(high) > _MAX_MAXIMUM):
                raise SchemaError(
                    f"{path}.pattern: a repetition count may be at most {_MAX_MINIMUM} "
                    f"(a minimum) or {_MAX_MAXIMUM} (a maximum)"
                )


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
            resolved = converter.resolve_refs(copy.deepcopy(schema), name)
            converter.visit(resolved, name)
        grammar: str = converter.format_grammar()
    except (AssertionError, KeyError, TypeError, ValueError, RecursionError, IndexError):
        # the converter's message quotes the schema: say what, not what it held
        raise SchemaError("the schema cannot be turned into a grammar") from None
    if len(grammar) > _MAX_GRAMMAR_CHARS:
        raise SchemaError(f"the schema's grammar is over {_MAX_GRAMMAR_CHARS >> 10} KiB")
    return grammar.replace(_LOOSE_CHAR, _JSON_CHAR)


def schema_grammar(schema: Any, where: str = "json_schema.schema") -> str:
    """The grammar of the JSON values ``schema`` allows (checked by :func:`check_schema`)."""
    check_schema(schema, where)
    return _convert([("", schema)])


def tool_call_grammar(functions: Sequence[tuple[str, Any]], *, parallel: bool) -> str:
    """Tool calls to one of ``functions`` (``(name, parameters schema)``), in the default
    format; with ``parallel``, one or more of them."""
    if sum("$ref" in json.dumps(p) for _, p in functions) > 1:
        raise SchemaError("tools: $ref in more than one function's parameters is not supported")
    schemas = []
    for i, (name, params) in enumerate(functions):
        check_schema(params, f"tools[{i}].function.parameters")
        call = {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": params},
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
