"""The Python API: load a draft/target pair, stream or collect completions.

    from spececd import Generator

    gen = Generator.load(draft="models/draft", target="models/target", device="cpu")
    for chunk in gen.stream("def parse(line):", max_tokens=64, temperature=0.7, seed=1):
        print(chunk.text, end="", flush=True)       # chunk.source: "draft" or "target"
    completion = gen.generate("import os\n", max_tokens=32, temperature=0)
    print(completion.token_ids, completion.stats.acceptance_rate)

In-process generation runs the verifier behind an in-memory transport: the same frames,
session state machines and verification as the networked edge/cloud split.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from spececd.backends.base import Backend, Tokenizer, tokenizer_fingerprint
from spececd.backends.registry import load_backend
from spececd.core.sampling import Mode, SamplingParams, check_token_ids
from spececd.core.stats import GenerationStats
from spececd.edge.client import EdgeClient, Reconnect
from spececd.edge.drafter import DEFAULT_MAX_SUPPORT, Drafter
from spececd.errors import InputError
from spececd.transports.base import Transport
from spececd.transports.memory import local_verifier


@dataclass(frozen=True)
class StreamChunk:
    token_ids: tuple[int, ...]
    text: str
    # "draft": drafted and accepted; "target": supplied by the verifier; "fallback": the
    # draft model's, unverified (the verifier was unreachable and fallback="draft")
    source: str


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (a stop token), "length" (max_tokens or the context)
    stats: GenerationStats = field(default_factory=GenerationStats)


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas. Decodes a short window that
    starts before the new ids, so tokenizers that render a token differently at the start
    of a text (SentencePiece's leading space) come out right, and holds text back while it
    ends in a partial UTF-8 character (byte-level BPE tokens can split one)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decoding window
        self._read = 0  # ids before this are emitted

    def push(self, ids: Sequence[int]) -> str:
        self._ids.extend(ids)
        before = self._tokenizer.decode(self._ids[self._prefix:self._read])
        text = self._tokenizer.decode(self._ids[self._prefix:])
        if len(text) <= len(before) or text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(before):]


def parse_k(k: int | str) -> int | None:
    """A fixed draft length, or None for ``"auto"`` (chosen each round)."""
    if k == "auto":
        return None
    try:
        value = int(k)
    except (TypeError, ValueError):
        raise InputError(f"k must be a number >= 1 or 'auto', got {k!r}") from None
    if value < 1:
        raise InputError(f"k (draft tokens per round) must be >= 1, got {value}")
    return value


PROACTIVE = ("off", "on", "stream")


def proactive_setting(value: bool | str) -> str:
    """``off``, ``on`` or ``stream`` (True and False stand for on and off)."""
    setting = {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value
    if setting not in PROACTIVE:
        raise InputError(f"proactive must be one of {', '.join(PROACTIVE)}, got {value!r}")
    return setting


class Generator:
    """Speculative generation with a local drafter and a verifier reached by a transport:
    in this process (``target=``) or on a server (``server="ws://host:port"``)."""

    def __init__(self, draft: Backend, connect: Callable[[], Transport], *, max_context: int,
                 mode: str = "exact", k: int | str = 4,
                 max_support: int = DEFAULT_MAX_SUPPORT, auth_token: str = "",
                 reconnect: Reconnect | None = None, fallback: str = "none",
                 target: Backend | None = None, proactive: bool | str = False,
                 k_max: int = 8) -> None:
        self.k = parse_k(k)
        if max_support < 1:
            raise InputError(f"max-support must be >= 1, got {max_support}")
        if fallback not in ("none", "draft"):
            raise InputError(f"fallback must be 'none' or 'draft', got {fallback!r}")
        try:
            self.mode = Mode(mode)
        except ValueError:
            raise InputError(f"unknown mode {mode!r}: use exact, match or greedy") from None
        self.draft_backend, self.target_backend = draft, target
        self.tokenizer = draft.tokenizer
        fingerprint = tokenizer_fingerprint(draft.tokenizer, draft.vocab_size)
        self.client = EdgeClient(Drafter(draft, max_support), connect, fingerprint,
                                 max_context, auth_token, reconnect, fallback, k_max=k_max)
        self.proactive = proactive

    @classmethod
    def load(cls, draft: str, target: str | None = None, *, server: str | None = None,
             device: str = "auto", dtype: str = "auto", mode: str = "exact",
             k: int | str = 4, max_support: int = DEFAULT_MAX_SUPPORT, auth_token: str = "",
             reconnect: Reconnect | None = None, fallback: str = "none",
             tls_ca: str | None = None, tls_verify: bool = True,
             proactive: bool | str | None = None, threads: int = 0) -> Generator:
        """Load the draft model and reach the target: load it here (``target``) or connect
        to a verifier server (``server``, a ``ws://`` or ``wss://`` URL).

        ``k``: drafted tokens per round, or ``"auto"`` to choose each round from measured
        acceptance and costs. ``proactive``: ``"on"`` (or True) drafts the next block while
        a verdict is in flight; ``"stream"`` lets the server generate without waiting and
        sends it drafts as hints (:meth:`EdgeClient.stream_rounds`); ``"off"``. Default: on
        with a server, off in-process, where nothing runs in parallel.
        """
        if proactive is not None:
            proactive_setting(proactive)  # a bad value fails before any model loads
        if (target is None) == (server is None):
            raise InputError("give either a target model (in-process) or a server URL")
        draft_backend = load_backend(draft, device=device, dtype=dtype, threads=threads)
        if server is not None:
            from spececd.transports.registry import connector

            return cls(draft_backend, connector(server, cafile=tls_ca, verify=tls_verify),
                       max_context=draft_backend.max_context, mode=mode, k=k,
                       max_support=max_support, auth_token=auth_token, reconnect=reconnect,
                       fallback=fallback, proactive=True if proactive is None else proactive)
        assert target is not None
        target_backend = load_backend(target, device=device, dtype=dtype, threads=threads)
        if (tokenizer_fingerprint(draft_backend.tokenizer, draft_backend.vocab_size)
                != tokenizer_fingerprint(target_backend.tokenizer, target_backend.vocab_size)):
            raise InputError(f"draft {draft!r} and target {target!r} have incompatible "
                             f"tokenizers or vocabularies; pick a draft model that shares the "
                             f"target's tokenizer")
        verifier = local_verifier(target_backend)
        return cls(draft_backend, verifier,
                   max_context=min(draft_backend.max_context, verifier.engine.limits.max_context),
                   mode=mode, k=k, max_support=max_support, fallback=fallback,
                   target=target_backend, proactive=proactive or False)

    @property
    def proactive(self) -> str:
        return self._proactive

    @proactive.setter
    def proactive(self, value: bool | str) -> None:
        setting = proactive_setting(value)
        if setting == "stream" and self.target_backend is not None:
            raise InputError("stream drafting needs a server (--server): in one process "
                             "nothing runs while the target works; use --proactive on or off")
        self._proactive = setting
        self.client.proactive = setting == "on"

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids or (isinstance(prompt, str) and not prompt):
            raise InputError("the prompt is empty: give some text or token ids")
        check_token_ids(ids, self.draft_backend.vocab_size, "the prompt")
        limit = self.client.max_context
        if len(ids) >= limit:
            raise InputError(f"the prompt has {len(ids)} tokens; the models' context holds "
                             f"{limit}, leaving no room to generate: shorten the prompt")
        return ids

    def params(self, *, max_tokens: int = 128, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None,
               stop_token_ids: Sequence[int] | None = None) -> SamplingParams:
        if self.mode is Mode.GREEDY:
            temperature = 0.0
        stops = self.tokenizer.eos_token_ids if stop_token_ids is None else stop_token_ids
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                              seed=secrets.randbits(62) if seed is None else seed,
                              max_tokens=max_tokens, stop_token_ids=tuple(stops))

    def _stream(self, ids: list[int], params: SamplingParams, stats: GenerationStats,
                cloud_only: bool = False) -> Iterator[StreamChunk]:
        decoder = IncrementalDecoder(self.tokenizer)
        rounds = (self.client.cloud_rounds(ids, params, stats) if cloud_only
                  else self.client.stream_rounds(ids, params, self.k, stats)
                  if self.proactive == "stream"
                  else self.client.rounds(ids, params, self.mode, self.k, stats))
        for out in rounds:
            verified = "fallback" if out.fallback else "target"
            for source, part in (("draft", out.token_ids[:out.from_draft]),
                                 (verified, out.token_ids[out.from_draft:])):
                if part:
                    yield StreamChunk(part, decoder.push(part), source)

    def stream(self, prompt: str | Sequence[int], stats: GenerationStats | None = None, *,
               cloud_only: bool = False, **sampling: Any) -> Iterator[StreamChunk]:
        """Yield the completion as it is verified (see :meth:`params` for the options);
        ``stats``, when given, is filled in as generation goes. ``cloud_only``: no
        drafting, the verifier generates every token itself (a baseline)."""
        ids = self.prompt_ids(prompt)
        yield from self._stream(ids, self.params(**sampling), stats or GenerationStats(),
                                cloud_only)

    def generate(self, prompt: str | Sequence[int], *, cloud_only: bool = False,
                 **sampling: Any) -> Completion:
        return self.generate_n(prompt, 1, cloud_only=cloud_only, **sampling)[0]

    def generate_n(self, prompt: str | Sequence[int], n: int, *, cloud_only: bool = False,
                   **sampling: Any) -> list[Completion]:
        """``n`` independent completions (seeds ``seed``, ``seed + 1``, ...)."""
        ids = self.prompt_ids(prompt)
        base = self.params(**sampling)
        assert base.seed is not None
        completions = []
        for i in range(n):
            params = replace(base, seed=base.seed + i)
            stats = GenerationStats()
            token_ids: list[int] = []
            for chunk in self._stream(ids, params, stats, cloud_only):
                token_ids.extend(chunk.token_ids)
            stopped = bool(token_ids) and token_ids[-1] in params.stop_token_ids
            completions.append(Completion(token_ids, self.tokenizer.decode(token_ids),
                                          "stop" if stopped else "length", stats))
        return completions


class AsyncGenerator:
    """The asyncio face of :class:`Generator`: the same sessions, streamed as an async
    iterator. Model work and the blocking link run on a worker thread, so the event loop
    is never blocked.

        gen = await AsyncGenerator.load(draft="models/draft", server="ws://gpu:8765")
        async for chunk in gen.stream("def main():", max_tokens=64):
            print(chunk.text, end="")
    """

    def __init__(self, generator: Generator) -> None:
        self.generator = generator
        self._lock = asyncio.Lock()  # one generation at a time per link

    @classmethod
    async def load(cls, *args: Any, **kwargs: Any) -> AsyncGenerator:
        return cls(await asyncio.to_thread(Generator.load, *args, **kwargs))

    async def stream(self, prompt: str | Sequence[int], stats: GenerationStats | None = None,
                     **sampling: Any) -> AsyncIterator[StreamChunk]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamChunk | BaseException | None] = asyncio.Queue()

        def work() -> None:
            try:
                for chunk in self.generator.stream(prompt, stats, **sampling):
                    loop.call_soon_threadsafe(queue.put_nowait, chunk)
            except BaseException as exc:  # handed to the consumer, raised there
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            else:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        async with self._lock:
            worker = loop.run_in_executor(None, work)
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    await worker
                    raise item
                yield item
            await worker

    async def generate(self, prompt: str | Sequence[int], **sampling: Any) -> Completion:
        async with self._lock:
            return await asyncio.to_thread(self.generator.generate, prompt, **sampling)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.generator.close)
