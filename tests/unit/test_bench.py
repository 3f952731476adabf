"""The bench's own pure logic: statistics, alternation, tables, targets, the document markers."""

from __future__ import annotations

import sys
from pathlib import Path

import psutil
import pytest

from bench.clients import _Frames
from bench.document import BEGIN, END, replace_results
from bench.plan import Plan
from bench.report import (
    Table,
    Target,
    b1_ratio_table,
    b1_table,
    b2_table,
    b4_table,
    b5_ratio,
    b5_ratios,
    b5_table,
    b7_table,
    targets,
    to_markdown,
)
from bench.results import ResultSet, RunRecord
from bench.stats import alternated, median, percentile, ratio
from bench.systems import serve_device


def test_median_of_odd_and_even_counts() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5


def test_percentile_interpolates_like_numpy_linear() -> None:
    values = [float(v) for v in range(1, 11)]  # 1..10
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 10.0
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile([7.0], 99) == 7.0


def test_percentile_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_ratio_is_none_when_a_side_is_missing_or_zero() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None
    assert ratio(3.0, None) is None
    assert ratio(3.0, 0.0) is None


def test_alternation_puts_every_system_in_every_position() -> None:
    systems = ["resq", "direct", "serve"]
    orders = [alternated(systems, round_index) for round_index in range(3)]
    assert orders == [["resq", "direct", "serve"], ["direct", "serve", "resq"], ["serve", "resq", "direct"]]
    for position in range(3):
        assert {order[position] for order in orders} == set(systems)
    assert alternated(["a", "b"], 1) == ["b", "a"]
    assert alternated(["a", "b"], 2) == ["a", "b"]
    assert alternated([], 5) == []


def test_results_take_medians_over_rounds_and_pool_samples() -> None:
    results = ResultSet()
    for round_index, (tok_s, ttfts) in enumerate([(100.0, [1.0, 2.0]), (300.0, [3.0]), (200.0, [4.0])]):
        results.add(RunRecord("B1", "resq", "tiny", 8, round_index, {"tok_s": tok_s}, {"ttft_ms": ttfts}))
    results.add(RunRecord("B1", "direct", "tiny", 8, 0, {"tok_s": 250.0}))
    assert results.scalar("B1", "resq", "tok_s", "tiny", 8) == 200.0
    assert results.pooled("B1", "resq", "ttft_ms", 50, "tiny", 8) == 2.5
    assert results.scalar("B1", "resq", "tok_s", "tiny", 32) is None
    assert results.scalar("B1", "resq", "tok_s", "bench", 8) is None
    row = b1_table(results).rows[0]
    assert row == ["tiny", "8", "200.0", "250.0", "-", "-", "-"]
    # Only round 0 ran both: the ratio is that round's (100 / 250), not the medians' (200 / 250).
    assert b1_ratio_table(results).rows[0][:3] == ["tiny", "8", "0.40 -> 0.40x"]


def test_every_ratio_is_the_median_of_per_round_ratios() -> None:
    """The issue's case: dividing medians of different rounds said 1.40x; paired, 1.17x."""
    results = ResultSet()
    for round_index, (resq, serve) in enumerate([(114.0, 100.0), (234.0, 200.0), (145.0, 100.0)]):
        results.add(RunRecord("B1", "resq", "tiny", 32, round_index, {"tok_s": resq}))
        results.add(RunRecord("B1", "serve", "tiny", 32, round_index, {"tok_s": serve}))
    assert results.per_round_ratios("B1", "resq", "serve", "tok_s", "tiny", 32) == [1.14, 1.17, 1.45]
    assert results.paired_ratio("B1", "resq", "serve", "tok_s", "tiny", 32) == 1.17
    unpaired = results.scalar("B1", "resq", "tok_s", "tiny", 32) / results.scalar(
        "B1", "serve", "tok_s", "tiny", 32
    )
    assert round(unpaired, 2) == 1.45  # what dividing medians says: another number
    assert b1_ratio_table(results).rows[0][5] == "1.14, 1.17, 1.45 -> 1.17x"
    target = next(
        found
        for found in targets(results)
        if "tiny 32 clients: resq / transformers serve (resq's" in found.name
    )
    assert target.measured == 1.17


def test_results_survive_a_save_and_load(tmp_path) -> None:
    results = ResultSet([RunRecord("B3", "pp1", "tiny", 64, 1, {"events_s": 5.0})], {"cores": 2})
    results.save(tmp_path / "r.json")
    loaded = ResultSet.load(tmp_path / "r.json")
    assert loaded.records == results.records
    assert loaded.context == {"cores": 2}


