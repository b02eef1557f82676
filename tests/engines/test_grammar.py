"""Grammars: which schema keywords are refused, the JSON-string fix to llama.cpp's
converter, and the closing path on the demo model's real vocabulary and llama.cpp's
real grammar sampler."""

from __future__ import annotations

import ctypes
import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from qrtest import demo_model_dir
from quantroute.engines.grammar import (
    SchemaError,
    check_schema,
    json_object_grammar,
    schema_grammar,
    tool_call_grammar,
)


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "integer", "minimum": 0}, "'minimum'"),
        ({"type": "number", "multipleOf": 2}, "'multipleOf'"),
        ({"oneOf": [{"type": "string"}]}, "'oneOf'"),
        ({"allOf": [{"type": "string"}]}, "'allOf'"),
        ({"not": {"type": "string"}}, "'not'"),
        ({"type": "array", "items": {}, "uniqueItems": True}, "'uniqueItems'"),
        ({"type": "object", "properties": {"a": {"if": {}}}}, "schema.properties[0]"),
        ({"type": "string", "format": "email"}, "'email'"),
        ({"type": "string", "pattern": "ab"}, "anchored"),
        ({"$ref": "https://example.com/s.json"}, "local references"),
        ({"type": "array", "minItems": 2}, "minItems"),
        ({"type": "object", "required": ["a"], "properties": {}}, "required[0]"),
        ({"enum": ["a"], "items": {}}, "'items' beside 'enum'"),
        ({"type": ["object", "null"], "properties": {}}, "list of types"),
        ({"type": "strin"}, "not a JSON schema type"),
        ([1], "must be an object"),
    ],
)
def test_unenforceable_schemas_are_refused_by_name(schema: Any, named: str) -> None:
    with pytest.raises(SchemaError, match=re.escape(named)):
        check_schema(schema)


@pytest.mark.parametrize(
    "schema",
    [
        {},
        {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}},
        {"type": "array", "items": {"enum": [1, "x", None]}, "minItems": 1, "maxItems": 2},
        {"$defs": {"p": {"type": "boolean"}}, "type": "object",
         "properties": {"p": {"$ref": "#/$defs/p"}}, "required": ["p"]},
        {"anyOf": [{"type": "null"}, {"type": "string", "format": "date"}]},
        {"type": "string", "pattern": "^[a-z]{2,4}$", "title": "t", "description": "d"},
    ],
)  # fmt: skip
def test_enforceable_schemas_convert(schema: dict[str, Any]) -> None:
    assert "root ::=" in schema_grammar(schema)


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "string", "maxLength": 20_000}, "maxLength may be at most 512"),
        ({"type": "string", "minLength": 3_000}, "minLength may be at most 256"),
        ({"type": "array", "items": {"type": "null"}, "minItems": 40_000_000}, "minItems"),
        ({"type": "array", "items": {}, "maxItems": 10**9}, "maxItems"),
        ({"type": "string", "pattern": "^a{0,30000}$"}, "repetition count"),
        ({"type": "string", "pattern": "^a{500}$"}, "repetition count"),
        ({"type": "string", "maxLength": -1}, "non-negative integer"),
        ({"type": "string", "maxLength": True}, "non-negative integer"),
    ],
)
def test_counts_past_the_bounds_are_refused_before_any_grammar_is_built(
    schema: dict[str, Any], named: str
) -> None:
    """A length or count the converter would nest that deep once crashed llama.cpp's
    grammar parser (maxLength 20,000) or stalled the gateway building it."""
    with pytest.raises(SchemaError, match=named):
        schema_grammar(schema)


def test_strings_admit_no_raw_control_characters() -> None:
    # llama.cpp's converter allows [^"\\] (a raw newline, which JSON forbids); ours not
    grammar = schema_grammar({"type": "string"})
    assert r'char ::= [^"\\\x7F\x00-\x1F]' in grammar
    assert r'char ::= [^"\\] |' not in grammar


