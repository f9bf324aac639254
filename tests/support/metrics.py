"""Reading the plugin's Prometheus counters (vllm_ascend_rl.metrics) in tests."""

from __future__ import annotations

import requests

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape_text(text: str) -> Samples:
    """Every ``vllm_ascend_rl_*`` sample of a Prometheus text page, by (name, labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name.removeprefix("vllm_ascend_rl_"), tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("vllm_ascend_rl_") and s.name.endswith("_total")
    }


def scrape(url: str, path: str = "/metrics") -> Samples:
    return scrape_text(requests.get(url + path, timeout=30).text)


def series(samples: Samples, name: str) -> list[dict[str, str]]:
    return [dict(labels) for (n, labels) in samples if n == f"{name}_total"]


def added(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """How much counter ``name`` grew over every series with ``labels`` (workers summed)."""

    def total(samples: Samples) -> float:
        return sum(
            v
            for (n, ls), v in samples.items()
            if n == f"{name}_total" and labels.items() <= dict(ls).items()
        )

    return total(after) - total(before)
