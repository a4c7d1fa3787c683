"""`GET /metrics` of `meshpar serve`: Prometheus's text format, written by `prometheus_client`.

    meshpar_requests_total{status}                  HTTP answers to /v1/* by status code
    meshpar_prompt_tokens_total                     prompt tokens of the requests served (once each, whatever its n)
    meshpar_generation_tokens_total                 tokens generated (every choice's)
    meshpar_time_to_first_token_seconds             histogram: submission -> a request's first token (of any choice)
    meshpar_inter_token_latency_seconds             histogram: between two tokens of one choice
    meshpar_e2e_request_latency_seconds             histogram: submission -> a request's last token
    meshpar_requests_running / _waiting             gauges: requests in a slot / queued
    meshpar_kv_cache_slots / _slots_in_use          gauges: the decode batch's KV-cache slots, and those busy
    meshpar_prefix_cache_hits_total / _misses_total prompts that reused a cached prefix, and that did not
    meshpar_compilations_total                      programs compiled since the start (a new shape compiles once)
    meshpar_decode_steps_total                      decode ticks

Each server has a registry of its own (two servers in one process never share counts). Values the
scheduler and engine already keep (slots, queue, prefix cache, compilations) are read at scrape
time by a collector, not copied. The latencies are what the API's event loop sees, as a client would.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# seconds: from a fast decode tick to a long prompt's wait in a queue
LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)


class ServeMetrics:
    """The counters and histograms of one server (`scheduler`, `engine`: where the gauges read from)."""

    def __init__(self, scheduler, engine):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("meshpar_requests", "HTTP answers to /v1/* by status code", ["status"], registry=r)
        self.prompt_tokens = Counter("meshpar_prompt_tokens", "Prompt tokens of the requests served", registry=r)
        self.generation_tokens = Counter("meshpar_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "meshpar_time_to_first_token_seconds", "Submission to first token", buckets=LATENCY, registry=r
        )
        self.itl = Histogram(
            "meshpar_inter_token_latency_seconds", "Between two tokens of one request", buckets=LATENCY, registry=r
        )
        self.e2e = Histogram(
            "meshpar_e2e_request_latency_seconds", "Submission to last token", buckets=LATENCY, registry=r
        )
        r.register(_Live(scheduler, engine))
        self.in_flight = 0  # HTTP requests to /v1/* not yet answered whole (`Observed`)

    def timing(self) -> RequestTiming:
        """The latencies of one request (all its `n` choices), from now."""
        return RequestTiming(self)

    def exposition(self) -> tuple[bytes, str]:
        """-> (the text a scrape reads, its content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTiming:
    """One HTTP request's share of the metrics, its `n` choices together (as its `usage` counts them):
    its prompt's tokens once, the time to its first token (of any choice), and to its last."""

    def __init__(self, metrics: ServeMetrics):
        self.metrics, self.start, self.first, self.last = metrics, time.perf_counter(), None, None

    def token(self, now: float, prompt_tokens: int) -> None:
        """A token of any of its choices came at `now` (perf_counter)."""
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
            self.metrics.prompt_tokens.inc(prompt_tokens)
        self.last = now

    def done(self) -> None:
        if self.first is not None:
            self.metrics.e2e.observe(self.last - self.start)


class _Live:
    """The values the scheduler and engine keep, read at each scrape."""

    def __init__(self, scheduler, engine):
        self.scheduler, self.engine = scheduler, engine

    def describe(self):
        return []

    def collect(self):
        s, e = self.scheduler, self.engine
        running, waiting = len(s.active), len(s.waiting) + len(s.inbox)
        yield GaugeMetricFamily("meshpar_requests_running", "Requests in a decode slot", value=running)
        yield GaugeMetricFamily("meshpar_requests_waiting", "Requests queued for a slot", value=waiting)
        yield GaugeMetricFamily("meshpar_kv_cache_slots", "KV-cache slots of the decode batch", value=e.slots)
        yield GaugeMetricFamily("meshpar_kv_cache_slots_in_use", "KV-cache slots holding a request", value=running)
        p = s.prefix
        yield CounterMetricFamily(
            "meshpar_prefix_cache_hits", "Prompts that reused a cached prefix", value=p.hits if p is not None else 0
        )
        yield CounterMetricFamily(
            "meshpar_prefix_cache_misses", "Prompts that found no cached prefix", value=p.misses if p is not None else 0
        )
        yield CounterMetricFamily(
            "meshpar_compilations", "Programs compiled since the start", value=sum(e.traces.values())
        )
        yield CounterMetricFamily("meshpar_decode_steps", "Decode ticks", value=s.decode_steps)


class Observed:
    """ASGI middleware: counts each answer to /v1/* by status code (refusals of the guard in front of
    the routes too: 401, 413, 415), and the requests not yet answered whole (`in_flight`)."""

    def __init__(self, app, metrics: ServeMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)

        async def observed(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(status=str(message["status"])).inc()
            await send(message)

        self.metrics.in_flight += 1
        try:
            return await self.app(scope, receive, observed)
        finally:
            self.metrics.in_flight -= 1
