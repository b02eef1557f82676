from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hostile import loop_gaps
from quantroute.errors import InvalidRequestError, TemplateError
from quantroute.shaping import chat_template
from quantroute.shaping.chat_template import (
    DEFAULT_STOPS,
    INLINE_CONTENT_CHARS,
    render_chat,
    render_chat_bounded,
)
from quantroute.shaping.template_pool import TemplatePool
from quantroute.shaping.template_worker import RenderJob

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_default_template_is_documented_format_with_its_stop() -> None:
    prompt = render_chat(MESSAGES, model_template=None)
    assert prompt.text == "### System:\nBe brief.\n### User:\nHi\n### Assistant:\n"
    assert prompt.stops == DEFAULT_STOPS
    assert prompt.template == "default"


def test_model_template_is_used_and_leading_bos_is_not_doubled() -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
        "<|assistant|>"
    )
    prompt = render_chat(MESSAGES, model_template=template, bos_token="<s>")
    assert prompt.text == "<|system|>Be brief.<|user|>Hi<|assistant|>"
    assert prompt.stops == ()


@pytest.mark.parametrize(
    "template",
    [
        "{{ self.__init__.__globals__ }}",
        "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{% for m in messages %}{{ m.__class__.__init__.__globals__ }}{% endfor %}",
    ],
)
def test_unsafe_templates_execute_nothing_and_raise(template: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(TemplateError) as info:
        render_chat(MESSAGES, model_template=template.replace("MARKER", str(marker)))
    assert not marker.exists()
    assert info.value.status == 500
    assert info.value.error_code == "chat_template_error"


def test_raise_exception_in_template_refuses_the_conversation_with_a_400() -> None:
    # The template judging the client's conversation (roles that do not alternate,
    # a system message it does not take): the client's to change, so a 400.
    template = "{{ raise_exception('only user and assistant roles') }}"
    with pytest.raises(InvalidRequestError, match="only user and assistant roles") as info:
        render_chat(MESSAGES, model_template=template)
    assert info.value.status == 400
    assert info.value.param == "messages"
    assert info.value.error_code == "chat_template_refused"


def test_broken_template_syntax_is_a_template_error() -> None:
    with pytest.raises(TemplateError):
        render_chat(MESSAGES, model_template="{% for m in messages %}")


# ---- the budget: time and size ---------------------------------------------------------------

BIG = "{% set s = 'x' * 100000 %}"
RUNAWAY = {
    # loops: the deadline is checked on every iteration of every loop
    "nested ranges": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}"
    "{% endfor %}",
    "nested over messages": "{% for a in range(100000) %}{% for b in messages %}"
    "{% for c in messages %}{% endfor %}{% endfor %}{% endfor %}",
    "nested over a string": BIG + "{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
    "a filter in a loop": "{% for a in range(100000) %}"
    "{{ range(100000)|map('string')|join|length }}{% endfor %}",
    "the hook's name shadowed": "{% set qr_iter = none %}{% for a in range(100000) %}"
    "{% for b in range(100000) %}{% endfor %}{% endfor %}",
}
OVERSIZED = {
    # one C-level operation that would build gigabytes: refused before it runs
    "string repeat": "{{ 'x' * 10**10 }}",
    "list repeat": "{{ ([0] * 1000000000)|length }}",
    "power": "{{ 2 ** 10000000000 }}",
    "percent width": "{{ '%0999999999d' % 1 }}",
    "percent star": "{{ '%*d' % (999999999, 1) }}",
    "format width": "{{ '{:>999999999}'.format(1) }}",
    "nested format width": "{{ '{:>{}}'.format(1, 999999999) }}",
    "center filter": "{{ 'x'|center(999999999) }}",
    "center method": "{{ 'x'.center(999999999) }}",
    "replace method": BIG + "{{ s.replace('x', s) }}",
    "replace filter": BIG + "{{ s|replace('x', s) }}",
    "indent": "{% set s = '\n' * 100000 %}{{ s|indent(s) }}",
    "join of a range": BIG + "{{ range(100000)|join(s) }}",
    "join of a generator": BIG + "{{ range(20000)|map('string')|join(s) }}",
    "join method": BIG + "{{ s.join(range(20000)|map('string')) }}",
    "expandtabs": "{% set s = '\t' * 100000 %}{{ s.expandtabs(100000) }}",
    "wordwrap": "{% set s = 'x ' * 500000 %}{{ s|wordwrap(1, wrapstring='y' * 100000) }}",
    "batch": "{{ [1]|batch(999999999, 0)|list|length }}",
    "slice": "{{ [1]|slice(999999999)|list|length }}",
    "tojson indent": "{{ range(1000)|list|tojson(indent=1000000) }}",
    "translate": "{{ 'abc'.translate({97: 'x'}) }}",
    # growth across operations: every value made is counted
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "doubling with +": "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "a macro body": "{% set s = 'x' * 1000000 %}{% macro m() %}{% for i in range(100000) %}"
    "{{ s }}{% endfor %}{% endmacro %}{{ m()|length }}",
    "a block set": "{% set s = 'x' * 1000000 %}{% set b %}{% for i in range(100000) %}{{ s }}"
    "{% endfor %}{% endset %}{{ b|length }}",
    "the output": "{% set s = 'x' * 1000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}",
    "many distinct strings": "{% set s = 'x' * 1000000 %}{% set ns = namespace(l=[]) %}"
    "{% for i in range(100000) %}{% set ns.l = ns.l + [s ~ i] %}{% endfor %}{{ ns.l|length }}",
    "many replaced strings": "{% set s = 'x' * 1000000 %}"
    "{{ range(100000)|map('string')|map('replace', '', s)|list|length }}",
    # str() of a list holding one big string many times
    "repr of a repeated list": "{% set s = 'x' * 1000000 %}{{ [s] * 100000 }}",
    "repr of nested literals": "{% set s = 'x' * 1000000 %}{% set a = [s,s,s,s,s,s,s,s,s,s] %}"
    "{% set b = [a,a,a,a,a,a,a,a,a,a] %}{% set c = [b,b,b,b,b,b,b,b,b,b] %}{{ c ~ '' }}",
    "repr via string": "{% set s = 'x' * 1000000 %}{{ ([s] * 1000)|string|length }}",
    "repr via tojson": "{% set s = 'x' * 1000000 %}{{ ([s] * 1000)|tojson|length }}",
    "repr via percent": "{% set s = 'x' * 1000000 %}{{ ('%s' % ([s] * 1000,))|length }}",
    "repr via format": "{% set s = 'x' * 1000000 %}{{ '{}'.format([s] * 1000)|length }}",
    "repr of a namespace": "{% set s = 'x' * 1000000 %}{% set ns = namespace(a=[s] * 1000) %}"
    "{{ ns }}",
}
LIMITS = {"timeout_s": 0.5, "max_chars": 1 << 20}


