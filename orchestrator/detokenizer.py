"""Turns generated token ids into text deltas and finds stop strings.

Text already sent to a client never changes: a trailing incomplete UTF-8 character, and any
tail that could still grow into a stop string, are held back until the next round decides.
A stop string is cut from the text; token_ids keep the token that completed it (as vLLM does).
"""

from __future__ import annotations

from typing import Sequence


class TextAssembler:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # what has been released to the client
        self._max_stop = max((len(s) for s in self.stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, new_ids: Sequence[int]) -> tuple[str, int | None]:
        """Appends tokens; returns (text delta, None) or, when a stop string completed,
        (final delta, number of generated tokens to keep)."""
        before = len(self.ids)
        self.ids.extend(new_ids)
        full = self._decode(self.ids)
        if self.stop:
            search_from = max(0, len(self.text) - self._max_stop + 1)
            hit = self._find_stop(full, search_from)
            if hit is not None:
                keep = next(
                    k for k in range(before + 1, len(self.ids) + 1)
                    if self._find_stop(self._decode(self.ids[:k]), search_from) is not None
                )
                del self.ids[keep:]
                # the text as of the token that completed the first stop string
                hit = self._find_stop(self._decode(self.ids), search_from)
                return self._release(self._decode(self.ids)[:hit]), keep
        safe = full.rstrip("\ufffd")  # an incomplete multi-byte character decodes to U+FFFD
        safe = safe[: len(safe) - self._held_stop_prefix(safe)]
        return self._release(safe), None

    def finish(self) -> str:
        """Releases what was held back; call when generation ends without a stop string."""
        return self._release(self._decode(self.ids))

    def _release(self, text: str) -> str:
        if not text.startswith(self.text) or len(text) <= len(self.text):
            return ""
        delta, self.text = text[len(self.text) :], text
        return delta

    def _find_stop(self, text: str, start: int) -> int | None:
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _held_stop_prefix(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of a stop string."""
        for n in range(min(self._max_stop - 1, len(text)), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stop):
                return n
        return 0


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE writes each byte as one printable character; this maps them back."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes one token stands for (a piece of a UTF-8 character, perhaps), as OpenAI's
    logprobs report them: exact for byte-level BPE vocabularies (GPT-2, Qwen, Llama 3), else
    the token's decoded text."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if piece is not None and all(c in BYTE_LEVEL for c in piece):
        return bytes(BYTE_LEVEL[c] for c in piece)
    return tokenizer.decode([token_id], clean_up_tokenization_spaces=False).encode()