def test_tool_grammar_names_each_function() -> None:
    grammar = tool_call_grammar([("f", {"type": "object"}), ("g", {})], parallel=False)
    assert grammar.startswith("root ::= call\n") and '"\\"f\\""' in grammar
    assert "( fn0 | fn1 )" in tool_call_grammar([("f", {}), ("g", {})], parallel=True)


# ---- on llama.cpp's own sampler ---------------------------------------------------------


@pytest.fixture(scope="module")
def vocab() -> Iterator[tuple[Any, int, list[bytes], list[int]]]:
    import llama_cpp as lc

    lc.llama_backend_init()
    params = lc.llama_model_default_params()
    params.vocab_only = True
    model = lc.llama_model_load_from_file(str(demo_model_dir() / "q8_0.gguf").encode(), params)
    v = lc.llama_model_get_vocab(model)
    n = lc.llama_vocab_n_tokens(v)
    buf = ctypes.create_string_buffer(256)
    pieces = []
    for t in range(n):
        k = lc.llama_token_to_piece(v, t, buf, 256, 0, False)
        pieces.append(buf.raw[: max(k, 0)])
    eog = [t for t in range(n) if lc.llama_vocab_is_eog(v, t)]
    yield v, n, pieces, eog
    lc.llama_model_free(model)


SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "string", "minLength": 2},
        "b": {"type": "array", "items": {"type": "integer"}, "minItems": 1},
        "c": {"enum": ["x", "yz"]},
        "d": {"type": "boolean"},
    },
    "required": ["a", "b", "c", "d"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("grammar", "schema"),
    [(json_object_grammar(), {"type": "object"}), (schema_grammar(SCHEMA), SCHEMA)],
)
def test_the_closing_path_ends_valid_from_anywhere(
    vocab: tuple[Any, int, list[bytes], list[int]], grammar: str, schema: dict[str, Any]
) -> None:
    """Random allowed tokens first (as a model at temperature 1 might), then the closing
    path: its length is what ``closing_length`` said, and the text validates."""
    import numpy as np

    from quantroute.engines.constrained import ClosingOrder, Grammar

    v, n, pieces, eog = vocab
    order = ClosingOrder(pieces, eog)
    rng = np.random.default_rng(0)
    for trial in range(30):
        g = Grammar(v, n, grammar, order)
        text = b""
        for _ in range(trial * 3):
            allowed = np.flatnonzero(np.isfinite(g.mask(np.zeros(n, dtype=np.float32))))
            allowed = [t for t in allowed if t not in eog]
            if not allowed:
                break
            token = int(rng.choice(allowed))
            g.accept(token)
            text += pieces[token]
        length = g.closing_length(500)
        assert length is not None
        steps = 0
        while (token := g.closing_token()) not in eog:
            g.accept(token)
            text += pieces[token]
            steps += 1
        g.close()
        assert steps == length
        value = json.loads(text.decode("utf-8", "replace"))  # as the worker decodes
        jsonschema.validate(value, schema)


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "maxLength": 512},
        {"type": "string", "minLength": 256},
        {"type": "array", "items": {"type": "string", "maxLength": 100}, "maxItems": 512},
        {"type": "string", "pattern": "^[a-z]{256,512}$"},
    ],
)
def test_grammars_at_the_bounds_load_on_llama_cpps_sampler(
    vocab: tuple[Any, int, list[bytes], list[int]], schema: dict[str, Any]
) -> None:
    """The largest counts allowed make grammars llama.cpp parses (in this process: a
    crash would fail the test run, not pass it)."""
    import numpy as np

    from quantroute.engines.constrained import ClosingOrder, Grammar

    v, n, pieces, eog = vocab
    g = Grammar(v, n, schema_grammar(schema), ClosingOrder(pieces, eog))
    try:
        assert np.isfinite(g.mask(np.zeros(n, dtype=np.float32))).any()
        assert g.closing_length(4096) is not None
    finally:
        g.close()
