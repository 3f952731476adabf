"""docker-compose.yml is valid, uses only real settings, and keeps its promises (GPU, health, AOF).

No Docker engine runs here: ``docker-compose config`` (Debian's package; ``.ci/run``
installs it) parses, validates against the compose schema and interpolates the file
without one; where no compose is installed, :mod:`tests.support.compose` does the same in
Python against the Compose Specification's JSON schema. The structural checks read the YAML itself, so they hold for compose v1 and v2.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from resq.settings import Settings
from resq.settings_doc import variable
from tests.support.compose import ConfigResult, InterpolationError, interpolate, read_env_file
from tests.support.compose import compose_config as python_compose_config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
GPU_HOST_FILE = ROOT / "deploy" / "compose.gpu-host.yml"
ENV_EXAMPLE = ROOT / ".env.example"
RESQ_SERVICES = ("api", "postprocess", "gpu-worker")
GPU_HOST_SERVICES = ("gpu-worker-0", "gpu-worker-1")
SETTING_VARIABLES = {variable(name) for name in Settings.model_fields}


@cache
def compose_command() -> list[str] | None:
    """``docker-compose`` (v1, Debian) or ``docker compose`` (v2 plugin), whichever works; None: neither."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=60)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def _environment(**variables: str) -> dict[str, str]:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("RESQ_")}
    return {**environment, **variables}


def run_compose_config(
    compose_file: Path, **variables: str
) -> subprocess.CompletedProcess[str] | ConfigResult:
    """``compose config`` of ``compose_file`` with ``.env.example`` and ``variables`` (no other RESQ_*).

    With no compose installed, the same in Python (:mod:`tests.support.compose`): interpolated
    the same way and validated against the Compose Specification's schema.
    """
    command = compose_command()
    if command is None:
        return python_compose_config(
            compose_file, {**read_env_file(ENV_EXAMPLE), **_environment(**variables)}
        )
    return subprocess.run(
        [*command, "--env-file", str(ENV_EXAMPLE), "-f", str(compose_file), "config"],
        cwd=ROOT,
        env=_environment(**variables),
        capture_output=True,
        text=True,
        timeout=120,
    )


def compose_config(compose_file: Path = COMPOSE_FILE, **variables: str) -> dict[str, Any]:
    """The file as compose resolves it."""
    result = run_compose_config(compose_file, **variables)
    assert result.returncode == 0, f"compose rejects {compose_file.name}:\n{result.stderr}"
    parsed: dict[str, Any] = yaml.safe_load(result.stdout)
    return parsed


@cache
def compose_yaml(compose_file: Path = COMPOSE_FILE) -> dict[str, Any]:
    """The file as YAML (anchors and merge keys resolved), before interpolation."""
    loaded: dict[str, Any] = yaml.safe_load(compose_file.read_text())
    return loaded


def resq_services() -> list[tuple[Path, str]]:
    return [(COMPOSE_FILE, name) for name in RESQ_SERVICES] + [
        (GPU_HOST_FILE, name) for name in GPU_HOST_SERVICES
    ]


def test_compose_validates_with_the_defaults() -> None:
    services = compose_config()["services"]
    assert {"redis", "api", "postprocess", "gpu-worker", "flower", "prometheus"} <= set(services)
    assert services["api"]["environment"]["RESQ_REDIS_URL"] == "redis://redis:6379/0"
    assert str(services["postprocess"]["deploy"]["replicas"]) == "2"


def test_compose_passes_chosen_values_through() -> None:
    services = compose_config(
        RESQ_MAX_BATCH="7", POSTPROCESS_REPLICAS="0", RESQ_MODEL="/models/qwen3", API_PORTS="8000-8003"
    )["services"]
    assert str(services["gpu-worker"]["environment"]["RESQ_MAX_BATCH"]) == "7"
    assert services["gpu-worker"]["environment"]["RESQ_MODEL"] == "/models/qwen3"
    assert str(services["postprocess"]["deploy"]["replicas"]) == "0"
    # No post-process workers: the API must post-process inline.
    assert str(services["api"]["environment"]["RESQ_POSTPROCESS_WORKERS"]) == "0"


@pytest.mark.parametrize(("compose_file", "service"), resq_services())
def test_every_resq_variable_compose_sets_is_a_setting(compose_file: Path, service: str) -> None:
    environment = compose_yaml(compose_file)["services"][service]["environment"]
    unknown = {key for key in environment if key.startswith("RESQ_")} - SETTING_VARIABLES
    assert not unknown, f"{service} sets variables no setting reads: {sorted(unknown)}"


@pytest.mark.parametrize(("compose_file", "service"), resq_services())
def test_every_setting_can_be_set_for_every_resq_service(compose_file: Path, service: str) -> None:
    environment = compose_yaml(compose_file)["services"][service]["environment"]
    missing = SETTING_VARIABLES - set(environment)
    assert not missing, f"{service} does not pass through {sorted(missing)}: run `make docs`"