@pytest.mark.parametrize("template", RUNAWAY.values(), ids=RUNAWAY.keys())
def test_a_runaway_template_stops_at_its_deadline(template: str) -> None:
    start, cpu = time.monotonic(), time.thread_time()
    with pytest.raises(InvalidRequestError) as info:
        render_chat(MESSAGES, model_template=template, **LIMITS)
    assert info.value.error_code == "chat_template_limit"
    assert info.value.status == 400 and info.value.param == "messages"
    assert "exceeded its time budget (0.5 s)" in info.value.message
    # it stopped itself (this thread), within a few checks of the deadline
    assert time.monotonic() - start < 1.5
    assert time.thread_time() - cpu < 1.5


@pytest.mark.parametrize("template", OVERSIZED.values(), ids=OVERSIZED.keys())
def test_an_oversized_template_value_is_refused_before_it_is_built(template: str) -> None:
    start = time.monotonic()
    with pytest.raises(InvalidRequestError) as info:  # time enough for a busy machine
        render_chat(MESSAGES, model_template=template, **(LIMITS | {"timeout_s": 10.0}))
    assert info.value.error_code == "chat_template_limit"
    assert "exceeded its size budget (1048576 characters" in info.value.message
    assert time.monotonic() - start < 5


@pytest.mark.parametrize(
    "template",
    [
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{% for x in [1] recursive %}{{ loop([1, 2]) }}{% endfor %}",
    ],
)
def test_unbounded_recursion_is_over_the_budget(template: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        render_chat(MESSAGES, model_template=template, **LIMITS)
    assert info.value.error_code == "chat_template_limit"
    assert "recursion budget" in info.value.message


@pytest.mark.parametrize(
    "template",
    [
        "{{ lipsum(1000000) }}",  # not offered: n paragraphs in one call
        "{{ (10 ** 4000) * (10 ** 4000) }}",  # under the bit limit, but too long to print
    ],
)
def test_other_failures_of_the_template_are_template_errors(template: str) -> None:
    with pytest.raises(TemplateError) as info:
        render_chat(MESSAGES, model_template=template, **LIMITS)
    assert info.value.error_code == "chat_template_error"


LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}"
    "{%- endif %}{{- bos_token }}{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant') }}{%- endif %}"
    "{%- if message['role'] == 'user' %}{%- if loop.first and system_message is defined %}"
    "{{- ' [INST] ' + system_message + '\n\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' [INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token}}"
    "{%- endif %}{%- endfor %}"
)
TOOLISH = (
    "{% set ns = namespace(sys='') %}{% for m in messages %}{% if m.role == 'system' %}"
    "{% set ns.sys = ns.sys ~ m.content %}{% endif %}{% endfor %}[{{ ns.sys }}]"
    "{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|join(', ') }}"
    " {{ messages|tojson(indent=2)|length > 0 }} {{ '%s-%d' % ('a', 3) }} {{ '{}!'.format('b') }}"
    " {{ (strftime_now('%Y') | int) > 2000 }} {{ range(3)|list }} {{ 'ab' * 2 }} {{ 2 ** 10 }}"
)


