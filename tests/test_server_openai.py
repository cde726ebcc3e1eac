"""`tierkv serve` through the official `openai` client: completions and chat (plain and streaming), the
standard cached-token field, parameters honoured or refused by name, tenants that never share KV, and
metrics that Prometheus' and OpenMetrics' parsers accept."""

import http.client
import json

import openai
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_prometheus

from engine_helpers import reference, tiny_model
from engine_helpers import single_torch_thread  # noqa: F401  (autouse fixture)
from tierkv.engine.engine import Engine, EngineConfig
from tierkv.engine.server import CompletionServer

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def model():
    return tiny_model(MODEL)


def start_server(model, **kwargs):
    engine = Engine(model, EngineConfig(mode="l1+l2", l1_tokens=4096))
    return CompletionServer(engine, model_name=MODEL, **kwargs).start()


@pytest.fixture(scope="module")
def server(model):
    srv = start_server(model)
    yield srv
    srv.close()


def client_for(srv, api_key="unused"):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key=api_key, max_retries=0)


def test_completions_and_cached_tokens_through_the_client(server, model):
    client, prompt = client_for(server), "The quick brown fox jumps over the lazy dog"
    want = reference(model, [list(prompt.encode())], 4)[0].output
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert first.choices[0].finish_reason == "length" and first.usage.completion_tokens == 4
    assert first.choices[0].text == bytes(t for t in want if t < 256).decode("utf-8", "replace")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1


def test_chat_plain_and_streaming_agree(server):
    client = client_for(server)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert plain.object == "chat.completion" and plain.choices[0].message.role == "assistant"
    assert plain.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens - 1


def test_stop_echo_and_logprobs_are_honoured(server):
    client, prompt = client_for(server), "stop and echo"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12)
    text = full.choices[0].text
    stop = text[3:5] if len(text) > 5 else None
    if stop and text.find(stop) == 3:
        cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, stop=[stop])
        assert cut.choices[0].text == text[:3] and cut.choices[0].finish_reason == "stop"
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, echo=True)
    assert echoed.choices[0].text == prompt + text
    with_lp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=2)
    lp = with_lp.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(v <= 0 for v in lp.token_logprobs)
    assert all(top and all(v <= 0 for v in top.values()) for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                          logprobs=True, top_logprobs=3)
    assert [len(c.top_logprobs) for c in chat.choices[0].logprobs.content] == [3, 3]


@pytest.mark.parametrize("param, value", [("temperature", 0.8), ("top_p", 0.5), ("n", 2),
                                          ("presence_penalty", 1.0), ("max_tokens", 0)])
def test_unsupported_parameters_are_refused_naming_them(server, param, value):
    with pytest.raises(openai.BadRequestError) as info:
        client_for(server).completions.create(model=MODEL, prompt="x", **({"max_tokens": 2} | {param: value}))
    assert info.value.status_code == 400 and param in str(info.value)


def test_unknown_fields_are_refused_and_greedy_settings_accepted(server):
    client = client_for(server)
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"best_of": 3})
    ok = client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0, top_p=1, seed=7)
    assert ok.usage.completion_tokens == 2


def test_unknown_model_is_a_404(server):
    with pytest.raises(openai.NotFoundError, match="gpt-4o"):
        client_for(server).completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    assert [m.id for m in client_for(server).models.list()] == [MODEL]


# ---- tenants -------------------------------------------------------------------------------------
SECRET, CHARSET = "k3y9", "abck0123y9"


def probe_attack(send, prefix: str = "pw=") -> str:
    """Recover a cached prompt character by character from `cached_tokens`: a guess that extends the
    recovered prefix by one cached character is right (the victim's prompt starts with ``prefix``)."""
    recovered = prefix
    for _ in range(len(SECRET)):
        hits = [c for c in CHARSET if send(recovered + c + "\x00") > len(recovered)]
        if len(hits) != 1:
            break
        recovered += hits[0]
    return recovered[len(prefix):]


def cached(client, prompt: str, **extra) -> int:
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, **extra)
    return reply.usage.prompt_tokens_details.cached_tokens


