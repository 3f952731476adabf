"""``docs/benchmarks.md``: the generated results between markers, the hand-written analysis around them.

Only the part between :data:`BEGIN` and :data:`END` is rewritten by a run, so
the method, the profile findings and the explanations written by people stay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.plan import Plan
from bench.plot import write_plot
from bench.report import all_tables, to_markdown
from bench.results import ResultSet

BEGIN = "<!-- bench:results:begin -->"
END = "<!-- bench:results:end -->"

SKELETON = f"""# Benchmarks

{BEGIN}
{END}
"""


def conditions(context: dict[str, Any]) -> str:
    """One paragraph on what the figures were taken on and how."""
    plan = context.get("plan", {})
    quiet = context.get("waited_for_quiet")
    waited = {
        True: "after waiting for the load average to stay below 0.5 for a minute",
        False: "on a machine that never got quiet (other work ran on it throughout)",
        None: "without waiting for a quiet machine",
    }[quiet]
    models = "; ".join(f"`{key}`: {text}" for key, text in context.get("models", {}).items())
    return (
        f"Produced by `{context.get('command', 'make bench')}` on {context.get('started', '?')} at commit "
        f"`{context.get('commit', '?')}`, in {context.get('duration_s', '?')} s: {context.get('cpu', '?')}, "
        f"{context.get('cores', '?')} cores, {context.get('memory_gb', '?')} GiB; Python {context.get('python', '?')}, "
        f"torch {context.get('torch', '?')}, transformers {context.get('transformers', '?')}, "
        f"redis-server {context.get('redis_server', '?')}. Measured {waited}; load average (1, 5, 15 min) "
        f"{context.get('load_before', '?')} before and {context.get('load_after', '?')} after. "
        f"{plan.get('rounds', '?')} alternating rounds per case, medians of rounds (latency percentiles "
        f"pooled over rounds); B1 {plan.get('b1_tokens', '?')} output tokens per request, B3 "
        f"{plan.get('b3_streams', '?')} streams of {plan.get('b3_tokens', '?')} tokens, B4 "
        f"{plan.get('b4_tokens', '?')} tokens per request and {plan.get('capacity_streams', '?')} held streams. "
        f"Models: {models}." + _placement(plan)
    )


def _placement(plan: dict[str, Any]) -> str:
    # Only a run that changed it says so: the targets are judged on the default shape.
    default = Plan.postprocess_workers
    workers = plan.get("postprocess_workers", default)
    if workers == default:
        return ""
    shape = "inline in the API" if workers == 0 else f"in {workers} post-process worker(s)"
    return f" resq post-processed {shape} (`--postprocess-workers {workers}`), not in the default {default}."


def results_section(results: ResultSet, plot_name: str | None = None) -> str:
    """The generated block: conditions, the plot (``plot_name``: its file, None: no plot) and tables."""
    parts = [conditions(results.context)]
    if plot_name is not None:
        parts.append(f"![benchmark figures]({plot_name})")
    parts += [to_markdown(table) for table in all_tables(results)]
    return "\n\n".join(parts)


def replace_results(document: str, section: str) -> str:
    """``document`` with the text between the markers replaced by ``section`` (markers added if absent)."""
    if BEGIN not in document or END not in document:
        document = document.rstrip("\n") + f"\n\n{BEGIN}\n{END}\n"
    head, rest = document.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{section}\n{END}{tail}"


def write_document(results: ResultSet, out_dir: Path) -> list[Path]:
    """Write ``benchmarks.png`` and the results block of ``benchmarks.md`` under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plot = write_plot(results, out_dir / "benchmarks.png")
    results.save(out_dir / "benchmarks.json")
    document_path = out_dir / "benchmarks.md"
    current = document_path.read_text() if document_path.exists() else SKELETON
    document_path.write_text(replace_results(current, results_section(results, plot.name)))
    return [document_path, plot, out_dir / "benchmarks.json"]


if __name__ == "__main__":  # `python -m bench.document results.json`: a run's block as Markdown
    import sys

    print(results_section(ResultSet.load(Path(sys.argv[1]))))
