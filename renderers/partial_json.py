"""JSON read a character at a time, as a model writes it: whether the text so far can still begin a valid JSON
value, and where each value near the top begins and ends. The tool parsers (tool_parsers.py) use it to
stream a call's name and arguments while they are generated instead of waiting for the whole call."""
from __future__ import annotations

from dataclasses import dataclass

_WS = " \t\r\n"
_HEX = frozenset("0123456789abcdefABCDEF")
# Number states: what has been read so far, and which of them may end the number.
_NUM_END = frozenset({"zero", "int", "frac", "exp"})


@dataclass
class Span:
    """One value in the text: its place (keys and list indices from the top), kind and extent."""
    path: tuple[str | int, ...]
    kind: str                 # "object", "array", "string", "number", "literal"
    start: int                # offset of its first character
    end: int | None = None    # offset just past its last character, once complete
    progressed: bool = False  # a character after its first one was read and valid (not just whitespace)


class JsonReader:
    """Feed text; `valid` turns False at the first character no JSON value could have there (and stays so),
    `done` when one whole value was read. Spans are kept for values at most `max_depth` deep."""

    def __init__(self, max_depth: int = 1) -> None:
        self.text = ""
        self.valid = True
        self.done = False
        self.max_depth = max_depth
        self.spans: dict[tuple[str | int, ...], Span] = {}
        self._frames: list[list] = []   # per open container: [kind, state, key or index, span or None]
        self._expect_value = True       # at the top, before the value
        self._scalar: list | None = None  # the scalar being read: [kind, state, span or None, start]
        self._spilled = False             # the last character came after the value (feed gives it back)

    def feed(self, text: str) -> int:
        """More text; returns how many of its characters were taken. Reading stops at the first invalid
        character (taken: `self.text` ends with it) or at the first non-space character after the value
        (not taken: it belongs to whatever follows)."""
        for i, ch in enumerate(text):
            if not self.valid:
                return i
            if self.done and ch not in _WS and self._scalar is None:
                return i
            at = len(self.text)
            self.text += ch
            self._char(ch, at)
            if self._spilled:  # a number ended by what follows the value
                self._spilled = False
                self.text = self.text[:-1]
                return i
        return len(text)

    def span(self, *path: str | int) -> Span | None:
        return self.spans.get(tuple(path))

    def string(self, span: Span | None) -> str | None:
        """A complete string value's text (None while incomplete, or for any other kind)."""
        import json
        if span is None or span.kind != "string" or span.end is None:
            return None
        return json.loads(self.text[span.start:span.end])

    # ---- the automaton ----------------------------------------------------------------------------

    def _char(self, ch: str, at: int) -> None:
        if self._scalar is not None and not self._scalar_char(ch, at):
            return  # the scalar's own character (a number's end is read again as what follows it)
        if ch in _WS:
            return
        if self.done:
            self._spilled = True  # not ours: something after the one value
            return
        self._structure(ch, at)
        if self.valid:
            self._progress(at)

    def _structure(self, ch: str, at: int) -> None:
        if self._expect_value:
            self._value(ch, at)
            return
        frame = self._frames[-1]
        kind, state = frame[0], frame[1]
        if kind == "object":
            if state in ("key_or_end", "key") and ch == '"':
                self._scalar = ["key", "str", None, at]
            elif state in ("key_or_end", "comma_or_end") and ch == "}":
                self._close(at)
            elif state == "colon" and ch == ":":
                frame[1] = "value"
                self._expect_value = True
            elif state == "comma_or_end" and ch == ",":
                frame[1] = "key"
            else:
                self.valid = False
        else:
            if state == "comma_or_end" and ch == ",":
                frame[1] = "value"
                frame[2] += 1
                self._expect_value = True
            elif state in ("value_or_end", "comma_or_end") and ch == "]":
                self._close(at)
            else:
                self.valid = False

    def _value(self, ch: str, at: int) -> None:
        if ch == "]" and self._frames and self._frames[-1][:2] == ["array", "value_or_end"]:
            self._expect_value = False
            self._close(at)
            return
        self._expect_value = False
        path = self._path()
        span = Span(path, "", at) if len(path) <= self.max_depth else None
        if ch in "{[":
            if span is not None:
                span.kind = "object" if ch == "{" else "array"
                self.spans[path] = span
            self._frames.append(["object", "key_or_end", None, span] if ch == "{" else ["array", "value_or_end", 0, span])
            if ch == "[":
                self._expect_value = True
            return
        if ch == '"':
            kind, state = "string", "str"
        elif ch == "-" or ch.isdigit():
            kind, state = "number", "minus" if ch == "-" else "zero" if ch == "0" else "int"
        elif ch in "tfn":
            kind, state = "literal", {"t": "true", "f": "false", "n": "null"}[ch]
        else:
            self.valid = False
            return
        if span is not None:
            span.kind = kind
            self.spans[path] = span
        self._scalar = [kind, state if kind != "literal" else 1, span, at]
        if kind == "literal":
            self._scalar.append(state)  # the word; state counts its letters read

    def _scalar_char(self, ch: str, at: int) -> bool:
        """One character of the scalar in progress; True when it was not the scalar's (read it again)."""
        scalar = self._scalar
        assert scalar is not None
        kind, state = scalar[0], scalar[1]
        if kind in ("string", "key"):
            if state == "str":
                if ch == '"':
                    self._end_scalar(at + 1)
                elif ch == "\\":
                    scalar[1] = "esc"
                elif ord(ch) < 0x20:
                    self.valid = False
            elif state == "esc":
                if ch == "u":
                    scalar[1] = 0  # hex digits read
                elif ch in '"\\/bfnrt':
                    scalar[1] = "str"
                else:
                    self.valid = False
            elif ch in _HEX:
                scalar[1] = "str" if state == 3 else state + 1
            else:
                self.valid = False
            if self.valid:
                self._progress(at)
            return False
        if kind == "literal":
            word, read = scalar[4], scalar[1]
            if ch != word[read]:
                self.valid = False
                return False
            scalar[1] = read + 1
            self._progress(at)
            if scalar[1] == len(word):
                self._end_scalar(at + 1)
            return False
        nxt = _number_step(state, ch)
        if nxt is not None:
            scalar[1] = nxt
            self._progress(at)
            return False
        if state not in _NUM_END:
            self.valid = False
            return False
        self._end_scalar(at)
        return True

    def _end_scalar(self, end: int) -> None:
        scalar = self._scalar
        assert scalar is not None
        self._scalar = None
        if scalar[0] == "key":
            import json
            frame = self._frames[-1]
            frame[2] = json.loads(self.text[scalar[3]:end])
            frame[1] = "colon"
            return
        if scalar[2] is not None:
            scalar[2].end = end
        self._after_value()

    def _close(self, at: int) -> None:
        frame = self._frames.pop()
        if frame[3] is not None:
            frame[3].end = at + 1
        self._after_value()

    def _after_value(self) -> None:
        if not self._frames:
            self.done = True
        else:
            self._frames[-1][1] = "comma_or_end"

    def _path(self) -> tuple[str | int, ...]:
        return tuple(frame[2] for frame in self._frames)

    def _progress(self, at: int) -> None:
        """A valid non-whitespace character at `at`: every open span that began before it has progressed."""
        for frame in self._frames:
            if frame[3] is not None and frame[3].start < at:
                frame[3].progressed = True
        if self._scalar is not None and self._scalar[2] is not None and self._scalar[2].start < at:
            self._scalar[2].progressed = True


def _number_step(state: str, ch: str) -> str | None:
    """The number state after `ch`, or None when `ch` cannot continue the number."""
    digit = ch.isdigit() and ch.isascii()
    if state == "minus":
        return "zero" if ch == "0" else "int" if digit else None
    if state in ("zero", "int"):
        if digit and state == "int":
            return "int"
        return "dot" if ch == "." else "e" if ch in "eE" else None
    if state == "dot":
        return "frac" if digit else None
    if state == "frac":
        return "frac" if digit else "e" if ch in "eE" else None
    if state == "e":
        return "esign" if ch in "+-" else "exp" if digit else None
    if state in ("esign", "exp"):
        return "exp" if digit else None
    return None
