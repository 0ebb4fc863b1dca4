"""Interactive LMTP client: type a prompt, watch its tokens stream over the WebSocket, then read the text.

    python -m frontend.lmtp_client --url ws://127.0.0.1:8088/lmtp
    >>>> Hello there max_tokens=5 temperature=1.2

Options go at the end of the line as key=value (values are JSON, else strings) and are sent as GENERATE
fields. Prompts are tokenized here with the model's tokenizer (--tokenizer, default: the embedded
model), so the wire carries token ids exactly as LMQL's client sends them. `quit` or Ctrl-D ends.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import sys
from typing import Any, TextIO

from websockets.asyncio.client import ClientConnection, connect

from kvyard.model_path import ModelFileError, resolve_model_path
from kvyard.tokenizer import TextTokenizer

_OPTION = re.compile(r"^([A-Za-z_]\w*)=(\S+)$")


def parse_line(line: str) -> tuple[str, dict[str, Any]]:
    """'Hello there max_tokens=5 temperature=1.2' → ('Hello there', {'max_tokens': 5, 'temperature': 1.2})."""
    words = line.rstrip().split(" ")
    options: dict[str, Any] = {}
    while words and (m := _OPTION.match(words[-1])):
        key, raw = m.groups()
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
        words.pop()
    return " ".join(words), dict(reversed(options.items()))


class LmtpConsole:
    """One connection; each prompt is one GENERATE stream, read to its end before the next prompt."""

    def __init__(self, ws: ClientConnection, tokenizer: TextTokenizer, model: str, out: TextIO) -> None:
        self.ws = ws
        self.tokenizer = tokenizer
        self.model = model
        self.out = out
        self.stream_ids = itertools.count(1)

    async def run_prompt(self, line: str) -> str:
        """Sends the line as GENERATE, prints each item as it arrives, then prompt + completion text."""
        prompt, options = parse_line(line)
        ids = self.tokenizer.encode(prompt)
        if self.tokenizer.add_bos_token and self.tokenizer.bos_token_id is not None:
            ids = [self.tokenizer.bos_token_id, *ids]
        stream_id = next(self.stream_ids)
        payload = {**options, "model": self.model, "prompt": ids, "stream_id": stream_id}
        await self.ws.send(f"GENERATE {json.dumps(payload)}")
        generated: list[int] = []
        while True:
            kind, _, body = str(await self.ws.recv()).partition(" ")
            for item in json.loads(body) if kind == "TOKEN" else []:
                if item.get("stream_id") != stream_id:
                    continue
                print(f">>>> {item}", file=self.out, flush=True)
                if item.get("error") is not None:
                    return ""
                generated.append(item["token"])
                if item.get("finish_reason") is not None:
                    text = self.tokenizer.decode(ids + generated, skip_special_tokens=True)
                    print(text, file=self.out, flush=True)
                    return text


async def interactive(url: str, model: str, tokenizer: TextTokenizer) -> None:
    async with connect(url, max_size=None) as ws:
        console = LmtpConsole(ws, tokenizer, model, sys.stdout)
        while True:
            try:
                line = await asyncio.to_thread(input, ">>>> ")
            except EOFError:
                break
            if line.strip() == "quit":
                break
            if line.strip():
                await console.run_prompt(line)
    print("[LMTP connection closed]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="ws://127.0.0.1:8088/lmtp", help="the frontend's LMTP WebSocket")
    parser.add_argument("--model", default="", help="model name to send (default: the server's own)")
    parser.add_argument("--tokenizer", default=None, help="GGUF file or HF directory (default: embedded model)")
    args = parser.parse_args(argv)
    try:
        tokenizer = TextTokenizer.from_path(resolve_model_path(args.tokenizer))
    except ModelFileError as exc:
        print(f"lmtp_client: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(interactive(args.url, args.model, tokenizer))
    except (OSError, KeyboardInterrupt) as exc:
        print(f"lmtp_client: {exc or 'interrupted'}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
