"""Stop strings on streamed text: hold back what might be the start of one, cut before a match."""
from __future__ import annotations


class StopStringMatcher:
    """Feed text pieces; get back what is safe to emit. Once a stop string appears, the text before
    it is released and `stopped` turns True; nothing after it is ever released."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        if not self.stop:
            return text
        buf = self._held + text
        # The stop string that completes first wins (ties: the one that starts first), so the result
        # is the same however the text is split into pieces (e.g. stops "abcd" and "bc" in "abcd").
        found = [(i + len(s), i) for s, i in ((s, buf.find(s)) for s in self.stop) if i >= 0]
        cut = min(found)[1] if found else -1
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return buf[:cut]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        """At the end of generation the held-back text is not a stop string after all."""
        out, self._held = self._held, ""
        return "" if self.stopped else out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