def test_probing_recovers_a_shared_cache_prompt_but_nothing_across_salts(server):
    victim = client_for(server)
    cached(victim, f"pw={SECRET} and more", extra_body={"cache_salt": "victim-salt"})
    cached(victim, f"pw={SECRET} and more")  # the same prompt once without a salt: the shared cache
    attacker = client_for(server)
    assert probe_attack(lambda p: cached(attacker, p)) == SECRET  # the attack works on a shared cache...
    salted_only = f"PW:{SECRET} salted"  # ...but recovers nothing of a prompt sent only with a salt
    cached(victim, salted_only, extra_body={"cache_salt": "victim-salt"})
    assert cached(victim, salted_only, extra_body={"cache_salt": "victim-salt"}) == len(salted_only) - 1
    assert probe_attack(lambda p: cached(attacker, p), "PW:") == ""
    assert probe_attack(lambda p: cached(attacker, p, extra_body={"cache_salt": "guess"}), "PW:") == ""
    assert cached(attacker, salted_only, extra_body={"cache_salt": "other"}) == 0


def test_tenants_from_api_keys_never_share_kv(model, tmp_path):
    srv = start_server(model, api_keys={"key-a": "alice", "key-b": "bob", "key-c": "carol"})
    try:
        alice, bob = client_for(srv, "key-a"), client_for(srv, "key-b")
        cached(alice, f"pw={SECRET} tenant")
        assert cached(alice, f"pw={SECRET} tenant") > 0
        assert probe_attack(lambda p: cached(bob, p)) == ""
        assert probe_attack(lambda p: cached(bob, p, extra_body={"cache_salt": "alice"})) == ""
        assert cached(client_for(srv, "key-c"), f"pw={SECRET} tenant") == 0
        with pytest.raises(openai.AuthenticationError):
            cached(client_for(srv, "wrong"), "hello")
    finally:
        srv.close()


def test_a_tenant_with_a_salt_never_shares_kv_with_a_tenant_named_like_both(model):
    srv = start_server(model, api_keys={"key-a": "a", "key-x": "a|salt:b"})
    try:
        alice, mallory = client_for(srv, "key-a"), client_for(srv, "key-x")
        cached(alice, f"pw={SECRET} salted", extra_body={"cache_salt": "b"})
        assert cached(alice, f"pw={SECRET} salted", extra_body={"cache_salt": "b"}) > 0
        assert cached(mallory, f"pw={SECRET} salted") == 0
    finally:
        srv.close()


# ---- metrics -------------------------------------------------------------------------------------
def scrape(srv, accept: str | None = None) -> tuple[str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    conn.request("GET", "/metrics", headers={"Accept": accept} if accept else {})
    resp = conn.getresponse()
    return resp.getheader("Content-Type"), resp.read().decode()


def test_metrics_parse_as_prometheus_text_and_openmetrics(server):
    client = client_for(server)
    for _ in range(2):
        client.completions.create(model=MODEL, prompt="metrics prompt here", max_tokens=2)
    ctype, text = scrape(server)
    assert ctype.startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in parse_prometheus(text) for s in family.samples}
    assert samples[("tierkv_requests_total", (("outcome", "finished"),))] >= 2
    assert samples[("tierkv_cache_hit_tokens_total", (("tier", "device"),))] >= 18
    assert ("tierkv_cache_hit_tokens_total", (("tier", "host"),)) in samples
    assert samples[("tierkv_cache_capacity_tokens", (("tier", "host"),))] == server.loop.engine.cache.host_pool.num_slots
    assert samples[("tierkv_time_to_first_token_seconds_count", ())] >= 2
    assert ("tierkv_evicted_tokens_total", (("tier", "device"),)) in samples
    ctype, text = scrape(server, "application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text")
    families = {f.name: f for f in parse_openmetrics(text)}
    assert families["tierkv_time_to_first_token_seconds"].type == "histogram"
    assert families["tierkv_cache_hit_tokens"].type == "counter"
