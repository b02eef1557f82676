"""Grammars: which schema keywords are refused, the JSON-string fix to llama.cpp's
converter, and the closing path on the demo model's real vocabulary and llama.cpp's
real grammar sampler."""

from __future__ import annotations

import codecs
import ctypes
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from qrtest import demo_model_dir
from quantroute.shaping.grammar import (
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
        # "." and [^a] are written raw or escaped (\" \\ \n...): two ways open each
        ({"type": "string", "pattern": "^(.?){129}$"}, "at most 256 positions open"),
        ({"type": "string", "pattern": "^([^a]?){129}$"}, "at most 256 positions open"),
        ({"type": "string", "pattern": "^(x|y)((a|b|c|d)?){65}$"}, "positions open"),
        ({"type": "string", "pattern": "^(" + "|".join(["ab"] * 257) + ")$"}, "256 alternatives"),
        ({"type": "string", "pattern": "^(" + "|".join(["ab"] * 30_000) + ")$"},
         "at most 8192 characters long"),
        ({"type": "string", "pattern": "^[^" + "\\d" * 4100 + "]$"}, "at most 8192 characters"),
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
    {"type": "string", "pattern": "^(.?){128}$"},  # 256: each "." raw or escaped
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
    from quantroute.engines.llamacpp.constrained import ClosingOrder, Grammar

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


PERSON = {
    "type": "object",
    "properties": {"name": {"$ref": "#/$defs/Name"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
# as generators write it (pydantic's for a model at the top): the root is a reference
REF_AT_ROOT = {
    "$ref": "#/$defs/Person",
    "$defs": {"Person": PERSON, "Name": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}},
}
NAMES_TAKEN = {  # definitions named as a property's rule, and as the converter's "space"
    "$defs": {"a": {"type": "integer"}, "space": {"type": "boolean"}},
    "type": "object",
    "properties": {
        "a": {"type": "string", "maxLength": 2},
        "b": {"$ref": "#/$defs/a"},
        "c": {"$ref": "#/$defs/space"},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}
TREE = {  # recursive, from the root
    "$ref": "#/$defs/Node",
    "$defs": {
        "Node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2},
            },
            "required": ["v"],
            "additionalProperties": False,
        }
    },
}
KEYWORD_NAMES = {  # properties named as the keywords whose values are not schemas
    "type": "object",
    "properties": {
        name: {"type": "string", "pattern": "^\\d\\.[^a]$"} for name in ("default", "enum", "const")
    },
    "required": ["default", "enum", "const"],
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

    from quantroute.engines.llamacpp.constrained import ClosingOrder, Grammar

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
        while (token := g.closing_token(500)) not in eog:
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

    from quantroute.engines.llamacpp.constrained import ClosingOrder, Grammar

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

    from quantroute.engines.llamacpp.constrained import ClosingOrder, Grammar

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


@pytest.mark.parametrize(
    ("pattern", "named"),
    [
        ("^a\\bc$", "an escape"),
        ("^(a)\\1$", "an escape"),
        ("^\\p{L}$", "an escape"),
        ("^[\\b]$", "an escape"),
        ("^\\ud800x$", "surrogate"),
        ("^(?=ab)ab$", "only (?:...)"),
        ("^(?<n>ab)$", "only (?:...)"),
        ("^(ab$|cd)$", "^ and $"),
        ("^[]ab$", "an empty []"),
        ("^[^\\s\\S]$", "holds no character"),
        ("^[z-a]$", "in order"),
        ("^[\\d-z]$", "in order"),
    ],
)
def test_patterns_with_no_grammar_are_refused_by_position_without_quoting(
    pattern: str, named: str
) -> None:
    schema = {"type": "object", "properties": {"ab": {"type": "string", "pattern": pattern}}}
    with pytest.raises(SchemaError, match=re.escape(named)) as caught:
        schema_grammar(schema)
    assert str(caught.value).startswith("json_schema.schema.properties[0].pattern")
    assert "ab" not in str(caught.value).replace("json_schema", "")


# ---- a pattern's values, written as JSON strings ---------------------------------------


def _utf8(text: bytes, *, final: bool = False) -> bool:
    """Whether ``text`` is UTF-8 (``final``) or the start of some."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(text, final=final)
    except UnicodeDecodeError:
        return False
    return True


def _walk(
    g: Any, rng: Any, vocab: tuple[Any, int, list[bytes], list[int]], steps: int,
    *, tricky: list[int], hints: list[int] | None = None, keep_utf8: bool = True,
) -> bytes:  # fmt: skip
    """``steps`` random tokens the grammar allows, half of them (where one is allowed)
    holding ``"``, a backslash or a control character, as a model at temperature 1 might
    pick; then the closing path, as long as ``closing_length`` said (the greedy path took
    "}" in ``[^@]+`` for ever, never the "@" that must follow; a state met again now
    takes another token). With ``hints``, the closing path but for the next hint where
    it would not end (an e-mail pattern ending in a dot and two letters: its way out of
    a loop takes a "." but never the two letters after it).

    Each token keeps the text UTF-8: llama.cpp's sampler reads bytes leniently (an
    overlong ``E0 92 BC`` as U+04BC, ``F6 B6 A3 80`` as a code point past U+10FFFF), which
    no grammar can tell apart; ``Grammar.mask`` leaves such tokens out, and the walk
    checks as well, but without ``keep_utf8`` (the mask's own test)."""
    import numpy as np

    _, n, pieces, eog = vocab
    text = b""
    for step in range(steps + 8 if keep_utf8 else steps):  # then on to a whole character
        if step >= steps and _utf8(text, final=True):
            break
        allowed = np.flatnonzero(np.isfinite(g.mask(np.zeros(n, dtype=np.float32))))
        allowed = np.array(
            [t for t in allowed if t not in eog and (not keep_utf8 or _utf8(text + pieces[t]))]
        )
        if not allowed.size:
            break
        hard = allowed[np.isin(allowed, tricky)]
        token = int(rng.choice(hard if hard.size and rng.random() < 0.5 else allowed))
        g.accept(token)
        text += pieces[token]
    while hints:
        if any(g.allows(t) for t in eog):
            return text
        token = g.closing_token(50)
        if g.closing_length(50) is None and g.allows(hints[0]):
            token = hints.pop(0)
        g.accept(token)
        text += pieces[token]
    length = g.closing_length(200)
    assert length is not None, f"no closing path after {text!r}"
    steps = 0
    while (token := g.closing_token(200)) not in eog:
        assert _utf8(text + pieces[token]) or not keep_utf8, text
        g.accept(token)
        text += pieces[token]
        steps += 1
    assert steps == length, (steps, length, text)
    return text


def _walks(grammar: str, vocab: tuple[Any, int, list[bytes], list[int]]) -> list[bytes]:
    """Twelve :func:`_walk` texts of ``grammar``, of 0, 4, ... 44 random tokens each."""
    import numpy as np

    from quantroute.engines.llamacpp.constrained import ClosingOrder, Grammar

    v, n, pieces, eog = vocab
    order = ClosingOrder(pieces, eog)
    walks = []
    for seed in range(12):
        g = Grammar(v, n, grammar, order)
        try:
            walks.append(_walk(g, np.random.default_rng(seed), vocab, seed * 4, tricky=[]))
        finally:
            g.close()
    return walks


#: Schemas whose references the converter resolved wrongly, or not at all.
REFERENCES = [REF_AT_ROOT, NAMES_TAKEN, TREE, KEYWORD_NAMES]


@pytest.mark.parametrize(
    "schema", REFERENCES, ids=["ref_at_root", "names_taken", "tree", "keyword_names"]
)
def test_references_resolve_to_what_they_name(
    vocab: tuple[Any, int, list[bytes], list[int]], schema: dict[str, Any]
) -> None:
    """A ``$ref`` at the root beside its ``$defs`` (the converter left the references
    inside them unresolved and refused the schema), one to a definition named as another
    rule (the converter gave it that rule: a string for an integer, its optional space
    for a boolean), recursion; and patterns under properties named as keywords."""
    for walk in _walks(schema_grammar(schema), vocab):
        jsonschema.validate(json.loads(walk), schema)


#: (pattern, whether its values may hold what JSON escapes: ".", negated classes and
#: \D \S \W hold ", \ and control characters)
PATTERNS = [
    ("^.+$", b"", True),
    ("^[^a]{3,8}$", b"", True),
    ("^[^@]+@[^@]+$", b"", True),  # the greedy closing path never left [^@]+
    ('^a"b$', b"", True),
    ('^[a-z"\\\\]{2,6}$', b"", True),
    ("^[ -~]{1,10}$", b"", True),
    ("^\\D{3}\\S\\W\\s$", b"", True),
    ("^[^\\s@]+@[^\\s@]+\\.[a-z]{2,3}$", b"@x.nn", True),  # see _walk's hints
    ("^(?:x|\\n|\\t)[\\x00-\\x1F]{2}\\\\\\f$", b"", True),
    ("^a]}\\{[\\]]$", b"", False),  # llama.cpp's converter looped for ever on "]"
]


@pytest.mark.parametrize(("pattern", "hints", "escapes"), PATTERNS)
def test_a_patterns_values_are_json_strings_the_pattern_matches(
    vocab: tuple[Any, int, list[bytes], list[int]], pattern: str, hints: bytes, escapes: bool
) -> None:
    """Whatever tokens the grammar lets a model pick, the text is a JSON string
    (``json.loads``) whose value the pattern matches, as Python's ``re`` and jsonschema
    read it: ", \\ and control characters come escaped (llama.cpp's converter let ``.``
    and ``[^a]`` write them raw, ending the string early or breaking it), and \\D \\W
    \\S hold no digit, letter or space of Python's Unicode classes."""
    import numpy as np

    from quantroute.engines.llamacpp.constrained import ClosingOrder, Grammar

    v, n, pieces, eog = vocab
    schema = {"type": "string", "pattern": pattern}
    grammar = schema_grammar(schema)
    order = ClosingOrder(pieces, eog)
    tricky = [t for t, p in enumerate(pieces) if any(b in b'"\\' or b < 0x20 for b in p)]
    held = 0
    for seed in range(16):
        g = Grammar(v, n, grammar, order)
        try:
            spell = [pieces.index(bytes([b])) for b in hints]
            walk = _walk(g, np.random.default_rng(seed), vocab, 24, tricky=tricky, hints=spell)
        finally:
            g.close()
        value = json.loads(walk)
        assert isinstance(value, str) and re.fullmatch(pattern[1:-1], value), walk
        jsonschema.validate(value, schema)
        held += re.search('["\\\\\x00-\x1f]', value) is not None
    assert held if escapes else not held  # the walks wrote escapes, where they could


def test_forced_tool_calls_parameters_may_refer_to_their_own_defs(
    vocab: tuple[Any, int, list[bytes], list[int]],
) -> None:
    """A reference in a tool's parameters is read from the parameters' root (the
    converter read it from the tool call around them, and refused every one), and two
    tools may each have a definition of the same name."""
    params = {
        "f": {
            "type": "object",
            "properties": {"who": {"$ref": "#/$defs/Person"}},
            "required": ["who"],
            "$defs": REF_AT_ROOT["$defs"],
        },
        "g": {  # its own "Person", and at the root
            "$ref": "#/$defs/Person",
            "$defs": {"Person": {"type": "array", "items": {"type": "boolean"}, "minItems": 1}},
        },
    }
    names = set()
    for walk in _walks(tool_call_grammar(list(params.items()), parallel=False), vocab):
        text = walk.decode()
        assert text.startswith("<tool_call>") and text.endswith("</tool_call>"), text
        call = json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))
        jsonschema.validate(call["arguments"], params[call["name"]])
        names.add(call["name"])
    assert names == {"f", "g"}


def test_a_schema_seen_before_is_not_converted_again_and_the_memo_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from quantroute.shaping import grammar as g

    converted: list[int] = []
    real = g._convert

    def counting(schemas: Any) -> str:
        converted.append(len(schemas))
        return real(schemas)

    monkeypatch.setattr(g, "_convert", counting)
    monkeypatch.setattr(g, "_MEMO", g._Memo(budget=64 << 10))
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^.+$"}}}
    first = g.schema_grammar(schema)
    assert g.schema_grammar(json.loads(json.dumps(schema))) == first and converted == [1]
    reordered = {"properties": schema["properties"], "type": "object"}  # same keys, new order
    assert g.schema_grammar(reordered) == first and converted == [1, 1]  # its own entry
    tools = [("f", {"type": "object", "properties": {"x": {"type": "integer"}}})]
    assert g.tool_call_grammar(tools, parallel=True) == g.tool_call_grammar(tools, parallel=True)
    assert g.tool_call_grammar(tools, parallel=False) != g.tool_call_grammar(tools, parallel=True)
    assert converted == [1, 1, 1, 1]
    checked: list[int] = []
    real_check = g.check_schema

    def counting_check(schema: Any, where: str = "schema") -> None:
        checked.append(1)
        real_check(schema, where)

    monkeypatch.setattr(g, "check_schema", counting_check)
    messages = set()
    for _ in range(3):  # a refusal is remembered like a grammar: checked once, refused thrice
        with pytest.raises(SchemaError) as refused:
            g.schema_grammar({"type": "string", "minimum": 1})
        messages.add(str(refused.value))
    assert checked == [1] and len(messages) == 1 and "'minimum'" in messages.pop()
    for n in range(200):  # many schemas: the oldest go, the memo stays within its budget
        g.schema_grammar({"type": "string", "maxLength": n + 1})
    assert g._MEMO._used <= 64 << 10 and len(g._MEMO._grammars) < 200
    before = len(converted)
    g.schema_grammar({"type": "string", "maxLength": 200})  # the latest: kept
    assert len(converted) == before
    g.schema_grammar({"type": "string", "maxLength": 1})  # the oldest: gone, converted again
    assert len(converted) == before + 1


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "maxLength": 2},
        {"type": "string", "pattern": "^[^a]{1,3}$"},
        {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}},
    ],
)
def test_every_token_the_grammar_allows_keeps_the_output_utf8(
    vocab: tuple[Any, int, list[bytes], list[int]], schema: dict[str, Any]
) -> None:
    """llama.cpp's grammar sampler reads bytes leniently (an overlong ``E0 92 BC`` passes
    as U+04BC), and the worker decodes each bad byte as U+FFFD, which broke a string's
    ``maxLength``; the mask keeps only the tokens after which the output is UTF-8, the
    closing path too, so whatever a model picks the text decodes and validates."""
    import numpy as np

    from quantroute.engines.llamacpp.constrained import ClosingOrder, Grammar

    v, n, pieces, eog = vocab
    grammar = schema_grammar(schema)
    order = ClosingOrder(pieces, eog)
    high = [t for t, p in enumerate(pieces) if p and p[0] >= 0x80]  # lead and trail bytes
    for seed in range(300):
        rng = np.random.default_rng(seed)
        g = Grammar(v, n, grammar, order)
        try:
            steps = int(rng.integers(1, 6))
            text = _walk(g, rng, vocab, steps, tricky=high, keep_utf8=False)
        finally:
            g.close()
        value = json.loads(text.decode("utf-8"))  # strict: no byte the worker would replace
        jsonschema.validate(value, schema)


