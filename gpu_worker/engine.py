"""The generation engine: transformers' continuous batching, sized from settings.

Concurrent requests share engine steps (``model.init_continuous_batching``). The
engine runs in its own thread; finished and streaming outputs land in a mailbox
(:mod:`gpu_worker.output_mailbox`) that :mod:`gpu_worker.publisher` empties, off the
engine's critical path, woken only for a request's first tokens, its end, or a round
that is due.

Sampling is per request. transformers' per-request logits processors carry each
request's temperature, top-p, and top-k = 1 for greedy (``temperature: 0``) into the
step, since the engine's argmax/sampling switch is global; resq's own step
(:mod:`gpu_worker.sampling_step`) then chooses the tokens from those settings
without running the processors: an all-greedy batch costs one argmax, and only
rows with ``top_p < 1`` are sorted. The end tokens are per request too: a request
may add its own (``stop_token_ids``) to the model's.

Presence and frequency penalties are per request as well (:mod:`gpu_worker.penalties`):
the engine counts what each penalised request generated (starting from the tokens a
resumed one replays), and the step subtracts the penalties from those rows only. They
need the step to run eagerly at every batch, as grammars do: when transformers turns
on CUDA graphs, ``torch.compile`` or asynchronous batching (on CUDA with
``RESQ_STRUCTURED_OUTPUTS`` off), a job with a penalty is refused.

With ``RESQ_LOGPROBS`` the engine also computes each sampled token's logprob
under the model's raw distribution (:mod:`gpu_worker.raw_logprobs`), for every
request; only those that ask get them published.

One request must not bring down its neighbours. A temperature below
:data:`gpu_worker.sampling.GREEDY_BELOW_TEMPERATURE` decodes greedily (as vLLM does);
every other value the API accepts (temperature up to 2, any top-p above 0, penalties in
[-2, 2]) keeps finite logits finite. A row whose scores are not finite anyway (the model
itself produced a NaN) is reported by the step as
:data:`gpu_worker.sampling.NON_FINITE_TOKEN`, an end token of every request: transformers
finishes that request alone, and :meth:`Engine.next_outputs` hands it on as a failed
output (an ``error`` finish) without the flag. When the generation loop dies of an
exception nonetheless, transformers fails every request it holds; those outputs are
dropped here, so that the publisher hands the requests back for another GPU worker to
resume, as it would the requests of a lost worker, rather than ending them ``failed``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import queue
import threading
import time
from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.continuous_api import BackgroundThreadStatus
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from gpu_worker import decode_attention, prefix_cache, raw_logprobs, sampling_step
from gpu_worker.constraints import GrammarConstraints, GrammarRefusedError
from gpu_worker.model_loading import LoadedModel
from gpu_worker.output_mailbox import OutputMailbox
from gpu_worker.penalties import Penalties
from gpu_worker.sampling import GRAMMAR_FAILED_TOKEN, GREEDY_BELOW_TEMPERATURE, NON_FINITE_TOKEN, STEP_FLAGS
from gpu_worker.seeds import Seeds
from gpu_worker.top_logprobs import Alternatives, TopLogprobs
from resq.settings import Settings
from resq.wire import FailureCode, GenerationJob

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_TOKENS = 16384
# Defaults that differ from transformers' "no-op" values, so that transformers builds
# the temperature, top-k and top-p processors; every request overrides all three.
_PROCESSOR_DEFAULT_TEMPERATURE = 0.7
_PROCESSOR_DEFAULT_TOP_P = 0.95
NON_FINITE_ERROR = (
    "The model's next-token scores for this response were not finite (NaN or infinity); generation stopped."
)
GRAMMAR_FAILED_ERROR = (
    "The constrained decoder could not go on with this response's grammar (text.format or a tool's "
    "grammar: a schema too large for it, or text it cannot spell with this vocabulary); generation stopped."
)
_FLAG_ERRORS = {NON_FINITE_TOKEN: NON_FINITE_ERROR, GRAMMAR_FAILED_TOKEN: GRAMMAR_FAILED_ERROR}
_REQUEST_FAULTS = frozenset({GRAMMAR_FAILED_ERROR})
"""Failures that are the request's own: its grammar (a schema past llguidance's parser limits,
forced text this vocabulary cannot spell) could not be followed to the end."""


def failure_code(error: str | None) -> FailureCode:
    """The Responses API's ``error.code`` of an output that failed with ``error``."""
    return "invalid_prompt" if error in _REQUEST_FAULTS else "server_error"