def test_target_verdicts_say_met_or_missed_and_by_how_much() -> None:
    assert Target("t", 0.9, 0.8, "min").verdict() == "met (+12%)"
    assert Target("t", 0.4, 0.8, "min").verdict() == "MISSED (-50%)"
    assert Target("t", 4.0, 5.0, "max").verdict() == "met (+20%)"
    assert Target("t", 15.0, 10.0, "max").verdict() == "MISSED (-50%)"
    assert Target("t", None, 10.0, "max").verdict() == "not measured"
    # Within a percent of the bound, the sign still shows.
    assert Target("t", 0.8466, 0.85, "min").verdict() == "MISSED (-0.4%)"
    assert Target("t", 0.8521, 0.85, "min").verdict() == "met (+0.2%)"
    assert Target("t", 10.0, 10.0, "max").met is True


def test_markdown_table_has_header_separator_and_rows() -> None:
    text = to_markdown(Table("T", ["a", "b"], [["1", "2"], ["3", "4"]]))
    assert text.splitlines() == ["**T**", "", "| a | b |", "|---|---|", "| 1 | 2 |", "| 3 | 4 |"]


def test_document_keeps_the_prose_around_the_markers() -> None:
    document = f"# B\n\nintro\n\n{BEGIN}\nold figures\n{END}\n\nanalysis\n"
    updated = replace_results(document, "new figures")
    assert updated == f"# B\n\nintro\n\n{BEGIN}\nnew figures\n{END}\n\nanalysis\n"
    assert replace_results("# B\n", "x").endswith(f"{BEGIN}\nx\n{END}\n")


def test_quick_plan_is_smaller_and_counts_its_runs() -> None:
    full, quick = Plan(), Plan().quick
    assert quick.rounds < full.rounds and quick.b1_tokens < full.b1_tokens
    # B1: 3 concurrencies x 5 systems (resq, the engine alone, upstream transformers, transformers
    # serve at resq's sizes and at its own defaults), B2: 4 systems (resq, the engine alone, the HTTP
    # floor, transformers serve), per model and round; B3: 3 per round; B4: 2 systems x 3
    # concurrencies per round, plus the held-streams run; B5: 2 kinds per model and round.
    assert full.runs() == (15 + 4) * 2 * 3 + 3 * 3 + 2 * 3 * 3 + 1 + 2 * 2 * 3
    assert Plan(with_serve=False).runs() == (9 + 3) * 2 * 3 + 3 * 3 + 2 * 3 * 3 + 1 + 2 * 2 * 3


def test_b5_pairs_the_kinds_of_each_round_and_takes_the_median_of_the_ratios() -> None:
    results = ResultSet()
    rates = [(100.0, 90.0), (200.0, 100.0), (100.0, 95.0)]  # (plain, structured) per round
    for round_index, (plain, structured) in enumerate(rates):
        results.add(RunRecord("B5", "plain", "bench", 32, round_index, {"tok_s": plain}, {"ttft_ms": [10.0]}))
        results.add(
            RunRecord(
                "B5", "structured", "bench", 32, round_index, {"tok_s": structured}, {"ttft_ms": [12.0]}
            )
        )
    mask = {"us_per_token": 60.0, "ms_per_step": 2.0, "masked_share": 0.25}
    results.add(RunRecord("B5mask", "structured", "bench", 32, 0, mask))
    assert b5_ratios(results, "bench") == [0.9, 0.5, 0.95]
    # Paired per round: the median of the ratios (0.9), not the ratio of medians (95 / 100).
    assert b5_ratio(results, "bench") == 0.9
    (row,) = b5_table(results).rows
    assert row[:4] == ["bench", "32", "0.90, 0.50, 0.95", "0.90x"] and row[-2:] == ["60.0", "25%"]
    (target,) = [found for found in targets(results) if found.name.startswith("B5")]
    assert target.met is True


def test_sse_frames_are_split_across_chunk_boundaries() -> None:
    frames = _Frames()
    assert frames.feed(b"event: a\ndata: 1\n\nevent: b\nda") == [b"event: a\ndata: 1"]
    assert frames.feed(b"ta: 2\n") == []
    assert frames.feed(b"\n") == [b"event: b\ndata: 2"]