def test_the_utf8_mask_never_leaves_nothing(
    vocab: tuple[Any, int, list[bytes], list[int]],
) -> None:
    """Inside a character, only the bytes that go on with it as UTF-8 are kept (after
    ``E0``: ``A0``..``BF``, not the overlong ``80``..``9F`` llama.cpp would pass); where
    the grammar allowed none of those it says so, and ``Grammar.mask`` takes what the
    grammar allowed: a byte the worker decodes as U+FFFD, never a row with no token."""
    import numpy as np

    from quantroute.engines.llamacpp.constrained import ClosingOrder, _keep_utf8

    _, n, pieces, eog = vocab
    order = ClosingOrder(pieces, eog)
    byte = {p[0]: t for t, p in enumerate(pieces) if len(p) == 1}
    logits = np.full(n, -np.inf)
    logits[[byte[0x80], byte[0x9F], byte[0xA0], byte[0xBF], byte[0x41]]] = 0.0
    assert _keep_utf8(logits, b"\xe0", order)
    assert set(np.flatnonzero(np.isfinite(logits))) == {byte[0xA0], byte[0xBF]}
    only_overlong = np.full(n, -np.inf)
    only_overlong[byte[0x80]] = 0.0
    assert not _keep_utf8(only_overlong, b"\xe0", order)  # nothing left: the caller's turn
    fresh = np.zeros(n)
    assert _keep_utf8(fresh, b"", order)  # after a whole character: no trail byte
    assert not np.isfinite(fresh[byte[0x80]]) and np.isfinite(fresh[byte[0x41]])
    # nor a control token: the worker writes nothing for <s>, where the grammar reads "<s>"
    control = [t for t, p in enumerate(pieces) if not p and t not in eog]
    assert control and not np.isfinite(fresh[control]).any()
    assert all(np.isfinite(fresh[t]) for t in eog)
