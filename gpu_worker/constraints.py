"""Grammar matchers of the constrained requests in the engine, and the masks they put on logits.

One llguidance matcher per request whose job carries a grammar (:mod:`resq.grammars`).
At every engine step resq's sampling step (:mod:`gpu_worker.sampling_step`) has each
constrained row's token either checked by its matcher after the choice or chosen under
its mask, and hands the chosen tokens back so that each matcher advances. Rows of
unconstrained requests are never touched, and a step without constrained rows costs one
dictionary look-up.

Most constrained rows need no mask at all. A row that is greedy, or drawn from its whole
distribution (``top_p`` 1), is *checked after its choice*: the step chooses its token from the
unmasked logits and the matcher tries it (:meth:`GrammarConstraints.check`, well under a
microsecond); only a row whose token the grammar refuses gets its mask, and is chosen again
from the masked logits. This is exact. The greedy choice of the masked
logits is the unmasked argmax whenever the grammar allows it, and a draw that keeps an allowed
token and redraws a refused one under the mask gives each allowed token ``p / p(allowed)``, the
masked distribution. A seeded row redraws with its own noise, so it picks what the mask-first
path would have picked. A row needs a mask only where the model strays from its format. The one
difference from llguidance's mask: the mask also steers forced text
towards its canonical tokens (``",`` rather than ``"`` then ``,``), and a check keeps the
model's own split of the same text, which the grammar accepts all the same.

A row drawn from a nucleus (``top_p`` < 1) cannot be checked afterwards (the nucleus of the
masked distribution is not the nucleus of the unmasked one), so its mask is computed first,
while the forward pass runs: :meth:`GrammarConstraints.start_masks` fills and unpacks those masks
on a helper thread (llguidance releases the GIL) and the step collects them once the logits
exist. A large vocabulary on a host with cores to spare has its rows spread over
llguidance's own threads; a small one, or a host of two cores, fills them one after the other on
the helper thread (:func:`masks_in_parallel`): there a row takes a few microseconds, less than
handing it to another thread. A chosen token is fed to its matcher on the engine thread, one row
after the other, for the same reason.

A resumed generation (its previous GPU worker was lost) replays the tokens already
published into a fresh matcher before it generates again, so the constraint carries
on exactly where it stopped.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy
import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from gpu_worker import metrics
from gpu_worker.sampling import NON_FINITE_TOKEN
from resq.deep_stack import on_deep_stack

log = logging.getLogger(__name__)

_BITS = 32
COMPILED_GRAMMARS_KEPT = 64
"""How many distinct grammars stay compiled (an agent's schema repeats on every turn)."""
PARALLEL_MASKS_MIN_VOCAB = 16_384
"""The smallest vocabulary whose masks are spread over llguidance's threads: a row's mask costs
about its vocabulary's size (~50 us at 128k tokens), and on the built-in 2k vocabulary it is
~8 us, where the executor's hand-off cost ~2 us a row more than filling it in place
(``docs/benchmarks.md``, B5)."""
PARALLEL_MASKS_MIN_CORES = 3
"""The fewest cores on which the executor's threads can run beside the engine thread and the helper."""


def masks_in_parallel(vocab_size: int, cores: int | None) -> bool:
    """Whether a step's masks are spread over llguidance's threads (else filled one row after another)."""
    return vocab_size >= PARALLEL_MASKS_MIN_VOCAB and (cores or 1) >= PARALLEL_MASKS_MIN_CORES


class GrammarRefusedError(ValueError):
    """A job's grammar does not compile, or its replayed tokens do not follow it."""


@dataclass
class ConstrainedRows:
    """The constrained rows of one step: those masked before the choice and those checked after it."""

    masked_rows: list[int]
    """Rows whose masks are computed before the choice (a nucleus draw)."""
    masked_index: torch.Tensor | None
    """``masked_rows`` as a tensor, on the logits' device (None without such rows: most steps)."""
    masked_matchers: list[LLMatcher]
    forbidden: Future[tuple[torch.Tensor, float]] | None
    """Done once the masks of ``masked_rows`` are computed: bool [len(masked_rows), vocab], True where
    a grammar forbids the token, and the seconds it took (None without such rows)."""
    checked_rows: list[int]
    """Rows whose chosen token is tried against the grammar after the choice (greedy, or a draw
    from the whole distribution)."""
    checked_matchers: list[LLMatcher]
    refused_rows: list[int] = field(default_factory=list)
    """Checked rows whose token the grammar refused (set by :meth:`GrammarConstraints.check`): masked
    and chosen again, then fed by :meth:`GrammarConstraints.advance`."""
    refused_matchers: list[LLMatcher] = field(default_factory=list)


@dataclass(eq=False)
class _Constrained:
    matcher: LLMatcher
    checked_after_choice: bool


class GrammarConstraints:
    """The matchers of the requests in one engine (thread-safe: jobs arrive from Celery threads)."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: list[int],
        parallel: bool | None = None,
        check_after_choice: bool = True,
    ) -> None:
        """``parallel``: spread a step's masks over llguidance's threads; None decides by
        :func:`masks_in_parallel` on this host. ``check_after_choice``: check the tokens of the
        rows that allow it after their choice instead of masking them first (False masks every
        row first, for comparison)."""
        self._tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids or None)
        self.vocab_size = vocab_size
        self._eos_tokens = numpy.asarray([t for t in eos_token_ids if t < vocab_size], dtype=numpy.int64)
        self._eos_set = frozenset(int(t) for t in self._eos_tokens)
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        """Recently used grammars, compiled once: a request's matcher is a copy of one (about
        1 us, where a compile takes 0.5 ms and more)."""
        self._words = (vocab_size + _BITS - 1) // _BITS
        if parallel is None:
            parallel = masks_in_parallel(vocab_size, os.cpu_count())
        self._executor: LLExecutor | None = LLExecutor() if parallel else None
        self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resq-masks")
        self.check_after_choice = check_after_choice
        """Whether requests added from now on are checked after their choice when they allow it."""
        self._requests: dict[str, _Constrained] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """How many requests are constrained now (a step checks this before anything else)."""
        return len(self._requests)

    def add(self, request_id: str, grammar: str, replay: list[int], checkable: bool = False) -> None:
        """Constrain ``request_id`` by ``grammar``, after ``replay`` (tokens it already generated).

        ``checkable``: the request's draw allows a check after the choice (it is greedy, or drawn
        from the whole distribution: no ``top_p`` below 1), so its rows need a mask only when the
        grammar refuses the token chosen without one.
        """
        matcher = self._compile(grammar).deep_copy()
        if replay and not matcher.consume_tokens(replay):
            raise GrammarRefusedError(
                f"the tokens already generated do not follow the grammar: {matcher.get_error()}"
            )
        with self._lock:
            self._requests[request_id] = _Constrained(matcher, checkable and self.check_after_choice)

    def _compile(self, grammar: str) -> LLMatcher:
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled
        # llguidance's compiler recurses as deep as the grammar's chains of rules (resq.deep_stack).
        compiled = on_deep_stack(LLMatcher, self._tokenizer, grammar, log_level=0)
        if compiled.is_error():
            raise GrammarRefusedError(f"grammar does not compile: {compiled.get_error()}")
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > COMPILED_GRAMMARS_KEPT:
                self._compiled.popitem(last=False)
        return compiled

    def forget(self, request_id: str) -> None:
        """Drop the matcher of a request that ended (or never had one)."""
        with self._lock:
            self._requests.pop(request_id, None)

    def start_masks(self, row_request_ids: list[str], device: torch.device) -> ConstrainedRows | None:
        """The constrained rows of a step, the masks of those that need them first already being
        filled; None when the step has no constrained row."""
        with self._lock:
            found = [(row, self._requests.get(rid)) for row, rid in enumerate(row_request_ids)]
        masked_rows: list[int] = []
        masked_matchers: list[LLMatcher] = []
        checked_rows: list[int] = []
        checked_matchers: list[LLMatcher] = []
        for row, request in found:
            if request is None:
                continue
            rows, matchers = (
                (checked_rows, checked_matchers)
                if request.checked_after_choice
                else (masked_rows, masked_matchers)
            )
            rows.append(row)
            matchers.append(request.matcher)
        if not masked_rows and not checked_rows:
            return None
        return ConstrainedRows(
            masked_rows=masked_rows,
            masked_index=torch.tensor(masked_rows, device=device) if masked_rows else None,
            masked_matchers=masked_matchers,
            forbidden=self._filler.submit(self._forbidden_tokens, masked_matchers) if masked_rows else None,
            checked_rows=checked_rows,
            checked_matchers=checked_matchers,
        )

    def _forbidden_tokens(self, matchers: list[LLMatcher]) -> tuple[torch.Tensor, float]:
        # On the helper thread while the forward pass runs (masks first), or on the engine thread
        # for refused rows: the mask fill (llguidance, GIL released) and unpacking its bits into
        # one boolean per token.
        started = time.perf_counter()
        bitmask = numpy.zeros((len(matchers), self._words), dtype=numpy.int32)
        row_bytes = self._words * 4
        if self._executor is not None:
            self._executor.unsafe_compute_mask_ptr(
                [(matcher, index) for index, matcher in enumerate(matchers)],
                bitmask.ctypes.data,
                row_bytes,
                len(matchers),
            )
        else:
            start = bitmask.ctypes.data
            for index, matcher in enumerate(matchers):
                matcher.unsafe_compute_mask_ptr(start + index * row_bytes, row_bytes)
        # Bit t of little-endian word w is token 32 w + t: one unpack gives a byte per token. The
        # masks cover the model's vocabulary (the tokenizer was sized to it), rounded up to 32.
        allowed = numpy.unpackbits(bitmask.view(numpy.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        # A matcher in an error state allows nothing: let it end rather than sample from all -inf.
        stuck = ~allowed.any(axis=1)
        if stuck.any() and self._eos_tokens.size:
            allowed[numpy.flatnonzero(stuck)[:, None], self._eos_tokens] = 1
        return torch.from_numpy(allowed == 0), time.perf_counter() - started

    def apply(self, constrained: ConstrainedRows, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [rows, vocab] with every token forbidden to a row masked first at -inf (a copy,
        or ``logits`` itself when no row is masked first)."""
        if constrained.forbidden is None or constrained.masked_index is None:
            return logits
        forbidden, elapsed = constrained.forbidden.result()
        metrics.GRAMMAR_MASK_SECONDS.observe(elapsed)
        return _masked(logits, constrained.masked_rows, constrained.masked_index, forbidden)

    def check(self, constrained: ConstrainedRows, tokens: list[int]) -> list[int]:
        """Feed each checked row's chosen token (``tokens``: one per row of the step) to its matcher
        if its grammar accepts it; the rows it refused, which must be masked and chosen again.

        A row reported as :data:`~gpu_worker.sampling.NON_FINITE_TOKEN` is neither fed nor
        refused: its request ends with an error at this step.
        """
        refused_rows: list[int] = []
        refused_matchers: list[LLMatcher] = []
        for row, matcher in zip(constrained.checked_rows, constrained.checked_matchers, strict=True):
            token = tokens[row]
            if token != NON_FINITE_TOKEN and not self._consumed(matcher, token):
                refused_rows.append(row)
                refused_matchers.append(matcher)
        constrained.refused_rows = refused_rows
        constrained.refused_matchers = refused_matchers
        accepted = len(constrained.checked_rows) - len(refused_rows)
        metrics.CONSTRAINED_TOKENS.inc(accepted)
        metrics.GRAMMAR_TOKENS_ACCEPTED.inc(accepted)
        metrics.GRAMMAR_TOKENS_REFUSED.inc(len(refused_rows))
        return refused_rows

    def _consumed(self, matcher: LLMatcher, token: int) -> bool:
        # An end token is the mask's to allow whenever the grammar accepts (even once it can take
        # nothing more), where trying it as input refuses it: asked apart, as the mask has it.
        if token in self._eos_set:
            return bool(matcher.is_accepting()) and bool(matcher.consume_token(token))
        return bool(matcher.try_consume_tokens([token]) == 1)

    def mask_refused(self, constrained: ConstrainedRows, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [refused rows, vocab] (the refused rows' logits, in order) with every token
        their grammars forbid at -inf, the masks computed now (a copy)."""
        forbidden, elapsed = self._forbidden_tokens(constrained.refused_matchers)
        metrics.GRAMMAR_MASK_SECONDS.observe(elapsed)
        return logits.masked_fill(forbidden.to(logits.device, non_blocking=True), float("-inf"))

    def advance(self, constrained: ConstrainedRows, tokens: list[int]) -> list[int]:
        """Feed the tokens chosen under a mask (``tokens``: one per row of the step) to their matchers:
        the rows masked first and the refused rows chosen again. Returns the rows whose grammar
        failed, whose requests must end with an error.

        A matcher refuses a token its own mask allowed only when llguidance fails: a limit of its
        parser hit at run time (an enum of thousands of objects: "max is 2000" items in a row),
        which compiling the grammar could not foresee, or a forced text spelled with an added
        token it then reads as special (a schema whose ``const`` is ``"<tool_call>"``). A matcher
        in such a state allows no token (its mask lets the end token through). Either way the
        answer can no longer follow its grammar.

        A row reported as :data:`~gpu_worker.sampling.NON_FINITE_TOKEN` is skipped: its
        request ends with an error at this step.
        """
        failed: list[int] = []
        fed = 0
        # One row after another: a token takes a matcher well under a microsecond, where
        # llguidance's parallel consume cost ~2.5 us a row in hand-offs (docs/benchmarks.md, B5).
        for rows, matchers in (
            (constrained.masked_rows, constrained.masked_matchers),
            (constrained.refused_rows, constrained.refused_matchers),
        ):
            for row, matcher in zip(rows, matchers, strict=True):
                token = tokens[row]
                if token == NON_FINITE_TOKEN:
                    continue
                fed += 1
                if not matcher.consume_token(token) or matcher.is_error():
                    failed.append(row)
                    log.error(
                        "a grammar failed; its request ends with an error: %s", grammar_failure(matcher)
                    )
        metrics.CONSTRAINED_TOKENS.inc(fed)
        return failed


GRAMMAR_FAILURE_CHARS = 300
"""How much of llguidance's message is logged: its messages can hold the whole grammar."""


def grammar_failure(matcher: LLMatcher) -> str:
    """The first line of a failed matcher's error, bounded."""
    lines = matcher.get_error().strip().splitlines()
    first = lines[0] if lines else "no message"
    return first if len(first) <= GRAMMAR_FAILURE_CHARS else first[:GRAMMAR_FAILURE_CHARS] + "..."


def _masked(
    logits: torch.Tensor, rows: list[int], index: torch.Tensor, forbidden: torch.Tensor
) -> torch.Tensor:
    forbidden = forbidden.to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:  # every row masked: one masking op
        return logits.masked_fill(forbidden, float("-inf"))
    masked = logits.clone()
    masked[index] = logits[index].masked_fill(forbidden, float("-inf"))
    return masked
