"""Grammars: which schema keywords are refused, the JSON-string fix to llama.cpp's
converter, and the closing path on the demo model's real vocabulary and llama.cpp's
real grammar sampler."""

from __future__ import annotations

import ctypes
import json
import re
import time
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


LONE = "\ud800"  # a lone surrogate, as json.loads reads the JSON escape "\ud800"


def _ref_chain(levels: int, branch: Any) -> dict[str, Any]:
    """$defs a0..a<levels>, each an anyOf of two copies of ``branch(next)``: 2**levels
    alternatives open at once from a few dozen subschemas."""
    defs: dict[str, Any] = {
        f"a{i}": {"anyOf": [branch(f"#/$defs/a{i + 1}")] * 2} for i in range(levels)
    }
    defs[f"a{levels}"] = {"type": "string"}
    return {"$defs": defs, "type": "object", "properties": {"v": {"$ref": "#/$defs/a0"}}}


def _pair(ref: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"x": {"$ref": ref}}, "required": ["x"]}


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        # each count within its bound, their product not: 65,536 optional a's
        ({"type": "string", "pattern": "^((a?){256}){256}$"}, "nested counts multiply"),
        ({"type": "string", "pattern": "^(a{64}){64}$"}, "at most 2048 characters"),
        ({"type": "string", "pattern": "^((a?){16}){17}$"}, "at most 256 positions open"),
        ({"type": "string", "pattern": "^(x|y)((a|b|c|d)?){65}$"}, "positions open"),
        ({"type": "string", "pattern": "^(" + "|".join(["ab"] * 257) + ")$"}, "256 alternatives"),
        ({"type": "string", "pattern": "^(" + "|".join(["ab"] * 30_000) + ")$"}, "alternatives"),
        ({"enum": list(range(501))}, "at most 500 values"),
        ({"enum": [{"a": [i]} for i in range(20_000)]}, "at most 500 values"),
        ({"const": "x" * 70_000}, "65536 characters"),
        ({"type": "object", "properties": {f"p{i}": {"enum": ["y" * 1000] * 10} for i in range(7)}},
         "65536 characters"),
        ({"anyOf": [{"enum": list(range(500))}] * 3}, "at most 1024 alternatives"),
        (_ref_chain(11, lambda ref: {"$ref": ref}), "at most 1024 alternatives"),
        (_ref_chain(16, _pair), "through $ref"),
        ({"type": "string", "minLength": 10, "maxLength": 5}, "minLength is more than maxLength"),
        ({"type": "array", "items": {}, "minItems": 3, "maxItems": 2}, "minItems is more"),
        ({"enum": "a"}, "enum must be a non-empty list"),
        ({"enum": []}, "enum must be a non-empty list"),
        ({"type": "string", "pattern": "^((a$"}, "a ( is not closed"),
        ({"type": "string", "pattern": "^(a))$"}, "a ) closes no ("),
        ({"type": "string", "pattern": "^[a-z$"}, "a [ is not closed"),
        ({"type": "string", "pattern": "^a{2$"}, "a { is not closed"),
        ({"type": "string", "pattern": "^a{x}$"}, "not a repetition count"),
        ({"type": "string", "pattern": "^a{3,1}$"}, "n > m"),
        ({"type": "string", "pattern": "^+a$"}, "repeats nothing"),
        ({"type": "string", "pattern": "^(|*)$"}, "repeats nothing"),
        ({"type": "string", "pattern": "^a|b$"}, "outside parentheses"),
        ({"type": "string", "pattern": f"^{LONE}$"},
         "lone surrogates"),
        ({"enum": ["ok", "\udfff"]}, "lone surrogates"),
        ({"type": "object", "properties": {LONE: {}}},
         "lone surrogates"),
        ({"type": "string", "description": LONE},
         "lone surrogates"),
    ],
)  # fmt: skip
def test_schemas_too_costly_to_sample_or_unsatisfiable_are_refused(schema: Any, named: str) -> None:
    """A grammar llama.cpp's sampler would follow in too many ways at once (a worker
    spun for minutes on the first of these), or one no value satisfies; refused fast,
    and quoting nothing of the schema."""
    start = time.perf_counter()
    with pytest.raises(SchemaError, match=re.escape(named)) as info:
        schema_grammar(schema)
    assert time.perf_counter() - start < 0.5
    assert "ab|" not in str(info.value) and "yyy" not in str(info.value)


def test_a_lone_surrogate_in_a_forced_tools_parameters_is_refused() -> None:
    params = {
        "type": "object",
        "properties": {"a": {"enum": [LONE]}},
    }
    with pytest.raises(SchemaError, match=r"tools\[0\].function.parameters: keys and strings"):
        tool_call_grammar([("f", params)], parallel=False)


