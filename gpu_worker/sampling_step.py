"""resq's sampling inside transformers' continuous-batching step.

The engine builds its manager with transformers' per-request temperature,
top-k and top-p processors: they carry each request's settings into the step
(``add_request(temperature=..., top_k=..., top_p=...)`` becomes one row of
``batch_data["logits_processor_args"]`` per processor, one column per sampled
sequence). Running those processors is what costs: two full-vocabulary sorts
per row per step, greedy rows included, then a softmax and a draw for all.

:func:`install` wraps ``ModelRunner._forward_process_and_sample``. For a runner
whose processor list :func:`enable` marked, the step runs the model as
transformers does (carry-over, forward, the logits of the sampled positions in
float32), then chooses the tokens with :func:`gpu_worker.sampling.next_tokens`
from the same argument rows: a request with ``top_k == 1`` is greedy (how the
engine asks for ``temperature: 0``), any other is drawn with its temperature and
top-p (top-k is otherwise unused by resq). With ``return_logprobs`` it also
writes each chosen token's logprob under the model's raw distribution, as
:mod:`gpu_worker.raw_logprobs` does for the unfused step, and records the most likely
tokens of the rows whose requests ask for them (:mod:`gpu_worker.top_logprobs`). Runners that were not
marked (a processor list resq did not expect) run transformers' step unchanged.

When the step is captured in a CUDA graph or compiled (``runner.pad_inputs``),
the sampler takes its branch-free path, since a decision taken on the host at
capture time would be replayed for every later batch.

Constrained decoding happens here too: when :func:`enable` was given the engine's
:class:`gpu_worker.constraints.GrammarConstraints`, the rows of constrained requests drawn
from a nucleus get their grammar masks (filled while the forward pass runs) before the
tokens are chosen; every other constrained row has its token chosen without a mask and
tried by its grammar, and only a row whose token the grammar refuses is masked and chosen
again. Their matchers advance with the chosen tokens. Logprobs stay those of
the model's raw distribution. Rows map to requests through the order in which the
batch was built (``req_id_to_new_token_position``, one entry per sampled row), which
is why the engine turns off CUDA graphs and asynchronous batching while structured
outputs are on: a replayed graph or a batch prepared ahead would skip this code.

Presence and frequency penalties (:mod:`gpu_worker.penalties`) come first: when
:func:`enable` was given the engine's :class:`gpu_worker.penalties.Penalties`, the rows
of penalised requests have their penalties subtracted (a copy of the logits), then the
grammar masks go on, then the tokens are chosen, which the penalised rows' counts take
in. They map rows to requests the same way, so the engine keeps them only while its step
is neither captured nor compiled nor prepared ahead.

A row with nothing finite to choose from (not :attr:`gpu_worker.sampling.Choice.finite`)
is reported as :data:`gpu_worker.sampling.NON_FINITE_TOKEN` in ``output_ids``: the flag
reaches the host with the tokens transformers copies back anyway, without a sync of its
own, and the engine makes that token an end token of every request, so transformers
finishes the request at once and the engine turns it into an error finish. Its logprob,
its penalty count and its grammar matcher take the valid token the sampler chose instead
(the matcher skips it). With asynchronous batching the next batch is built on the device
before the host sees the flag: its carried-over inputs are mapped back to token 0, so the
embedding never meets the flag (the request is over by then).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from transformers.generation.continuous_batching.cb_logits_processors import (
    ContinuousBatchingLogitsProcessorList,
    ContinuousBatchingTemperatureLogitsWarper,
    ContinuousBatchingTopKLogitsWarper,
    ContinuousBatchingTopPLogitsWarper,
)
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingAsyncIOs

from gpu_worker.constraints import ConstrainedRows, GrammarConstraints
from gpu_worker.penalties import Penalties
from gpu_worker.raw_logprobs import raw_distribution, token_logprobs
from gpu_worker.runner_step import Step, wrap_step
from gpu_worker.sampling import GRAMMAR_FAILED_TOKEN, NON_FINITE_TOKEN, STEP_FLAGS, Choice, choose
from gpu_worker.seeds import SeededRow, Seeds
from gpu_worker.top_logprobs import TopLogprobs

log = logging.getLogger(__name__)

_MARK = "_resq_sampling_step"
_PLAN = "_resq_sampling_rows"
_CONSTRAINTS = "_resq_constraints"
_PENALTIES = "_resq_penalties"
_SEEDS = "_resq_seeds"
_TOP_LOGPROBS = "_resq_top_logprobs"


@dataclass(frozen=True)
class ArgumentRows:
    """Which row of ``logits_processor_args`` holds each per-request setting."""

    temperature: int
    top_k: int
    top_p: int


def argument_rows(processors: ContinuousBatchingLogitsProcessorList) -> ArgumentRows | None:
    """The rows of the three per-request settings, or None when the list holds anything else."""
    kinds = [type(processor) for processor in processors.logits_processor]
    expected = {
        ContinuousBatchingTemperatureLogitsWarper,
        ContinuousBatchingTopKLogitsWarper,
        ContinuousBatchingTopPLogitsWarper,
    }
    if len(kinds) != len(expected) or set(kinds) != expected:
        return None
    # Every processor here is a per-request one, so its argument row is its position.
    return ArgumentRows(
        temperature=kinds.index(ContinuousBatchingTemperatureLogitsWarper),
        top_k=kinds.index(ContinuousBatchingTopKLogitsWarper),
        top_p=kinds.index(ContinuousBatchingTopPLogitsWarper),
    )


def enable(
    processors: ContinuousBatchingLogitsProcessorList,
    constraints: GrammarConstraints | None = None,
    penalties: Penalties | None = None,
    seeds: Seeds | None = None,
    top_logprobs: TopLogprobs | None = None,
) -> bool:
    """Let the runners that use ``processors`` sample with resq's step (with ``constraints``,
    ``penalties``, ``seeds`` and ``top_logprobs``); False when it cannot."""
    rows = argument_rows(processors)
    if rows is None:
        log.warning(
            "unexpected logits processors %s: sampling with transformers' processors (slower)",
            [type(processor).__name__ for processor in processors.logits_processor],
        )
        return False
    setattr(processors, _PLAN, rows)
    setattr(processors, _CONSTRAINTS, constraints)
    setattr(processors, _PENALTIES, penalties)
    setattr(processors, _SEEDS, seeds)
    setattr(processors, _TOP_LOGPROBS, top_logprobs)
    return True


def _row_request_ids(runner: Any) -> list[str]:
    # One entry per sampled row, in row order (transformers builds logits_indices in this order).
    return list(runner.inputs_and_outputs.req_id_to_new_token_position)


class RowSettings(NamedTuple):
    """Each row's draw settings, read from a step's argument rows (in :func:`choose`'s order)."""

    temperature: torch.Tensor
    """float32 [n]."""
    top_p: torch.Tensor
    """float32 [n]."""
    greedy: torch.Tensor
    """bool [n]."""


def row_settings(arguments: torch.Tensor, rows: ArgumentRows, count: int) -> RowSettings:
    """The settings of the first ``count`` rows of a step's argument rows [k, >= count] (int32)."""
    return RowSettings(
        temperature=arguments[rows.temperature, :count].view(dtype=torch.float32),
        top_p=arguments[rows.top_p, :count].view(dtype=torch.float32),
        greedy=arguments[rows.top_k, :count] == 1,
    )


def _checked_choice(
    constraints: GrammarConstraints,
    constrained: ConstrainedRows,
    choice: Choice,
    scores: torch.Tensor,
    settings: RowSettings,
    graph_safe: bool,
    seeded: list[SeededRow] | None,
) -> tuple[Choice, list[int]]:
    """``choice`` once the grammars checked their rows' tokens, with every refused row chosen again
    from its masked logits; and the reported token of every row, on the host.

    A seeded row is drawn again with its own noise, which picks what a mask applied first would
    have picked; any other row's redraw is fresh noise, exact in distribution (see
    :mod:`gpu_worker.constraints`).
    """
    reported = reported_tokens(choice).tolist()
    refused = constraints.check(constrained, reported)
    if not refused:
        return choice, reported
    index = torch.tensor(refused, device=scores.device)
    masked = constraints.mask_refused(constrained, scores[index])
    position = {row: at for at, row in enumerate(refused)}
    again = choose(
        masked,
        settings.temperature[index],
        settings.top_p[index],
        settings.greedy[index],
        graph_safe=graph_safe,
        seeded=[
            SeededRow(position[entry.row], entry.generator_seed)
            for entry in seeded or ()
            if entry.row in position
        ],
    )
    for row, token in zip(refused, reported_tokens(again).tolist(), strict=True):
        reported[row] = token
    merged = Choice(
        choice.tokens.index_put((index,), again.tokens), choice.finite.index_put((index,), again.finite)
    )
    return merged, reported


def reported_tokens(choice: Choice) -> torch.Tensor:
    """The tokens the step reports: :data:`NON_FINITE_TOKEN` for the rows that are not finite."""
    return choice.tokens.where(choice.finite, NON_FINITE_TOKEN)


def install() -> None:
    """Wrap the continuous-batching step of every runner (idempotent); only enabled runners change."""

    def wrap(previous: Step) -> Step:
        def forward_process_and_sample(
            self: Any,
            model: Any,
            batch_data: dict[str, Any],
            carry_over_ids: torch.Tensor,
            prev_output_ids: torch.Tensor,
            output_ids: torch.Tensor,
        ) -> None:
            rows: ArgumentRows | None = getattr(self.logit_processor, _PLAN, None)
            if rows is None:
                previous(self, model, batch_data, carry_over_ids, prev_output_ids, output_ids)
                return
            constraints: GrammarConstraints | None = getattr(self.logit_processor, _CONSTRAINTS, None)
            penalties: Penalties | None = getattr(self.logit_processor, _PENALTIES, None)
            seeds: Seeds | None = getattr(self.logit_processor, _SEEDS, None)
            top: TopLogprobs | None = getattr(self.logit_processor, _TOP_LOGPROBS, None)
            constrained = None
            penalised = None
            seeded = None
            top_rows = None
            if (
                (constraints is not None and len(constraints))
                or (penalties is not None and len(penalties))
                or (seeds is not None and len(seeds))
                or (top is not None and len(top))
            ):
                row_request_ids = _row_request_ids(self)
                if constraints is not None and len(constraints):
                    constrained = constraints.start_masks(row_request_ids, output_ids.device)
                if penalties is not None and len(penalties):
                    penalised = penalties.rows(row_request_ids, output_ids.device)
                if seeds is not None and len(seeds):
                    seeded = seeds.rows(row_request_ids)
                if top is not None and len(top):
                    top_rows = top.rows(row_request_ids, output_ids.device)
            # As transformers' step (model_runner.py, 5.x), up to the processed logits.
            self.inputs_and_outputs.carry_over_tokens(
                batch_data["input_ids"], carry_over_ids, prev_output_ids
            )
            if isinstance(self.inputs_and_outputs, ContinuousBatchingAsyncIOs):
                # A carried-over flag is not a token id; its request ends at this batch's update.
                input_ids = batch_data["input_ids"]
                input_ids.masked_fill_(input_ids >= min(STEP_FLAGS), 0)
            logits = model(**batch_data).logits
            if "logits_to_keep" not in batch_data:
                logits = logits[:, batch_data["logits_indices"], :]
            logits = logits[0].float()
            # Penalties, then masks (-inf stays -inf under any penalty), each on a copy: logprobs
            # below are those of the model's raw distribution.
            scores = logits
            if penalties is not None and penalised is not None:
                scores = penalties.apply(penalised, scores)
            if constraints is not None and constrained is not None:
                scores = constraints.apply(constrained, scores)
            settings = row_settings(batch_data["logits_processor_args"], rows, scores.shape[0])
            graph_safe = bool(self.pad_inputs)
            choice = choose(scores, *settings, graph_safe=graph_safe, seeded=seeded)
            failed: list[int] = []
            if constraints is not None and constrained is not None:
                choice, chosen = _checked_choice(
                    constraints, constrained, choice, scores, settings, graph_safe, seeded
                )
                failed = constraints.advance(constrained, chosen)
            tokens = choice.tokens
            reported = reported_tokens(choice)
            if failed:
                reported = reported.index_fill(
                    0, torch.tensor(failed, device=reported.device), GRAMMAR_FAILED_TOKEN
                )
            if penalties is not None and penalised is not None:
                penalties.count(penalised, tokens)
            count = tokens.shape[0]
            output_ids[0, :count].copy_(reported)
            if self.return_logprobs:
                distribution = raw_distribution(logits)
                logprobs = token_logprobs(distribution, tokens)
                output_ids[1, :count].copy_(logprobs.view(dtype=torch.int32))
                if top is not None and top_rows is not None:
                    top.record(top_rows, distribution)

        return forward_process_and_sample

    wrap_step(_MARK, wrap)
