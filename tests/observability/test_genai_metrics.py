"""The GenAI semantic conventions' server metrics in ``/metrics``: the same requests as
quantroute's own families, under the conventions' names and attributes."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from qrtest import fake_app, serving

BODY = {"model": "tiny-llama", "prompt": "def f():", "max_tokens": 5, "quality": "fast"}


def _series(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _sum(
    series: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **want: str
) -> float:
    return sum(v for (n, ls), v in series.items() if n == name and set(want.items()) <= ls)


async def test_the_conventions_names_count_what_quantroutes_families_count() -> None:
    async with serving(fake_app()) as (client, _):
        for _ in range(2):
            assert (await client.post("/v1/completions", json=BODY)).status_code == 200
        stream = await client.post("/v1/completions", json=BODY | {"stream": True})
        assert stream.status_code == 200
        missing = await client.post("/v1/completions", json=BODY | {"model": "nope"})
        assert missing.status_code == 404
        text = (await client.get("/metrics")).text
    s = _series(text)
    ours = {"gen_ai_provider_name": "quantroute", "gen_ai_request_model": "tiny-llama"}
    assert _sum(s, "gen_ai_server_time_to_first_token_seconds_count", **ours) == 3
    assert _sum(s, "gen_ai_server_time_to_first_token_seconds_sum", **ours) == _sum(
        s, "quantroute_time_to_first_token_seconds_sum", model="tiny-llama"
    )
    # every request's 4 gaps after its first token, whole or streamed
    assert _sum(s, "gen_ai_server_time_per_output_token_seconds_count", **ours) == 12
    assert _sum(s, "gen_ai_server_request_duration_seconds_count", error_type="", **ours) == 3
    assert _sum(s, "gen_ai_server_request_duration_seconds_count", error_type="404") == 1
    assert _sum(s, "gen_ai_server_token_usage_total", gen_ai_token_type="output", **ours) == 15
    assert _sum(s, "gen_ai_server_token_usage_total", gen_ai_token_type="input", **ours) == _sum(
        s, "quantroute_prompt_tokens_total", model="tiny-llama"
    )
    branches = {ls for (n, ls) in s if n == "gen_ai_server_token_usage_total"}
    assert all(
        dict(ls)["gen_ai_response_model"].startswith("q")
        or dict(ls)["gen_ai_response_model"] == "f16"
        for ls in branches
    )
    # buckets stay cumulative and end in +Inf = count
    inf = _sum(s, "gen_ai_server_time_to_first_token_seconds_bucket", le="+Inf", **ours)
    assert inf == 3
