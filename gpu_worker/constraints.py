"""Grammar matchers of the constrained requests in the engine, and the masks they put on logits.

One llguidance matcher per request whose job carries a grammar (:mod:`resq.grammars`).
At every engine step resq's sampling step (:mod:`gpu_worker.sampling_step`) asks for
the masks of the batch rows that belong to constrained requests, applies each to its
row's logits before the token is chosen, and hands the chosen tokens back so that
each matcher advances. Rows of unconstrained requests are never touched, and a step
without constrained rows costs one dictionary look-up.

The masks are computed while the forward pass runs: :meth:`GrammarConstraints.start_masks`
fills and unpacks them on a helper thread (llguidance releases the GIL) and the step collects them
once the logits exist. A large vocabulary on a host with cores to spare has its rows spread over
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
from dataclasses import dataclass

import numpy
import torch
from llguidance import LLExecutor, LLMatcher, LLTokenizer

from gpu_worker import metrics
from gpu_worker.sampling import NON_FINITE_TOKEN

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
    """The constrained rows of one step and their masks (filled by a helper thread)."""

    rows: list[int]
    index: torch.Tensor
    """``rows`` as a tensor, on the logits' device."""
    matchers: list[LLMatcher]
    forbidden: Future[tuple[torch.Tensor, float]]
    """Done once the masks are computed: bool [len(rows), vocab], True where a grammar forbids the
    token, and the seconds it took."""


class GrammarConstraints:
    """The matchers of the requests in one engine (thread-safe: jobs arrive from Celery threads)."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: list[int],
        parallel: bool | None = None,
    ) -> None:
        """``parallel``: spread a step's masks over llguidance's threads; None decides by
        :func:`masks_in_parallel` on this host."""
        self._tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids or None)
        self.vocab_size = vocab_size
        self._eos_tokens = numpy.asarray([t for t in eos_token_ids if t < vocab_size], dtype=numpy.int64)
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()
        """Recently used grammars, compiled once: a request's matcher is a copy of one (about
        1 us, where a compile takes 0.5 ms and more)."""
        self._words = (vocab_size + _BITS - 1) // _BITS
        if parallel is None:
            parallel = masks_in_parallel(vocab_size, os.cpu_count())
        self._executor: LLExecutor | None = LLExecutor() if parallel else None
        self._filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resq-masks")
        self._matchers: dict[str, LLMatcher] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """How many requests are constrained now (a step checks this before anything else)."""
        return len(self._matchers)

    def add(self, request_id: str, grammar: str, replay: list[int]) -> None:
        """Constrain ``request_id`` by ``grammar``, after ``replay`` (tokens it already generated)."""
        matcher = self._compile(grammar).deep_copy()
        if replay and not matcher.consume_tokens(replay):
            raise GrammarRefusedError(
                f"the tokens already generated do not follow the grammar: {matcher.get_error()}"
            )
        with self._lock:
            self._matchers[request_id] = matcher

    def _compile(self, grammar: str) -> LLMatcher:
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled
        compiled = LLMatcher(self._tokenizer, grammar, log_level=0)
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
            self._matchers.pop(request_id, None)

    def start_masks(self, row_request_ids: list[str], device: torch.device) -> ConstrainedRows | None:
        """Begin filling the masks of the constrained rows of a step; None when it has none."""
        with self._lock:
            found = [(row, self._matchers.get(rid)) for row, rid in enumerate(row_request_ids)]
        rows = [row for row, matcher in found if matcher is not None]
        if not rows:
            return None
        matchers = [matcher for _, matcher in found if matcher is not None]
        forbidden = self._filler.submit(self._forbidden_tokens, matchers)
        return ConstrainedRows(rows, torch.tensor(rows, device=device), matchers, forbidden)

    def _forbidden_tokens(self, matchers: list[LLMatcher]) -> tuple[torch.Tensor, float]:
        # Runs on the helper thread, all of it while the forward pass runs: the mask fill
        # (llguidance, GIL released) and unpacking its bits into one boolean per token.
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
        """``logits`` [rows, vocab] with every token a constrained row's grammar forbids at -inf (a copy)."""
        forbidden, elapsed = constrained.forbidden.result()
        forbidden = forbidden.to(logits.device, non_blocking=True)
        if len(constrained.rows) == logits.shape[0]:  # every row constrained: one masking op
            masked = logits.masked_fill(forbidden, float("-inf"))
        else:
            masked = logits.clone()
            masked[constrained.index] = logits[constrained.index].masked_fill(forbidden, float("-inf"))
        metrics.GRAMMAR_MASK_SECONDS.observe(elapsed)
        return masked

    def advance(self, constrained: ConstrainedRows, tokens: torch.Tensor) -> None:
        """Feed each constrained row's chosen token (of ``tokens`` [rows]) to its matcher.

        A row reported as :data:`~gpu_worker.sampling.NON_FINITE_TOKEN` is skipped: its
        request ends with an error at this step.
        """
        chosen = tokens[constrained.index].tolist()
        fed = 0
        # One row after another: a token takes a matcher well under a microsecond, where
        # llguidance's parallel consume cost ~2.5 us a row in hand-offs (docs/benchmarks.md, B5).
        for matcher, token in zip(constrained.matchers, chosen, strict=True):
            if token == NON_FINITE_TOKEN:
                continue
            fed += 1
            if not matcher.consume_token(token):
                # Cannot happen for a token its own mask allowed; say so rather than hide it.
                log.error("a constrained token was refused by its grammar: %s", matcher.get_error())
        metrics.CONSTRAINED_TOKENS.inc(fed)
