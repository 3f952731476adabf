"""Settings that would misbehave at run time are refused at start-up, and ``resq up`` tells a
Redis that refuses its URL from one that is not there."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from pydantic import ValidationError

from resq.embedded_redis import RedisRefusedError, masked_url, redis_answers
from resq.settings import Settings
from resq.supervisor import check_metrics_ports, check_port_free
from tests.support.processes import free_port
from tests.support.redis_server import PrivateRedis


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"worker_ttl_s": 1}, "worker_ttl_s"),  # a live worker would count as gone between beats
        ({"heartbeat_s": 3, "worker_ttl_s": 3}, "worker_ttl_s"),
        ({"heartbeat_s": float("inf")}, "heartbeat_s"),  # a timer's wait overflowed
        ({"postprocess_lease_s": float("inf")}, "postprocess_lease_s"),
        ({"reaper_interval_s": 1e12}, "reaper_interval_s"),
        ({"transient_ttl_s": 99_999_999_999_999_999}, "transient_ttl_s"),  # Redis: invalid expire
        ({"host": ""}, "host"),  # uvicorn listened on every interface
        ({"model": ""}, "model"),  # the working directory
        ({"builtin_model_dir": ""}, "builtin_model_dir"),
    ],
)
def test_a_setting_that_would_fail_later_is_refused_naming_it(fields: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(**fields)
    assert [error["loc"] for error in refused.value.errors()] == [(field,)]


def test_the_defaults_and_long_periods_are_accepted() -> None:
    Settings()
    Settings(heartbeat_s=2, worker_ttl_s=2.5, store_ttl_s=365 * 86400, gpu_stall_timeout_s=86400)


def test_resq_up_refuses_metrics_ports_past_the_last_one() -> None:
    check_metrics_ports(Settings(metrics_port=65533))
    with pytest.raises(ValueError, match="65535 to 65537"):  # its workers would get 65536 and on
        check_metrics_ports(Settings(metrics_port=65535))


def test_resq_up_refuses_a_port_another_process_listens_on() -> None:
    port = free_port()
    check_port_free("127.0.0.1", port)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        with pytest.raises(ValueError, match=f"RESQ_PORT={port}: the API cannot listen"):
            check_port_free("127.0.0.1", port)
        with pytest.raises(ValueError):  # every address includes the one taken
            check_port_free("0.0.0.0", port)
    check_port_free("127.0.0.1", port)


def test_a_redis_that_refuses_the_url_is_an_error_and_nothing_listening_is_no_redis(
    private_redis: PrivateRedis,
) -> None:
    assert redis_answers(private_redis.url)
    # A database the server lacks (or a wrong password): a setting to fix, not a Redis to replace.
    with pytest.raises(RedisRefusedError, match="DB index is out of range"):
        redis_answers(private_redis.url.rsplit("/", 1)[0] + "/99")
    assert not redis_answers(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    with pytest.raises(ValueError):
        redis_answers("localhost:6379")


def test_a_password_is_masked_in_what_is_logged() -> None:
    assert masked_url("redis://:s3cret@redis:6379/0") == "redis://:**@redis:6379/0"
    assert masked_url("redis://redis:6379/2") == "redis://redis:6379/2"
