"""Tool calls in chat (orchestrator/tool_calls.py): tools reach the chat template, tool_choice required or
a named function constrains the output to calls whose arguments validate (exactly the target's
output under that grammar, speculation on), auto parses the model's own <tool_call> blocks, and
OpenAI's shapes come back over gRPC and HTTP, streamed too."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from orchestrator import tool_calls
from orchestrator.decoder import SpeculativeDecoder
from specdec.errors import ServiceError
from specdec.protocol import GenerationRequest, SamplingParams
from tests.support.reference import controlled as reference  # the target alone, under its grammar
from tests.support.tools import TOOLS

CHAT = [{"role": "user", "content": "What is the weather in Lisbon?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def call(text: str) -> str:
    return f'<tool_call>\n{text}\n</tool_call>'


def test_parse_takes_calls_out_of_the_text_and_leaves_the_rest():
    text = "Let me check." + call('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}') + "\n" + \
        call('{"name": "get_time", "arguments": {"zone": "UTC"}}')
    content, calls = tool_calls.parse(text)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "c"} and calls[0].id.startswith("call_")
    assert tool_calls.parse("no calls here") == ("no calls here", [])
    assert tool_calls.parse(call("not json"))[1] == []  # a block that is not a call stays text
    # what small models write instead of the tags (Qwen2.5-Coder-1.5B does, measured): a call as the
    # whole answer, bare or fenced, to one of the request's tools
    fenced = '```json\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n```'
    content, calls = tool_calls.parse(fenced, {"get_time"})
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "UTC"})]
    assert tool_calls.parse('[{"name": "get_time"}, {"name": "get_weather", "arguments": {}}]', {"get_time", "get_weather"})[1]
    assert tool_calls.parse(fenced, {"get_weather"})[1] == []  # not one of the tools: text
    assert tool_calls.parse(fenced)[1] == []  # no names given (tool_choice none): text
    assert tool_calls.parse('{"name": "get_time", "arguments": {}, "extra": 1}', {"get_time"})[1] == []


def test_held_text_streams_the_content_and_holds_back_the_blocks():
    text = "Sure. " + call('{"name": "get_time", "arguments": {"zone": "CET"}}')
    for size in (1, 3, 7, len(text)):
        held = tool_calls.HeldText()
        sent = "".join(held.add(text[i : i + size]) for i in range(0, len(text), size))
        rest, calls = held.finish()
        assert sent + rest == "Sure." or (sent + rest).rstrip() == "Sure.", (size, sent, rest)
        assert "<tool" not in sent and [c.name for c in calls] == ["get_time"]
    bare = '```json\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n```'
    for text, content, n in ((bare, "", 1), ("{not a call}", "{not a call}", 0)):
        held = tool_calls.HeldText({"get_time"})  # auto: what may be a bare call waits for the end
        sent = "".join(held.add(text[i : i + 5]) for i in range(0, len(text), 5))
        rest, calls = held.finish()
        assert sent == "" and rest == content and len(calls) == n
    held = tool_calls.HeldText()  # a tail that could begin a tag waits; one that never becomes one goes out at the end
    assert held.add("a <b") == "a <b" and held.add(" <tool") == " " and held.finish() == ("<tool", [])


@pytest.fixture(scope="module")
def decoder(target_engine, draft_engine):
    return SpeculativeDecoder(target_engine, draft_engine, target_engine.tokenizer)


@pytest.mark.parametrize("choice", ["required", "get_weather", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_choices_give_valid_calls_exactly_the_targets(decoder, target_engine, choice):
    prompt = decoder.checks.prompt(GenerationRequest(messages=CHAT, tools=TOOLS))
    spec = tool_calls.grammar(TOOLS, choice)
    expected = reference(target_engine, prompt, SamplingParams(0.0, output_start=len(prompt), grammar=spec), 160)
    for gamma in (0, 3, 6):
        r = decoder.generate(GenerationRequest(messages=CHAT, tools=TOOLS, tool_choice=choice, gamma=gamma,
                                               temperature=0, max_new_tokens=160))
        assert r.token_ids == expected, (choice, gamma)
        assert r.finish_reason == "tool_calls" and r.tool_calls
        for c in r.tool_calls:
            jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])
        if choice != "required":
            name = choice if isinstance(choice, str) else choice["function"]["name"]
            assert [c["function"]["name"] for c in r.tool_calls] == [name]


def test_parallel_tool_calls_false_makes_required_one_call():
    spec = tool_calls.grammar(TOOLS, "required", parallel=False)
    assert spec.text.startswith("start: call\n")
    assert tool_calls.grammar(TOOLS, "required").text.startswith('start: call ("\\n" call)*')


def test_auto_parses_the_models_own_blocks_over_grpc(client):
    """The tiny random model never writes a call by itself: a regex makes it write one, and auto
    (the default with tools) parses it."""
    block = "Ok. " + call('{"name": "get_time", "arguments": {"zone": "UTC"}}')
    literal = "".join("\\" + ch if ch in ".{}[]()*+?|^$\\" else ch for ch in block)
    r = client.generate(messages=CHAT, tools=TOOLS, max_new_tokens=80, temperature=0,
                        structured_output={"regex": literal})
    assert r.finish_reason == "tool_calls" and r.text.startswith("Ok. <tool_call>")
    assert r.tool_calls == [{"id": r.tool_calls[0]["id"], "type": "function",
                             "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]
    chunks = list(client.stream(messages=CHAT, tools=TOOLS, max_new_tokens=160, temperature=0, tool_choice="get_time"))
    assert chunks[-1].finish_reason == "tool_calls" and chunks[-1].tool_calls
    none = client.generate(messages=CHAT, tools=TOOLS, tool_choice="none", max_new_tokens=8, temperature=0)
    assert none.tool_calls is None and none.finish_reason != "tool_calls"


def test_tools_and_the_call_history_reach_the_chat_template(target_engine, draft_engine):
    tok = target_engine.tokenizer.__class__.from_pretrained(target_engine.tokenizer.name_or_path) \
        if target_engine.tokenizer.name_or_path else target_engine.tokenizer
    tok.chat_template = ("{{ tools | tojson }}|{% for m in messages %}{{ m.role }}:{{ m.content }}"
                         "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]"
                         "{% endfor %};{% endfor %}")
    decoder = SpeculativeDecoder(target_engine, draft_engine, tok)
    history = [*CHAT, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Lisbon", "unit": "c"}'}}]},
        {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}]
    text = tok.decode(decoder.checks.prompt(GenerationRequest(messages=history, tools=TOOLS)))
    assert '"get_weather"' in text and '"get_time"' in text  # the tools, as the template writes them
    assert '[get_weather {"city": "Lisbon", "unit": "c"}]' in text  # arguments as an object, not a string
    assert "tool:21 C;" in text


@pytest.mark.parametrize("change, words", [
    (dict(tool_choice="get_nothing"), "tool_choice"),
    (dict(tool_choice="required", tools=()), "tool_choice needs tools"),
    (dict(tools=({"type": "function", "function": {"name": "bad name!"}},)), "tools[0].function.name"),
    (dict(tools=({"type": "retrieval"},)), "tools[0]"),
    (dict(tool_choice="required", structured_output={"regex": "a"}), "structured_output"),
    (dict(messages=None, prompt="hi"), "chat"),
])
def test_bad_tools_are_invalid_argument(decoder, change, words):
    kw = dict(messages=CHAT, tools=TOOLS, max_new_tokens=4, temperature=0)
    if "structured_output" in change:
        from specdec.protocol import GrammarSpec

        change = {**change, "structured_output": GrammarSpec("regex", "a")}
    with pytest.raises(ServiceError) as err:
        decoder.generate(GenerationRequest(**{**kw, **change}))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.message, err.value.message


def test_tools_and_the_call_history_cross_the_wire():
    from specdec.protocol import request_from_proto
    from specdec_client.protocol import request_to_proto

    history = [*CHAT, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}]
    r = request_from_proto(request_to_proto(messages=history, tools=TOOLS, tool_choice={
        "type": "function", "function": {"name": "get_weather"}}))
    assert r.messages == history and r.tool_choice == "get_weather"
    assert [(t["function"]["name"], t["function"]["parameters"]) for t in r.tools] == \
        [(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS]


def test_a_tokenizer_with_tool_call_tokens_gets_them_in_the_grammar():
    """Qwen2.5's tokenizer has <tool_call> and </tool_call> as added tokens, which llguidance
    treats as special: the grammar names them by id, so the model's own tokens match, and the
    forced tokens the engine offers are always ones the grammar accepts."""
    from specdec.grammar import GrammarCompiler
    from specdec_tools.testing.tiny_models import build_tokenizer

    tok = build_tokenizer()
    tok.add_tokens([tool_calls.OPEN, tool_calls.CLOSE])
    tags = tool_calls.tag_ids(tok)
    assert tags == (tok.convert_tokens_to_ids(tool_calls.OPEN), tok.convert_tokens_to_ids(tool_calls.CLOSE))
    assert tool_calls.tag_ids(build_tokenizer()) is None
    compiler = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    by_id = compiler.matcher(tool_calls.grammar(TOOLS, "get_time", tags))
    assert by_id.forced_tokens()[0] == tags[0]
    ids = tok.encode(call('{"name": "get_time", "arguments": {"zone": "CET"}}'), add_special_tokens=False)
    assert ids[0] == tags[0] and ids[-1] == tags[1]
    by_id.consume(ids)
    assert by_id.is_accepting()
    literal = compiler.matcher(tool_calls.grammar(TOOLS, "get_time"))  # spelled out: the added token is not it
    forced = literal.forced_tokens()
    literal.consume(forced)  # whatever it offers, it takes
    assert tags[0] not in forced
