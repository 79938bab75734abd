"""Structured output on the default pair: speculation's speedup with and without a JSON schema, and
what the grammar costs per token.

One run, the three services as `make run` starts them (specdec_tools.stack.ProcessStack). Greedy,
chat prompts that ask for a JSON record; each row is the same prompts:

  free, gamma 0 / free, gamma 4          unconstrained
  schema, gamma 0 / schema, gamma 4      response_format json_schema
  tools auto / required, gamma 0 and 4   four tool-using chats, tool_choice auto (the model's own
                                         <tool_call> blocks, parsed) and required (constrained)

(The draft's grammar mask and its pass-free forced tokens were ablated once, by two switches
since removed: docs/benchmarks/structured-output keeps those rows.)

The grammar's own cost (consume + mask per generated token, on the target's tokenizer, in this
process) is set against the mean round time of the schema, gamma 4 row.

    specdec bench structured [--max-new-tokens 96] [--out docs/benchmarks/structured-output]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from specdec_tools import report

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "role": {"enum": ["engineer", "manager", "designer", "researcher"]},
    "languages": {"type": "array", "items": {"type": "string"}},
    "city": {"type": "string"}}, "required": ["name", "age", "role", "languages", "city"],
    "additionalProperties": False}
BUG = {"type": "object", "properties": {
    "title": {"type": "string"}, "severity": {"enum": ["low", "medium", "high", "critical"]},
    "component": {"type": "string"}, "steps": {"type": "array", "items": {"type": "string"}},
    "regression": {"type": "boolean"}}, "required": ["title", "severity", "component", "steps", "regression"],
    "additionalProperties": False}
PRODUCT = {"type": "object", "properties": {
    "product": {"type": "string"}, "price_usd": {"type": "number"}, "in_stock": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["product", "price_usd", "in_stock", "tags"],
    "additionalProperties": False}
EVENT = {"type": "object", "properties": {
    "event": {"type": "string"}, "date": {"type": "string"}, "attendees": {"type": "integer"},
    "online": {"type": "boolean"}}, "required": ["event", "date", "attendees", "online"], "additionalProperties": False}

TASKS = [
    ("Extract the person as JSON with keys name, age, role, languages, city: Maria Lopez, 34, is a "
     "senior engineer in Lisbon who writes Rust, Python and Go.", PERSON),
    ("Turn this bug report into JSON with keys title, severity, component, steps, regression: Since "
     "yesterday's release the login page crashes when the password field is empty. Steps: open /login, leave "
     "the password empty, press Enter. Critical, it worked last week.", BUG),
    ("Give this product as JSON with keys product, price_usd, in_stock, tags: The Acme X200 mechanical "
     "keyboard costs $89.99, ships today, and is tagged wireless, rgb and compact.", PRODUCT),
    ("Extract the event as JSON with keys event, date, attendees, online: PyCon Lisbon takes place on "
     "2026-06-12 with about 800 attendees, in person only.", EVENT),
]


def _tool(name: str, description: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}}}


TOOLS = [
    _tool("get_weather", "Current weather in a city", {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}),
    _tool("convert_currency", "Convert an amount between currencies",
          {"amount": {"type": "number"}, "source": {"type": "string"}, "target": {"type": "string"}}),
    _tool("search_flights", "Find flights", {"origin": {"type": "string"}, "destination": {"type": "string"},
                                             "date": {"type": "string"}}),
    _tool("set_timer", "Start a countdown timer", {"minutes": {"type": "integer"}}),
]
TOOL_TASKS = ["What's the weather in Lisbon right now, in celsius?", "How much is 250 US dollars in euros?",
              "Find me a flight from Paris to Rome on 2026-07-01.", "Set a timer for 12 minutes."]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", default="docs/benchmarks/structured-output", help="where README.md and results.json go")
    p.add_argument("--target", help="target model (default: the default pair's)")
    p.add_argument("--draft", help="draft model (default: the default pair's)")


def cmd_bench_structured(a) -> int:
    import jsonschema
    from transformers import AutoTokenizer

    from orchestrator.client import Client
    from specdec.grammar import GrammarCompiler
    from specdec.model_store import DEFAULT_DRAFT, DEFAULT_TARGET, resolve_model
    from specdec.protocol import GrammarSpec
    from specdec_tools.stack import DEFAULT_DRAFT_VOCAB, ProcessStack

    target = str(resolve_model(a.target or DEFAULT_TARGET))
    draft = str(resolve_model(a.draft or DEFAULT_DRAFT))
    stack = ProcessStack(target, draft, draft_vocab=DEFAULT_DRAFT_VOCAB)
    rows: dict[str, dict] = {}
    outputs: dict[str, list] = {}
    texts: dict[str, list] = {}  # what each row answered (results.json): to see why an answer is invalid
    with stack:
        stack.wait_until_ready(1800)
        clients = {"main": Client(stack.address, timeout_s=1800)}
        setups = [
            ("free, gamma 0", "main", 0, "free"), ("free, gamma 4", "main", 4, "free"),
            ("schema, gamma 0", "main", 0, "schema"), ("schema, gamma 4", "main", 4, "schema"),
            ("tools auto, gamma 0", "main", 0, "auto"), ("tools auto, gamma 4", "main", 4, "auto"),
            ("tools required, gamma 0", "main", 0, "required"), ("tools required, gamma 4", "main", 4, "required"),
        ]
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for name in clients:  # warm-up: compile caches, first passes
            clients[name].generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=4, temperature=0,
                                   structured_output={"json_schema": PERSON})
        for name, which, gamma, kind in setups:
            generated = rounds = drafted = accepted = 0
            valid, seconds, outs = 0, 0.0, []
            tasks = TASKS if kind in ("free", "schema") else [(prompt, None) for prompt in TOOL_TASKS]
            for prompt, schema in tasks:
                kw = ({"structured_output": {"json_schema": schema}} if kind == "schema" else
                      {"tools": TOOLS, "tool_choice": kind} if kind in ("auto", "required") else {})
                t0 = time.perf_counter()
                r = clients[which].generate(messages=[{"role": "user", "content": prompt}],
                                            max_new_tokens=a.max_new_tokens, temperature=0, gamma=gamma, **kw)
                seconds += time.perf_counter() - t0
                generated += len(r.token_ids)
                rounds += r.stats["rounds"]
                drafted += r.stats["drafted_tokens"]
                accepted += r.stats["accepted_tokens"]
                try:
                    if schema is not None:
                        jsonschema.validate(json.loads(r.text), schema)
                    else:  # a tool row: at least one call, every call's arguments valid
                        assert r.tool_calls
                        for c in r.tool_calls:
                            jsonschema.validate(json.loads(c["function"]["arguments"]), params[c["function"]["name"]])
                    valid += 1
                except Exception:  # noqa: BLE001 - counted, not raised
                    pass
                outs.append(r.token_ids)
                texts.setdefault(name, []).append({"text": r.text, "tool_calls": r.tool_calls})
            rows[name] = {"tokens": generated, "seconds": seconds, "tok_s": generated / seconds, "rounds": rounds,
                          "drafted": drafted,
                          "acceptance": accepted / drafted if drafted else 0.0, "valid": valid,
                          "round_ms": 1e3 * seconds / rounds, "prompts": len(tasks)}
            outputs[name] = outs
            print(f"{name}: {rows[name]}", flush=True)
        for c in clients.values():
            c.close()

    # the grammar's own cost per generated token, on the schema rows' outputs
    tok = AutoTokenizer.from_pretrained(target)
    compiler = GrammarCompiler(tok, max(len(tok), 151936), sorted({tok.eos_token_id, *(
        [tok.convert_tokens_to_ids("<|im_end|>")] if "<|im_end|>" in tok.get_vocab() else [])}))
    per_token, compile_ms = [], []
    for (prompt, schema), ids in zip(TASKS, outputs["schema, gamma 4"]):
        spec = GrammarSpec("json_schema", json.dumps(schema))
        t0 = time.perf_counter()
        m = compiler.compile(spec).matcher()
        compile_ms.append((time.perf_counter() - t0) * 1e3)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_bitmask()
            if t in compiler.eos_token_ids:
                break
            m.consume([t])
            per_token.append((time.perf_counter() - t0) * 1e6)
    mask_us = statistics.fmean(per_token)
    g4 = rows["schema, gamma 4"]
    tokens_per_round = g4["tokens"] / g4["rounds"]
    drafts = g4["drafted"] / g4["rounds"]  # a round masks drafts + 1 rows on the target, drafts on the draft
    share = (2 * drafts + 1) * mask_us / 1e3 / g4["round_ms"]
    same = outputs["schema, gamma 4"] == outputs["schema, gamma 0"]

    free = rows["free, gamma 4"]["tok_s"] / rows["free, gamma 0"]["tok_s"]
    constrained = g4["tok_s"] / rows["schema, gamma 0"]["tok_s"]
    base = {name: rows[name.split(",")[0] + ", gamma 0"]["tok_s"] for name in rows}
    table = report.markdown_table(["setup", "tok/s", "speedup vs its gamma 0", "acceptance", "ms/round",
                                   "valid JSON / calls"], (
        [name, f"{r['tok_s']:.2f}", f"{r['tok_s'] / base[name]:.2f}x", f"{r['acceptance']:.3f}", f"{r['round_ms']:.1f}",
         f"{r['valid']}/{r['prompts']}"] for name, r in rows.items()))
    table += (f"\n\nSpeculation's speedup: {constrained:.2f}x with the schema, {free:.2f}x without. "
              f"Grammar cost: {mask_us:.0f} us per token (consume + mask, mean of {len(per_token)}), compile "
              f"{statistics.fmean(compile_ms):.1f} ms per schema (first use; cached after); at "
              f"{tokens_per_round:.2f} tokens per round, both workers' masks are {100 * share:.1f}% of a "
              f"{g4['round_ms']:.0f} ms round. Greedy outputs identical across the schema rows: {same}.")
    out = report.out_dir(a.out)
    report.write_table(out, table)
    report.write_json(out / "results.json", {"rows": rows, "mask_us_per_token": mask_us, "compile_ms": compile_ms,
                                             "round_share": share, "outputs_identical": same, "answers": texts})
    return 0
