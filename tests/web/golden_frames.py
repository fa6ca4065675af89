"""The server's frames as Python encodes them, and what the page must read in each: the
golden corpus (``web/test/frames.json``) that ``web/test/protocol.test.js`` decodes with
the page's own codec (``web/src/protocol.js``), under ``node --test``.

Each entry is a frame (hex) and what the page's ``decodeFrame`` must give for it, taken
from Python's own decode of the same frame (named as the page names the fields), or the
error it must throw. So the page's codec and ``spececd.protocol.messages`` are checked
against each other whenever either changes: ``tests/web/test_golden_frames.py`` fails
when the committed corpus is not what this module writes now.

usage: python -m tests.web.golden_frames   # rewrites web/test/frames.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from spececd.core.logprobs import Logprobs
from spececd.protocol import messages as m

CORPUS = Path(__file__).resolve().parents[2] / "web" / "test" / "frames.json"


def _logprobs(n: int) -> Logprobs:
    return Logprobs(np.full(n, -0.5, np.float32), np.arange(2 * n).reshape(n, 2),
                    np.full((n, 2), -1.25, np.float32))


def messages() -> list[tuple[str, m.Message]]:
    """Every kind of frame a server sends a page, with each optional field present and
    absent."""
    many = tuple(range(300, 340))  # long and past 127: sent as raw uint16
    return [
        ("welcome, an older server's (no width)", m.Welcome("s1", 2, 8, 512)),
        ("welcome, lossy", m.Welcome("s2", 7, 8, 512, lossy=True)),
        ("welcome, trees, no width", m.Welcome("s3", 7, 16, 2048, trees=True)),
        ("welcome, a width", m.Welcome("s4", 8, 64, 4096, width=32)),
        ("welcome, a width past max_draft", m.Welcome("s5", 8, 16, 4096, width=64)),
        ("verdict, plain", m.Verdict(1, 3, 42, 0.0125)),
        ("verdict, none accepted", m.Verdict(2, 0, 7)),
        ("verdict, a tree's path", m.Verdict(3, 2, 9, 0.002, path=(0, 2, 5))),
        ("verdict, log-probabilities", m.Verdict(4, 1, 11, 0.001, logprobs=_logprobs(2))),
        ("verdict, a budget", m.Verdict(5, 4, 13, 0.02, budget=6)),
        ("verdict, a budget and a cut", m.Verdict(6, 2, 17, 0.03, budget=3, verified=4)),
        ("verdict, a budget of 0", m.Verdict(7, 0, 19, budget=0)),
        ("tokens, a few", m.Tokens(1, (5, 6, 7), False, 0.004)),
        ("tokens, many (uint16)", m.Tokens(2, many, False, 0.05)),
        ("tokens, the last", m.Tokens(3, (), True)),
        ("tokens, drafted and accepted", m.Tokens(4, (8, 9), False, 0.001, drafted=3,
                                                  accepted=1)),
        ("tokens, a budget", m.Tokens(5, (10,), False, 0.001, budget=4)),
        ("error, fatal", m.Error("server_busy", "too many sessions", fatal=True)),
        ("error, of a step", m.Error("invalid_tokens", "token 99999 is past the vocabulary",
                                     seq=4)),
    ]


def page_view(message: m.Message) -> dict[str, Any]:
    """What the page's ``decodeFrame`` returns for ``message`` (an error: what it throws)."""
    if isinstance(message, m.Welcome):
        return {"type": "welcome", "sessionId": message.session_id,
                "protocolVersion": message.protocol_version, "maxDraft": message.max_draft,
                "maxContext": message.max_context, "lossy": message.lossy,
                "width": message.pass_width}
    if isinstance(message, m.Verdict):
        return {"type": "verdict", "seq": message.seq, "numAccepted": message.num_accepted,
                "nextToken": message.next_token, "verifyS": message.verify_s,
                "budget": message.budget, "verified": message.verified}
    if isinstance(message, m.Tokens):
        return {"type": "tokens", "seq": message.seq, "tokenIds": list(message.token_ids),
                "done": message.done, "computeS": message.compute_s}
    if isinstance(message, m.Error):
        return {"error": message.code, "message": message.message, "fatal": message.fatal,
                "seq": message.seq}
    raise TypeError(f"a server sends a page no {type(message).__name__}")


def corpus() -> str:
    entries = []
    for name, message in messages():
        frame = m.encode(message)
        entries.append({"name": name, "frame": frame.hex(),
                        "page": page_view(m.decode(frame))})  # as Python reads the frame
    return json.dumps({"protocol_version": m.PROTOCOL_VERSION, "tick": m.TICK,
                       "frames": entries}, indent=1) + "\n"


if __name__ == "__main__":
    CORPUS.parent.mkdir(exist_ok=True)
    CORPUS.write_text(corpus())
    print(f"wrote {CORPUS}")
