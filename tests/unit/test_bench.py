"""The bench's own pure logic: statistics, alternation, tables, targets, the document markers."""

from __future__ import annotations

import pytest

from bench.clients import _Frames
from bench.document import BEGIN, END, replace_results
from bench.plan import Plan
from bench.report import Table, Target, b1_table, b5_ratio, b5_ratios, b5_table, targets, to_markdown
from bench.results import ResultSet, RunRecord
from bench.stats import alternated, median, percentile, ratio


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
    assert row[:5] == ["tiny", "8", "200.0", "250.0", "-"]
    # Only round 0 ran both: the ratio is that round's (100 / 250), not the medians' (200 / 250).
    assert row[5] == "0.40 -> 0.40x"


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
    assert b1_table(results).rows[0][6] == "1.14, 1.17, 1.45 -> 1.17x"
    target = next(found for found in targets(results) if "transformers serve" in found.name)
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
    # B1: 3 concurrencies x 3 systems, B2: 3 systems, per model and round; B3: 3 per round;
    # B4: 2 systems x 3 concurrencies per round, plus the held-streams run; B5: 2 kinds per model
    # and round.
    assert full.runs() == (9 + 3) * 2 * 3 + 3 * 3 + 2 * 3 * 3 + 1 + 2 * 2 * 3


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
    results.add(RunRecord("B5mask", "structured", "bench", 32, 0, {"us_per_token": 60.0, "ms_per_step": 2.0}))
    assert b5_ratios(results, "bench") == [0.9, 0.5, 0.95]
    # Paired per round: the median of the ratios (0.9), not the ratio of medians (95 / 100).
    assert b5_ratio(results, "bench") == 0.9
    (row,) = b5_table(results).rows
    assert row[:4] == ["bench", "32", "0.90, 0.50, 0.95", "0.90x"] and row[-1] == "60.0"
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