def test_real_world_templates_render_as_before_within_the_budget() -> None:
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    llama3 = render_chat(conversation, model_template=LLAMA3, bos_token="<|begin_of_text|>")
    assert llama3.text.startswith("<|start_header_id|>system<|end_header_id|>\n\nBe brief.")
    assert llama3.text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    mistral = render_chat(conversation, model_template=MISTRAL, bos_token="<s>", eos_token="</s>")
    assert mistral.text == " [INST] Be brief.\n\nHi [/INST] Hello.</s> [INST] Bye [/INST]"
    toolish = render_chat(conversation, model_template=TOOLISH)
    assert toolish.text == "[Be brief.]Hi, Bye True a-3 b! True [0, 1, 2] abab 1024"
    with pytest.raises(InvalidRequestError, match="must alternate"):
        render_chat([{"role": "user", "content": "Hi"}] * 2, model_template=MISTRAL)


def test_a_large_conversation_renders_in_time() -> None:
    conversation = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 800}
        for i in range(1024)
    ]
    for template in (None, LLAMA3, MISTRAL):
        prompt = render_chat(conversation, model_template=template, timeout_s=5.0)
        assert len(prompt.text) > 1024 * 4000


def test_the_output_limit_counts_the_prompt_itself() -> None:
    conversation = [{"role": "user", "content": "x" * 1000}]
    assert render_chat(conversation, model_template=None, max_chars=1100).text
    with pytest.raises(InvalidRequestError, match=r"size budget \(1000 characters"):
        render_chat(conversation, model_template=None, max_chars=1000)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "developer", "user", "assistant", "tool"]),
                "content": st.text(),
            }
        ),
        min_size=1,
        max_size=6,
    )
)
def test_the_default_template_is_the_documented_format_for_any_conversation(
    conversation: list[dict[str, str]],
) -> None:
    prompt = render_chat(conversation, model_template=None)
    expected = "".join(f"### {m['role'].capitalize()}:\n{m['content']}\n" for m in conversation)
    assert prompt.text == expected + "### Assistant:\n"


class CountingPool(TemplatePool):
    """A real pool that counts the renders it is given."""

    def __init__(self) -> None:
        super().__init__(size=1)
        self.jobs: list[RenderJob] = []

    async def render(self, job: RenderJob) -> str:
        self.jobs.append(job)
        return await super().render(job)


@pytest.fixture
def pool() -> Any:
    p = CountingPool()
    p.warm()  # its process started: the renders' times are the renders'
    yield p
    p.close()


SHIFTY = (
    "{% set last = messages[-1].content %}"
    "{% if last == 'slow' %}{% for i in messages %}{% for j in messages %}{% endfor %}"
    "{% endfor %}{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
)


async def test_bounded_render_gives_the_same_prompt(pool: CountingPool) -> None:
    for template in (None, LLAMA3, MISTRAL, TOOLISH, SHIFTY):
        conversation = [*MESSAGES, {"role": "assistant", "content": "Hello."}]
        conversation.append({"role": "user", "content": "Bye"})
        if template is MISTRAL:
            conversation = conversation[1:]
        expected = render_chat(conversation, model_template=template, bos_token="<s>")
        got = await render_chat_bounded(
            conversation, model_template=template, bos_token="<s>", pool=pool
        )
        assert got == expected


async def test_a_provably_bounded_template_renders_small_conversations_on_the_loop(
    pool: CountingPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chat_template, "INLINE_S", 0.05)  # a busy machine's pauses aside
    for content in ("hi", "slow"):
        prompt = await render_chat_bounded(
            [{"role": "user", "content": content}], model_template=SHIFTY, pool=pool
        )
        assert prompt.text == f"<user>{content}<assistant>"
    assert pool.jobs == []  # no render process involved
    big = "y" * (INLINE_CONTENT_CHARS + 1)  # a long conversation: a render process
    prompt = await render_chat_bounded(
        [{"role": "user", "content": big}], model_template=SHIFTY, pool=pool
    )
    assert prompt.text.endswith(big + "<assistant>") and len(pool.jobs) == 1


async def test_a_template_that_is_not_provably_bounded_always_renders_out_of_process(
    pool: CountingPool,
) -> None:
    template = SHIFTY + "{{ 'ab' * 2 }}"  # one multiplication: not provably bounded
    for _ in range(3):
        prompt = await render_chat_bounded(
            [{"role": "user", "content": "hi"}], model_template=template, pool=pool
        )
        assert prompt.text == "<user>hi<assistant>abab"
    assert len(pool.jobs) == 3


async def test_a_runaway_render_is_a_400_at_its_deadline_and_the_loop_runs_meanwhile(
    pool: CountingPool,
) -> None:
    start = time.monotonic()
    outcome, gap = await loop_gaps(
        render_chat_bounded(
            MESSAGES, model_template=RUNAWAY["nested ranges"], timeout_s=0.5, pool=pool
        )
    )
    assert isinstance(outcome, InvalidRequestError)
    assert outcome.error_code == "chat_template_limit"
    assert gap < 0.2  # the render ran in its process, not on the loop
    assert 0.45 < time.monotonic() - start < 0.5 + 1.5  # the kill, a busy machine
    # and the pool still renders
    prompt = await render_chat_bounded(MESSAGES, model_template=TOOLISH, pool=pool)
    assert prompt.text.startswith("[Be brief.]")