def test_nothing_served_imports_the_bench() -> None:
    from tests.unit.test_boundaries import ROOT, imported_modules

    for folder in ("resq", "api", "workers", "gpu_worker"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == ROOT / "resq" / "cli.py":  # `resq bench` imports it lazily, by design
                continue
            assert "bench" not in imported_modules(path), f"{path} imports the bench"


def _agent_loop(
    system: str, round_index: int, ttft_ms: list[float], inputs: list[int], cached: list[int], wall_s: float
):
    from bench.agent_loop import LoopRun, Turn

    turns = [
        Turn(ttft / 1000, ttft / 1000 + 0.1, prompt, hit, 16, f"resp_{system}_{round_index}_{index}")
        for index, (ttft, prompt, hit) in enumerate(zip(ttft_ms, inputs, cached, strict=True))
    ]
    return LoopRun(system, round_index, turns, wall_s)


def test_agent_loop_requests_chain_turns_and_resend_the_fixed_prefix() -> None:
    from bench.agent_loop import LoopShape, create_params

    shape = LoopShape(turns=3, instructions_chars=500, turn_chars=100, max_output_tokens=16)
    first = create_params("bench-bench", "s1", 0, None, shape)
    second = create_params("bench-bench", "s1", 1, "resp_1", shape)
    assert "previous_response_id" not in first and second["previous_response_id"] == "resp_1"
    assert first["instructions"] == second["instructions"] and first["instructions"].startswith("Session s1.")
    assert first["prompt_cache_key"] == second["prompt_cache_key"]
    assert (first["max_output_tokens"], first["temperature"], "stream" in first) == (16, 0, False)
    assert first["input"] == [{"role": "user", "content": first["input"][0]["content"]}]
    call, output = second["input"]
    assert call["type"] == "function_call" and output["type"] == "function_call_output"
    assert call["call_id"] == output["call_id"] and len(output["output"]) == 100
    assert output["output"] != first["input"][0]["content"]
    # Another session: another tag in front, so no KV block of one loop serves another.
    assert create_params("bench-bench", "s2", 0, None, shape)["instructions"] != first["instructions"]


def test_a_resending_loop_sends_the_whole_conversation_unstored() -> None:
    from bench.agent_loop import LoopShape, create_params, resent_params

    shape = LoopShape(turns=3, instructions_chars=500, turn_chars=100, max_output_tokens=16)
    history = [{"role": "user", "content": "first"}, {"type": "message", "role": "assistant", "content": []}]
    resent = resent_params("bench-bench", "s1", 1, history, shape)
    chained = create_params("bench-bench", "s1", 1, None, shape)
    assert resent["input"] == [*history, *chained["input"]] and resent["store"] is False
    assert "previous_response_id" not in resent
    assert {key: value for key, value in resent.items() if key not in ("input", "store")} == {
        key: value for key, value in chained.items() if key != "input"
    }


def test_agent_loop_reader_times_the_first_text_delta_and_reads_usage() -> None:
    from bench.agent_loop import AgentLoopError, TurnReader

    reader = TurnReader(sent=10.0)
    assert reader.feed({"type": "response.created"}, 10.1) is None
    assert reader.feed({"type": "response.output_text.delta", "delta": "a"}, 10.25) is None
    assert reader.feed({"type": "response.output_text.delta", "delta": "b"}, 10.3) is None
    usage = {"input_tokens": 900, "output_tokens": 16, "input_tokens_details": {"cached_tokens": 640}}
    turn = reader.feed({"type": "response.completed", "response": {"id": "resp_x", "usage": usage}}, 10.5)
    assert turn is not None and turn.ttft_s == pytest.approx(0.25) and turn.total_s == pytest.approx(0.5)
    assert (turn.input_tokens, turn.cached_tokens, turn.output_tokens, turn.response_id) == (
        900,
        640,
        16,
        "resp_x",
    )
    with pytest.raises(AgentLoopError):
        TurnReader(0.0).feed({"type": "error", "status": 400, "error": {"message": "no"}}, 1.0)
    with pytest.raises(AgentLoopError):
        TurnReader(0.0).feed({"type": "response.failed", "response": {"error": {"code": "x"}}}, 1.0)


def test_agent_loop_pairs_each_round_and_judges_the_targets() -> None:
    from bench.agent_loop import OFF, ON, WS, agent_targets, rounds_table, ttft_ratios, turns_table, ws_ratios

    results = ResultSet()
    inputs = [1000, 1300, 1600]
    for round_index, (off_ms, on_ms, http_s, ws_s) in enumerate(
        [(400.0, 100.0, 3.0, 2.0), (900.0, 100.0, 3.0, 2.8), (500.0, 100.0, 3.0, 2.4)]
    ):
        results.add(
            _agent_loop(OFF, round_index, [90.0, 200.0, off_ms], inputs, [0, 0, 0], 5.0).record("bench")
        )
        results.add(
            _agent_loop(ON, round_index, [90.0, 80.0, on_ms], inputs, [0, 960, 1280], http_s).record("bench")
        )
        results.add(
            _agent_loop(WS, round_index, [85.0, 75.0, 95.0], inputs, [0, 960, 1280], ws_s).record("bench")
        )
    assert ttft_ratios(results, "bench") == [4.0, 9.0, 5.0]
    assert ws_ratios(results, "bench") == pytest.approx([1.5, 3.0 / 2.8, 1.25])
    ttft, cached, speed = agent_targets(results, "bench")
    assert ttft.measured == 5.0 and ttft.met is True
    # The last turn shares turn 2's 1300-token prompt: 20 whole pages of 64 = 1280 tokens, all reused.
    assert cached.measured == 1.0 and cached.met is True
    assert speed.measured == pytest.approx(1.25) and speed.met is True
    *per_round, medians = rounds_table(results, "bench").rows
    assert [row[4] for row in per_round] == ["4.00x", "9.00x", "5.00x"]
    assert medians[4] == "4.00, 9.00, 5.00 -> 5.00x" and medians[5] == "1,280 / 1,300"
    rows = turns_table(results, "bench").rows
    assert [row[:4] for row in rows] == [
        ["1", "1,000", "0", "0"],
        ["2", "1,300", "1,000", "960"],
        ["3", "1,600", "1,300", "1,280"],
    ]
    assert rows[2][4] == "80%" and rows[2][5] == "98%"


def test_agent_loop_misses_when_the_ratios_fall_short() -> None:
    from bench.agent_loop import OFF, ON, WS, agent_targets

    results = ResultSet()
    results.add(_agent_loop(OFF, 0, [100.0, 150.0], [1000, 1300], [0, 0], 3.0).record("bench"))
    results.add(_agent_loop(ON, 0, [100.0, 100.0], [1000, 1300], [0, 640], 3.0).record("bench"))
    results.add(_agent_loop(WS, 0, [100.0, 100.0], [1000, 1300], [0, 640], 2.9).record("bench"))
    verdicts = [target.verdict() for target in agent_targets(results, "bench")]
    assert verdicts == ["MISSED (-50%)", "MISSED (-33%)", "MISSED (-14%)"]


def test_agent_loop_http_loops_of_a_round_share_a_session_and_the_socket_has_its_own() -> None:
    from bench.agent_loop import OFF, ON, WS, session_tag

    assert session_tag("t", 0, ON) == session_tag("t", 0, OFF) != session_tag("t", 0, WS)
    assert session_tag("t", 0, ON) != session_tag("t", 1, ON) != session_tag("t", -1, ON)


def test_agent_loop_silences_the_tokens_that_stream_no_text() -> None:
    from types import SimpleNamespace

    from bench.agent_loop import silent_token_ids

    pieces = ["a", "\ufffd", "", "<think>", " b", "\n"]

    class FakeTokenizer:
        def get_added_tokens_decoder(self):
            return {3: SimpleNamespace(content="<think>")}

        def get_vocab_size(self, with_added_tokens: bool) -> int:
            return len(pieces)

        def decode(self, ids, skip_special_tokens: bool) -> str:
            return pieces[ids[0]]

    assert silent_token_ids(FakeTokenizer()) == [1, 2, 3]


def test_agent_loop_reads_events_from_sse_frames_and_skips_done_and_pings() -> None:
    from bench.agent_loop import event_of_frame

    assert event_of_frame(b'event: response.created\ndata: {"type":"response.created"}') == {
        "type": "response.created"
    }
    assert event_of_frame(b"data: [DONE]") is None
    assert event_of_frame(b": ping") is None


def test_the_warm_up_includes_a_round_as_wide_as_the_widest_measured_one() -> None:
    from bench.plan import Plan
    from bench.runner import WARMUP_CONCURRENCY, warm_up_widths

    assert warm_up_widths(Plan()) == (WARMUP_CONCURRENCY, 64)
    narrow = Plan(b1_concurrencies=(1, 4), b4_concurrencies=(1,))
    assert warm_up_widths(narrow) == (WARMUP_CONCURRENCY,)


def test_the_affinity_hit_rate_is_read_from_the_api_metrics() -> None:
    from bench.affinity import hit_rate, routed_counts

    page = (
        "# HELP resq_affinity_routed_total ...\n"
        'resq_affinity_routed_total{outcome="hit"} 144.0\n'
        'resq_affinity_routed_total{outcome="none"} 16.0\n'
        'resq_affinity_routed_total{outcome="fallback"} 0.0\n'
        'resq_affinity_routed_created{outcome="hit"} 1.7e+09\n'
    )
    counts = routed_counts(page)
    assert counts == {"hit": 144.0, "none": 16.0, "fallback": 0.0}
    assert hit_rate({}, counts) == 0.9
    assert hit_rate(counts, counts) is None
    assert hit_rate({"hit": 100.0}, {"hit": 110.0, "fallback": 10.0}) == 0.5


def test_b1_and_b2_targets_are_judged_on_every_model_against_every_baseline() -> None:
    results = ResultSet()
    for model in ("tiny", "bench"):
        for system, rate in (("resq", 90.0), ("direct", 100.0), ("upstream", 120.0), ("serve", 60.0), ("serve-defaults", 45.0)):  # fmt: skip
            results.add(RunRecord("B1", system, model, 32, 0, {"tok_s": rate}))
    found = {target.name: target for target in targets(results)}
    for model in ("tiny", "bench"):
        assert found[f"B1 {model} 32 clients: resq / direct engine (median of per-round ratios)"].met is True
        upstream = found[f"B1 {model} 32 clients: resq / upstream transformers (median of per-round ratios)"]
        assert upstream.measured == 0.75 and upstream.met is False
        assert found[f"B1 {model} 32 clients: resq / transformers serve (resq's sizes) (median of per-round ratios)"].met is True  # fmt: skip
        defaults = found[f"B1 {model} 32 clients: resq / transformers serve (its defaults) (median of per-round ratios)"]  # fmt: skip
        assert defaults.measured == 2.0 and defaults.met is True
        assert f"B2 {model} 1 client: TTFT overhead p50" in found
    ratios = b1_ratio_table(results).rows[0]
    assert ratios[2:] == ["0.90 -> 0.90x", "0.75 -> 0.75x", "0.83 -> 0.83x", "1.50 -> 1.50x", "2.00 -> 2.00x"]


def test_b2_reads_the_overhead_above_the_http_floor_beside_the_overhead_the_target_judges() -> None:
    results = ResultSet()
    for system, ttft in (("resq", 12.0), ("direct", 3.0), ("floor", 2.0), ("serve", 8.0)):
        results.add(RunRecord("B2", system, "tiny", 1, 0, {}, {"ttft_ms": [ttft]}))
    table = b2_table(results)
    row = table.rows[0]
    assert table.headers[4] == "overhead" and row[4] == "9.0"  # the target's: resq minus the engine alone
    assert table.headers[-2:] == ["HTTP floor p50", "p50 overhead above the floor"]
    assert row[-2:] == ["2.0", "7.0"]
    found = {target.name: target for target in targets(results)}
    assert found["B2 tiny 1 client: TTFT overhead p50"].measured == 9.0


def test_b7_compares_cpu_outside_the_engine_paired_per_round() -> None:
    results = ResultSet()
    for round_index, (resq, serve) in enumerate([(30.0, 20.0), (24.0, 20.0), (40.0, 20.0)]):
        for system, server in (("resq", resq), ("serve", serve)):
            metrics = {"tok_s": 1.0, "server_cpu_us_per_token": server, "engine_cpu_us_per_token": 100.0}
            results.add(RunRecord("B1", system, "tiny", 32, round_index, metrics))
    b7 = next(
        found for found in targets(results) if found.name.startswith("B7") and "resq's sizes" in found.name
    )
    assert b7.measured == 1.5 and b7.met is False
    row = b7_table(results).rows[0]
    assert row[:5] == ["tiny", "32", "30.0", "20.0", "-"]
    assert row[8] == "1.50, 1.20, 2.00 -> 1.50x"


def test_b4_is_judged_against_the_floor_at_the_widest_load() -> None:
    results = ResultSet()
    for clients, (resq, floor) in ((1, (300.0, 100.0)), (64, (50.0, 30.0))):
        results.add(RunRecord("B4", "resq", "tiny", clients, 0, {"cpu_us_per_token": resq}))
        results.add(RunRecord("B4", "floor", "tiny", clients, 0, {"cpu_us_per_token": floor}))
    b4 = [found for found in targets(results) if found.name.startswith("B4")]
    assert len(b4) == 1 and "64 clients" in b4[0].name
    assert b4[0].measured == pytest.approx(50 / 30) and b4[0].met is True


def test_b4_also_compares_cpu_per_delta_frame_when_resq_packs_tokens() -> None:
    """With a stream interval resq sends several tokens per frame: per token it may beat a floor
    that sends one frame per token, so the table also says what each costs per frame."""
    results = ResultSet()
    for round_index, frame_ratio in enumerate((2.0, 3.0, 4.0)):
        resq = {"cpu_us_per_token": 20.0, "cpu_us_per_frame": 30.0 * frame_ratio, "tokens_per_frame": 5.0}
        floor = {"cpu_us_per_token": 30.0, "cpu_us_per_frame": 30.0, "tokens_per_frame": 1.0}
        results.add(RunRecord("B4", "resq", "tiny", 64, round_index, resq))
        results.add(RunRecord("B4", "floor", "tiny", 64, round_index, floor))
    row = b4_table(results).rows[0]
    assert row == [
        "64 clients",
        "20.0",
        "30.0",
        "0.67, 0.67, 0.67 -> 0.67x",
        "5.0",
        "2.00, 3.00, 4.00 -> 3.00x",
    ]


def test_cpu_split_counts_the_engine_threads_apart() -> None:
    from bench.cpu_accounting import split

    before = {(1, 10): 5.0, (1, 11): 1.0, (2, 20): 0.5}
    after = {(1, 10): 9.0, (1, 11): 1.5, (2, 20): 0.75, (2, 21): 0.25}  # (2, 21) began during the run
    spent = split(before, after, {(1, 10)}, {1: "gpu-worker", 2: "api"})
    assert spent.engine_s == 4.0
    assert spent.server_s == pytest.approx(0.5 + 0.25 + 0.25)
    assert spent.server_s_by_label == pytest.approx({"gpu-worker": 0.5, "api": 0.5})


def test_thread_times_read_each_thread_to_the_nanosecond_not_in_whole_clock_ticks() -> None:
    """B7 reads every thread's CPU: psutil's Linux figures are whole 10 ms ticks per thread, which
    over a stack's ~100 threads blurred a round's figure; ``schedstat`` counts nanoseconds."""
    import os
    import threading
    import time

    from bench.cpu_accounting import SCHEDSTAT, thread_times

    if not SCHEDSTAT:
        pytest.skip("this kernel has no per-thread schedstat")
    burnt: list[float] = []
    measured = threading.Event()
    ready = threading.Event()
    tid: list[int] = []

    def burn_then_wait() -> None:
        tid.append(threading.get_native_id())
        began = time.thread_time()
        while time.thread_time() - began < 0.023:  # 23 ms: not a whole number of ticks
            pass
        burnt.append(time.thread_time())
        ready.set()
        measured.wait(10)

    worker = threading.Thread(target=burn_then_wait)
    worker.start()
    try:
        assert ready.wait(10)
        # The thread sleeps now, so the scheduler's count is final: it equals the thread's own clock.
        read = thread_times([os.getpid()])[(os.getpid(), tid[0])]
        assert read == pytest.approx(burnt[0], abs=0.001)
        assert read * 100 != pytest.approx(round(read * 100), abs=0.01)  # not a whole tick
    finally:
        measured.set()
        worker.join()


def test_engine_threads_are_found_by_the_generation_loop_name() -> None:
    """py-spy names transformers' generation thread in this very process (needs ptrace rights)."""
    import os
    import threading

    from bench.cpu_accounting import (
        ENGINE_LOOP,
        EngineThreadNotFoundError,
        PySpyUnavailableError,
        engine_threads,
    )

    stop = threading.Event()

    def loop() -> None:
        stop.wait(30)

    loop.__name__ = ENGINE_LOOP
    thread = threading.Thread(target=loop)
    thread.start()
    try:
        try:
            found = engine_threads(os.getpid())
        except PySpyUnavailableError as error:
            pytest.skip(str(error))
        assert found == {thread.native_id}
    finally:
        stop.set()
        thread.join()
    with pytest.raises(EngineThreadNotFoundError, match="runs no"):
        engine_threads(os.getpid())


_CHILD_WITH_AN_ENGINE_THREAD = """
import os, sys, threading
def _run_generation_loop():
    sys.stdin.readline()
thread = threading.Thread(target=_run_generation_loop)
thread.start()
print(os.getpid(), thread.native_id, flush=True)
thread.join()
"""

_PARENT_OF_IT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdin=sys.stdin, stdout=sys.stdout)
sys.exit(child.wait())
"""


def test_engine_threads_are_found_in_a_spawned_model_process() -> None:
    """``transformers serve`` >= 5.25 runs its engine in a process it spawns: found there, by pid."""
    import subprocess
    import sys

    from bench.cpu_accounting import (
        EngineThreadNotFoundError,
        PySpyUnavailableError,
        engine_thread_keys,
        engine_threads,
    )

    # A server process (no engine thread of its own) whose one child runs the engine thread.
    server = subprocess.Popen(
        [sys.executable, "-c", _PARENT_OF_IT, _CHILD_WITH_AN_ENGINE_THREAD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert server.stdout is not None and server.stdin is not None
        child_pid, engine_tid = (int(value) for value in server.stdout.readline().split())
        try:
            engine_threads(child_pid)
        except PySpyUnavailableError as error:
            pytest.skip(str(error))
        with pytest.raises(EngineThreadNotFoundError, match="runs no"):
            engine_threads(server.pid)
        assert engine_thread_keys(server.pid) == {(child_pid, engine_tid)}
    finally:
        if server.stdin is not None:
            server.stdin.close()
        server.wait(10)


def test_the_stream_interval_table_pairs_each_interval_with_the_first_per_round() -> None:
    from bench.stream_interval import SCENARIO, interval_table, system_name

    results = ResultSet()
    for round_index, (off, on) in enumerate([(1000.0, 1500.0), (1000.0, 2000.0), (800.0, 1600.0)]):
        for interval, tok_s, cpu in ((0, off, 400.0), (50, on, 100.0 * (round_index + 1))):
            metrics = {
                "tok_s": tok_s,
                "server_cpu_us_per_token": cpu,
                "tokens_per_frame": 1.0 + interval / 10,
            }
            results.add(RunRecord(SCENARIO, system_name(interval), "tiny", 32, round_index, metrics))
    table = interval_table(results, [0, 50], "tiny", 32)
    first, second = table.rows
    assert first[0] == "0 ms" and first[-2:] == ["-", "-"]
    assert second[:3] == ["50 ms", "1,600", "6.0"]
    assert second[-2:] == ["1.50, 2.00, 2.00 -> 2.00x", "0.25, 0.50, 0.75 -> 0.50x"]


def test_the_placement_table_pairs_inline_with_the_workers_per_round() -> None:
    from bench.placement import SCENARIO, placement_table, system_name

    results = ResultSet()
    for round_index, (workers_cpu, inline_cpu) in enumerate([(160.0, 120.0), (150.0, 135.0), (200.0, 100.0)]):
        for count, cpu in ((2, workers_cpu), (0, inline_cpu)):
            metrics = {"tok_s": 2000.0 + count, "server_cpu_us_per_token": cpu}
            if count:
                metrics["server_cpu_us_per_token:postprocess"] = cpu / 3
            results.add(RunRecord(SCENARIO, system_name(count), "tiny", 32, round_index, metrics))
    table = placement_table(results, [2, 0], "tiny", 32)
    workers, inline = table.rows
    assert table.headers[0] == "post-processing"
    assert workers[0] == "2 post-process workers" and workers[-2:] == ["-", "-"]
    assert inline[0] == "inline" and inline[4] == "120.0"
    postprocess = table.headers.index("postprocess")
    assert workers[postprocess] == "53.3" and inline[postprocess] == "-"
    assert inline[-1] == "0.75, 0.90, 0.50 -> 0.75x"
    assert system_name(1) == "1 post-process worker"


def test_the_attention_bench_runs_its_baseline_with_the_setting_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.decode_attention import CONFIGURATIONS
    from resq.settings import Settings

    (packed_name, packed), (per_request_name, per_request) = CONFIGURATIONS.items()
    assert "packed" in packed_name and "per-request" in per_request_name
    assert "gpu_worker_env" not in per_request and Settings().decode_attention
    for name, value in packed["gpu_worker_env"].items():
        monkeypatch.setenv(name, value)
    assert not Settings().decode_attention


def test_the_versus_table_pairs_this_checkout_with_the_base_per_round() -> None:
    from bench.versus import HERE, SCENARIO, versus_table

    results = ResultSet()
    for round_index, (here, base) in enumerate([(1200.0, 1000.0), (900.0, 1000.0), (1500.0, 1000.0)]):
        for name, tok_s in ((HERE, here), ("abc123", base)):
            results.add(RunRecord(SCENARIO, name, "tiny", 32, round_index, {"tok_s": tok_s}))
    table = versus_table(results, "abc123", "tiny", 32)
    tok_s = next(row for row in table.rows if row[0] == "tok_s")
    # Paired per round (1.2, 0.9, 1.5), not the ratio of the medians (1,200 / 1,000).
    assert tok_s == ["tok_s", "1,200", "1,000", "1.20, 0.90, 1.50 -> 1.20x"]
    missing = next(row for row in table.rows if row[0] == "ttft_p50_ms")
    assert missing[1:] == ["-", "-", "-"]


def test_a_process_group_with_another_tree_starts_its_roles_there(tmp_path: Path) -> None:
    """``python -m`` puts the working directory first on ``sys.path``: a role must start in its tree."""
    from bench.procs import ProcGroup

    tree = tmp_path / "tree"
    (tree / "probe").mkdir(parents=True)
    (tree / "probe" / "__init__.py").write_text("")
    (tree / "probe" / "__main__.py").write_text("import os, probe; print(os.getcwd(), probe.__file__)")
    group = ProcGroup(tmp_path / "logs", tree=tree)
    proc = group.start("probe", [sys.executable, "-m", "probe"])
    proc.popen.wait(30)
    cwd, module = proc.log_path.read_text().split()
    assert Path(cwd) == tree and Path(module).parent.parent == tree


def test_an_embedded_redis_runs_the_binary_it_is_given_and_its_cpu_is_counted_under_a_forks_name(
    tmp_path: Path,
) -> None:
    """``make bench-redis`` runs a stack on another server (Valkey answers INFO as Redis 7.2.4 does):
    the bench must start that binary and still count its Redis's CPU, or the A/B reads low."""
    import redis

    from bench.cpu_accounting import redis_server_pid
    from resq.embedded_redis import EmbeddedRedis, redis_server_binary

    renamed = tmp_path / "valkey-server"
    renamed.symlink_to(redis_server_binary())
    server = EmbeddedRedis(binary=str(renamed))
    server.start()
    try:
        info = redis.Redis.from_url(server.url).info("server")
        pid = redis_server_pid(info)
        assert pid is not None
        assert psutil.Process(pid).exe() == str(Path(redis_server_binary()).resolve())
        assert psutil.Process(pid).name() == "valkey-server"
    finally:
        server.stop()


