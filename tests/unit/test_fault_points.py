"""RESQ_FAULT_POINT: a process ends at the point it names, and only there; unset, nothing happens."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from resq.faults import FAULT_EXIT_CODE, FAULT_POINTS

PROGRAM = "from resq import faults; faults.reached('gpu.after_claim'); print('went on')"


def run(point: str | None) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "RESQ_FAULT_POINT"}
    if point is not None:
        env["RESQ_FAULT_POINT"] = point
    return subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=60
    )


def test_unset_every_point_is_passed() -> None:
    done = run(None)
    assert done.returncode == 0 and done.stdout.strip() == "went on"


@pytest.mark.parametrize("point", [point for point in FAULT_POINTS if point != "gpu.after_claim"])
def test_another_point_is_passed(point: str) -> None:
    assert run(point).returncode == 0


def test_the_named_point_ends_the_process_at_once() -> None:
    done = run("gpu.after_claim")
    assert done.returncode == FAULT_EXIT_CODE and "went on" not in done.stdout


def test_an_unknown_point_is_refused() -> None:
    done = run("gpu.nowhere")
    assert done.returncode != 0 and "fault_point" in done.stderr


def test_prepare_reads_the_settings_before_any_point_is_reached() -> None:
    """A role calls ``faults.prepare`` as it starts: the settings (~2 ms to read from the
    environment) are then read, and the first point reached (on a first request's way) reads none."""
    from resq import faults
    from resq.settings import get_settings

    get_settings.cache_clear()
    try:
        faults.prepare()
        assert get_settings.cache_info().currsize == 1
        misses = get_settings.cache_info().misses
        faults.reached("gpu.after_claim")
        assert get_settings.cache_info().misses == misses
    finally:
        get_settings.cache_clear()