def test_the_gpu_host_file_validates_and_demands_the_shared_redis() -> None:
    services = compose_config(GPU_HOST_FILE, RESQ_REDIS_URL="redis://main-host:6379/0")["services"]
    assert set(services) == set(GPU_HOST_SERVICES)
    assert {s["environment"]["RESQ_REDIS_URL"] for s in services.values()} == {"redis://main-host:6379/0"}
    device_ids = [
        s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for s in services.values()
    ]
    assert sorted(device_ids) == [["0"], ["1"]]  # one GPU each, none shared
    assert run_compose_config(GPU_HOST_FILE).returncode != 0  # no RESQ_REDIS_URL: refused


@pytest.mark.parametrize("compose_file", [COMPOSE_FILE, GPU_HOST_FILE], ids=lambda path: path.name)
def test_every_compose_variable_is_documented_in_env_example(compose_file: Path) -> None:
    used = set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*)", compose_file.read_text()))
    documented = set(re.findall(r"^# ([A-Z_][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(), flags=re.MULTILINE))
    assert used, "the compose file interpolates nothing?"
    assert not used - documented, f"undocumented in .env.example: {sorted(used - documented)}"


def test_gpu_worker_reserves_an_nvidia_gpu_and_names_its_model() -> None:
    worker = compose_yaml()["services"]["gpu-worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert "RESQ_MODEL" in worker["environment"]
    assert any(volume.endswith(":/cache/huggingface") for volume in worker["volumes"])


def test_redis_persists_with_aof_on_a_volume() -> None:
    redis = compose_yaml()["services"]["redis"]
    command = redis["command"]
    assert command[command.index("--appendonly") + 1] == "yes"
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert any(volume.endswith(":/data") for volume in redis["volumes"])


def test_every_service_has_a_healthcheck_and_waits_for_healthy_dependencies() -> None:
    services = compose_yaml()["services"]
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for dependency, condition in (service.get("depends_on") or {}).items():
            assert condition == {"condition": "service_healthy"}, f"{name} -> {dependency}"
    for name in RESQ_SERVICES:
        assert services[name]["healthcheck"]["test"][1:3] == ["resq", "healthcheck"], name
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_optional_services_sit_behind_profiles() -> None:
    services = compose_yaml()["services"]
    assert services["flower"]["profiles"] == ["flower"]
    assert services["prometheus"]["profiles"] == ["monitoring"]
    assert not any("profiles" in services[name] for name in ("redis", *RESQ_SERVICES))


@pytest.mark.parametrize("compose_file", [COMPOSE_FILE, GPU_HOST_FILE], ids=lambda path: path.name)
def test_the_python_validator_agrees_with_compose(compose_file: Path) -> None:
    """The fallback accepts what compose accepts, resolves the same values, and refuses what it refuses."""
    variables = {"RESQ_REDIS_URL": "redis://main-host:6379/0", "RESQ_MAX_BATCH": "7"}
    environment = {**read_env_file(ENV_EXAMPLE), **_environment(**variables)}
    result = python_compose_config(compose_file, environment)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    if compose_command() is not None:
        assert set(services) == set(compose_config(compose_file, **variables)["services"])
    worker = services["gpu-worker" if compose_file == COMPOSE_FILE else "gpu-worker-0"]
    assert str(worker["environment"]["RESQ_MAX_BATCH"]) == "7"
    assert worker["environment"]["RESQ_REDIS_URL"] == "redis://main-host:6379/0"


def test_the_python_validator_refuses_what_the_schema_refuses(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("services:\n  api:\n    image: x\n    restart_policy: always\n")  # not a service key
    result = python_compose_config(bad, {})
    assert result.returncode != 0 and "restart_policy" in result.stderr
    missing = tmp_path / "missing.yml"
    missing.write_text("services:\n  api:\n    image: ${IMAGE:?set IMAGE}\n")
    refused = python_compose_config(missing, {})
    assert refused.returncode != 0 and "set IMAGE" in refused.stderr
    assert python_compose_config(missing, {"IMAGE": "x$$y"}).returncode == 0


def test_interpolation_follows_compose() -> None:
    environment = {"SET": "v", "EMPTY": ""}
    cases = {
        "${SET}": "v",
        "$SET-x": "v-x",
        "${UNSET:-d}": "d",
        "${EMPTY:-d}": "d",
        "${EMPTY-d}": "",
        "${UNSET-d}": "d",
        "$${SET}": "${SET}",
        "${SET:?no}": "v",
    }
    for text, expected in cases.items():
        assert interpolate(text, environment) == expected, text
    with pytest.raises(InterpolationError):
        interpolate("${EMPTY:?needed}", environment)
