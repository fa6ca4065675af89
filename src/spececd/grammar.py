"""Constraints compiled against a tokenizer, and the matcher each session masks with.

The one module that imports xgrammar (a maintained grammar engine: JSON schema, regex,
EBNF/GBNF and Lark grammars compiled to a token-level pushdown automaton with rollback);
the rest of SpecECD sees :class:`Grammars` (a tokenizer's compiler and cache),
:class:`CompiledConstraint` and :class:`ConstraintMatcher`, and numpy arrays.

- JSON (``json_object``, ``json_schema``) is generated as ``json.dumps`` writes it
  (``", "`` and ``": "``, no other whitespace, which small models otherwise fill).
- :meth:`Grammars.compile` turns a :class:`~spececd.core.params.Constraint` into a
  compiled grammar, cached by a hash of (kind, spec, strict) for this tokenizer, within a
  time limit. What cannot compile (an invalid schema, an unsupported keyword, a grammar
  with errors, one that takes too long) raises :class:`InvalidConstraint`, which names
  the constraint and says why.
- A :class:`ConstraintMatcher` follows one generation: :meth:`~ConstraintMatcher.sync`
  moves it to the tokens generated so far (rolling back what a rejected block left),
  :meth:`~ConstraintMatcher.allowed` gives the tokens allowed at each row of a block (a
  chain or a tree) without moving it, and :func:`mask_logits` sets the others to minus
  infinity *before* any logits processing, so that after penalties and temperature they
  have probability zero and greedy picks the argmax among the allowed.

Once the output is complete only the end-of-sequence tokens are allowed; after one of them
(the grammar is then terminated) they stay the only ones, as in xgrammar's transformers
logits processor.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from spececd.core.params import Constraint
from spececd.errors import InputError

log = logging.getLogger(__name__)

# Seconds a compilation may take before the constraint is refused as too slow.
COMPILE_TIMEOUT = 10.0
# Compilations running at once across the process (a slow one that timed out keeps its
# thread until it ends: this bounds how many such threads a flood of schemas can hold).
_COMPILE_THREADS = 2
_CACHE_SIZE = 256


class InvalidConstraint(InputError):
    """A constraint that cannot be compiled: the message says which and why."""


@dataclass(frozen=True)
class CompiledConstraint:
    """A constraint compiled for one tokenizer (``grammar``: xgrammar's)."""

    constraint: Constraint
    grammar: Any
    vocab_size: int
    stop_token_ids: tuple[int, ...]

    def matcher(self) -> ConstraintMatcher:
        return ConstraintMatcher(self)


_pool = concurrent.futures.ThreadPoolExecutor(_COMPILE_THREADS,
                                              thread_name_prefix="spececd-grammar")


class Grammars:
    """One tokenizer's grammar compiler and cache. ``tokenizer``: a SpecECD tokenizer
    (:class:`~spececd.backends.base.Tokenizer`); ``vocab_size``: the width of the logits
    that get masked (the tokenizer's ids)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(getattr(tokenizer, "eos_token_ids", ()))
        if not self.stop_token_ids:
            raise InvalidConstraint("constraints need a tokenizer with an end-of-sequence "
                                    "token, and this one has none")
        self._info = _tokenizer_info(tokenizer, vocab_size, list(self.stop_token_ids))
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        self._cache: dict[str, CompiledConstraint | InvalidConstraint] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(constraint: Constraint) -> str:
        return hashlib.sha256(json.dumps(
            [constraint.kind, constraint.spec, constraint.strict]).encode()).hexdigest()

    def cached(self, constraint: Constraint) -> bool:
        return self.key(constraint) in self._cache

    def compile(self, constraint: Constraint, timeout: float = COMPILE_TIMEOUT
                ) -> CompiledConstraint:
        """``constraint`` compiled (from the cache when it was before); raises
        :class:`InvalidConstraint` when it cannot be (cached too: a schema that failed is
        not compiled again), or not within ``timeout`` seconds (not cached: the compile
        goes on, and its result is cached when it comes)."""
        key = self.key(constraint)
        with self._lock:
            hit = self._cache.get(key)
        if hit is None:
            began = time.perf_counter()
            future = _pool.submit(self._compile, constraint)
            try:
                hit = future.result(timeout)
            except concurrent.futures.TimeoutError:
                # Not cached: the wait may have been another compile's queue. The result is
                # cached when it comes.
                future.add_done_callback(lambda done: self._store(key, done.result()))
                raise InvalidConstraint(
                    f"the {constraint.kind} constraint took longer than {timeout:g} s to "
                    f"compile; simplify it (fewer alternatives, bounded repetitions)"
                ) from None
            log.info("compiled a %s constraint in %.1f ms", constraint.kind,
                     1e3 * (time.perf_counter() - began))
            self._store(key, hit)
        if isinstance(hit, InvalidConstraint):
            raise hit
        return hit

    def _store(self, key: str, hit: CompiledConstraint | InvalidConstraint) -> None:
        with self._lock:
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = hit

    def _compile(self, constraint: Constraint) -> CompiledConstraint | InvalidConstraint:
        kind, spec = constraint.kind, constraint.spec
        try:
            if kind in ("json_object", "json_schema"):
                grammar = self._compiler.compile_json_schema(
                    spec if kind == "json_schema" else '{"type": "object"}',
                    any_whitespace=False, strict_mode=constraint.strict and kind != "json_object")
            elif kind == "regex":
                grammar = self._compiler.compile_regex(spec)
            elif kind == "choice":
                alternatives = " | ".join(json.dumps(c) for c in constraint.choices())
                grammar = self._compiler.compile_grammar(f"root ::= {alternatives}")
            else:
                grammar = self._compile_grammar(spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            return InvalidConstraint(f"invalid {kind} constraint: {_reason(exc)}")
        return CompiledConstraint(constraint, grammar, self.vocab_size, self.stop_token_ids)

    def _compile_grammar(self, spec: str) -> Any:
        """EBNF (GBNF, with a ``root`` rule) or, failing that, Lark."""
        try:
            return self._compiler.compile_grammar(spec)
        except RuntimeError as ebnf_error:
            if "::=" in spec:
                raise
            try:
                return self._compiler.compile_lark(spec)
            except RuntimeError:
                raise ebnf_error from None


XGRAMMAR_MISSING = (
    "constraints (structured outputs: JSON schema, regex, choice, grammar) and forced tool "
    "calls need xgrammar, which SpecECD's `hf` extra installs (and its `grammar` extra "
    "alone): in SpecECD's folder, `pip install torch==2.13.0 && pip install -e '.[hf]'`")


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise InputError(XGRAMMAR_MISSING) from None
    return xgrammar


def _reason(exc: BaseException) -> str:
    """xgrammar's message without its source location prefix."""
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if text.startswith("Check failed") and ": " in text:
            text = text.split(": ", 1)[1]
    return text.strip()


def _tokenizer_info(tokenizer: Any, vocab_size: int, stops: list[int]) -> Any:
    xgr = _xgrammar()
    hf = getattr(tokenizer, "_tok", None)  # a transformers tokenizer (HFTokenizer)
    if hf is not None:
        return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                  stop_token_ids=stops)
    vocab = tokenizer.vocab_tokens()[:vocab_size]
    by_string = {token: i for i, token in enumerate(vocab)}
    detected = xgr.TokenizerInfo._detect_vocab_type_from_vocab(by_string)
    return xgr.TokenizerInfo(vocab, detected or xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=stops)


