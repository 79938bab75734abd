"""Grammar matching for structured output (specdec/grammar.py) on tokenizers built in the test: the
byte-level one the tiny test models use and a small BPE trained here (tokens that span JSON structure).
No downloads, no model: masks, consume, absolute truncate, the verify pass's draft masks, forced tokens,
invalid specs and the compile cache."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdec.errors import InvalidArgument, OutOfRange, ResourceExhausted
from specdec.grammar import GrammarCompiler, GrammarLimits, GrammarSpec, GrammarViolation, KINDS
from specdec.grammar_limits import grammar_flags
from specdec_tools.testing.tiny_models import SPECIALS, build_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "role": {"enum": ["engineer", "manager", "designer"]},
        "skills": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "skills", "address", "active"],
    "additionalProperties": False,
}
DOC = json.dumps({"name": "Ada", "age": 36, "role": "engineer", "skills": ["math", "poetry"],
                  "address": {"city": "London"}, "active": True})
SCHEMA_SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))
REGEX = r"[a-z]{2,5}-\d{3}"
EXTRA_ROWS = 13  # model embedding rows past the tokenizer: never allowed


def _bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on JSON records: merges such as '": "' cross structure boundaries."""
    rng = random.Random(0)
    words = ["Ada", "Grace", "London", "Paris", "math", "poetry", "engineer", "manager", "designer", "code"]
    corpus = [json.dumps({"name": rng.choice(words), "age": rng.randrange(90), "role": rng.choice(words[6:9]),
                          "skills": rng.sample(words, 2), "address": {"city": rng.choice(words[2:4])},
                          "active": rng.random() < 0.5}) for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:2])


@pytest.fixture(scope="module", params=["bytes", "bpe"])
def tok(request):
    return build_tokenizer() if request.param == "bytes" else _bpe_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, len(tok) + EXTRA_ROWS, [tok.eos_token_id])


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _text(tok, ids) -> str:
    return tok.decode(list(ids), skip_special_tokens=True)


def _allowed_ids(matcher) -> list[int]:
    return torch.nonzero(matcher.allowed_mask()).flatten().tolist()


def _valid(doc: str) -> bool:
    try:
        value = json.loads(doc)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:  # the fields by hand
        return (set(value) <= set(SCHEMA["properties"]) and set(SCHEMA["required"]) <= set(value)
                and value["role"] in SCHEMA["properties"]["role"]["enum"] and isinstance(value["age"], int)
                and all(isinstance(s, str) for s in value["skills"]) and isinstance(value["address"]["city"], str))
    try:
        jsonschema.validate(value, SCHEMA)
        return True
    except jsonschema.ValidationError:
        return False


def _sample(matcher, tok, seed: int, max_steps: int = 3000) -> list[int]:
    """Random generation under the mask, nudged to close strings and containers so it ends."""
    gen = torch.Generator().manual_seed(seed)
    vocab = matcher.vocab_size
    bonus = torch.zeros(vocab)
    for i in range(len(tok)):
        if any(c in _text(tok, [i]) for c in '"]}'):
            bonus[i] = 3.0
    bonus[tok.eos_token_id] = 3.0
    out = []
    for _ in range(max_steps):
        logits = torch.randn(vocab, generator=gen) * 2 + bonus
        matcher.apply(logits)
        t = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        matcher.consume([t])
        if t == tok.eos_token_id:
            return out
        out.append(t)
    raise AssertionError(f"no EOS after {max_steps} tokens: {_text(tok, out)!r}")


# ------------------------------------------------------------------- masks and generation


def test_the_schema_mask_allows_only_valid_continuations(tok, compiler):
    m = compiler.matcher(SCHEMA_SPEC)
    first = {_text(tok, [i]) for i in _allowed_ids(m)}
    assert first and all(s.lstrip(" \t\r\n").startswith("{") or not s.strip() for s in first), first
    prefix = DOC[: DOC.index('"role": ') + len('"role": ')]
    m.consume(_ids(tok, prefix))
    values = ['"engineer"', '"manager"', '"designer"']
    allowed = [_text(tok, [i]) for i in _allowed_ids(m)]
    assert allowed
    for s in allowed:  # whitespace, or the start of one of the enum's values
        assert not s.strip() or any(v.startswith(s.lstrip(" \t\r\n")) for v in values), s


