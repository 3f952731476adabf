"""The images, as far as they can be checked without a Docker engine.

The Dockerfiles copy only what exists and what ``.dockerignore`` lets through, run as
an unprivileged user with a healthcheck, on a pinned base; the pinned requirements
agree with pyproject.toml; and the slim image's code really runs without torch.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {"slim": ROOT / "docker" / "Dockerfile", "gpu": ROOT / "docker" / "Dockerfile.gpu"}
LOCKS = ROOT / "docker" / "requirements"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", re.MULTILINE)
GPU_ONLY = {"torch", "transformers", "triton", "safetensors"}


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def stages(dockerfile: Path) -> dict[str, list[tuple[str, str]]]:
    """Instructions by stage name."""
    result: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for keyword, rest in instructions(dockerfile):
        if keyword == "FROM":
            current = []
            result[rest.split(" AS ")[-1].strip()] = current
        current.append((keyword, rest))
    return result


def dockerignore_admits(path: str) -> bool:
    """Whether the build context keeps ``path`` (last matching pattern wins, as Docker does)."""
    admitted = True
    for pattern in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = pattern.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/") or path == pattern:
            admitted = negated
    return admitted


@pytest.mark.parametrize("image", DOCKERFILES)
def test_every_copied_source_exists_and_is_in_the_build_context(image: str) -> None:
    copies = [rest for keyword, rest in instructions(DOCKERFILES[image]) if keyword == "COPY"]
    sources = [source for rest in copies if not rest.startswith("--from") for source in rest.split()[:-1]]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"{image}: COPY {source}: no such path"
        assert dockerignore_admits(source), f"{image}: .dockerignore drops {source}"


@pytest.mark.parametrize(("image", "stage"), [("slim", "runtime"), ("slim", "flower"), ("gpu", "runtime")])
def test_runtime_stages_are_unprivileged_and_have_a_healthcheck(image: str, stage: str) -> None:
    steps = stages(DOCKERFILES[image])[stage]
    users = [rest for keyword, rest in steps if keyword == "USER"]
    assert users and users[-1] not in ("root", "0"), f"{image}/{stage} runs as root"
    assert any(keyword == "HEALTHCHECK" for keyword, _ in steps), f"{image}/{stage} has no HEALTHCHECK"


@pytest.mark.parametrize("image", DOCKERFILES)
def test_the_last_stage_is_the_runtime_on_a_pinned_base(image: str) -> None:
    assert list(stages(DOCKERFILES[image]))[-1] == "runtime"
    base = next(rest for keyword, rest in instructions(DOCKERFILES[image]) if keyword == "ARG")
    assert re.fullmatch(r"PYTHON_IMAGE=python:\d+\.\d+\.\d+-slim-\w+", base), base


def pins(lock: str) -> dict[str, set[str]]:
    text = (LOCKS / f"{lock}.txt").read_text()
    found: dict[str, set[str]] = {}
    for name, version in PIN.findall(text):
        found.setdefault(canonicalize_name(name), set()).add(version)
    return found


def wanted(*extras: str) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = list(project["dependencies"])
    for extra in extras:
        names += project["optional-dependencies"][extra]
    return [Requirement(name) for name in names]


@pytest.mark.parametrize(("lock", "extras"), [("slim", ()), ("flower", ("flower",)), ("gpu", ("gpu",))])
def test_locks_pin_every_dependency_within_pyproject_bounds(lock: str, extras: tuple[str, ...]) -> None:
    pinned = pins(lock)
    for requirement in wanted(*extras):
        versions = pinned.get(canonicalize_name(requirement.name))
        assert versions, f"{lock}.txt lacks {requirement.name}: run `make lock`"
        assert any(requirement.specifier.contains(v, prereleases=True) for v in versions), (
            f"{lock}.txt pins {requirement.name}=={versions}, outside {requirement.specifier}: run `make lock`"
        )


@pytest.mark.parametrize("lock", ["slim", "flower", "gpu"])
def test_every_pin_carries_hashes(lock: str) -> None:
    text = (LOCKS / f"{lock}.txt").read_text()
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text.split("\n", 2)[-1])
    for block in blocks:
        if PIN.match(block):
            assert "--hash=sha256:" in block, f"{lock}.txt: no hash for {block.splitlines()[0]}"


def test_the_slim_lock_holds_no_gpu_stack() -> None:
    slim = set(pins("slim"))
    assert not slim & GPU_ONLY
    assert not any(name.startswith("nvidia-") for name in slim)
    assert {"torch", "transformers"} <= set(pins("gpu"))


def test_the_slim_roles_run_with_torch_and_transformers_absent() -> None:
    # None in sys.modules makes any import of them fail, as in the slim image.
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
        "import resq.cli, workers.main, api.main; api.main.create_app(); "
        "from resq.postprocess.observed import postprocess_response; "
        "sys.argv = ['resq', 'healthcheck', '--help']; resq.cli.main()"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "healthcheck" in result.stdout
