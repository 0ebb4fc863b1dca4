"""Requests for the multi-host checks, each counted as answered, errored (a clear error: an OpenAI error
object, or a stream's error chunk then [DONE]) or lost (a hang, a cut-off stream, a malformed answer). A
check ends with `tally.assert_none_lost(sent)`."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

REQUEST_TIMEOUT_S = 90.0  # longer than any outage a check makes: past it, the request counts as lost


@dataclass
class Tally:
    answered: int = 0
    errored: list[str] = field(default_factory=list)  # the error messages
    lost: list[str] = field(default_factory=list)     # what went wrong
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, detail: str = "") -> None:
        with self._lock:
            if outcome == "answered":
                self.answered += 1
            elif outcome == "errored":
                self.errored.append(detail)
            else:
                self.lost.append(detail)

    def assert_none_lost(self, sent: int) -> None:
        assert not self.lost, f"lost requests: {self.lost}"
        assert self.answered + len(self.errored) == sent, (self.answered, self.errored, sent)


def messages(question: str, system: str | None = None) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


def chat(tally: Tally, base_url: str, question: str, system: str | None = None, max_tokens: int = 8,
         **extra: Any) -> dict[str, Any] | None:
    """One chat completion (greedy); its body when answered."""
    body = {"messages": messages(question, system), "max_tokens": max_tokens, "temperature": 0, **extra}
    try:
        resp = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        data = resp.json()
    except (httpx.HTTPError, ValueError) as exc:
        tally.add("lost", f"{base_url}: {type(exc).__name__}: {exc}")
        return None
    if resp.status_code == 200 and data.get("choices"):
        tally.add("answered")
        return data
    error = data.get("error") if isinstance(data, dict) else None
    if resp.status_code >= 400 and isinstance(error, dict) and error.get("message"):
        tally.add("errored", f"HTTP {resp.status_code}: {error['message']}")
    else:
        tally.add("lost", f"{base_url}: HTTP {resp.status_code} {str(data)[:200]}")
    return None


@dataclass
class Stream:
    """A streamed chat read on a thread of its own: `first` is set once a content token arrived."""
    tally: Tally
    base_url: str
    question: str
    system: str | None = None
    max_tokens: int = 200  # long enough to be cut mid-stream, short enough to end well within the timeout
    first: threading.Event = field(default_factory=threading.Event)
    outcome: str = ""
    chunks: int = 0
    ended_at: float = 0.0  # time.monotonic() when the stream ended
    _thread: threading.Thread | None = None

    def start(self) -> Stream:
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def join(self, timeout_s: float = REQUEST_TIMEOUT_S + 5) -> None:
        assert self._thread is not None
        self._thread.join(timeout_s)

    def _read(self) -> None:
        body = {"messages": messages(self.question, self.system), "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True, "ignore_eos": True}
        datas: list[str] = []
        try:
            with httpx.stream("POST", f"{self.base_url}/v1/chat/completions", json=body,
                              timeout=REQUEST_TIMEOUT_S) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data:"):
                        datas.append(line[5:].strip())
                        self.chunks += 1
                        if self.chunks >= 2:
                            self.first.set()
        except httpx.HTTPError as exc:
            self.outcome = "lost"
            self.tally.add("lost", f"stream via {self.base_url}: {type(exc).__name__}: {exc}")
            return
        finally:
            self.first.set()
            self.ended_at = time.monotonic()
        self.outcome, detail = _stream_outcome(datas)
        self.tally.add(self.outcome, detail)


def _stream_outcome(datas: list[str]) -> tuple[str, str]:
    if not datas or datas[-1] != "[DONE]":
        return "lost", f"no [DONE] at the end: {datas[-2:]}"
    events = [json.loads(d) for d in datas[:-1]]
    errors = [e["error"] for e in events if "error" in e]
    if errors:
        ok = len(errors) == 1 and "error" in events[-1] and errors[0].get("message")
        return ("errored", errors[0]["message"]) if ok else ("lost", f"malformed error tail: {events[-2:]}")
    finished = [c for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    return ("answered", "") if finished else ("lost", "no finish_reason before [DONE]")
