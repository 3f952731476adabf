"""Reading a role's Prometheus endpoint in tests: every sample by name and labels."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """Every sample of a Prometheus endpoint, by name and labels."""
    reply = httpx.get(url, timeout=10)
    reply.raise_for_status()
    samples: Samples = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value (0 when the endpoint has not reported it yet)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
