"""The Python API: load a draft/target pair, stream or collect completions.

    from spececd import Generator

    gen = Generator.load(draft="models/draft", target="models/target", device="cpu")
    for chunk in gen.stream("def parse(line):", max_tokens=64, temperature=0.7, seed=1):
        print(chunk.text, end="", flush=True)       # chunk.source: "draft" or "target"
    completion = gen.generate("import os\n", max_tokens=32, temperature=0)
    print(completion.token_ids, completion.stats.acceptance_rate)
    scored = gen.generate("x = 1", max_tokens=4, logprobs=5, prompt_logprobs=0)
    print(scored.logprobs[0].logprob, scored.logprobs[0].top, scored.prompt_logprobs)

Log-probabilities (``logprobs=N``: of each generated token with its ``N`` most likely
alternatives; ``prompt_logprobs=N``: of the prompt's tokens too; ``logprobs_mode``:
``raw_logprobs`` or ``processed_logprobs``, see :mod:`spececd.core.logprobs`) are the
target's own, computed by the verifier, and arrive on the chunks and the completion as
:class:`~spececd.core.logprobs.TokenLogprob` values.

In-process generation runs the verifier behind an in-memory transport: the same frames,
session state machines and verification as the networked edge/cloud split.

What a generation runs with is decided once, by :meth:`Generator.resolve`
(:func:`spececd.edge.options.resolve`): the edge's options as they run here and the
sampling keywords, with :class:`~spececd.core.params.SamplingParams`' defaults. The text
a stream shows comes from :mod:`spececd.text`. (This module was ``spececd.api``, which
still re-exports it.)

``token_healing=True`` (off by default here; on by default in the CLI, ``config.toml`` and
the OpenAI API) heals a text prompt's boundary (:mod:`spececd.healing`; a prompt of token
ids is the model's input as given, never healed): the output is then
the target's own for the prompt without its last token, with the first generated token
restricted to those whose text starts with that token's text, and the text shown starts
after the prompt as given.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from collections.abc import Generator as PyGenerator
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spececd.backends.base import Backend, Tokenizer, tokenizer_fingerprint
from spececd.backends.registry import load_backend, load_tokenizer, model_format
from spececd.core.logprobs import Logprobs, TokenLogprob
from spececd.core.params import SamplingParams, check_token_ids
from spececd.core.stats import GenerationStats
from spececd.edge.client import EdgeClient
from spececd.edge.drafter import Drafter, DraftSource
from spececd.edge.emit import RoundOutput
from spececd.edge.options import (
    ROUND_TIMEOUT,
    EdgeOptions,
    Resolved,
    Site,
    resolve,
    sampling_params,
)
from spececd.edge.retokenize import CrossDrafter
from spececd.edge.transport import Transport
from spececd.errors import InputError
from spececd.grammar import grammars_for
from spececd.healing import HealedText, Healing, heal
from spececd.protocol.errors import Unsupported
from spececd.text import IncrementalDecoder, StopStrings

if TYPE_CHECKING:
    from spececd.transports.memory import LocalServer

__all__ = ["AsyncGenerator", "Completion", "Generator", "StreamChunk", "TokenLogprob"]

log = logging.getLogger(__name__)

UNBOUNDED_CONTEXT = 1 << 30  # an edge with no draft model: the server's welcome bounds it


class PromptTooLong(InputError):
    """A prompt of ``tokens`` that leaves no room to generate in the models' ``context``."""

    def __init__(self, tokens: int, context: int) -> None:
        super().__init__(f"the prompt has {tokens} tokens; the models' context holds "
                         f"{context}, leaving no room to generate: shorten the prompt")
        self.tokens, self.context = tokens, context