WARM_UP_REQUEST_ID = "resq-warm-up"
"""The engine's id of :meth:`Engine.warm_up`'s request (no response is named so: ids are ``resp_...``)."""
WARM_UP_PROMPT_TOKENS = 16
WARM_UP_NEW_TOKENS = 4

PREFILL_ONLY_STEPS = 2
"""The steps a prefill-only job (a prewarm) runs, whatever its ``max_output_tokens`` says (the
context allowing) and whatever it samples; none of their tokens is published. Two, not one:
transformers 5.25 registers a prompt's pages for sharing after the step that computed them, and
skips a request that step finished (``PagedAttentionCache.mark_complete_blocks``), so a prompt
computed by a request ending in that step left nothing a next turn could reuse."""


CLAIM_SEPARATOR = "@"
"""Between a response id and its claim's epoch in an engine request id (never in a response id)."""


def engine_request_id(response_id: str, epoch: int) -> str:
    """The engine's id for one claim of a job: ``<response id>@<epoch>``.

    A GPU worker that froze (SIGSTOP, a stalled host) past its heartbeat can claim its own job
    again once it wakes, while the old copy is still in its engine: the two must not share an id.
    """
    return f"{response_id}{CLAIM_SEPARATOR}{epoch}"


def response_of(request_id: str) -> str:
    """The response id of an engine request id (itself, for one named after its response)."""
    return request_id.split(CLAIM_SEPARATOR, 1)[0]


def drain(output_queue: queue.Queue[GenerationOutput], timeout_s: float) -> list[GenerationOutput]:
    """Everything in ``output_queue``, waiting up to ``timeout_s`` for the first item (none: [])."""
    outputs: list[GenerationOutput] = []
    try:
        outputs.append(output_queue.get(timeout=timeout_s))
    except queue.Empty:
        return outputs
    while True:
        try:
            outputs.append(output_queue.get_nowait())
        except queue.Empty:
            return outputs


class EngineStoppedError(RuntimeError):
    """The engine thread is gone; no request can be added."""


class PenaltiesRefusedError(ValueError):
    """A job asks for presence or frequency penalties that this engine's step cannot apply."""


class TopLogprobsRefusedError(ValueError):
    """A job asks for ``top_logprobs`` that this engine's step cannot record."""


