"""``response_format`` and the grammar a request's output must match.

``{"type": "text"}`` constrains nothing; ``json_object`` is any JSON object;
``json_schema`` is a value of its schema, every keyword enforced by the grammar or
refused with a 400 that names it (``engines.grammar.check_schema``). A forced tool
call (``tool_choice`` ``required`` or a named function) has its own grammar and
wins over ``response_format``.

Parsing a body reads a schema's shape only: what it costs to check and convert is the
client's to choose, so :func:`grammar_of` does that, after the tenant's limits and in
a thread (``api/grammars.py``), never while the body is parsed on the event loop.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from quantroute.api.tools import STRICT, NamedToolChoice, Tool, encodable
from quantroute.errors import InvalidRequestError
from quantroute.shaping.grammar import (
    SchemaError,
    json_object_grammar,
    schema_grammar,
    tool_call_grammar,
)

__all__ = ["JsonSchemaSpec", "ResponseFormat", "forces_tools", "grammar_of", "needs_grammar"]


class TextFormat(BaseModel):
    model_config = STRICT
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = STRICT
    type: Literal["json_object"]


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: Annotated[str, AfterValidator(encodable)] | None = Field(None, max_length=1 << 16)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # enforced either way


class JsonSchemaFormat(BaseModel):
    model_config = STRICT
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]
# Each member's tag ("text", ...): pydantic's error paths name the member by it.
FORMAT_TAGS = frozenset(
    get_args(m.model_fields["type"].annotation)[0]
    for m in (TextFormat, JsonObjectFormat, JsonSchemaFormat)
)


def forces_tools(tools: list[Tool] | None, choice: Any) -> bool:
    """Whether ``tool_choice`` forces a call to one of ``tools`` (a grammar does)."""
    return bool(tools) and (choice == "required" or isinstance(choice, NamedToolChoice))


def needs_grammar(fmt: ResponseFormat | None, tools: Any = None, choice: Any = None) -> bool:
    """Whether :func:`grammar_of` has work to do (else it is ``None``, at once)."""
    return isinstance(fmt, JsonObjectFormat | JsonSchemaFormat) or forces_tools(tools, choice)


def grammar_of(
    fmt: ResponseFormat | None,
    tools: list[Tool] | None = None,
    choice: Any = None,
    parallel_tool_calls: bool | None = True,
) -> str | None:
    """The GBNF the output must match for a request's ``response_format`` and, a chat
    request's, its ``tools``, ``tool_choice`` and ``parallel_tool_calls``; or ``None``.
    A schema it refuses is a 400 naming ``tools`` or ``response_format.json_schema``."""
    if tools and forces_tools(tools, choice):
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        chosen = [t for t in tools if named is None or t.function.name == named]
        functions = [(t.function.name, t.function.schema_) for t in chosen]
        try:
            return tool_call_grammar(functions, parallel=parallel_tool_calls is not False)
        except SchemaError as exc:
            raise InvalidRequestError(str(exc), param="tools") from None
    if isinstance(fmt, JsonObjectFormat):
        return json_object_grammar()
    if isinstance(fmt, JsonSchemaFormat):
        try:
            return schema_grammar(fmt.json_schema.schema_, "schema")  # the param's own key
        except SchemaError as exc:  # worded as a field's error is (api/errors.py)
            param = "response_format.json_schema"
            raise InvalidRequestError(f"{param}: {exc}", param=param) from None
    return None