_grammars: dict[int, tuple[Any, Grammars]] = {}
_grammars_lock = threading.Lock()


def grammars_for(tokenizer: Any, vocab_size: int) -> Grammars:
    """The :class:`Grammars` of ``tokenizer`` (one per tokenizer object in the process, so
    that an edge and a server in one process share compilations only when they share it)."""
    with _grammars_lock:
        held = _grammars.get(id(tokenizer))
        if held is None or held[0] is not tokenizer or held[1].vocab_size != vocab_size:
            held = _grammars[id(tokenizer)] = (tokenizer, Grammars(tokenizer, vocab_size))
        return held[1]


def warm(tokenizer: Any, vocab_size: int) -> threading.Thread:
    """Import xgrammar, build ``tokenizer``'s :class:`Grammars` and compile a JSON object
    once, on a thread of its own (returned), so that a server's first constrained request
    does not wait for them (about 0.3 s for the default pair, most of it xgrammar's
    tokenizer info), nor its start for xgrammar's import (0.5 s). Where xgrammar is not
    installed, or the tokenizer has no end-of-sequence token, the thread does nothing:
    constraints are refused with the reason when asked for. Whoever starts it joins it
    before the process ends: a thread still in xgrammar's C++ code as the interpreter ends
    aborts the process ("exception not rethrown", exit -6: a server stopped as it began
    serving, 2 times in 8 on a busy CPU)."""

    def build() -> None:
        try:
            grammars_for(tokenizer, vocab_size).compile(Constraint("json_object"))
        except InputError as exc:  # no xgrammar, or no end-of-sequence token
            log.debug("no grammars to warm: %s", exc)

    thread = threading.Thread(target=build, name="spececd-grammar-warm", daemon=True)
    thread.start()
    return thread


