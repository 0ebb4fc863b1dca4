"""Generated token ids → streamed text chunks (after the engine emits tokens, before SSE)."""
from __future__ import annotations

import os
from collections.abc import Sequence

from kvyard.tokenizer import TextTokenizer

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens kept as decoding context: enough for decoders that treat the first token of a string
# specially (e.g. SentencePiece dropping a leading space) to see the real text before the new ids.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one request's generated ids into text without ever emitting half a UTF-8 character.

    Keeps two offsets into the ids: text for ids[prefix:read] has been emitted; decoding ids[prefix:]
    and cutting off that already-emitted text gives the new suffix. Decoding from `prefix` rather than
    `read` keeps enough context that a chunk's leading space or a character split across tokens comes
    out right. A suffix ending in U+FFFD is held back: its last character's bytes are still arriving.
    """

    def __init__(
        self, tokenizer: TextTokenizer, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = [int(i) for i in prompt_ids[-PROMPT_CONTEXT_TOKENS:]]
        self._prefix = 0
        self._read = len(self._ids)
        self._chunks: list[str] = []

    def push(self, token_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text they complete (may be "")."""
        ids = [int(i) for i in token_ids]
        self._tokenizer.check_ids(ids)  # before extending, so one bad id does not poison later pushes
        self._ids.extend(ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """The text still held back at the end of generation; incomplete bytes become U+FFFD here."""
        return self._emit(final=True)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)

    def _emit(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._prefix, self._read)
        end = len(self._ids)
        full_text = self._decode(self._prefix, end)
        # A push of several ids may end mid-character: emit up to the last id that ends on a whole one.
        while not final and full_text.endswith(REPLACEMENT_CHAR):
            end -= 1
            if end == self._read:
                return ""
            full_text = self._decode(self._prefix, end)
        cut = len(prefix_text)
        if not full_text.startswith(prefix_text):
            # Only when the prompt ends mid-character and the new ids complete it: emit that character
            # whole rather than lose it (the prompt's share of it was never shown as text).
            cut = len(os.path.commonprefix([prefix_text, full_text]))
        new_text = full_text[cut:]
        # `prefix` moves to the old `read`, so the next decode still has the last chunk's ids as context.
        self._prefix, self._read = self._read, end
        if new_text:
            self._chunks.append(new_text)
        return new_text

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)