@dataclass(frozen=True)
class StreamChunk:
    token_ids: tuple[int, ...]
    text: str
    # "draft": drafted and accepted; "forced": drafted because a constraint allowed no other
    # token (no draft model step), and accepted; "lookup": drafted by looking it up in the
    # text so far (no draft model step), and accepted; "prediction": drafted from the
    # prediction of the output the caller gave (no draft model step), and accepted;
    # "target": supplied by the verifier;
    # "fallback": the draft model's, unverified (the verifier was unreachable and
    # fallback="draft")
    source: str
    # On the last chunk only: "stop" (a stop token or stop string) or "length" (max_tokens
    # or the context). That chunk may carry no tokens: text held back, or nothing.
    finish_reason: str | None = None
    # With logprobs asked: one per token of token_ids (None for the draft model's
    # unverified tokens: the target never saw them).
    logprobs: tuple[TokenLogprob, ...] | None = None
    # With prompt_logprobs asked, on the first chunk: one per prompt token, the first None
    # (nothing precedes it).
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (a stop token or string), "length" (max_tokens or context)
    stats: GenerationStats = field(default_factory=GenerationStats)
    # As on StreamChunk: per token of token_ids (None if not asked, or if any token was the
    # draft model's alone), and per prompt token.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


def _runs(out: RoundOutput, verified: str) -> Iterator[tuple[str, int, int]]:
    """``out``'s tokens as runs of one source, ``(source, start, end)`` in order: accepted
    drafts are ``draft``, ``forced``, ``prediction`` or ``lookup``, the rest
    ``verified``."""
    sources = ["forced" if i in out.forced else "prediction" if i in out.predicted
               else "lookup" if i in out.looked_up else "draft" for i in range(out.from_draft)]
    sources += [verified] * (len(out.token_ids) - out.from_draft)
    start = 0
    for i in range(1, len(sources) + 1):
        if i == len(sources) or sources[i] != sources[start]:
            yield sources[start], start, i
            start = i