def test_a_stack_of_two_gpu_workers_is_ready_only_when_health_counts_both() -> None:
    """``/health`` answers 200 once one GPU worker has loaded its model; the affinity bench's
    loops started then all stayed with that worker, so its warm-up measured one worker."""
    from bench.systems import reports_gpu_workers

    assert not reports_gpu_workers({"status": "ok", "gpu_workers": 1}, started=2)
    assert reports_gpu_workers({"status": "ok", "gpu_workers": 2}, started=2)
    assert reports_gpu_workers({"status": "ok", "gpu_workers": 1}, started=1)
    assert not reports_gpu_workers({"status": "ok"}, started=1)


def test_the_bench_names_a_forks_version_and_the_redis_it_answers_as() -> None:
    from bench.runner import redis_server_version

    assert redis_server_version({"redis_version": "6.2.14"}) == "6.2.14"
    assert redis_server_version({"redis_version": "7.4.2", "server_name": "redis"}) == "7.4.2"
    valkey = {"redis_version": "7.2.4", "server_name": "valkey", "valkey_version": "8.0.1"}
    assert redis_server_version(valkey) == "valkey 8.0.1 (as Redis 7.2.4)"


def test_agent_loop_reports_the_prewarmed_socket_loop_with_and_without_its_prewarm() -> None:
    from bench.agent_loop import ON, WS, WS_PREWARMED, LoopRun, prewarmed_ratios, session_tag, verdict_lines
    from bench.results import ResultSet

    results = ResultSet()
    inputs = [1000, 1300]
    results.add(_agent_loop(ON, 0, [900.0, 100.0], inputs, [0, 640], 4.0).record("bench"))
    results.add(_agent_loop(WS, 0, [900.0, 100.0], inputs, [0, 640], 4.0).record("bench"))
    warmed = _agent_loop(WS_PREWARMED, 0, [300.0, 100.0], inputs, [640, 640], 3.2)
    results.add(LoopRun(warmed.system, 0, warmed.turns, warmed.wall_s, prewarm_s=0.8).record("bench"))
    assert prewarmed_ratios(results, "bench") == pytest.approx([1.25])
    assert prewarmed_ratios(results, "bench", counted=True) == pytest.approx([1.0])
    line = verdict_lines(results, "bench")[-1]
    assert "prewarm not timed: 1.25" in line and "timed: 1.00" in line and "300.0 ms against 900.0 ms" in line
    assert session_tag("t", 0, WS_PREWARMED) != session_tag("t", 0, WS)