def test_every_allowed_token_consumes_and_a_forbidden_one_is_refused_without_a_trace(tok, compiler):
    m = compiler.matcher(SCHEMA_SPEC)
    ids = _ids(tok, DOC)
    rng = random.Random(1)
    for pos, t in enumerate(ids):
        mask = m.allowed_mask()
        assert mask[t], f"document token {pos} forbidden"
        assert not mask[len(tok):].any(), "ids past the tokenizer must never be allowed"
        forbidden = torch.nonzero(~mask[: len(tok)]).flatten().tolist()
        with pytest.raises(GrammarViolation, match="not allowed"):
            m.consume([rng.choice(forbidden)])
        after_t = m.draft_masks([t])[1]
        forbidden_next = torch.nonzero(~after_t[: len(tok)]).flatten().tolist()
        with pytest.raises(GrammarViolation, match="not allowed"):
            m.consume([t, rng.choice(forbidden_next)])  # all or none: t must not stay consumed
        assert m.consumed == pos and torch.equal(m.allowed_mask(), mask)
        m.consume([t])
    assert m.is_accepting() and m.is_stopped()
    assert _allowed_ids(m) == [tok.eos_token_id]  # complete: only EOS


@pytest.mark.parametrize("seed", range(6))
def test_random_generation_under_the_mask_always_validates(tok, compiler, seed):
    out = _sample(compiler.matcher(SCHEMA_SPEC), tok, seed)
    assert _valid(_text(tok, out)), _text(tok, out)


@pytest.mark.parametrize("spec, check", [
    (GrammarSpec("regex", REGEX), lambda s: re.fullmatch(REGEX, s, re.ASCII)),  # \d is [0-9], not any Unicode digit
    (GrammarSpec("choice", json.dumps(["yes", "no", "not sure"])), lambda s: s in ("yes", "no", "not sure")),
    (GrammarSpec("json_object"), lambda s: isinstance(json.loads(s), dict)),
    (GrammarSpec("grammar", 'start: expr\nexpr: NUMBER | "(" expr ("+" | "*") expr ")"\nNUMBER: /[0-9]{1,3}/'),
     lambda s: re.fullmatch(r"[0-9()+*]+", s) and eval(s) is not None),  # noqa: S307 - digits and +*() only
    (GrammarSpec("grammar", 'root ::= "x" [0-9]+ ( "," "x" [0-9]+ )*'),  # GBNF, converted
     lambda s: re.fullmatch(r"x[0-9]+(,x[0-9]+)*", s)),
])
def test_other_kinds_generate_what_they_describe(tok, compiler, spec, check):
    for seed in range(3):
        out = _text(tok, _sample(compiler.matcher(spec), tok, seed))
        assert check(out), (spec.kind, out)


