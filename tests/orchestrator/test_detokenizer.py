"""Text deltas and stop strings, with a one-character-per-token tokenizer."""

from orchestrator.detokenizer import TextAssembler


class CharTokenizer:
    def decode(self, ids, **_):
        return "".join(chr(i) for i in ids)


def ids(text):
    return [ord(c) for c in text]


def test_deltas_add_up_and_hold_back_a_possible_stop_prefix():
    a = TextAssembler(CharTokenizer(), stop=["END"])
    assert a.add(ids("hello E")) == ("hello ", None)  # "E" may start "END": held back
    assert a.add(ids("x")) == ("Ex", None)
    assert a.finish() == ""
    assert a.text == "hello Ex"


def test_stop_string_is_cut_and_tokens_kept_up_to_it():
    a = TextAssembler(CharTokenizer(), stop=["END"])
    assert a.add(ids("abc")) == ("abc", None)
    delta, keep = a.add(ids("dENDxyz"))
    assert (delta, keep) == ("d", 7)  # tokens up to and including the "D" of END
    assert a.text == "abcd"


def test_overlapping_stop_strings_cut_at_the_first_completed():
    a = TextAssembler(CharTokenizer(), stop=["Human:", "man"])
    delta, keep = a.add(ids("Hi Human: more"))
    assert delta == "Hi Hu" and keep == len("Hi Human")


def test_token_bytes_are_the_exact_bytes_of_a_byte_level_vocabulary(target_engine):
    from orchestrator.detokenizer import BYTE_LEVEL, token_bytes

    assert sorted(BYTE_LEVEL.values()) == list(range(256))  # one character per byte, none twice
    tokenizer = target_engine.tokenizer
    text = "naïve café → 数据 ok"
    pieces = [token_bytes(tokenizer, i) for i in tokenizer(text, add_special_tokens=False).input_ids]
    assert b"".join(pieces) == text.encode()
    assert any(len(p.decode(errors="replace")) != len(p.decode(errors="ignore")) for p in pieces)  # split characters
