"""The drafter's side of a session, sans-I/O: it numbers drafts, tracks what context the
server holds, and turns received frames into messages (or raises the
:class:`~spececd.protocol.errors.ProtocolError` an ``Error`` frame names).

The edge holds the authoritative token history; the server's context is only a cache of
it. A draft says how much of it it builds on (``context_len``) and what to append first
(``prefix``), so after a lost verdict, a reconnect or a server restart the edge re-sends
and the result is the same. It never awaits and never touches a model or a socket.
"""

from __future__ import annotations

import dataclasses

from spececd.core.params import Mode, SamplingParams
from spececd.core.sampling import SparseProbs
from spececd.protocol import messages as m
from spececd.protocol.errors import UnexpectedMessage, error_for_code


def _is_path(path: tuple[int, ...], parents: tuple[int, ...], length: int) -> bool:
    """Whether ``path`` is ``length`` nodes of the tree ``parents``, each the child of the
    one before, the first a child of the root."""
    return len(path) == length and all(
        0 <= node < len(parents) and parents[node] == (path[j - 1] if j else -1)
        for j, node in enumerate(path))


class EdgeSession:
    """The drafter's side of one session: numbers drafts and tracks what the server holds.

    The caller keeps the authoritative token history and passes it to :meth:`draft`; the
    session sends only what the server lacks. After :meth:`hello` (a new connection, or a
    server that lost its state) the server holds nothing, so the next draft carries the
    whole history.
    """

    def __init__(self, fingerprint: m.Fingerprint, mode: Mode, params: SamplingParams,
                 auth_token: str = "", threshold: float = 0.0, trees: bool = False,
                 budget: bool = True) -> None:
        """``trees``: ask for token trees (a protocol-4 hello; the welcome says whether
        the server verifies them). ``budget``: offer to read the server's budget and width
        (a protocol-8 hello; an older server refuses it, and :meth:`older_server` then
        greets at 7, the budget alone, and then at the lowest version that carries the
        rest)."""
        if params.seed is None:
            raise ValueError("the edge session needs a concrete seed")
        # The hellos to offer, newest first; the last is the lowest version that carries
        # what is asked, so that older servers still serve.
        hellos = [m.Hello.from_params(params, fingerprint, mode.value, auth_token, threshold,
                                      trees, reads)
                  for reads in ((m.WIDTH_VERSION, m.BUDGET_VERSION) if budget else ()) + (0,)]
        self._hellos = [h for i, h in enumerate(hellos)
                        if i == 0 or h.protocol_version < hellos[i - 1].protocol_version]
        self.hello_message = self._hellos[0]
        # Positions of the next draft or hint the server expects to verify, as its last
        # reply said (None: any, or a server that does not say).
        self.budget: int | None = None
        # The prompt's log-probabilities are asked for until a reply brings them (a hello
        # after a reconnect does not ask again).
        self.prompt_pending = self.hello_message.logprobs.prompt_top >= 0
        self.welcome: m.Welcome | None = None
        self.server_len = 0  # tokens of the edge's history the server holds
        self._seq = 0
        self._pending: m.Draft | m.Generate | None = None

    def hello(self, checked: bool = False) -> bytes:
        """The greeting; ``checked``: this connection already carried a hello whose
        fingerprint the server accepted, so this one leaves it out."""
        self.welcome, self.server_len, self._pending = None, 0, None
        self.budget = None
        hello = self.hello_message
        if not self.prompt_pending and hello.logprobs.prompt_top >= 0:
            hello = dataclasses.replace(hello, logprobs=dataclasses.replace(
                hello.logprobs, prompt_top=-1))
        if checked:
            hello = dataclasses.replace(hello, fingerprint=m.SAME_FINGERPRINT)
        return m.encode(hello)

    def older_server(self, refused: int | None = None) -> bool:
        """The server refused a hello of version ``refused`` (default: this session's own)
        with ``version_mismatch``: greet below it, with fewer reply fields read, where a
        lower version carries what is asked (now :attr:`hello_message`); whether one does."""
        refused = self.hello_message.protocol_version if refused is None else refused
        stepped = False
        while len(self._hellos) > 1 and self._hellos[0].protocol_version >= refused:
            self._hellos.pop(0)
            stepped = True
        self.hello_message = self._hellos[0]
        return stepped

    @property
    def generating(self) -> int | None:
        """The sequence number of the generation under way (a ``Generate`` whose last
        ``Tokens`` has not arrived), or None."""
        return self._pending.seq if isinstance(self._pending, m.Generate) else None

    @property
    def trees(self) -> bool:
        """Whether the server took this session's offer of token trees."""
        return self.welcome is not None and self.welcome.trees

    def draft(self, history: tuple[int, ...] | list[int], tokens: tuple[int, ...],
              draft_probs: tuple[SparseProbs, ...] | None,
              parents: tuple[int, ...] | None = None) -> bytes:
        """The frame for a draft of ``tokens`` (a tree with ``parents``; see
        :class:`~spececd.protocol.messages.Draft`) continuing ``history``."""
        self._seq += 1
        self._pending = m.Draft(self._seq, self.server_len, tuple(history[self.server_len:]),
                                tokens, draft_probs, parents)
        return m.encode(self._pending)

    def generate(self, history: tuple[int, ...] | list[int], max_tokens: int,
                 stop_token_ids: tuple[int, ...]) -> bytes:
        """The frame asking the server to generate up to ``max_tokens`` itself."""
        self._seq += 1
        self._pending = m.Generate(self._seq, self.server_len,
                                   tuple(history[self.server_len:]), max_tokens, stop_token_ids)
        self.server_len = len(history)
        return m.encode(self._pending)

    def hint(self, position: int, tokens: tuple[int, ...] | list[int],
             alternatives: tuple[tuple[int, int], ...] = ()) -> bytes:
        """The frame offering drafted ``tokens`` for positions from ``position`` on to the
        cloud-only generation under way, and other candidates for some of them where the
        server takes them (see :class:`~spececd.protocol.messages.Hint`)."""
        return m.encode(m.Hint(position, tuple(tokens),
                               alternatives if self.hint_trees else ()))

    @property
    def hint_trees(self) -> bool:
        """Whether the server takes alternatives in hints (trees, protocol 5)."""
        return (self.trees and self.welcome is not None
                and self.welcome.protocol_version >= m.HINT_TREES_VERSION)

    def receive(self, frame: bytes) -> m.Welcome | m.Verdict | m.Tokens:
        """Decode a frame from the server: a ``Welcome``, or the ``Verdict`` or ``Tokens``
        answering the request pending, checked against it (its sequence number, accepted
        count, tree path and log-probabilities). Raises the ``ProtocolError`` an ``Error``
        frame names, and ``UnexpectedMessage`` for anything else."""
        message = m.decode(frame)
        if isinstance(message, m.Error):
            raise error_for_code(message.code, message.message)
        if isinstance(message, m.Welcome) and self.welcome is None:
            self.welcome = message
            return message
        pending = self._pending
        if isinstance(message, m.Verdict) and isinstance(pending, m.Draft) \
                and message.seq == pending.seq:
            if not 0 <= message.num_accepted <= len(pending.tokens):
                raise UnexpectedMessage(f"verdict accepts {message.num_accepted} of "
                                        f"{len(pending.tokens)} drafted tokens")
            if (message.path is None) != (pending.parents is None) or (
                    message.path is not None and not _is_path(
                        message.path, pending.parents or (), message.num_accepted)):
                raise UnexpectedMessage(f"verdict's path {message.path} is not a path of "
                                        f"{message.num_accepted} nodes from the draft's root")
            self._check_logprobs(message, pending, message.num_accepted + 1)
            self.server_len = (pending.context_len + len(pending.prefix)
                               + message.num_accepted + 1)
            self._pending = None
            self.budget = message.budget
            return message
        if isinstance(message, m.Tokens) and isinstance(pending, m.Generate) \
                and message.seq == pending.seq:
            self._check_logprobs(message, pending, len(message.token_ids))
            self.server_len += len(message.token_ids)
            self.budget = message.budget
            if message.done:
                self._pending = None
            return message
        raise UnexpectedMessage(f"unexpected {type(message).__name__} from the server")

    def _check_logprobs(self, reply: m.Verdict | m.Tokens, pending: m.Draft | m.Generate,
                        emitted: int) -> None:
        """Check that ``reply`` carries the log-probabilities asked for: of its
        ``emitted`` tokens, and (the first reply after the hello that asked) of the
        request's context after its first token."""
        ask = self.hello_message.logprobs
        lp, prompt = reply.logprobs, reply.prompt_logprobs
        if ask.top >= 0 and (lp is None or len(lp) != emitted or lp.top > ask.top):
            raise UnexpectedMessage(f"the server sent {len(lp) if lp else 'no'} rows of "
                                    f"logprobs for {emitted} tokens")
        if prompt is not None:
            context = pending.context_len + len(pending.prefix)
            if not self.prompt_pending or len(prompt) != context - 1 \
                    or prompt.top > ask.prompt_top:
                raise UnexpectedMessage(f"the server sent {len(prompt)} rows of prompt "
                                        f"logprobs for a context of {context} tokens")
            self.prompt_pending = False
