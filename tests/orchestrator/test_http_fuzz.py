"""Hostile input against the HTTP door (orchestrator/http/), property-based with hypothesis.

Random bodies for every endpoint, built from the fields the door knows with values of every JSON
type at their edges (integers past 64 bits, NaN and infinities, strings holding lone surrogates,
lists where strings belong, nested objects), random methods and paths, and raw bytes that are not
JSON. Invariants: no answer is a 5xx; every refusal is in OpenAI's error shape
({"error": {"message", "type", "param", "code"}}, a non-empty message); the door stays up, the
orchestrator's memory stays bounded (this process: the stack runs in it), and a reference request
running beside the fuzzing keeps its exact output. Bodies at the size limit are
test_http.py's test_lists_as_long_as_the_body_limit_allows_are_refused_in_bounded_memory. The examples are
derandomized, so CI runs the same inputs every time.
"""

from __future__ import annotations

import json
import threading

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.fuzz import SETTINGS
from tests.support.memory import rss_mib

PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/models", "/health", "/v1/nothing",
         "/v1/completions/", "/"]
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "def f(", "é" * 50]))
INTS = st.one_of(st.integers(-3, 40), st.sampled_from([2**31, 2**63, 2**64, -2**63 - 1, 10**30, -1]))
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1e-45, 3.4e38, -0.0]))
SMALL_MAX_TOKENS = st.one_of(st.integers(1, 4), st.sampled_from([0, -1, 10**30, 1.5, "4", None]))
SCALAR = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
VALUE = st.recursive(SCALAR, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                    st.dictionaries(TEXT, inner, max_size=3)), max_leaves=8)
MESSAGE = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), TEXT)},
                                optional={"content": st.one_of(TEXT, VALUE)})
FIELDS = {
    "prompt": st.one_of(TEXT, st.lists(TEXT, max_size=3), st.lists(INTS, max_size=5), VALUE),
    "messages": st.one_of(st.lists(MESSAGE, max_size=3), VALUE),
    "temperature": st.one_of(FLOATS, VALUE), "top_p": st.one_of(FLOATS, VALUE), "top_k": st.one_of(INTS, VALUE),
    "seed": st.one_of(INTS, VALUE), "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3), VALUE),
    "n": INTS, "stream": st.one_of(st.booleans(), VALUE), "gamma": INTS, "logprobs": st.one_of(INTS, st.booleans()),
    "top_logprobs": INTS, "echo": st.booleans(), "stream_options": st.one_of(VALUE, st.just({"include_usage": True})),
    "response_format": VALUE, "tools": VALUE, "logit_bias": st.one_of(VALUE, st.dictionaries(TEXT, FLOATS, max_size=3)),
    "presence_penalty": FLOATS, "frequency_penalty": FLOATS, "repetition_penalty": FLOATS, "min_p": FLOATS,
    "min_tokens": INTS, "stop_token_ids": st.one_of(st.lists(INTS, max_size=3), VALUE), "ignore_eos": VALUE,
    "structured_outputs": st.one_of(VALUE, st.fixed_dictionaries({}, optional={
        "regex": st.one_of(TEXT, VALUE), "choice": st.one_of(st.lists(TEXT, max_size=3), VALUE),
        "json": VALUE, "grammar": st.one_of(TEXT, VALUE)})),
    "guided_regex": st.one_of(TEXT, VALUE), "guided_choice": VALUE, "guided_json": VALUE, "guided_grammar": VALUE,
    "logprobs_mode": st.one_of(st.sampled_from(["raw", "processed_logprobs"]), VALUE),
}


def check(r: httpx.Response, what) -> None:
    assert r.status_code < 500, (what, r.status_code, r.text[:300])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"], (what, error)


def test_fuzzed_http_requests_never_get_a_5xx_or_a_shapeless_error(http_stack):
    base, model = http_stack["http"], http_stack["model"]
    reference = {"model": model, "prompt": "def fib(n):", "max_tokens": 6, "temperature": 0}
    expected = httpx.post(base + "/v1/completions", json=reference, timeout=60).json()["choices"][0]["text"]
    stop, drift = threading.Event(), []

    def keep_checking():
        while not stop.is_set():
            got = httpx.post(base + "/v1/completions", json=reference, timeout=60).json()["choices"][0]["text"]
            if got != expected:
                drift.append(got)

    checker = threading.Thread(target=keep_checking, daemon=True)
    checker.start()
    rss_before = rss_mib()
    try:
        with httpx.Client(timeout=60) as client:
            @settings(max_examples=300, **SETTINGS)
            @given(path=st.sampled_from(["/v1/completions"] * 6 + ["/v1/chat/completions"] * 6 + ["/tokenize"] * 2
                                        + PATHS),
                   method=st.sampled_from(["POST"] * 8 + ["GET", "PUT"]),
                   model_field=st.sampled_from([model] * 6 + [None, "gpt-9", "\ud800", 7]),
                   max_tokens=SMALL_MAX_TOKENS,
                   fields=st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), max_size=5).flatmap(
                       lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in keys})),
                   raw=st.one_of(st.none(), st.binary(max_size=64), st.sampled_from([b"{", b"[]", b"null", b"1e999",
                                                                                      b'{"a":' * 600])))
            def fuzz(path, method, model_field, max_tokens, fields, raw):
                valid_input = {"prompt": "def f("} if "chat" not in path else {
                    "messages": [{"role": "user", "content": "hi"}]}
                body = {"model": model_field, "max_tokens": max_tokens, **valid_input, **fields}
                body = {k: v for k, v in body.items() if v is not None}
                if "messages" in body and path == "/v1/chat/completions" and "max_tokens" not in body:
                    body["max_tokens"] = 4  # a valid chat without a limit runs to the context: slow, not wrong
                if raw is None:  # JSON as most clients send it: non-ASCII escaped, NaN as the bare word
                    content = json.dumps(body, allow_nan=True).encode()
                else:
                    content = raw
                r = client.request(method, base + path, content=content, headers={"content-type": "application/json"})
                check(r, (method, path, content[:200]))

            fuzz()
    finally:
        stop.set()
        checker.join(timeout=120)
    assert not drift, drift[:3]
    assert rss_mib() - rss_before < 128, f"the orchestrator grew by {rss_mib() - rss_before:.0f} MiB"
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.post(base + "/v1/completions", json=reference, timeout=60).json()["choices"][0]["text"] == expected
