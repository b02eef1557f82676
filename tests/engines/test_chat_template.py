from __future__ import annotations

from pathlib import Path

import pytest

from quantroute.engines.chat_template import DEFAULT_STOPS, render_chat
from quantroute.errors import TemplateError

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


def test_raise_exception_in_template_becomes_template_error() -> None:
    template = "{{ raise_exception('only user and assistant roles') }}"
    with pytest.raises(TemplateError, match="only user and assistant roles"):
        render_chat(MESSAGES, model_template=template)


def test_broken_template_syntax_is_a_template_error() -> None:
    with pytest.raises(TemplateError):
        render_chat(MESSAGES, model_template="{% for m in messages %}")