def test_apply_sets_exactly_the_forbidden_logits_to_minus_inf(tok, compiler):
    m = compiler.matcher(SCHEMA_SPEC)
    m.consume(_ids(tok, DOC[:20]))
    mask = m.allowed_mask()
    for dtype in (torch.float32, torch.float64, torch.bfloat16):  # numpy for the first two, torch for the last
        logits = torch.randn(m.vocab_size, dtype=dtype)
        expected = logits.masked_fill(~mask, float("-inf"))
        m.apply(logits)
        assert torch.equal(logits, expected)
    assert m.fill_bitmask().shape == ((m.vocab_size + 31) // 32,)


# ------------------------------------------------------------------- rollback and verify


def _masks_along(m, ids) -> list[torch.Tensor]:
    masks = []
    for t in ids:
        masks.append(m.allowed_mask())
        m.consume([t])
    masks.append(m.allowed_mask())
    return masks


def test_truncate_then_consume_again_gives_identical_masks(tok, compiler):
    ids = _ids(tok, DOC) + [tok.eos_token_id, tok.eos_token_id]  # the second EOS: after completion
    m = compiler.matcher(SCHEMA_SPEC)
    reference = _masks_along(m, ids)
    assert m.consumed == len(ids)
    rng = random.Random(2)
    lengths = [len(ids), len(ids) - 1, len(ids) - 2, len(ids) - 3, 0] + rng.sample(range(len(ids)), min(8, len(ids)))
    for length in lengths:
        m.truncate(length)
        m.truncate(length)  # idempotent: a retried call does not drop twice
        assert m.consumed == length
        assert torch.equal(m.allowed_mask(), reference[length]), length
        for pos in range(length, len(ids)):
            m.consume([ids[pos]])
            assert torch.equal(m.allowed_mask(), reference[pos + 1]), pos
    with pytest.raises(OutOfRange):
        m.truncate(len(ids) + 1)
    with pytest.raises(GrammarViolation):
        m.consume(_ids(tok, " "))  # nothing but EOS after completion


def test_draft_masks_match_step_by_step_masks_and_leave_the_state_alone(tok, compiler):
    ids = _ids(tok, DOC) + [tok.eos_token_id]
    m = compiler.matcher(SCHEMA_SPEC)
    reference = _masks_along(m, ids)
    m.truncate(0)
    gamma = 5
    for start in range(0, len(ids), 3):
        m.consume(ids[m.consumed:start])
        drafts = ids[start:start + gamma]
        before = m.fill_bitmask().copy()
        masks = m.draft_masks(drafts)
        assert masks.shape == (len(drafts) + 1, m.vocab_size)
        for i in range(len(drafts) + 1):
            assert torch.equal(masks[i], reference[start + i]), (start, i)
        assert m.consumed == start and np.array_equal(m.fill_bitmask(), before)
        logits = torch.randn(len(drafts) + 1, m.vocab_size)
        expected = logits.masked_fill(~masks, float("-inf"))
        assert m.apply_draft_masks(logits, drafts) == len(drafts) + 1
        assert torch.equal(logits, expected)


def test_a_forbidden_draft_ends_the_draft_masks(tok, compiler):
    ids = _ids(tok, DOC)
    m = compiler.matcher(SCHEMA_SPEC)
    m.consume(ids[:4])
    reference = _masks_along(m, ids[4:7])
    m.truncate(4)
    bad = int(torch.nonzero(~reference[1][: len(tok)])[0])
    drafts = [ids[4], bad, ids[6], ids[7]]
    masks = m.draft_masks(drafts)
    assert masks.shape[0] == 2 and torch.equal(masks[0], reference[0]) and torch.equal(masks[1], reference[1])
    logits = torch.zeros(len(drafts) + 1, m.vocab_size)
    assert m.apply_draft_masks(logits, drafts) == 2
    assert torch.isinf(logits[:2]).any() and not torch.isinf(logits[2:]).any()  # later rows untouched
    assert m.consumed == 4 and torch.equal(m.allowed_mask(), reference[0])


def test_draft_masks_past_the_end_of_the_grammar_allow_only_eos(tok, compiler):
    m = compiler.matcher(GrammarSpec("choice", json.dumps(["yes"])))
    eos = tok.eos_token_id
    masks = m.draft_masks(_ids(tok, "yes") + [eos, eos])
    n = len(_ids(tok, "yes"))
    assert masks.shape[0] == n + 3
    for row in masks[n:]:
        assert torch.nonzero(row).flatten().tolist() == [eos]
    assert m.consumed == 0 and not m.is_stopped()


# ------------------------------------------------------------------- forced tokens and EOS


def test_forced_tokens_are_each_the_only_allowed_token(tok, compiler):
    spec = GrammarSpec("choice", json.dumps(["engineering manager"]))
    m = compiler.matcher(spec)
    forced = m.forced_tokens()
    assert forced and _text(tok, forced) == "engineering manager"[: len(_text(tok, forced))]
    for t in forced:
        assert _allowed_ids(m) == [t]
        m.consume([t])
    # along a schema document: wherever tokens are forced, the mask says the same
    m = compiler.matcher(SCHEMA_SPEC)
    seen = 0
    for t in _ids(tok, DOC):
        forced = m.forced_tokens()
        if forced:
            seen += 1
            assert _allowed_ids(m) == [forced[0]]
        m.consume([t])
    assert seen > 0  # property names are forced once their first byte is out


def test_once_complete_only_eos_is_allowed_and_forced(tok, compiler):
    m = compiler.matcher(GrammarSpec("regex", "ab"))
    assert not m.is_accepting() and not m.is_stopped()
    m.consume(_ids(tok, "ab"))
    assert m.is_accepting() and m.is_stopped()
    assert _allowed_ids(m) == [tok.eos_token_id] and m.forced_tokens() == [tok.eos_token_id]
    m.consume([tok.eos_token_id])
    assert m.consumed == len(_ids(tok, "ab")) + 1
    m.truncate(1)
    assert not m.is_stopped() and m.consumed == 1
    # accepting but not complete: EOS allowed beside more digits
    m = compiler.matcher(GrammarSpec("regex", "[0-9]+"))
    m.consume(_ids(tok, "7"))
    allowed = _allowed_ids(m)
    assert m.is_accepting() and not m.is_stopped() and tok.eos_token_id in allowed and len(allowed) > 1
    assert tok.convert_tokens_to_ids("<|im_start|>") not in allowed  # other special tokens never


def test_out_of_range_token_ids_are_refused_before_the_engine_sees_them(tok, compiler):
    m = compiler.matcher(SCHEMA_SPEC)
    for bad in ([m.vocab_size], [-1]):
        with pytest.raises(InvalidArgument, match="token ids"):
            m.consume(bad)
        with pytest.raises(InvalidArgument, match="token ids"):
            m.draft_masks(bad)
    m.consume(_ids(tok, "{"))  # still usable
    assert m.consumed == 1


# ------------------------------------------------------------------- specs, errors, cache


@pytest.mark.parametrize("spec, reason", [
    (GrammarSpec("yaml", "a: 1"), "kind must be one of"),
    (GrammarSpec("json_schema", "{not json"), "not valid JSON"),
    (GrammarSpec("json_schema", "[1, 2]"), "must be a JSON object"),
    (GrammarSpec("json_schema", '{"type": "nosuch"}'), "nosuch"),
    (GrammarSpec("json_object", '{"type": "object"}'), "takes no text"),
    (GrammarSpec("regex", "a("), "unclosed group"),
    (GrammarSpec("regex", ""), "empty"),
    (GrammarSpec("choice", "[]"), "non-empty JSON list"),
    (GrammarSpec("choice", '["a", 3]'), "non-empty JSON list"),
    (GrammarSpec("grammar", "start: foo"), "unknown name"),
    (GrammarSpec("grammar", 'root ::= "a" thing'), "Rule 'thing' not found"),  # GBNF
    (GrammarSpec("grammar", '{"grammars": []}'), "not JSON"),
    (GrammarSpec("grammar", 'start: gen\ngen[stop="."]: /[a-z]+/'), "cannot be rolled back"),
])
def test_invalid_specs_raise_invalid_argument_with_the_reason(compiler, spec, reason):
    with pytest.raises(InvalidArgument, match=re.escape(reason)):
        compiler.compile(spec)


def test_limits_bound_what_a_request_may_compile(tok):
    small = GrammarCompiler(tok, len(tok), [tok.eos_token_id], GrammarLimits(max_chars=200, max_grammar_size=20))
    with pytest.raises(InvalidArgument, match="the limit is 200"):
        small.compile(SCHEMA_SPEC)
    with pytest.raises(InvalidArgument, match="grammar size"):
        small.compile(GrammarSpec("grammar", "start: " + " | ".join(f'"w{i}" "x"' for i in range(10))))
    # a per-mask bound hit mid-generation: ResourceExhausted, not a silently wrong mask
    tight = GrammarCompiler(tok, len(tok), [tok.eos_token_id], GrammarLimits(step_max_items=3))
    with pytest.raises((InvalidArgument, ResourceExhausted), match="Too many items"):  # at compile's probe, or later
        m = tight.matcher(GrammarSpec("json_object"))
        for t in _ids(tok, '{"a": [1, 2, {"b": "c"}]}'):
            m.allowed_mask()
            m.consume([t])
    fields = {f.key for f in grammar_flags()}
    assert fields == {f"grammar_{name}" for name in GrammarLimits.__dataclass_fields__}
    config = type("Config", (), {"grammar_cache_size": 3, "grammar_step_max_items": 99})()
    assert GrammarLimits.from_config(config) == GrammarLimits(cache_size=3, step_max_items=99)
    assert KINDS == ("json_schema", "json_object", "regex", "choice", "grammar")


def test_the_compile_cache_hits_and_evicts_least_recently_used(tok):
    c = GrammarCompiler(tok, len(tok), [tok.eos_token_id], GrammarLimits(cache_size=2))
    a, b, d = (GrammarSpec("regex", r) for r in ("a+", "b+", "d+"))
    first = c.compile(a)
    assert c.compile(GrammarSpec("regex", "a+")) is first  # equal specs are one key
    assert c.cache_info().hits == 1 and c.cache_info().misses == 1
    c.compile(b)
    c.compile(a)  # a is now the most recent: d evicts b
    c.compile(d)
    info = c.cache_info()
    assert (info.size, info.max_size) == (2, 2)
    assert c.compile(a) is first and c.cache_info().hits == 3
    c.compile(b)
    assert c.cache_info().misses == 4
    # sessions from one compiled grammar are independent
    m1, m2 = first.matcher(), first.matcher()
    m1.consume(_ids(tok, "aaa"))
    assert m1.is_accepting() and not m2.is_accepting() and m2.consumed == 0
    assert torch.equal(m2.allowed_mask(), c.matcher(a).allowed_mask())
    assert first.compile_ms > 0


def test_the_compiler_refuses_a_vocabulary_smaller_than_the_tokenizer(tok):
    with pytest.raises(ValueError, match="vocab_size"):
        GrammarCompiler(tok, len(tok) - 1, [tok.eos_token_id])