#: At the bounds: real schemas' patterns and enums are far inside them.
AT_THE_BOUNDS = [
    {"type": "string", "pattern": "^((a?){16}){16}$"},  # 256 positions open
    {"type": "string", "pattern": "^(a?){256}$"},
    {"type": "string", "pattern": "^((a|b|c|d|e|f|g|h)?){32}$"},
    {"type": "string", "pattern": "^(" + "|".join(["ab"] * 256) + ")$"},
    {"type": "string", "pattern": "^(a{32}){64}$"},  # 2048 characters, one reading
    {"enum": [f"a_prefix_all_of_them_share_{i}" for i in range(500)]},
    {"anyOf": [{"enum": [f"same_{i}" for i in range(500)]}] * 2 + [{"enum": list(range(24))}]},
    _ref_chain(10, lambda ref: {"$ref": ref}),  # 1024
]


@pytest.mark.parametrize("schema", AT_THE_BOUNDS)
def test_schemas_at_the_cost_bounds_convert(schema: Any) -> None:
    assert "root ::=" in schema_grammar(schema)


@pytest.mark.parametrize(
    "pattern",
    [
        "^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$",
        "^[a-zA-Z0-9._%+-]{1,64}@[a-zA-Z0-9-]{1,63}([.][a-zA-Z0-9-]{1,63}){1,4}$",
        "^([+][0-9]{1,3} ?)?([(][0-9]{3}[)] ?)?[0-9]{3}-?[0-9]{4}$",
        "^([01][0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9]([.][0-9]{1,6})?)?(Z|[+-][0-9]{2}:[0-9]{2})?$",
        "^(([0-9a-fA-F]{1,4}:){7}[0-9a-fA-F]{1,4}|::)$",
        "^[A-Z]{2}[0-9]{2}[A-Z0-9]{11,30}$",
        "^(" + "|".join(f"C{i:03d}" for i in range(250)) + ")$",  # a list of codes
        "^\\(a\\|b\\)[(|)]$",  # escaped and bracketed (|) are characters
    ],
)
def test_real_patterns_are_inside_the_bounds(
    vocab: tuple[Any, int, list[bytes], list[int]], pattern: str
) -> None:
    from quantroute.engines.constrained import ClosingOrder, Grammar

    v, n, pieces, eog = vocab
    Grammar(
        v, n, schema_grammar({"type": "string", "pattern": pattern}), ClosingOrder(pieces, eog)
    ).close()


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


ESCAPED = {  # the escapes real schemas use (llama.cpp refused them as they were)
    "type": "object",
    "properties": {
        "day": {"type": "string", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"},
        "mail": {"type": "string", "pattern": "^[\\w.+-]{1,8}@[a-z]{1,8}\\.[a-z]{2,3}$"},
        "code": {"type": "string", "pattern": "^\\S{2}\\s\\D\\-\\u00e9$"},
    },
    "required": ["day", "mail", "code"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("grammar", "schema"),
    [
        (json_object_grammar(), {"type": "object"}),
        (schema_grammar(SCHEMA), SCHEMA),
        (schema_grammar(ESCAPED), ESCAPED),
    ],
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


@pytest.mark.parametrize("schema", AT_THE_BOUNDS)
def test_grammars_at_the_cost_bounds_step_quickly_on_llama_cpps_sampler(
    vocab: tuple[Any, int, list[bytes], list[int]], schema: dict[str, Any]
) -> None:
    """The widest grammars allowed cost each token a few milliseconds on the demo
    vocabulary (((a?){32}){32}, four times as wide, took a second a token; the audit's
    ((a?){256}){256} never finished one)."""
    import numpy as np

    from quantroute.engines.constrained import ClosingOrder, Grammar

    v, n, pieces, eog = vocab
    g = Grammar(v, n, schema_grammar(schema), ClosingOrder(pieces, eog))
    rng = np.random.default_rng(0)
    try:
        start = time.perf_counter()
        steps = 0
        for _ in range(12):
            allowed = np.flatnonzero(np.isfinite(g.mask(np.zeros(n, dtype=np.float32))))
            allowed = [t for t in allowed if t not in eog]
            if not allowed:
                break
            g.accept(int(rng.choice(allowed)))
            steps += 1
        assert (time.perf_counter() - start) / max(steps, 1) < 0.25
        assert g.closing_length(4096) is not None
    finally:
        g.close()


@pytest.mark.parametrize("pattern", ["^a\\bc$", "^(a)\\1$", "^[\\S]$", "^\\p{L}$"])
def test_escapes_with_no_class_are_refused_without_quoting(pattern: str) -> None:
    with pytest.raises(SchemaError) as caught:
        schema_grammar({"type": "string", "pattern": pattern})
    assert "escape" in str(caught.value) or "pattern" in str(caught.value)