class Engine:
    """One continuous-batching manager and the admission slots in front of it."""

    def __init__(self, loaded: LoadedModel, settings: Settings) -> None:
        self._loaded = loaded
        self.logprobs = settings.logprobs
        # Both wrap the runner's step; installed in this order every time, so resq's step is
        # the outer one and the raw-logprobs tap only runs for a runner it does not take over.
        raw_logprobs.install()
        sampling_step.install()
        prefix_cache.install()
        decode_attention.install()
        # Per model: the cache transformers builds reads this flag from the model's text config.
        decode_attention.enable(loaded.model.config.get_text_config(), settings.decode_attention)
        self._vocab_size = int(loaded.model.config.get_text_config().vocab_size)
        self.eos_token_ids = frozenset(loaded.card.eos_token_ids)
        self.context_length = loaded.card.context_length
        self.max_batch = settings.max_batch
        self._slots = threading.BoundedSemaphore(settings.max_batch)
        generation_config = GenerationConfig(
            do_sample=True,
            temperature=_PROCESSOR_DEFAULT_TEMPERATURE,
            top_k=self._vocab_size,
            top_p=_PROCESSOR_DEFAULT_TOP_P,
            max_new_tokens=settings.default_max_output_tokens,
            eos_token_id=list(loaded.card.eos_token_ids) or -1,
            pad_token_id=loaded.tokenizer.pad_token_id,
        )
        self._manager = loaded.model.init_continuous_batching(  # type: ignore[operator]
            generation_config=generation_config,
            continuous_batching_config=self._batching_config(settings, loaded.device),
        )
        self._outputs = OutputMailbox()
        # transformers calls only ``put`` on its router's queue: the mailbox keeps the latest
        # output per request and wakes the publisher only for what goes out at once.
        self._manager.output_router.output_queue = self._outputs
        self.constraints: GrammarConstraints | None = None
        """The grammar matchers of constrained requests; None with structured outputs off."""
        if settings.structured_outputs:
            self.constraints = GrammarConstraints(
                loaded.tokenizer_json, self._vocab_size, list(loaded.card.eos_token_ids)
            )
        self.penalties: Penalties | None = None
        """Generated-token counts of penalised requests; None when this engine's step cannot apply them."""
        self.seeds: Seeds | None = None
        """Seeds and output positions of seeded requests; None when this engine's step cannot apply them."""
        self.top_logprobs: TopLogprobs | None = None
        """The most likely tokens at each position of the requests that ask; None when this engine's
        step cannot record them (it does not run eagerly, or it computes no logprobs)."""
        if self._step_runs_eagerly(self._manager.continuous_batching_config):
            self.penalties = Penalties(self._vocab_size)
            self.seeds = Seeds()
            if settings.logprobs:
                self.top_logprobs = TopLogprobs()
        self.fused_sampling = sampling_step.enable(
            self._manager.logit_processor, self.constraints, self.penalties, self.seeds, self.top_logprobs
        )
        """Whether resq's sampling step replaces transformers' processors (False: an unexpected list)."""
        if not self.fused_sampling:
            # transformers' own step can neither mask nor penalise: such jobs are refused
            self.constraints = None
            self.penalties = None
            self.seeds = None
            self.top_logprobs = None

    @staticmethod
    def _step_runs_eagerly(resolved: ContinuousBatchingConfig) -> bool:
        # What transformers' runner calls pad_inputs (a graph or a compiled step), or a batch
        # prepared before the previous one's tokens exist: either would skip or outrun the
        # host-side row-to-request mapping that penalties read at every step.
        return not (
            any(resolved.cuda_graph_booleans)
            or resolved.varlen_compile_config is not None
            or resolved.decode_compile_config is not None
            or resolved.use_async_batching
        )

    @staticmethod
    def _batching_config(settings: Settings, device: torch.device) -> ContinuousBatchingConfig:
        cache_tokens = settings.kv_cache_tokens
        if cache_tokens is None and device.type != "cuda":
            # Left alone, transformers sizes the cache from ~90% of free RAM on CPU: slow
            # (masks grow with the cache) and an invitation to the OOM killer.
            cache_tokens = CPU_DEFAULT_KV_CACHE_TOKENS
        options: dict[str, Any] = {
            "page_size": settings.kv_page_size,
            "max_batch_tokens": settings.max_batch_tokens,
            "max_requests_per_batch": settings.max_batch,
            "per_request_processors": True,
            "seed": settings.seed,
            "return_logprobs": settings.logprobs,
            # Prefix caching: prompt blocks another request computed are shared, not recomputed.
            "allow_block_sharing": settings.prefix_caching,
        }
        if settings.structured_outputs and device.type == "cuda":
            # Grammar masks are applied by Python code in the step: a replayed CUDA graph would
            # skip it, and a batch prepared ahead would not know the tokens its masks depend on.
            options["use_cuda_graph"] = False
            options["use_async_batching"] = False
        if cache_tokens is not None:
            options["num_blocks"] = math.ceil(cache_tokens / settings.kv_page_size)
        else:
            options["max_memory_percent"] = settings.gpu_memory_fraction
        return ContinuousBatchingConfig(**options)

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread."""
        with torch.inference_mode():
            self._manager.start()

    def stop(self, hard: bool = False) -> None:
        """Stop the engine thread; ``hard`` drops the requests still running instead of finishing them."""
        if self._manager.is_running():
            self._manager.stop(block=True, timeout=10, hard_stop=hard)

    def is_running(self) -> bool:
        """Whether the engine thread is alive."""
        return bool(self._manager.is_running())

    def warm_up(self, timeout_s: float = 120.0) -> bool:
        """Run one short greedy request through the started engine before any job comes, so that
        no first request pays for the engine's first prefill and decode steps (the kernels' first
        runs and the cache's first pages; on a GPU, CUDA's and cuBLAS's lazy initialisation too).

        Call it before the publisher starts: it reads the engine's outputs itself. True when the
        request ended within ``timeout_s``; otherwise it is cancelled and the worker starts all the
        same (the first request then pays what is left).
        """
        prompt = list(
            itertools.islice(
                (t for t in range(self._vocab_size) if t not in self.eos_token_ids), WARM_UP_PROMPT_TOKENS
            )
        )
        job = GenerationJob(
            response_id=WARM_UP_REQUEST_ID,
            model=self._loaded.card.name,
            prompt_token_ids=prompt,
            max_output_tokens=WARM_UP_NEW_TOKENS,
            temperature=0.0,
            top_p=1.0,
        )
        if not self.acquire_slot(0):
            return False
        try:
            self.add(job)
            deadline = time.monotonic() + timeout_s
            while (remaining := deadline - time.monotonic()) > 0:
                for output in self.next_outputs(min(remaining, 0.5)):
                    if output.request_id == WARM_UP_REQUEST_ID and output.is_finished():
                        return output.status != RequestStatus.FAILED
            self.cancel(WARM_UP_REQUEST_ID)
            return False
        finally:
            self.forget(WARM_UP_REQUEST_ID)
            self.release_slot()

    # --- requests ------------------------------------------------------------------------------

    def acquire_slot(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for room in the engine; True when a slot was taken."""
        return bool(self._slots.acquire(timeout=timeout_s))

    def release_slot(self) -> None:
        """Give back the slot of a request that ended."""
        try:
            self._slots.release()
        except ValueError:  # pragma: no cover - a slot released twice is a bug, not a crash
            log.error("engine slot released more often than taken")

    def add(
        self, job: GenerationJob, generated: list[int] | None = None, request_id: str | None = None
    ) -> None:
        """Hand ``job`` to the engine (its slot must be held), as ``request_id`` (default: its response id).

        ``generated``: the tokens a lost worker already generated (the end of ``job``'s
        prompt), which a grammar replays before it constrains what follows, and which
        presence and frequency penalties count as generated. The GPU worker names each claim
        of a job apart (:func:`engine_request_id`), so that a copy of an earlier claim still in
        the engine is never mistaken for the current one.
        """
        request_id = request_id or job.response_id
        penalised = job.presence_penalty != 0 or job.frequency_penalty != 0
        if job.grammar is not None and self.constraints is None:
            raise GrammarRefusedError("this GPU worker does not run grammars (RESQ_STRUCTURED_OUTPUTS)")
        if penalised and self.penalties is None:
            raise PenaltiesRefusedError(
                "this GPU worker does not apply presence_penalty or frequency_penalty "
                "(its engine step runs in a CUDA graph, compiled or batched ahead)"
            )
        wants_alternatives = job.logprobs and job.top_logprobs > 0 and not job.prefill_only
        if wants_alternatives and self.top_logprobs is None:
            raise TopLogprobsRefusedError(
                "this GPU worker does not compute top_logprobs (RESQ_LOGPROBS is off, or its engine "
                "step runs in a CUDA graph, compiled or batched ahead)"
            )
        if job.grammar is not None and self.constraints is not None:
            # A greedy row, or one drawn from its whole distribution, is checked after its choice.
            checkable = job.temperature < GREEDY_BELOW_TEMPERATURE or job.top_p >= 1.0
            self.constraints.add(request_id, job.grammar, generated or [], checkable=checkable)
        if penalised and self.penalties is not None:
            # Before add_request: the engine may schedule the request's first step at once.
            self.penalties.add(request_id, job.frequency_penalty, job.presence_penalty, generated or [])
        if wants_alternatives and self.top_logprobs is not None:
            self.top_logprobs.add(request_id, job.top_logprobs)
        if job.seed is not None:
            if self.seeds is not None:
                self.seeds.add(request_id, job.seed, len(generated or []))
            else:  # best effort, as OpenAI's: the draw comes from the engine's shared stream
                log.info("seed of %s not applied: this engine's step is not eager", request_id)
        prefix_cache.salt(request_id, job.cache_owner)
        if job.temperature < GREEDY_BELOW_TEMPERATURE:
            sampling: dict[str, Any] = {"temperature": 1.0, "top_k": 1, "top_p": 1.0}
        else:
            sampling = {
                "temperature": float(job.temperature),
                "top_k": self._vocab_size,
                "top_p": float(job.top_p),
            }
        steps, ends = job.max_output_tokens, [*self.end_tokens(job), *STEP_FLAGS]
        if job.prefill_only:
            room = self.context_length - len(job.prompt_token_ids)
            steps, ends = max(1, min(PREFILL_ONLY_STEPS, room)), list(STEP_FLAGS)
        try:
            added = self._manager.add_request(
                job.prompt_token_ids,
                request_id=request_id,
                max_new_tokens=steps,
                streaming=True,
                # The step's flags for a row it could not sample, or whose grammar failed, end
                # the request at once (a prefill-only job: only they do).
                eos_token_id=ends,
                **sampling,
            )
        except BaseException:
            self.forget(request_id)
            raise
        if added is None:
            self.forget(request_id)
            raise EngineStoppedError("the engine does not accept requests (stopping or failed)")

    def forget(self, request_id: str) -> None:
        """Drop what the engine kept for a request that ended (its grammar matcher, its token counts)."""
        prefix_cache.forget(request_id)
        if self.constraints is not None:
            self.constraints.forget(request_id)
        if self.penalties is not None:
            self.penalties.forget(request_id)
        if self.seeds is not None:
            self.seeds.forget(request_id)
        if self.top_logprobs is not None:
            self.top_logprobs.forget(request_id)

    def alternatives(self, request_id: str, start: int, stop: int) -> list[Alternatives] | None:
        """The most likely tokens at output positions ``start`` (what is published) to ``stop`` of
        ``request_id`` (this engine copy's); None when it does not ask for them
        (:meth:`gpu_worker.top_logprobs.TopLogprobs.take`)."""
        if self.top_logprobs is None:
            return None
        return self.top_logprobs.take(request_id, start, stop)

    def cached_tokens(self, request_id: str) -> int:
        """Prompt tokens of ``request_id`` whose KV blocks the engine reused instead of computing."""
        return prefix_cache.reused(request_id)

    def end_tokens(self, job: GenerationJob) -> list[int]:
        """The tokens that end ``job``: the model's, and the request's own."""
        return sorted(self.eos_token_ids | set(job.stop_token_ids))

    def cancel(self, request_id: str) -> None:
        """Stop generating ``request_id``; the engine frees its cache at its next step."""
        self._manager.cancel_request(request_id)
        self.forget(request_id)

    def next_outputs(self, timeout_s: float, quiet_until: float = 0.0) -> list[GenerationOutput]:
        """Outputs produced since the last call: waits up to ``timeout_s`` for the first one.

        ``quiet_until`` (``time.monotonic()``): before it, only a request's first tokens or its
        end cut the wait short (:class:`gpu_worker.output_mailbox.OutputMailbox`).

        A request the step flagged non-finite comes out failed (without the flag); the
        failures of a generation loop that died are left out (their requests are handed back).
        """
        outputs = self._outputs.take(timeout_s, quiet_until)
        # Read after the outputs: transformers asks for a hard stop before it fails the requests.
        dying = self._dying()
        return [
            _flagged_as_error(output)
            for output in outputs
            if not (dying and output.status == RequestStatus.FAILED)
        ]

    def _dying(self) -> bool:
        # The generation loop is stopping at once: it died of an exception (or we stopped it hard).
        status = self._manager.background_thread_status
        return status.fatal_error is not None or status.local_status >= BackgroundThreadStatus.HARD_STOP


def _flagged_as_error(output: GenerationOutput) -> GenerationOutput:
    # The flag is the last token of a request it ended (an end token of every request).
    tokens = output.generated_tokens
    if not (output.is_finished() and tokens and tokens[-1] in _FLAG_ERRORS):
        return output
    error = _FLAG_ERRORS[tokens[-1]]
    log.error("ending %s with an error: %s", output.request_id, error)
    kept = len(tokens) - 1
    return dataclasses.replace(
        output,
        generated_tokens=tokens[:kept],
        logprobs=output.logprobs[:kept],
        status=RequestStatus.FAILED,
        error=error,
    )
