"""The OpenAI-compatible HTTP door (orchestrator/http/), with the official openai SDK as the
client and raw HTTP for the server-sent-event framing; real servers on free ports."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from orchestrator.admission import Admission
from orchestrator.http.app import FrontDoor
from orchestrator.http.transport import HttpServer
from orchestrator.servicer import DecoderSlot
from tests.support.memory import rss_mib
from tests.support.servers import client_of, paced, start_stack, stop_stack, wait_for

PROMPT = "def fib(n):"
CHAT = [{"role": "system", "content": "You write code."}, {"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def oai(http_stack):
    with openai.OpenAI(base_url=http_stack["http"] + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(http_stack):
    with client_of(http_stack["address"]) as c:
        yield c


def test_completion_is_the_grpc_answer_with_usage_and_stats(oai, grpc_client, http_stack):
    r = oai.completions.create(model=http_stack["model"], prompt=PROMPT, max_tokens=12, temperature=0)
    ref = grpc_client.generate(prompt=PROMPT, max_new_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == http_stack["model"]
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.prompt_tokens == ref.stats["prompt_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stats = r.model_extra["specdec"]  # the extension field
    assert stats["generated_tokens"] == len(ref.token_ids) and stats["rounds"] >= 1


def test_decoding_controls_through_the_sdk_are_the_grpc_answer(oai, grpc_client, http_stack):
    """OpenAI's penalties and logit_bias, and vLLM's extensions in extra_body, reach the decoder
    as the gRPC fields do (their exactness: tests/orchestrator/test_decoding_controls.py)."""
    controls = dict(frequency_penalty=1.2, presence_penalty=0.5)
    extensions = dict(repetition_penalty=1.3, min_tokens=3, stop_token_ids=[11], min_p=0.1)
    plain = oai.completions.create(model=http_stack["model"], prompt=PROMPT, max_tokens=16, temperature=0)
    r = oai.completions.create(model=http_stack["model"], prompt=PROMPT, max_tokens=16, temperature=0,
                               logit_bias={"30": 5.0}, extra_body=extensions, **controls)
    ref = grpc_client.generate(prompt=PROMPT, max_new_tokens=16, temperature=0, logit_bias={30: 5.0},
                               **controls, **extensions)
    assert r.choices[0].text == ref.text != plain.choices[0].text
    assert r.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")
    chat = oai.chat.completions.create(model=http_stack["model"], messages=CHAT, max_tokens=8, temperature=0,
                                       extra_body={"repetition_penalty": 1.5})
    ref = grpc_client.generate(messages=CHAT, max_new_tokens=8, temperature=0, repetition_penalty=1.5)
    assert chat.choices[0].message.content == ref.text


def test_structured_output_by_every_name_clients_use(oai, grpc_client, http_stack):
    """OpenAI's response_format (json_schema, json_object), vLLM's structured_outputs and its
    guided_* fields: the gRPC answer under the same grammar (exactness and validity:
    tests/orchestrator/test_structured_output.py)."""
    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    chat = oai.chat.completions.create(
        model=http_stack["model"], messages=CHAT, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}})
    ref = grpc_client.generate(messages=CHAT, max_new_tokens=40, temperature=0, structured_output={"json_schema": schema})
    assert chat.choices[0].message.content == ref.text
    jsonschema.validate(json.loads(ref.text), schema)
    for extra, so in (({"structured_outputs": {"regex": "[0-9]{3}"}}, {"regex": "[0-9]{3}"}),
                      ({"guided_choice": ["red", "blue"]}, {"choice": ["red", "blue"]}),
                      ({"guided_json": schema}, {"json_schema": schema})):
        r = oai.completions.create(model=http_stack["model"], prompt=PROMPT, max_tokens=40, temperature=0,
                                   extra_body=extra)
        assert r.choices[0].text == grpc_client.generate(prompt=PROMPT, max_new_tokens=40, temperature=0,
                                                         structured_output=so).text, extra
    obj = oai.chat.completions.create(model=http_stack["model"], messages=CHAT, max_tokens=60, temperature=0,
                                      response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_tool_calls_in_openais_shape_whole_and_streamed(oai, http_stack):
    """tools + tool_choice through the SDK: message.tool_calls with JSON arguments that validate,
    finish_reason tool_calls; streamed, the call comes as a tool_calls delta and no block leaks
    into the content; a tool answer in the history is accepted (tests/orchestrator/test_tool_calls.py
    has the exactness)."""
    import jsonschema
    from tests.support.tools import TOOLS

    weather = TOOLS[0]["function"]
    r = oai.chat.completions.create(model=http_stack["model"], messages=CHAT, max_tokens=200, temperature=0,
                                    tools=list(TOOLS), tool_choice={"type": "function",
                                                                    "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (c,) = choice.message.tool_calls
    assert c.type == "function" and c.function.name == "get_weather" and c.id.startswith("call_")
    jsonschema.validate(json.loads(c.function.arguments), weather["parameters"])
    stream = oai.chat.completions.create(model=http_stack["model"], messages=CHAT, max_tokens=200, temperature=0,
                                         tools=list(TOOLS), tool_choice={"type": "function",
                                                                         "function": {"name": "get_time"}}, stream=True)
    content, calls, finish = "", [], None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls and "<tool_call>" not in content
    assert all(t.function.name in ("get_weather", "get_time") for t in calls)
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [c.model_dump()]},
               {"role": "tool", "content": "21 C", "tool_call_id": c.id}]
    after = oai.chat.completions.create(model=http_stack["model"], messages=history, max_tokens=4, temperature=0,
                                        tools=list(TOOLS))
    assert after.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_n_choices_whole_and_streamed_with_usage_over_all(oai, grpc_client, http_stack):
    """n = 3 sampled with a seed: three choices with their indexes, each the gRPC answer of the
    same request (choice i's seed is derived from the request's), usage counting every choice
    and the prompt once; streamed, each choice's deltas say their index and end with a finish."""
    kw = dict(max_tokens=10, temperature=1.0, seed=11, n=3)
    r = oai.chat.completions.create(model=http_stack["model"], messages=CHAT, **kw)
    ref = grpc_client.generate(messages=CHAT, max_new_tokens=10, temperature=1.0, seed=11, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [c.text for c in ref.choices]
    assert r.usage.completion_tokens == sum(len(c.token_ids) for c in ref.choices)
    assert r.usage.prompt_tokens == ref.stats["prompt_tokens"]
    texts, finished = {}, set()
    for chunk in oai.completions.create(model=http_stack["model"], prompt=PROMPT, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    whole = oai.completions.create(model=http_stack["model"], prompt=PROMPT, **kw)
    assert finished == {0, 1, 2} and [texts[i] for i in range(3)] == [c.text for c in whole.choices]


def test_completion_defaults_to_sixteen_tokens_like_openai(oai, http_stack):
    r = oai.completions.create(model=http_stack["model"], prompt=PROMPT, temperature=0, extra_body={"gamma": 2})
    assert r.usage.completion_tokens <= 16
    assert r.choices[0].finish_reason == "stop" or r.usage.completion_tokens == 16


def test_completion_takes_token_ids_and_stop(oai, grpc_client, http_stack):
    ids = [5, 6, 7, 8]
    r = oai.completions.create(model=http_stack["model"], prompt=ids, max_tokens=8, temperature=0)
    ref = grpc_client.generate(token_ids=ids, max_new_tokens=8, temperature=0)
    assert r.choices[0].text == ref.text
    stop = ref.text[3:5]
    if stop.strip():
        r = oai.completions.create(model=http_stack["model"], prompt=ids, max_tokens=8, temperature=0, stop=[stop])
        assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text


def test_chat_is_the_grpc_chat_answer(oai, grpc_client, http_stack):
    r = oai.chat.completions.create(model=http_stack["model"], messages=CHAT, max_tokens=10, temperature=0)
    ref = grpc_client.generate(messages=CHAT, max_new_tokens=10, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.usage.completion_tokens == len(ref.token_ids)


def test_chat_without_max_tokens_runs_to_eos_or_the_context(oai, http_stack):
    r = oai.chat.completions.create(model=http_stack["model"], messages=CHAT, temperature=0,
                                    max_completion_tokens=None, extra_body={"gamma": 4})
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= 512  # the tiny models' context
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 16  # not the completions endpoint's default


def test_sampled_answer_is_reproducible_with_a_seed(oai, http_stack):
    """OpenAI's `seed`, kept: the same answer whatever gamma (coupled sampling by default), and the
    extension field says how it was drawn; asked for rejection sampling, the request gets it."""
    kw = dict(model=http_stack["model"], prompt=PROMPT, max_tokens=10, temperature=0.8, top_p=0.9, seed=7)
    runs = [oai.completions.create(**kw, extra_body={"top_k": 20, "gamma": g}) for g in (0, 2, 5)]
    assert len({r.choices[0].text for r in runs}) == 1
    assert {r.model_extra["specdec"]["sampling"] for r in runs} == {"coupled"}
    assert runs[0].model_extra["specdec"]["seed"] == 7
    chat = [oai.chat.completions.create(model=http_stack["model"], messages=CHAT, max_tokens=8, temperature=1.0,
                                        seed=2**64 - 1, extra_body={"gamma": g}) for g in (0, 4)]
    assert chat[0].choices[0].message.content == chat[1].choices[0].message.content
    other = oai.completions.create(**kw, extra_body={"sampling_mode": "rejection"})
    assert other.model_extra["specdec"]["sampling"] == "rejection"
    r = httpx.post(http_stack["http"] + "/v1/completions", json={**kw, "sampling_mode": "gumbel"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_mode"


def test_streamed_chat_and_completion_concatenate_to_the_whole_answer(oai, http_stack):
    whole = oai.chat.completions.create(model=http_stack["model"], messages=CHAT, max_tokens=12, temperature=0)
    chunks = list(oai.chat.completions.create(model=http_stack["model"], messages=CHAT, max_tokens=12,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert finals[0].model_extra["specdec"]["generated_tokens"] == whole.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])

    text = oai.completions.create(model=http_stack["model"], prompt=PROMPT, max_tokens=12, temperature=0)
    streamed = list(oai.completions.create(model=http_stack["model"], prompt=PROMPT, max_tokens=12, temperature=0,
                                           stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text.choices[0].text
    assert all(c.usage is None for c in streamed)  # no include_usage: no usage chunk


def test_sse_framing_over_raw_http(http_stack):
    body = {"model": http_stack["model"], "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", http_stack["http"] + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event
        assert json.loads(event[len("data: "):])["object"] == "text_completion"


def test_models_tokenize_and_health(http_stack, grpc_client):
    base = http_stack["http"]
    models = httpx.get(base + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [http_stack["model"]] and models["object"] == "list"
    assert httpx.get(base + "/health").status_code == 200
    tok = httpx.post(base + "/tokenize", json={"model": http_stack["model"], "prompt": PROMPT}).json()
    ref = grpc_client.generate(prompt=PROMPT, max_new_tokens=1, temperature=0)
    assert tok["count"] == len(tok["tokens"]) == ref.stats["prompt_tokens"]
    chat = httpx.post(base + "/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] == grpc_client.generate(messages=CHAT, max_new_tokens=1, temperature=0).stats["prompt_tokens"]


BAD = {  # body changes -> (status, param, words in the message)
    "n": ({"n": 17}, 400, "n", "[1, 16]"),
    "temperature": ({"temperature": -1}, 400, "temperature", "temperature"),
    "top_p": ({"top_p": 0}, 400, "top_p", "top_p"),
    "max_tokens zero": ({"max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    "beyond context": ({"max_tokens": 100_000}, 400, "max_tokens", "context"),
    "gamma": ({"gamma": 99}, 400, "gamma", "gamma"),
    "no model": ({"model": None}, 400, "model", "model"),
    "unknown model": ({"model": "gpt-9"}, 404, "model", "gpt-9"),
    "empty prompt": ({"prompt": ""}, 400, "prompt", "prompt"),
    "presence_penalty": ({"presence_penalty": 2.5}, 400, "presence_penalty", "presence_penalty"),
    "repetition_penalty": ({"repetition_penalty": 0}, 400, "repetition_penalty", "repetition_penalty"),
    "logit_bias key": ({"logit_bias": {"the": 1}}, 400, "logit_bias", "not a token id"),
    "logit_bias value": ({"logit_bias": {"5": 101}}, 400, "logit_bias", "100"),
    "logit_bias token": ({"logit_bias": {"99999999": 1}}, 400, "logit_bias", "vocabulary"),
    "min_tokens": ({"min_tokens": 5}, 400, "min_tokens", "max_new_tokens"),
    "stop_token_ids": ({"stop_token_ids": [10**7]}, 400, "stop_token_ids", "vocabulary"),
    "min_p": ({"min_p": 2}, 400, "min_p", "min_p"),
    "response_format": ({"response_format": {"type": "xml"}}, 400, "response_format", "json_schema"),
    "schema": ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, 400,
               "response_format", "json_schema"),
    "regex": ({"structured_outputs": {"regex": "[a-"}}, 400, "structured_outputs", "regex"),
    "two constraints": ({"guided_regex": "a", "guided_choice": ["b"]}, 400, "structured_outputs", "one output"),
    "token id": ({"prompt": [10**7]}, 400, "prompt", "vocabulary"),
    # values beyond what the decoder or the wire can hold (they were 500s)
    "seed beyond uint64": ({"seed": 2**64}, 400, "seed", "seed"),
    "seed below int64": ({"seed": -2**63 - 1}, 400, "seed", "seed"),
    "huge seed": ({"seed": 2**100}, 400, "seed", "seed"),
    "top_k beyond int32": ({"top_k": 2**31}, 400, "top_k", "top_k"),
    # text UTF-8 cannot encode: a lone surrogate, which JSON's \u escapes allow
    "surrogate prompt": ({"prompt": "a\ud800b"}, 400, "prompt", "Unicode"),
    "surrogate in a prompt list": ({"prompt": ["ok", "\ud800"]}, 400, "prompt.1", "Unicode"),
    "surrogate model": ({"model": "\ud800"}, 400, "model", "Unicode"),
    "surrogate stop": ({"stop": ["\udfff"]}, 400, "stop.0", "Unicode"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_requests_get_openai_errors_and_the_service_stays_healthy(http_stack, case):
    change, status, param, words = BAD[case]
    body = {"model": http_stack["model"], "prompt": PROMPT, "max_tokens": 4, **change}
    body = {k: v for k, v in body.items() if v is not None}
    r = _post_json(http_stack["http"] + "/v1/completions", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"] and error["type"]
    ok = httpx.post(http_stack["http"] + "/v1/completions", timeout=60,
                    json={"model": http_stack["model"], "prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200


def test_the_edges_of_seed_and_top_k_are_served(http_stack):
    for change in ({"seed": 2**64 - 1}, {"seed": -2**63}, {"top_k": 2**31 - 1}):
        r = httpx.post(http_stack["http"] + "/v1/completions", timeout=60,
                       json={"model": http_stack["model"], "prompt": PROMPT, "max_tokens": 2, **change})
        assert r.status_code == 200, (change, r.text)


def _post_json(url: str, body: dict) -> httpx.Response:
    """POSTs body as JSON with non-ASCII escaped, as most clients send it (so a lone surrogate
    travels as its \\u escape, which httpx's own json= cannot encode)."""
    return httpx.post(url, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=60)


def test_tokenize_and_chat_refuse_lone_surrogates_with_openai_errors(http_stack):
    r = _post_json(http_stack["http"] + "/tokenize", {"prompt": "\ud800"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = _post_json(http_stack["http"] + "/v1/chat/completions", {
        "model": http_stack["model"], "messages": [{"role": "user", "content": "hi \udbff"}], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content", r.text


def test_sdk_raises_its_own_error_classes(oai, http_stack):
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=http_stack["model"], messages=CHAT, n=0)
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=http_stack["model"], messages=[{"role": "robot", "content": "x"}])


def test_a_client_that_disconnects_mid_stream_frees_its_request(http_stack, target_engine, monkeypatch):
    decoder = http_stack["orchestrator"].slot.decoder
    admission = http_stack["orchestrator"].admission
    original = decoder.generate_stream
    seen = {"chunks": 0, "closed_early": False}

    def paced(request):  # the real decoder, one round at a time, slow enough to leave mid-way
        stream = original(request)
        try:
            for chunk in stream:
                seen["chunks"] += 1
                yield chunk
                threading.Event().wait(0.02)
        except GeneratorExit:
            seen["closed_early"] = True
            raise
        finally:
            stream.close()

    monkeypatch.setattr(decoder, "generate_stream", paced)
    body = {"model": http_stack["model"], "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "gamma": 0,
            "stream": True}
    with httpx.stream("POST", http_stack["http"] + "/v1/completions", json=body, timeout=60) as r:
        assert next(r.iter_lines()).startswith("data: {")  # the first event: the request is in flight
    # the connection is closed: within a round the request stops, its sessions closed on both workers
    wait_for(lambda: seen["closed_early"], 30, "the request stopped")
    wait_for(lambda: admission.running == 0, 30, "the admission slot freed")
    wait_for(lambda: target_engine.describe().open_sessions == 0, 30, "the target's session closed")
    assert seen["chunks"] < 400


# ---- a door of its own: tokens, a full queue, not ready ------------------------------------


def test_bearer_token_is_required_when_configured(target_engine, draft_engine, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n")
    stack = start_stack(target_engine, draft_engine, http_port=0, auth_token_file=str(tokens))
    base = f"http://127.0.0.1:{stack['orchestrator'].http.port}/v1"
    model = stack["orchestrator"].slot.decoder.target_info.model_name
    try:
        with openai.OpenAI(base_url=base, api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model=model, prompt=PROMPT, max_tokens=2)
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        with openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0) as good:
            assert good.completions.create(model=model, prompt=PROMPT, max_tokens=2, temperature=0).usage.completion_tokens == 2
        assert httpx.get(base.removesuffix("/v1") + "/health").status_code == 200  # health needs no token
    finally:
        stop_stack(stack)


def test_a_full_server_answers_429(http_stack):
    door = FrontDoor(http_stack["orchestrator"].slot, Admission(max_running=1, max_queued=0))
    server = HttpServer(door, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        door.admission.running = 1  # the one slot is taken
        r = httpx.post(base + "/v1/completions", json={"model": http_stack["model"], "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        door.admission.running = 0
        r = httpx.post(base + "/v1/completions", json={"model": http_stack["model"], "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200
    finally:
        server.stop()


def test_not_ready_is_503_everywhere():
    slot = DecoderSlot()  # no decoder yet: the workers have not loaded
    server = HttpServer(FrontDoor(slot, Admission(1, 1)), "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        assert httpx.get(base + "/health").status_code == 503
        assert httpx.get(base + "/v1/models").status_code == 503
        r = httpx.post(base + "/v1/chat/completions", json={"model": "m", "messages": CHAT})
        assert r.status_code == 503 and "starting" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_logprobs_in_completions_and_chat_match_grpc(oai, grpc_client, http_stack):
    ref = grpc_client.generate(prompt=PROMPT, max_new_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    r = oai.completions.create(model=http_stack["model"], prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-5)
    assert lp.text_offset[0] == 0 and len(lp.tokens) == len(ref.token_ids)
    assert all(len(top) == 2 for top in lp.top_logprobs)
    streamed = list(oai.completions.create(model=http_stack["model"], prompt=PROMPT, max_tokens=8, temperature=0,
                                           logprobs=2, stream=True))
    assert [x for c in streamed for x in c.choices[0].logprobs.token_logprobs] == pytest.approx(lp.token_logprobs)
    assert [x for c in streamed for x in c.choices[0].logprobs.text_offset] == lp.text_offset

    ref = grpc_client.generate(messages=CHAT, max_new_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    chat = oai.chat.completions.create(model=http_stack["model"], messages=CHAT, max_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([x.logprob for x in ref.logprobs], abs=1e-5)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    special = set(grpc_client_special_ids(http_stack))
    text_bytes = bytes(b for c, x in zip(content, ref.logprobs) if x.token_id not in special for b in c.bytes)
    assert text_bytes.decode(errors="replace") == chat.choices[0].message.content  # the tokens' exact bytes
    plain = oai.chat.completions.create(model=http_stack["model"], messages=CHAT, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def grpc_client_special_ids(http_stack) -> list[int]:
    return http_stack["orchestrator"].slot.decoder.tokenizer.all_special_ids


def test_the_servers_deadline_applies_to_http_requests(http_stack, target_engine, monkeypatch):
    decoder = http_stack["orchestrator"].slot.decoder
    # 300 rounds of at least 50 ms: cannot finish within the 1 s deadline
    monkeypatch.setattr(decoder, "generate_stream", paced(decoder.generate_stream, lambda i: time.sleep(0.05)))
    door = FrontDoor(http_stack["orchestrator"].slot, http_stack["orchestrator"].admission, request_timeout_s=1.0)
    server = HttpServer(door, "127.0.0.1", 0).start()
    body = {"model": http_stack["model"], "prompt": target_engine.tokenizer("The quick brown fox").input_ids,
            "max_tokens": 300, "temperature": 0, "gamma": 0}
    try:
        r = httpx.post(f"http://127.0.0.1:{server.port}/v1/completions", json=body, timeout=60)
        assert r.status_code == 504 and "--request-timeout" in r.json()["error"]["message"]
        with httpx.stream("POST", f"http://127.0.0.1:{server.port}/v1/completions", json={**body, "stream": True},
                          timeout=60) as s:
            events = [line for line in s.iter_lines() if line]
        assert events[-1] == "data: [DONE]" and "--request-timeout" in events[-2]
        wait_for(lambda: http_stack["orchestrator"].admission.running == 0, 30, "the slots freed")
    finally:
        server.stop()


FRAMEWORK_CASES = {  # (method, path, raw body) -> status; every answer in OpenAI's error shape
    "unknown path": ("POST", "/v1/nothing", b"{}", 404),
    "wrong method": ("GET", "/v1/completions", None, 405),
    "trailing slash": ("POST", "/v1/completions/", b"{}", 404),
    "malformed JSON": ("POST", "/v1/completions", b'{"model": "m", "prompt": "a"', 400),
    "invalid UTF-8": ("POST", "/v1/completions", b'{"model": "\xff\xfe"}', 400),
    "nested too deeply": ("POST", "/v1/completions", b"[" * 1000 + b"]" * 1000, 400),
}


@pytest.mark.parametrize("case", FRAMEWORK_CASES)
def test_the_frameworks_own_refusals_come_in_openais_shape(http_stack, case):
    method, path, body, status = FRAMEWORK_CASES[case]
    r = httpx.request(method, http_stack["http"] + path, content=body, timeout=60,
                      headers={"content-type": "application/json"}, follow_redirects=False)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"], error
    assert error["param"] is None  # a character position or a path is not a request field


def _raw_exchange(port: int, head: bytes, body_parts=(), pause_s: float = 0.0) -> tuple[int, dict, float]:
    """Sends a request head and body pieces over a plain socket; returns (status, error body,
    seconds from the end of the head to the answer)."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        t0 = time.monotonic()
        for part in body_parts:
            time.sleep(pause_s)
            try:
                sock.sendall(part)
            except OSError:  # the server answered and closed first
                break
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < int(
                dict(line.split(b": ", 1) for line in data.split(b"\r\n\r\n")[0].split(b"\r\n")[1:])
                .get(b"content-length", b"0")):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        elapsed = time.monotonic() - t0
    head_part, _, payload = data.partition(b"\r\n\r\n")
    return int(head_part.split()[1]), json.loads(payload)["error"], elapsed


def test_the_token_and_the_size_are_checked_before_the_body_is_read(target_engine, draft_engine, tmp_path):
    """A caller without the token, announcing a 50 MB body it never sends, gets 401 at once; one
    with the token gets 413 for the size, and 413 too when a body without a length grows past
    the limit; a body that stalls gets 408 after --http-body-timeout, a head that stalls is let go
    after --http-head-timeout. The door stays healthy."""
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n")
    stack = start_stack(target_engine, draft_engine, http_port=0, auth_token_file=str(tokens),
                        http_max_body_bytes=10_000, http_body_timeout_s=0.5, http_head_timeout_s=0.5)
    port = stack["orchestrator"].http.port
    model = stack["orchestrator"].slot.decoder.target_info.model_name

    def head(auth: bool, length: int | None) -> bytes:
        lines = [b"POST /v1/completions HTTP/1.1", b"Host: x", b"Content-Type: application/json"]
        lines += [b"Authorization: Bearer s3cret"] if auth else []
        lines += [b"Content-Length: %d" % length] if length is not None else [b"Transfer-Encoding: chunked"]
        return b"\r\n".join(lines) + b"\r\n\r\n"

    try:
        status, error, _ = _raw_exchange(port, head(False, 50_000_000))
        assert status == 401 and error["type"] == "authentication_error"
        status, error, _ = _raw_exchange(port, head(True, 50_000_000))
        assert status == 413 and "10000" in error["message"]
        piece = b"2000\r\n" + b" " * 0x2000 + b"\r\n"  # chunked, 8 KiB each: past 10,000 bytes at the second
        status, error, _ = _raw_exchange(port, head(True, None), [piece] * 4)
        assert status == 413
        status, error, elapsed = _raw_exchange(port, head(True, 100), [b'{"model": '], pause_s=0.0)
        assert status == 408 and error["code"] == "timeout"
        ok = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, headers={"Authorization": "Bearer s3cret"},
                        json={"model": model, "prompt": PROMPT, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
        # slow heads: nothing sent, half the headers, half the headers of a kept-alive connection's
        # second request: each connection is closed (--http-head-timeout), with no answer
        import socket

        for first, then in ((b"", b""), (b"GET /health HTTP/1.1\r\nHost: x\r\n", b""),
                            (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b"GET /health HTTP/1.1\r\n")):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(first)
                answered = b""
                if first.endswith(b"\r\n\r\n"):
                    while b"serving" not in answered:
                        answered += sock.recv(4096)
                    sock.sendall(then)
                assert sock.recv(4096) == b"", (first, then)  # closed, not held open
    finally:
        stop_stack(stack)


def test_answers_are_not_held_back_by_nagles_algorithm(http_stack):
    """Accepted connections inherit TCP_NODELAY from the listening socket: a response's head and
    body go out as written (without it, each answer on a kept-alive connection waited ~40 ms for
    the client's delayed ACK: 44 ms per GET /health, 0.46 ms with it, measured on this machine)."""
    import socket

    server = http_stack["orchestrator"].http
    assert server.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    with httpx.Client() as client:  # one kept-alive connection, several answers
        assert all(client.get(http_stack["http"] + "/health").status_code == 200 for _ in range(5))


@pytest.mark.parametrize("version, status", [(b"HTTP/1.0", 200), (b"HTTP/2.0", 505), (b"HTTP/9.9", 505)])
def test_http_versions_are_answered_as_they_can_be_served(http_stack, version, status):
    """HTTP/1.0 is served and told the connection closes (its clients would otherwise reuse a
    closed socket); request lines claiming other versions get 505, not a 1.1 answer."""
    import socket

    port = int(http_stack["http"].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /health " + version + b"\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    assert int(head.split()[1]) == status, data
    assert b"connection: close" in head


@pytest.mark.parametrize("head", [b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + b"a" * 1_000_000
                                  + b"\r\n\r\n",
                                  b"NOT A REQUEST LINE\r\n\r\n"], ids=["headers past 16 KiB", "garbage"])
def test_requests_h11_cannot_parse_get_openai_shaped_400s(http_stack, head):
    import socket

    port = int(http_stack["http"].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    assert int(status_line.split()[1]) == 400, data[:200]
    error = json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert httpx.get(http_stack["http"] + "/health").status_code == 200


LONG_LISTS = [  # (path, the field holding a list as long as a 4 MiB body allows, the item, param)
    ("/v1/completions", "prompt", "1", "prompt"),  # 2 million one-digit token ids: past MAX_PROMPT_IDS
    ("/v1/completions", "prompt", "123456", "prompt"),  # 600,000 ids: within it, past the context
    ("/v1/completions", "prompt", '"a"', "prompt"),  # a million prompts
    ("/v1/chat/completions", "messages", "1", "messages"),  # 2 million messages that are not messages
    ("/v1/chat/completions", "messages", '{"role":"user"}', "messages"),  # 260,000 empty user messages
    ("/v1/completions", "stop", '"x"', "stop"),
    ("/tokenize", "messages", "[]", "messages"),
]


def test_lists_as_long_as_the_body_limit_allows_are_refused_in_bounded_memory(http_stack):
    """The token-id count and every list's length are checked before its items are: bodies at the
    4 MiB limit holding millions of items get a 400 naming the field, and the orchestrator (this
    process) grows by a small multiple of the body, not by the gigabyte that validating (and
    building an error for) each item cost."""
    base, model = http_stack["http"], http_stack["model"]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    bodies = []
    for path, field, item, param in LONG_LISTS:
        head = json.dumps({"model": model, "max_tokens": 1, **({} if field == "messages" else chat)})[:-1]
        count = (4 * 1024 * 1024 - len(head) - 64) // (len(item) + 1)
        bodies.append((path, f'{head}, "{field}": [{",".join([item] * count)}]}}'.encode(), param))
    assert httpx.post(base + "/v1/completions", timeout=60, json={"model": model, "prompt": PROMPT,
                                                                    "max_tokens": 1}).status_code == 200
    peak, stop = [rss_mib()], threading.Event()
    before = peak[0]

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mib())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with httpx.Client(timeout=120) as client:
            for _ in range(2):
                for path, body, param in bodies:
                    r = client.post(base + path, content=body, headers={"content-type": "application/json"})
                    assert r.status_code == 400, (path, param, r.text[:300])
                    assert r.json()["error"]["param"] == param, (path, r.text[:300])
    finally:
        stop.set()
        watcher.join()
    assert peak[0] - before < 192, f"grew by {peak[0] - before:.0f} MiB for 4 MiB bodies"
    assert httpx.get(base + "/health").status_code == 200


def test_metrics_are_prometheus_text_on_the_http_port_without_a_token(target_engine, draft_engine, tmp_path):
    """GET /metrics on the OpenAI door (where vLLM serves it, and aiperf looks): the request and
    speculative counters and the step policy's, as Prometheus text, with no bearer token needed
    even where the API needs one."""
    from specdec.telemetry import Telemetry

    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret\n")
    stack = start_stack(target_engine, draft_engine, http_port=0, auth_token_file=str(tokens),
                        gamma_policy="goodput", telemetry={"orchestrator": Telemetry.create("t", scrape=True)})
    try:
        base = f"http://127.0.0.1:{stack['orchestrator'].http.port}"
        model = stack["orchestrator"].slot.decoder.target_info.model_name
        answer = httpx.post(base + "/v1/completions", headers={"Authorization": "Bearer s3cret"}, timeout=60,
                            json={"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0})
        assert answer.status_code == 200
        reply = httpx.get(base + "/metrics")
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
        text = reply.text
        for name in ("specdec_rounds_total", "specdec_requests_total", "gen_ai_server_time_to_first_token",
                     "specdec_step_duration", "specdec_round_gamma", "specdec_drafted_tokens_total"):
            assert name in text, name
        assert httpx.get(base + "/v1/models").status_code == 401  # the API itself still needs the token
    finally:
        stop_stack(stack)