def mask_logits(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """``logits`` ``[n, vocab]`` with the tokens not ``allowed`` ``[n, vocab]`` at minus
    infinity (a new array)."""
    return np.where(allowed, logits, -np.inf)


class ConstraintMatcher:
    """One generation's position in a compiled constraint: see the module docstring.

    It holds the tokens generated so far (:attr:`tokens`); tokens after the grammar has
    terminated (an end-of-sequence token was taken) are counted, not matched."""

    def __init__(self, compiled: CompiledConstraint) -> None:
        self.compiled = compiled
        self._matcher = _xgrammar().GrammarMatcher(compiled.grammar)
        self._bitmask = np.full((1, (compiled.vocab_size + 31) // 32), -1, dtype=np.int32)
        self._stops = np.zeros(compiled.vocab_size, dtype=bool)
        self._stops[[t for t in compiled.stop_token_ids if t < compiled.vocab_size]] = True
        self.tokens: list[int] = []
        self._matched = 0  # of tokens, those the matcher took (the rest follow termination)

    # -- moving -----------------------------------------------------------------------
    def accept(self, token: int) -> bool:
        """Take ``token`` if the constraint allows it next; whether it did."""
        if self._matcher.is_terminated():
            if not self._stops[token]:
                return False
            self.tokens.append(token)
            return True
        if not (0 <= token < self.compiled.vocab_size) or not self._matcher.accept_token(token):
            return False
        self.tokens.append(token)
        self._matched += 1
        return True

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens taken."""
        if not 0 <= n <= len(self.tokens):
            raise ValueError(f"cannot roll back {n} of {len(self.tokens)} tokens")
        extra = len(self.tokens) - self._matched
        matched = max(0, n - extra)
        if matched:
            self._matcher.rollback(matched)
            self._matched -= matched
        del self.tokens[len(self.tokens) - n:]

    def sync(self, generated: Sequence[int]) -> None:
        """Move to ``generated`` (the tokens after the prompt): roll back past where it
        differs from what was taken, then take the rest. Raises :class:`InputError` when
        the constraint does not allow them (a history the constraint never produced)."""
        common = 0
        for a, b in zip(self.tokens, generated, strict=False):
            if a != b:
                break
            common += 1
        self.rollback(len(self.tokens) - common)
        for i in range(common, len(generated)):
            if not self.accept(int(generated[i])):
                self.rollback(len(self.tokens) - common)
                raise InputError(f"the history's generated token {i} ({generated[i]}) is not "
                                 f"allowed by the {self.compiled.constraint.kind} constraint")

    # -- reading ----------------------------------------------------------------------
    def allowed_now(self) -> np.ndarray:  # [vocab] bool
        """The tokens the constraint allows next."""
        if self._matcher.is_terminated():
            return np.array(self._stops)
        self._matcher.fill_next_token_bitmask(self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        return bits[:self.compiled.vocab_size].astype(bool)

    def allowed(self, tokens: Sequence[int], parents: Sequence[int] | None = None
                ) -> np.ndarray:  # [n + 1, vocab] bool
        """The tokens allowed at the root and after each of ``tokens`` (a chain, or a tree
        by ``parents``), the matcher left where it was. A row after a token the constraint
        refuses is never reached (that token has probability zero): it allows all."""
        n, vocab = len(tokens), self.compiled.vocab_size
        rows = np.ones((n + 1, vocab), dtype=bool)
        rows[0] = self.allowed_now()
        if parents is None:
            taken = 0
            for i, token in enumerate(tokens):
                if not self.accept(int(token)):
                    break
                taken += 1
                rows[i + 1] = self.allowed_now()
            self.rollback(taken)
            return rows
        paths: list[tuple[int, ...]] = []
        for i, parent in enumerate(parents):
            paths.append((*paths[parent], i) if parent >= 0 else (i,))
            taken = 0
            for node in paths[i]:
                if not self.accept(int(tokens[node])):
                    break
                taken += 1
            if taken == len(paths[i]):
                rows[i + 1] = self.allowed_now()
            self.rollback(taken)
        return rows

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the constraint forces next (each the only one allowed, an
        end-of-sequence token last), the matcher left where it was."""
        out: list[int] = []
        while len(out) < limit and not self._matcher.is_terminated():
            allowed = np.flatnonzero(self.allowed_now())
            if allowed.size != 1 or not self.accept(int(allowed[0])):
                break
            out.append(int(allowed[0]))
        self.rollback(len(out))
        return out

    def jump_forward(self) -> str:
        """The longest text the constraint certainly continues with (xgrammar's
        jump-forward string; "" when none or terminated)."""
        if self._matcher.is_terminated():
            return ""
        return str(self._matcher.find_jump_forward_string())

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


def tagged_json_grammar(tags: Sequence[tuple[str, Any, str]], separator: str,
                        max_tags: int = 1) -> str:
    """An EBNF grammar (with a ``root`` rule, for a ``grammar`` constraint) of one to
    ``max_tags`` tags separated by ``separator``, each ``begin JSON end`` out of ``tags``
    (``(begin, json_schema, end)``, the schema a dict), each tag's JSON valid under its
    schema, with at most one whitespace character between its tokens. Built from
    xgrammar's structural tags, which embed the schemas; forced tool calls are such tags
    (:mod:`spececd.openai_api.tools`), and the bound is what ends them: a model that
    never chooses to stop still stops after ``max_tags``. The grammar holds the tags once
    whatever ``max_tags``. A schema xgrammar cannot take raises :class:`InvalidConstraint`
    saying why."""
    if max_tags < 1:
        raise ValueError(f"max_tags must be >= 1, got {max_tags}")
    xgr = _xgrammar()
    from xgrammar.structural_tag import (
        JSONSchemaFormat,
        StructuralTag,
        TagFormat,
        TagsWithSeparatorFormat,
    )

    formats = [TagFormat(begin=begin, end=end, content=JSONSchemaFormat(
        json_schema=schema, max_whitespace_cnt=1)) for begin, schema, end in tags]
    one = TagsWithSeparatorFormat(tags=formats, separator=separator, at_least_one=True,
                                  stop_after_first=True)
    try:
        ebnf = str(xgr.Grammar.from_structural_tag(StructuralTag(format=one)))
    except Exception as exc:  # xgrammar raises RuntimeError, ValueError, its own
        raise InvalidConstraint(_reason(exc)) from None
    if max_tags == 1:
        return ebnf
    # The one-tag grammar's root becomes a rule of its own, repeated up to the bound.
    name = "tag_once"
    while re.search(rf"\b{name}\b", ebnf):
        name += "_"
    rules = re.sub(r"^root ::=", f"{name} ::=", ebnf, count=1, flags=re.MULTILINE)
    return (f"root ::= {name} ({json.dumps(separator)} {name}){{0,{max_tags - 1}}}\n"
            f"{rules}")
