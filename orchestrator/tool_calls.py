"""Tool calls in chat: the tools' grammar for tool_choice required or a named function, and the
model's own tool-call blocks parsed out of its text.

The format is the one the default pair's chat template (Qwen2.5) teaches its model, shared by
Hermes-style templates: each call is

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Lisbon"}}
    </tool_call>

tool_choice "auto": the model decides; blocks it writes become OpenAI tool_calls (finish reason
"tool_calls") and the rest stays content. "required" and a named function constrain the output to
such blocks through structured output (specdec/grammar.py): the JSON in each must name a tool and
validate against its parameters' schema. "none": the tools are shown to the template and the text
is left as it is. Owns no model and no session: the decoder calls it before and after a request.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from specdec.errors import InvalidArgument
from specdec.grammar import JSON_LAYOUT
from specdec.protocol import GrammarSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CHOICES = ("none", "auto", "required")
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    @classmethod
    def new(cls, name: str, arguments) -> "ToolCall":
        """A call with a fresh id; arguments as the model wrote them (an object, or JSON text)."""
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return cls(f"call_{uuid.uuid4().hex[:24]}", name, text)

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def check_tools(tools, tool_choice) -> None:
    """INVALID_ARGUMENT for tools or a tool_choice OpenAI's API would refuse."""
    if len(tools) > MAX_TOOLS:
        raise InvalidArgument(f"tools: at most {MAX_TOOLS}, got {len(tools)}", param="tools")
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidArgument(f"tools[{i}]: must be {{'type': 'function', 'function': {{...}}}}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
            raise InvalidArgument(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -", param="tools")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise InvalidArgument(f"tools[{i}].function.parameters must be a JSON Schema object", param="tools")
        names.add(name)
    if tool_choice is not None and tool_choice not in CHOICES and named(tool_choice) not in names:
        raise InvalidArgument(f"tool_choice must be none, auto, required or a function among the tools; got "
                              f"{str(tool_choice)[:80]}", param="tool_choice")
    if tool_choice not in (None, "none") and not tools:
        raise InvalidArgument("tool_choice needs tools", param="tool_choice")


def named(tool_choice) -> str | None:
    """The function a tool_choice names ({"type": "function", "function": {"name": ...}}, or the name)."""
    if isinstance(tool_choice, dict):
        return (tool_choice.get("function") or {}).get("name")
    return tool_choice if isinstance(tool_choice, str) and tool_choice not in CHOICES else None


def tag_ids(tokenizer) -> tuple[int, int] | None:
    """The token ids of <tool_call> and </tool_call> where the tokenizer has each as one added token
    (Qwen2.5: 151657, 151658), else None. A grammar must name such tokens by id: llguidance treats
    added tokens as special, so a literal "<tool_call>" in the grammar would have to be spelled out
    in ordinary tokens, which the model never does."""
    vocab = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    ids = vocab.get(OPEN), vocab.get(CLOSE)
    return ids if None not in ids else None


def grammar(tools, tool_choice, tags: tuple[int, int] | None = None, parallel: bool = True) -> GrammarSpec | None:
    """The output grammar for tool_choice required (one or more calls to any tool; one when not
    parallel) or a named function (one call to it); None for auto and none. tags: tag_ids of the
    tokenizer."""
    name = named(tool_choice)
    if tool_choice != "required" and name is None:
        return None
    functions = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    variants = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                  "arguments": f.get("parameters") or {"type": "object"}},
                 "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    schema = {**({"anyOf": variants} if len(variants) > 1 else variants[0]), "x-guidance": JSON_LAYOUT}
    open_, close = (f"<[{tags[0]}]>", f"<[{tags[1]}]>") if tags else (json.dumps(OPEN), json.dumps(CLOSE))
    call = f'call: {open_} "\\n" %json {json.dumps(schema)} "\\n" {close}'
    return GrammarSpec("grammar", ("start: call\n" if name or not parallel else 'start: call ("\\n" call)*\n') + call)


def _split(text: str) -> tuple[list[tuple[int, int]], list[ToolCall]]:
    """The spans of text outside the tool-call blocks, and the calls those blocks hold (a block
    whose JSON is not {"name": str, "arguments": ...} is not a call: it stays text)."""
    calls, spans, last = [], [], 0
    for m in _BLOCK.finditer(text):
        try:
            body = json.loads(m.group(1))
            name, arguments = body["name"], body.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        spans.append((last, m.start()))
        last = m.end()
        calls.append(ToolCall.new(name, arguments))
    spans.append((last, len(text)))
    return spans, calls


_FENCED = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)


def parse(text: str, names: set[str] | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls): the model's <tool_call> blocks become calls; the text outside them,
    stripped, is the content (None when nothing is left). names: the request's tools; given, an
    answer that is nothing but a JSON call (or a list of them) to one of them, bare or in a ```json
    fence, is taken as calls too (small models often write that instead of the tags)."""
    spans, calls = _split(text)
    if calls:
        return "".join(text[a:b] for a, b in spans).strip() or None, calls
    if names:
        bare = _bare_calls(text, names)
        if bare:
            return None, bare
    return text or None, []


def _bare_calls(text: str, names: set[str]) -> list[ToolCall]:
    fenced = _FENCED.fullmatch(text)
    try:
        body = json.loads(fenced.group(1) if fenced else text)
    except ValueError:
        return []
    items = body if isinstance(body, list) else [body]
    calls = []
    for item in items:
        if not (isinstance(item, dict) and item.get("name") in names and set(item) <= {"name", "arguments"}):
            return []
        calls.append(ToolCall.new(item["name"], item.get("arguments", {})))
    return calls


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI-shaped chat history for a Hugging Face chat template: an assistant's tool_calls with
    their arguments as objects (OpenAI sends JSON text; templates write them with tojson)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": _object(c["function"])}}
                                     for c in calls]}
        out.append(m)
    return out


def _object(function: dict):
    args = function.get("arguments", {})
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


class HeldText:
    """A stream's content with tool calls held back: text before a block goes out as it comes; from
    an opening tag on (or a tail that could begin one) it waits for the end. names (tool_choice
    auto): an answer that so far could be a bare JSON call (it starts with {, [ or a ``` fence)
    waits for the end too, and goes out as content only if it was not one."""

    def __init__(self, names: set[str] | None = None):
        self.sent = 0
        self.text = ""
        self.names = names

    def add(self, delta: str) -> str:
        self.text += delta
        if self.names and self.sent == 0 and self.text.lstrip()[:1] in ("", "{", "[", "`"):
            return ""  # maybe a bare call: decided at the end
        cut = self.text.find(OPEN, self.sent)
        if cut < 0:  # hold back a tail that could be the start of an opening tag
            cut = len(self.text)
            for k in range(min(len(OPEN) - 1, len(self.text) - self.sent), 0, -1):
                if OPEN.startswith(self.text[-k:]):
                    cut = len(self.text) - k
                    break
        out, self.sent = self.text[self.sent : max(cut, self.sent)], max(cut, self.sent)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The content not sent yet (outside the blocks), and the calls."""
        spans, calls = _split(self.text)
        if not calls and self.names and self.sent == 0:
            calls = _bare_calls(self.text, self.names)
            if calls:
                return "", calls
        rest = "".join(self.text[max(a, self.sent) : b] for a, b in spans if b > self.sent)
        return (rest.rstrip() if calls else rest), calls