class Generator:
    """Speculative generation with a local drafter and a verifier reached by a transport:
    in this process (``target=``) or on a server (``server="ws://host:port"``).

    ``options`` (:class:`~spececd.edge.options.EdgeOptions`) say how to draft and verify;
    assign new ones to change them between generations. They read as they run here
    (:meth:`~spececd.edge.options.EdgeOptions.resolved`: ``proactive="auto"`` is plain
    rounds in-process; across two tokenizers exact verification is match).

    Safe to use from several threads at once: each generation under way has its own
    session (its own link to the verifier and its own draft KV cache, kept in a pool for
    the next one), and the draft model runs one forward pass at a time.

    ``target_tokenizer`` (and its ``target_vocab`` size): the target's tokenizer, when the
    draft's is another. The generator then speaks target ids and drafts across the two
    tokenizers (:mod:`spececd.edge.retokenize`), verified by match: still lossless."""

    def __init__(self, draft: Backend | None, connect: Callable[[], Transport], *,
                 max_context: int, options: EdgeOptions | None = None, auth_token: str = "",
                 target: Backend | None = None, local: LocalServer | None = None,
                 target_tokenizer: Tokenizer | None = None, target_vocab: int = 0) -> None:
        self.draft_backend, self.target_backend = draft, target
        self._local = local  # the in-process verifier, closed with this generator
        self.max_context = max_context
        if draft is None:  # drafts by lookup alone, in the target's token ids
            if target_tokenizer is None:
                raise InputError("without a draft model the edge needs the target's "
                                 "tokenizer: from the server, or --target-tokenizer")
            own = fingerprint = tokenizer_fingerprint(target_tokenizer, target_vocab)
        else:
            own = tokenizer_fingerprint(draft.tokenizer, draft.vocab_size)
            fingerprint = own if target_tokenizer is None else tokenizer_fingerprint(
                target_tokenizer, target_vocab)
        self.cross = fingerprint != own  # drafting across two tokenizers
        speaks = draft.tokenizer if draft is not None and not self.cross else target_tokenizer
        assert speaks is not None  # no draft or another tokenizer: the target's was given
        self.tokenizer: Tokenizer = speaks
        self.vocab_size = fingerprint.vocab_size
        self.site = Site(in_process=target is not None, cross=self.cross,
                         vocab_size=self.vocab_size,
                         eos_token_ids=tuple(self.tokenizer.eos_token_ids),
                         draft_model=draft is not None)
        draft_lock = threading.Lock()  # the draft model: one forward pass at a time

        def new_client() -> EdgeClient:
            drafter: DraftSource | None = None
            if draft is not None:
                drafter = (CrossDrafter(draft, self.tokenizer, draft_lock) if self.cross
                           else Drafter(draft, draft_lock))
            return EdgeClient(drafter, connect, fingerprint, max_context, auth_token)

        self._new_client = new_client
        self._pool_lock = threading.Lock()
        self._closed = False
        self.client = self._new_client()  # the first session; more when used concurrently
        self._clients, self._idle = [self.client], [self.client]
        self.options = options or EdgeOptions()

    @classmethod
    def load(cls, draft: str | None, target: str | None = None, *, server: str | None = None,
             device: str = "auto", dtype: str = "auto", threads: int = 0, npu: bool = True,
             auth_token: str = "", tls_ca: str | None = None, tls_verify: bool = True,
             target_tokenizer: str | None = None, round_timeout: float = ROUND_TIMEOUT,
             options: EdgeOptions | None = None, **settings: Any) -> Generator:
        """Load the draft model and reach the target: load it here (``target``) or connect
        to a verifier server (``server``, a ``ws://`` or ``wss://`` URL). ``draft=None``
        loads no draft model: the edge then drafts by lookup alone (``draft_source="lookup"`` or
        ``"suffix"``, :mod:`spececd.edge.lookup`), in the target's token ids, with the
        target's tokenizer from the server (or ``target_tokenizer``); no torch needed.

        ``settings`` are the edge's options by name, over ``options`` (default:
        :class:`~spececd.edge.options.EdgeOptions`' defaults): ``mode`` (exact, match,
        greedy), ``draft_source`` (where drafts come from: ``"model"``, ``"lookup"``, ``"suffix"``,
        ``"hybrid"`` or ``"auto"``; :class:`~spececd.edge.options.DraftKind`), ``k`` (drafted
        tokens per round, or ``"auto"`` to choose each round from
        measured acceptance and costs), ``proactive`` (``"on"`` or True: draft the next
        block while a verdict is in flight; ``"stream"``: the server generates without
        waiting and the edge sends it drafts as hints; ``"off"``; ``"auto"``: on with a
        server, off in-process), ``max_support``, ``tree_width`` (candidates per drafted
        position: token trees where the draft is unsure), ``constrained_drafting`` (False:
        draft unconstrained under a constraint, which the verifier alone enforces then),
        ``fallback`` (``"draft"``: finish with
        the draft model alone when the server is unreachable), ``reconnect``
        (a :class:`~spececd.edge.options.Reconnect`).

        A draft whose tokenizer is not the target's drafts across the two (verified by
        match, lossless): in-process that is found from the two models; against a server,
        the edge asks the server for its target's tokenizer when it loads (over WebSocket
        and HTTP; :mod:`spececd.backends.bundle`), or takes ``target_tokenizer`` (a
        transformers folder or hub id: needed over gRPC, or with a GGUF target).

        ``device``: ``auto``, ``cpu``, ``cuda[:N]``, ``mps``, or ``npu`` (the NPU of the
        model's runtime, OpenVINO or ONNX Runtime, else the cpu with a notice; ``npu=False``
        turns the NPU off); ONNX folders also take ``dml`` and ``qnn``, OpenVINO ``gpu``.

        ``round_timeout``: seconds to wait for the server's reply before treating the link
        as dead and reconnecting (with the history re-sent, so the output is unchanged): how
        long a hung server or replica stalls generation. Also bounds the connection's
        opening, at most 10 s.
        """
        in_process = server is None
        if (target is None) == in_process:
            raise InputError("give either a target model (in-process) or a server URL")
        # Every option is checked before any model loads (and resolved where it runs: the
        # options setter).
        options = (options or EdgeOptions()).with_settings(**settings)
        if server is not None:
            from spececd.transports.registry import connector

            if not round_timeout > 0:
                raise InputError(f"round_timeout must be a number of seconds > 0, got "
                                 f"{round_timeout!r}")
            connect = connector(server, cafile=tls_ca, verify=tls_verify,  # checks the URL
                                auth_token=auth_token, open_timeout=min(10.0, round_timeout),
                                recv_timeout=round_timeout)
            draft_backend = None if draft is None else load_backend(
                draft, device=device, dtype=dtype, threads=threads, npu=npu)
            return cls.remote(draft_backend, server, connect, target_tokenizer=target_tokenizer,
                              tls_ca=tls_ca, tls_verify=tls_verify, options=options,
                              auth_token=auth_token)
        assert target is not None
        # A draft on another runtime than the target's gets one thread of its own unless
        # asked: a small draft gains nothing from more, and the idle threads of one runtime
        # spin on the cores the other's are working on. Measured here (default target, two
        # torch threads, the GGUF draft): with llama.cpp at 2 threads a draft step took
        # 1.37 ms and a 5-position verify pass 19.1 ms; at 1 thread, 0.53 and 15.0 ms.
        draft_backend = None
        if draft is not None:
            draft_threads = threads or (1 if model_format(draft) != model_format(target) else 0)
            draft_backend = load_backend(draft, device=device, dtype=dtype,
                                         threads=draft_threads, npu=npu)
        target_backend = load_backend(target, device=device, dtype=dtype, threads=threads, npu=npu)
        from spececd.transports.memory import local_verifier

        verifier = local_verifier(target_backend)
        limit = verifier.engine.limits.max_context
        return cls(draft_backend, verifier,
                   max_context=min(draft_backend.max_context, limit) if draft_backend else limit,
                   options=options, target=target_backend, local=verifier,
                   target_tokenizer=target_backend.tokenizer,
                   target_vocab=target_backend.vocab_size)

    @classmethod
    def remote(cls, draft: Backend | None, server: str, connect: Callable[[], Transport], *,
               target_tokenizer: str | None = None, tls_ca: str | None = None,
               tls_verify: bool = True, options: EdgeOptions | None = None,
               auth_token: str = "") -> Generator:
        """A generator for a loaded draft (None: none, lookup drafts only) and the verifier
        at ``server``, reached through ``connect``: with the target's tokenizer when the
        draft's is another or there is no draft (``target_tokenizer``, else the server's,
        which it hands out)."""
        if target_tokenizer:
            shared: tuple[Tokenizer, int] | None = load_tokenizer(target_tokenizer)
        else:
            from spececd.transports.tokenizer import fetch

            own = None if draft is None else tokenizer_fingerprint(draft.tokenizer,
                                                                   draft.vocab_size)
            shared = fetch(server, own, tls_ca, tls_verify)
        theirs, vocab = shared if shared else (None, 0)
        if draft is None and theirs is None:
            raise InputError(f"without a draft model the edge needs the target's tokenizer, "
                             f"and {server} did not hand it out (gRPC cannot, nor can a "
                             f"GGUF target): pass --target-tokenizer")
        # Without a draft model nothing here bounds the context: the server's welcome does.
        limit = draft.max_context if draft is not None else UNBOUNDED_CONTEXT
        return cls(draft, connect, max_context=limit, options=options,
                   auth_token=auth_token, target_tokenizer=theirs, target_vocab=vocab)

    @property
    def options(self) -> EdgeOptions:
        return self._options

    @options.setter
    def options(self, options: EdgeOptions) -> None:
        self._options = options.resolved(self.site)

    @contextlib.contextmanager
    def _session(self) -> Iterator[EdgeClient]:
        """An idle client (a new one when all are busy)."""
        with self._pool_lock:
            client = self._idle.pop() if self._idle else None
        if client is None:
            client = self._new_client()  # outside the lock: a GGUF draft opens a context
            with self._pool_lock:
                self._clients.append(client)
        try:
            yield client
        finally:
            if self._closed:
                client.close()
            else:
                with self._pool_lock:
                    self._idle.append(client)

    def close(self) -> None:
        with self._pool_lock:
            self._closed = True
            clients, self._clients, self._idle = self._clients, [], []
        for client in clients:
            client.close()
        if self._local is not None:
            self._local.close()

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InputError(f"the prompt holds a lone UTF-16 surrogate at character "
                                 f"{exc.start}, which is not Unicode text: pass the "
                                 "character itself") from None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids or (isinstance(prompt, str) and not prompt):
            raise InputError("the prompt is empty: give some text or token ids")
        check_token_ids(ids, self.vocab_size, "the prompt")
        limit = self.max_context
        if len(ids) >= limit:
            raise PromptTooLong(len(ids), limit)
        return ids

    def params(self, **sampling: Any) -> SamplingParams:
        """The sampling settings of a generation, checked: keywords by
        :class:`~spececd.core.params.SamplingParams`' field names (``max_tokens``,
        ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``stop_token_ids``,
        ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``,
        ``logit_bias``, ``constraint``: a :class:`~spececd.core.params.Constraint`),
        each left out taking its default there; a fresh random ``seed``
        and the tokenizer's end-of-sequence tokens as stop tokens when none are given.
        ``logit_bias``: token id -> a number added to its logit, in [-100, 100] (-100 in
        effect bans the token). Reported, not sampled from: ``logprobs`` (the target's
        log-probability of each generated token with this many alternatives, 0 to 20),
        ``prompt_logprobs`` (the prompt's too) and ``logprobs_mode`` (``raw_logprobs`` or
        ``processed_logprobs``; :mod:`spececd.core.logprobs`)."""
        return sampling_params(sampling, self.site)

    def resolve(self, prompt_len: int, options: EdgeOptions | None = None,
                **sampling: Any) -> Resolved:
        """What a generation after a prompt of ``prompt_len`` tokens runs with: ``options``
        (default: :attr:`options`) as they run here and the sampling parameters
        ``sampling`` asks for (:meth:`params`); see :func:`spececd.edge.options.resolve`."""
        run = resolve(self._options if options is None else options, sampling, self.site,
                      prompt_len)
        if run.params.constraint is not None:  # refused here, before anything is sent
            grammars_for(self.tokenizer, self.vocab_size).compile(run.params.constraint)
        return run

    def chat_ids(self, messages: Sequence[dict[str, Any]],
                 tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
        """A conversation (``role`` and ``content`` per message; an assistant's
        ``tool_calls`` and a ``tool`` message's ``tool_call_id`` as OpenAI's API and the
        templates spell them) as prompt ids: the tokenizer's chat template when it has one,
        else a plain transcript ending in ``Assistant:``. ``tools``: OpenAI's function
        tools, which the template renders; a model whose template cannot take them (or
        that has none) is an :class:`~spececd.errors.InputError`."""
        try:
            ids = self.tokenizer.apply_chat_template(list(messages), list(tools or []) or None)
        except InputError:
            raise
        except Exception as exc:  # templates raise on what their model does not take
            raise InputError(f"the model's chat template refused these messages: "
                             f"{exc}") from None
        if ids is None:
            if tools:
                raise InputError("this model has no chat template, so it cannot be given "
                                 "tools: leave tools out, or serve a model whose template "
                                 "renders them")
            text = "".join(f"{m['role'].capitalize()}: {m.get('content') or ''}\n"
                           for m in messages)
            ids = self.tokenizer.encode(text + "Assistant:")
        return self.prompt_ids(list(ids))

    def healed(self, prompt: str | Sequence[int], token_healing: bool
               ) -> tuple[list[int], Healing | None]:
        """The prompt's ids as generation starts from them, and its healing: with
        ``token_healing`` and a text prompt, the prompt without its last token where
        :func:`~spececd.healing.heal` heals it, else the prompt as given."""
        ids = self.prompt_ids(prompt)
        healing = (heal(ids, self.tokenizer, self.vocab_size)
                   if token_healing and isinstance(prompt, str) else None)
        return (list(healing.prompt_ids), healing) if healing else (ids, None)

    def prediction_ids(self, prediction: str | Sequence[int] | None, dropped: str = ""
                       ) -> tuple[int, ...]:
        """A prediction of the output (Predicted Outputs) as the ids it is drafted in: a
        text in the target's tokens (no start token: it is text inside a sequence), after
        ``dropped`` (the text token healing took off the prompt, which the output's first
        token spells again: a prompt ending mid-word is continued by a token that also
        spells the word's start), ids as given, checked; empty for none."""
        if not prediction:
            return ()
        ids = (self.tokenizer.encode(dropped + prediction, bos=False)
               if isinstance(prediction, str) else list(prediction))
        check_token_ids(ids, self.vocab_size, "the prediction")
        return tuple(ids)

    def prepare(self, prompt: str | Sequence[int], *, token_healing: bool = False,
                options: EdgeOptions | None = None,
                prediction: str | Sequence[int] | None = None, **sampling: Any
                ) -> tuple[list[int], Resolved, Healing | None]:
        """What a generation of :meth:`stream` with these arguments starts from: the
        prompt's ids (healed: :meth:`healed`), what it runs with (:meth:`resolve`, with
        healing's mask and the prediction's ids: :meth:`prediction_ids`), and the healing
        (None: none)."""
        ids, healing = self.healed(prompt, token_healing)
        run = self.resolve(len(ids), options, **sampling)
        if healing is not None and run.params.constraint is not None:
            # A constraint starts where the prompt ends, and healing's mask may leave none
            # of the tokens it allows there: a constrained generation is never healed.
            ids, healing = self.prompt_ids(prompt), None
            run = self.resolve(len(ids), options, **sampling)
        if healing is not None:
            run = dataclasses.replace(run, params=dataclasses.replace(
                run.params, heal_ids=healing.allowed))
        if prediction:
            run = dataclasses.replace(run, prediction=self.prediction_ids(
                prediction, healing.dropped if healing is not None else ""))
        return ids, run, healing

    def _stream_healed(self, ids: list[int], run: Resolved, healing: Healing | None,
                       stats: GenerationStats, cloud_only: bool, stop: Sequence[str]
                       ) -> Iterator[StreamChunk]:
        """:meth:`_stream` of a prompt ``healing`` healed (None: not healed). A server
        whose engine cannot apply healing's mask (vLLM) refuses it at the hello, before any
        token: the prompt then runs as given, with a warning."""
        if healing is None:
            yield from self._stream(ids, run, stats, cloud_only, stop)
            return
        started = False
        try:
            for chunk in self._stream(ids, run, stats, cloud_only, stop, healing.dropped):
                started = True
                yield chunk
        except Unsupported:
            if started:
                raise
            log.warning("the server's engine does not serve token healing: generating from "
                        "the prompt as given (--no-token-healing, token_healing = false or "
                        "token_healing=False skips this try)")
            ids = [*ids, healing.last]
            params = dataclasses.replace(run.params, heal_ids=(), prompt_len=len(ids))
            yield from self._stream(ids, dataclasses.replace(run, params=params), stats,
                                    cloud_only, stop)

    def _stream(self, ids: list[int], run: Resolved, stats: GenerationStats,
                cloud_only: bool = False, stop: Sequence[str] = (), dropped: str = ""
                ) -> Iterator[StreamChunk]:
        """``dropped``: the text healing dropped from the prompt, left out of the text."""
        params = run.params
        decoder, stops = IncrementalDecoder(self.tokenizer), StopStrings(stop)
        healed = HealedText(dropped)
        emitted: list[int] = []
        source = "target"
        prompt: tuple[TokenLogprob | None, ...] | None = None  # handed on with the next chunk

        def chunk(part: tuple[int, ...], text: str, source: str,
                  logprobs: Logprobs | None) -> StreamChunk:
            nonlocal prompt
            entries = logprobs.rows(0, len(part)).entries(part) if logprobs else None
            made = StreamChunk(part, text, source, None, entries, prompt)
            prompt = None
            return made

        # Closing the client's generation when this one ends, however it ends, lets the
        # client end a stream it leaves early before the next generation takes it.
        with self._session() as client, \
                contextlib.closing(client.generate(ids, run, stats, cloud_only)) as rounds:
            for out in rounds:
                verified = "fallback" if out.fallback else "target"
                if out.prompt_logprobs is not None:
                    prompt = (None, *out.prompt_logprobs.entries(ids[1:]))
                lp = out.logprobs
                for source, start, end in _runs(out, verified):
                    part, part_lp = out.token_ids[start:end], lp.rows(start, end) if lp else None
                    # A stop token ends the completion: its id is kept, its text is not.
                    ends = part[-1] in params.stop_token_ids
                    text = stops.push(healed.push(decoder.push(part[:-1] if ends else part)))
                    if stops.found:  # the ids up to the stop string, no further
                        part = self._through_stop(emitted, part, stops.stops, dropped)
                        yield chunk(part, text, source, part_lp)
                        rounds.close()  # at once, not when the caller takes the last chunk
                        yield StreamChunk((), "", source, "stop")
                        return
                    emitted.extend(part)
                    yield chunk(part, text, source, part_lp)
        stopped = bool(emitted) and emitted[-1] in params.stop_token_ids
        yield StreamChunk((), stops.push(healed.push(decoder.flush())) + stops.flush(), source,
                          "stop" if stopped else "length", None, prompt)

    def _through_stop(self, emitted: Sequence[int], part: tuple[int, ...],
                      stops: Sequence[str], dropped: str = "") -> tuple[int, ...]:
        """The shortest head of ``part`` whose text, after ``emitted``'s (less the text
        healing ``dropped``), spells a stop."""
        for n in range(1, len(part)):
            text = self.tokenizer.decode([*emitted, *part[:n]])[len(dropped):]
            if any(stop in text for stop in stops):
                return part[:n]
        return part

    def stream(self, prompt: str | Sequence[int], stats: GenerationStats | None = None, *,
               cloud_only: bool = False, stop: Sequence[str] = (),
               options: EdgeOptions | None = None, token_healing: bool = False,
               prediction: str | Sequence[int] | None = None,
               **sampling: Any) -> PyGenerator[StreamChunk, None, None]:
        """Yield the completion as it is verified (see :meth:`params` for the sampling
        options); the last chunk says why it ended. ``stats``, when given, is filled in as
        generation goes. ``cloud_only``: no drafting, the verifier generates every token
        itself (a baseline). ``stop``: strings that end the completion, matched on the
        text across token boundaries and left out of it. ``options``: this generation's
        edge options, instead of :attr:`options`. ``token_healing``: heal a text prompt's
        boundary (:mod:`spececd.healing`; the text starts after the prompt as given).
        ``prediction``: what the output is expected to be, mostly (a text or target ids:
        OpenAI's Predicted Outputs), drafted first where the output follows it
        (:class:`~spececd.edge.sources.PredictedDraft`); the output stays the target's
        own."""
        ids, run, healing = self.prepare(prompt, token_healing=token_healing, options=options,
                                         prediction=prediction, **sampling)
        yield from self._stream_healed(ids, run, healing, stats or GenerationStats(),
                                       cloud_only, stop)

    def generate(self, prompt: str | Sequence[int], *, cloud_only: bool = False,
                 stop: Sequence[str] = (), options: EdgeOptions | None = None,
                 token_healing: bool = False, prediction: str | Sequence[int] | None = None,
                 **sampling: Any) -> Completion:
        return self.generate_n(prompt, 1, cloud_only=cloud_only, stop=stop, options=options,
                               token_healing=token_healing, prediction=prediction,
                               **sampling)[0]

    def generate_n(self, prompt: str | Sequence[int], n: int, *, cloud_only: bool = False,
                   stop: Sequence[str] = (), options: EdgeOptions | None = None,
                   token_healing: bool = False, prediction: str | Sequence[int] | None = None,
                   **sampling: Any) -> list[Completion]:
        """``n`` independent completions (seeds ``seed``, ``seed + 1``, ...); the keywords
        are :meth:`stream`'s. A completion's text leaves out a stop token's text and a stop
        string; its token ids keep the stop token, and the ids that spelled a stop
        string. With healing, the first id also spells the prompt's dropped last token."""
        ids, base, healing = self.prepare(prompt, token_healing=token_healing,
                                          options=options, prediction=prediction, **sampling)
        seed = base.params.seed
        assert seed is not None
        completions = []
        for i in range(n):
            stats = GenerationStats()
            token_ids: list[int] = []
            texts: list[str] = []
            logprobs: list[TokenLogprob] | None = [] if base.params.logprobs is not None \
                else None
            scored: list[TokenLogprob | None] | None = None  # the prompt's
            for chunk in self._stream_healed(ids, base.with_seed(seed + i), healing, stats,
                                             cloud_only, stop):
                token_ids.extend(chunk.token_ids)
                texts.append(chunk.text)
                finish = chunk.finish_reason
                if chunk.prompt_logprobs is not None:
                    scored = list(chunk.prompt_logprobs)
                if logprobs is not None and chunk.token_ids:
                    logprobs = logprobs + list(chunk.logprobs) if chunk.logprobs else None
            assert finish is not None
            completions.append(Completion(token_ids, "".join(texts), finish, stats, logprobs,
                                          scored))
        return completions


class AsyncGenerator:
    """The asyncio face of :class:`Generator`: the same sessions, streamed as an async
    iterator. Model work and the blocking link run on a worker thread, so the event loop
    is never blocked.

        gen = await AsyncGenerator.load(draft="models/draft", server="ws://gpu:8765")
        async for chunk in gen.stream("def main():", max_tokens=64):
            print(chunk.text, end="")
    """

    def __init__(self, generator: Generator, executor: Executor | None = None) -> None:
        self.generator = generator
        self.executor = executor  # where generations run (None: the loop's default)

    @classmethod
    async def load(cls, *args: Any, **kwargs: Any) -> AsyncGenerator:
        return cls(await asyncio.to_thread(Generator.load, *args, **kwargs))

    async def stream(self, prompt: str | Sequence[int], stats: GenerationStats | None = None,
                     **sampling: Any) -> AsyncIterator[StreamChunk]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamChunk | BaseException | None] = asyncio.Queue()

        stop = threading.Event()

        def work() -> None:
            try:
                chunks = self.generator.stream(prompt, stats, **sampling)
                for chunk in chunks:
                    loop.call_soon_threadsafe(queue.put_nowait, chunk)
                    if stop.is_set():
                        chunks.close()
                        break
            except BaseException as exc:  # handed to the consumer, raised there
                loop.call_soon_threadsafe(queue.put_nowait, exc)
            else:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        worker = loop.run_in_executor(self.executor, work)
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()  # the consumer left early: the worker ends after its current round
            await worker

    async def generate(self, prompt: str | Sequence[int], **sampling: Any) -> Completion:
        return await asyncio.get_running_loop().run_in_executor(
            self.executor, functools.partial(self.generator.generate, prompt, **sampling))

    async def aclose(self) -> None:
        await asyncio.to_thread(self.generator.close)
