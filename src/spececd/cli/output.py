"""What the commands print: completions streamed with their sources told apart by colour,
one-line summaries, and JSON log lines."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from spececd.core.stats import GenerationStats

if TYPE_CHECKING:
    from spececd.generator import Generator

COLOURS = {"draft": "\033[32m", "forced": "\033[36m", "lookup": "\033[35m",
           "target": "\033[1;33m", "fallback": "\033[2;31m"}
RESET = "\033[0m"


def use_colour(choice: str, stream: TextIO) -> bool:
    if choice != "auto":
        return choice == "always"
    return stream.isatty() and "NO_COLOR" not in os.environ


def stream_completion(gen: Generator, prompt: str | Sequence[int], kwargs: dict[str, Any],
                      colour: bool, out: TextIO, token_ids: list[int] | None = None
                      ) -> GenerationStats:
    """Print one completion as it is verified, accepted drafts and target tokens told apart
    by colour; return its statistics. ``token_ids``, when given, gets the completion's."""
    stats = GenerationStats()
    warned = False
    for chunk in gen.stream(prompt, stats, **kwargs):
        if token_ids is not None:
            token_ids.extend(chunk.token_ids)
        if chunk.source == "fallback" and not warned:
            warned = True
            print("\nspececd: the verifier is unreachable; the rest is the draft model's "
                  "alone, unverified", file=sys.stderr)
        if colour and chunk.text:
            out.write(COLOURS[chunk.source] + chunk.text + RESET)
        else:
            out.write(chunk.text)
        out.flush()
    out.write("\n")
    return stats


def summary_line(stats: GenerationStats) -> str:
    line = (f"{stats.tokens_per_s:.1f} tokens/s · acceptance {stats.acceptance_rate:.1%} · "
            f"mean accepted length {stats.mean_accepted_len:.2f} · {stats.generated} tokens "
            f"in {stats.wall_s:.2f} s")
    if stats.lookup_drafted:
        line += (f" · lookup: {stats.lookup_accepted} of its {stats.lookup_drafted} proposed "
                 f"tokens kept")
    if stats.auto_stream_tokens:
        line += f" · {stats.auto_stream_tokens} by stream drafting (auto: faster on this link)"
    if stats.auto_cloud_tokens:
        line += (f" ({stats.auto_cloud_tokens} of them by the server alone: hints did not "
                 f"pay on this link)")
    if stats.auto_plain_tokens:
        line += f" · {stats.auto_plain_tokens} by plain rounds (auto: faster than block-ahead)"
    if stats.fallback:
        line += f" · {stats.fallback_tokens} tokens from the draft alone (verifier unreachable)"
    if stats.lossy:
        line += " · LOSSY threshold mode: not the target model's own output"
    return line


class Tee(io.TextIOBase):
    def __init__(self, *streams: TextIO) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


class JsonLines(logging.Formatter):
    """One JSON object per record, with the structured fields passed as ``extra``."""

    STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": round(record.created, 3), "level": record.levelname.lower(),
                 "logger": record.name, "msg": record.getMessage()}
        entry.update({k: v for k, v in vars(record).items() if k not in self.STANDARD})
        return json.dumps(entry, default=str)