@pytest.mark.parametrize("setting", ["cuda", "cpu", "auto", None])
@pytest.mark.parametrize("has_cuda", [True, False])
def test_transformers_serve_runs_its_model_where_resq_engines_run(
    monkeypatch: pytest.MonkeyPatch, setting: str | None, has_cuda: bool
) -> None:
    # On a GPU host (scripts/device/check.sh) the peer must not stay on the CPU while resq's
    # engines run on the GPU, nor go to a GPU resq's engines do not use.
    import torch

    from gpu_worker.model_loading import ModelLoadError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: has_cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    if setting is None:
        monkeypatch.delenv("RESQ_DEVICE", raising=False)
    else:
        monkeypatch.setenv("RESQ_DEVICE", setting)
    if setting == "cuda" and not has_cuda:
        with pytest.raises(ModelLoadError, match="no CUDA device"):
            serve_device()
        return
    on_gpu = setting == "cuda" or (setting in (None, "auto") and has_cuda)
    assert serve_device() == ("cuda" if on_gpu else "cpu")


def test_a_tree_without_history_takes_its_commit_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The GPU check's device machine gets the working tree without .git.
    from bench.runner import _git_commit

    monkeypatch.delenv("RESQ_BENCH_COMMIT", raising=False)
    assert _git_commit(tmp_path) == "unknown"
    monkeypatch.setenv("RESQ_BENCH_COMMIT", "abc1234")
    assert _git_commit(tmp_path) == "abc1234"


def test_the_conditions_name_a_post_processing_placement_other_than_the_default() -> None:
    from bench.document import conditions

    default = conditions({"plan": {"postprocess_workers": 2}})
    inline = conditions({"plan": {"postprocess_workers": 0}})
    one = conditions({"plan": {"postprocess_workers": 1}})
    assert "post-processed" not in default
    assert "inline in the API (`--postprocess-workers 0`)" in inline
    assert "in 1 post-process worker(s)" in one
    assert "not in the default 2." in one


def test_a_block_names_the_options_it_was_run_with() -> None:
    from bench.cli import bench_command, invocation

    def named(arguments: list[str]) -> str:
        with bench_command.make_context("resq bench", arguments) as context:
            return invocation(context)

    assert named([]) == "make bench"
    assert named(["--quick"]) == "resq bench --quick"
    assert named(["--scenario", "b1", "--scenario", "B2", "--postprocess-workers", "0", "--no-doc"]) == (
        "resq bench --scenario B1 --scenario B2 --postprocess-workers 0 --no-doc"
    )
