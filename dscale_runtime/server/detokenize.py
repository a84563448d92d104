"""Incremental detokenisation for streaming: growing token ids in, text deltas out.

Two rules make the streamed deltas concatenate to exactly the final answer:
- a delta never ends inside a character: text is taken from a window of recent tokens only once its
  decoding no longer ends in U+FFFD (a multi-byte character still missing bytes);
- a delta never reaches into a possible stop string: the longest tail of the text that is a prefix of a
  stop string is held back until the next tokens show whether the stop string completes (the final text
  is cut before it, so the held tail may never be sent).
"""

from __future__ import annotations

from typing import Callable, Sequence

from dscale_runtime.tokenizer_backend import rust_tokenizer

INCOMPLETE = "\ufffd"


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)` as a function. For a fast tokenizer whose `decode` is the
    transformers base class's and that cleans up no spaces, that method only checks its arguments and calls the
    Rust tokenizer, so the returned function calls the Rust tokenizer directly. The text is the same and each
    call is about 2.5x cheaper. A server pays this twice per request per step on its engine thread. Any other
    tokenizer (a slow one, an overridden decode, clean-up on) keeps the method."""
    backend = rust_tokenizer(tokenizer)
    if backend is not None:
        return lambda token_ids: backend.decode(token_ids, skip_special_tokens=True)
    return lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: Sequence[str] = (), decode: Callable[[list[int]], str] | None = None) -> None:
        """`decode`: `text_decoder(tokenizer)`, made once per tokenizer and shared (made here if not given)."""
        self._decode = decode or text_decoder(tokenizer)
        self.stop = tuple(stop)
        self.token_ids: list[int] = []
        self.text = ""
        """Decoded text of the tokens before `_read` (whole characters only)."""
        self.num_emitted = 0
        """Characters of `text` already handed out as deltas."""
        self._context = 0
        """First token of the decode window: tokens before `_read` decoded again so that tokenizers whose
        pieces depend on their left neighbour (leading spaces, byte fallback) decode them as in the full text."""
        self._read = 0

    def add(self, new_token_ids: Sequence[int]) -> str:
        """Take the next generated tokens; returns the text that is now safe to send (maybe empty)."""
        self.token_ids.extend(new_token_ids)
        if len(self.token_ids) > self._read:
            known = self._decode(self.token_ids[self._context : self._read])
            window = self._decode(self.token_ids[self._context :])
            if len(window) > len(known) and not window.endswith(INCOMPLETE):
                self.text += window[len(known) :]
                self._context, self._read = self._read, len(self.token_ids)
        safe = self._safe_len()
        if safe <= self.num_emitted:
            return ""
        delta = self.text[self.num_emitted : safe]
        self.num_emitted = safe
        return delta

    def _safe_len(self) -> int:
        """Characters of `text` before any complete stop string and before a tail that may start one."""
        found = [self.text.find(stop) for stop in self.stop if stop in self.text]
        if found:
            return min(found)
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:n]):
                    longest = n
                    break
        return len(self.text) - longest

    def finish(self, final_text: str) -> str:
        """The rest of the answer once the request finished (`final_text`: the engine's text, cut before a
        stop string); what was sent is always a prefix of it."""
        delta = final_text[self.num_emitted :]
        self.num_emitted = len(final_text)
        return delta
