"""A server's metrics: vLLM's names and meanings under the prefix ``lookahead:``, each with a ``model_name``
label, plus lookahead's own (engine steps, segments by (w, n, g), the step-cost model's error).

``METRICS`` defines every metric once and two exporters read it. ``ServerMetrics`` keeps them on a
prometheus-client registry of its own (the gRPC server's /metrics). ``RayServerMetrics`` records them with
``ray.util.metrics`` for a Ray Serve replica, ``_`` in place of ``:`` (``lookahead_prompt_tokens``; Ray's
exporter adds ``ray_`` and a counter's ``_total``), as Ray Serve LLM does with vLLM's.

Engine-level metrics (queues, KV cache, token and draft totals, steps) are read from ``engine.stats()``:
at each scrape for Prometheus, at each ``refresh()`` for Ray. Request-level ones (latencies, sizes,
outcomes) are observed from each finished request's RequestOutput. The list is in docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from lookahead_serve.engine.llm_engine import EngineStats, LLMEngine
    from lookahead_serve.engine.outputs import RequestOutput

PROMETHEUS_PREFIX = "lookahead:"
RAY_PREFIX = "lookahead_"


def _1_2_5(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit``: vLLM's buckets for token counts."""
    return tuple(m * 10**e for e in range(len(str(limit))) for m in (1, 2, 5) if m * 10**e <= limit)


# vLLM's buckets, the latency ones extended below 10 ms for small models
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
         80.0, 160.0, 640.0, 2560.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
        10.0, 20.0, 40.0, 80.0)
_REQUEST = (0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TOKENS = _1_2_5(100_000)
_STEP_TOKENS = tuple(float(2**i) for i in range(16))  # 1 .. 32768
_TOKENS_PER_STEP = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 6, 8)


@dataclass(frozen=True)
class MetricSpec:
    """One metric for both exporters. ``read`` (engine-level metrics) gives its value from an EngineStats: a
    number, ``{label values: number}`` with ``labels``, or ``{observed value: count}`` for a histogram;
    request-level metrics (``read`` None) are fed by ``request_observations``."""

    name: str  # without prefix
    kind: str  # "gauge", "counter" or "histogram"
    help: str
    read: Callable[[EngineStats], Any] | None = None
    labels: tuple[str, ...] = ()  # besides model_name
    buckets: tuple[float, ...] = ()  # a histogram's upper bounds: positive, increasing (Ray's rule)

    @property
    def prometheus_name(self) -> str:
        return PROMETHEUS_PREFIX + self.name

    @property
    def ray_name(self) -> str:
        return RAY_PREFIX + self.name


def _engine(kind: str, name: str, help: str, read: Callable[[EngineStats], Any], **kw) -> MetricSpec:
    return MetricSpec(name, kind, help, read, **kw)


def _request(kind: str, name: str, help: str, **kw) -> MetricSpec:
    return MetricSpec(name, kind, help, **kw)


METRICS: tuple[MetricSpec, ...] = (
    # vLLM's engine-level metrics
    _engine("gauge", "num_requests_running", "Requests in the running batch", lambda s: s.num_running),
    _engine("gauge", "num_requests_waiting", "Requests waiting to be scheduled", lambda s: s.num_waiting),
    _engine("gauge", "kv_cache_usage_perc", "Fraction of KV blocks in use (1 = all)", lambda s: s.kv_cache_usage),
    _engine("counter", "prompt_tokens", "Prompt tokens of requests that reached their first token",
            lambda s: s.num_prompt_tokens),
    _engine("counter", "generation_tokens", "Generated tokens", lambda s: s.num_generation_tokens),
    _engine("counter", "num_preemptions", "Preemptions of running requests", lambda s: s.num_preemptions),
    _engine("counter", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
            lambda s: s.num_prefix_cache_queries),
    _engine("counter", "prefix_cache_hits", "Prompt tokens found in the prefix cache",
            lambda s: s.num_prefix_cache_hits),
    _engine("counter", "spec_decode_num_drafts", "Lookahead steps that verified at least one candidate",
            lambda s: s.num_drafts),
    _engine("counter", "spec_decode_num_draft_tokens", "Tokens those steps could accept beyond the first",
            lambda s: s.num_draft_tokens),
    _engine("counter", "spec_decode_num_accepted_tokens", "Tokens those steps accepted beyond the first",
            lambda s: s.num_accepted_tokens),
    _engine("histogram", "iteration_tokens_total", "Tokens per engine step (forward-pass width)",
            lambda s: s.step_token_counts, buckets=_STEP_TOKENS),
    # lookahead's engine-level metrics
    _engine("counter", "engine_steps", "Engine steps (forward passes)", lambda s: s.num_steps),
    _engine("counter", "engine_step_tokens", "Tokens in engine steps, summed", lambda s: s.step_tokens_total),
    _engine("counter", "engine_step_seconds", "Observed engine step time, summed", lambda s: s.step_seconds_total),
    _engine("counter", "engine_step_predicted_seconds", "Step time the step-cost model predicted, summed",
            lambda s: s.step_predicted_seconds_total),
    _engine("counter", "engine_step_abs_error_seconds", "|predicted - observed| step time, summed",
            lambda s: s.step_abs_error_seconds_total),
    _engine("counter", "segments", "Lookahead segments run, by (w, n, g)",
            lambda s: {(config,): n for config, n in s.lookahead_chosen.items()}, labels=("config",)),
    _engine("gauge", "engine_last_step_seconds", "Observed time of the latest step", lambda s: s.last_step_seconds),
    _engine("gauge", "kv_blocks_free", "Free KV blocks", lambda s: s.num_free_kv_blocks),
    _engine("gauge", "kv_blocks_used", "Used KV blocks", lambda s: s.num_used_kv_blocks),
    # vLLM's request-level metrics
    _request("counter", "request_success", "Finished requests, by finish reason", labels=("finished_reason",)),
    _request("histogram", "request_prompt_tokens", "Prompt tokens per finished request", buckets=_TOKENS),
    _request("histogram", "request_generation_tokens", "Generated tokens per finished request", buckets=_TOKENS),
    _request("histogram", "time_to_first_token_seconds", "Arrival to first token", buckets=_TTFT),
    _request("histogram", "inter_token_latency_seconds", "Time between a request's steps that gave it tokens",
             buckets=_ITL),
    _request("histogram", "request_time_per_output_token_seconds", "Decode time per output token after the first",
             buckets=_ITL),
    _request("histogram", "e2e_request_latency_seconds", "Arrival to finish", buckets=_REQUEST),
    _request("histogram", "request_queue_time_seconds", "Arrival to first scheduled", buckets=_REQUEST),
    _request("histogram", "request_inference_time_seconds", "First scheduled to last token", buckets=_REQUEST),
    _request("histogram", "request_prefill_time_seconds", "First scheduled to first token", buckets=_REQUEST),
    _request("histogram", "request_decode_time_seconds", "First token to last token", buckets=_REQUEST),
    # lookahead's request-level metric
    _request("histogram", "tokens_per_step", "Output tokens per decoding step, per finished request",
             buckets=_TOKENS_PER_STEP),
)
SPECS = {spec.name: spec for spec in METRICS}


def request_observations(out: RequestOutput) -> Iterator[tuple[str, tuple[str, ...], float]]:
    """(metric, label values besides model_name, value) for a finished request: a counter's increment or
    a histogram's observation."""
    m = out.metrics
    yield "request_success", (out.outputs[0].finish_reason or "unknown",), 1
    yield "request_prompt_tokens", (), len(out.prompt_token_ids)
    yield "request_generation_tokens", (), m.num_output_tokens
    for name, seconds in (
        ("time_to_first_token_seconds", m.time_to_first_token),
        ("request_time_per_output_token_seconds", m.time_per_output_token),
        ("e2e_request_latency_seconds", m.e2e_latency),
        ("request_queue_time_seconds", m.queue_time),
        ("request_inference_time_seconds", m.inference_time),
        ("request_prefill_time_seconds", m.prefill_time),
        ("request_decode_time_seconds", m.decode_time),
    ):
        if seconds is not None:
            yield name, (), seconds
    for seconds in m.inter_token_latencies:
        yield "inter_token_latency_seconds", (), seconds
    if m.num_steps:
        yield "tokens_per_step", (), m.tokens_per_step


def _labelled(spec: MetricSpec, value: Any) -> Iterator[tuple[tuple[str, ...], float]]:
    """A gauge's or counter's read value as (label values, number) pairs."""
    return iter(value.items()) if spec.labels else iter([((), value)])


# ---- Prometheus ---------------------------------------------------------------------------------


class _EngineCollector(Collector):
    """The engine-level metrics: one engine.stats() per scrape."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        stats = self.engine.stats()
        for spec in METRICS:
            if spec.read is None:
                continue
            value, labels = spec.read(stats), ["model_name", *spec.labels]
            if spec.kind == "histogram":
                family = HistogramMetricFamily(spec.prometheus_name, spec.help, labels=labels)
                family.add_metric([self.model_name], *_cumulative(value, spec.buckets))
            else:
                family = (GaugeMetricFamily if spec.kind == "gauge" else CounterMetricFamily)(
                    spec.prometheus_name, spec.help, labels=labels)
                for label_values, v in _labelled(spec, value):
                    family.add_metric([self.model_name, *label_values], v)
            yield family


def _cumulative(counts: dict[float, int], bounds: tuple[float, ...]) -> tuple[list[tuple[str, int]], float]:
    """Prometheus buckets (upper bound, observations at most it; "+Inf" last) and the sum of ``counts``
    ({observed value: count})."""
    buckets = [(floatToGoString(b), sum(n for x, n in counts.items() if x <= b)) for b in bounds]
    buckets.append(("+Inf", sum(counts.values())))
    return buckets, float(sum(x * n for x, n in counts.items()))


class ServerMetrics:
    """The metrics on a prometheus-client registry of its own (``registry``). Call ``observe_finished``
    once per finished request."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._request: dict[str, Counter | Histogram] = {}
        for spec in METRICS:
            if spec.read is not None:
                continue
            labels = ("model_name", *spec.labels)
            if spec.kind == "counter":
                metric = Counter(spec.prometheus_name, spec.help, labels, registry=self.registry)
            else:
                metric = Histogram(spec.prometheus_name, spec.help, labels, registry=self.registry,
                                   buckets=spec.buckets)
            if not spec.labels:
                metric.labels(model_name)  # shown at zero before the first request
            self._request[spec.name] = metric
        self.registry.register(_EngineCollector(engine, model_name))

    def observe_finished(self, out: RequestOutput) -> None:
        for name, label_values, value in request_observations(out):
            metric = self._request[name].labels(self.model_name, *label_values)
            if SPECS[name].kind == "counter":
                metric.inc(value)
            else:
                metric.observe(value)


# ---- Ray ----------------------------------------------------------------------------------------


class RayServerMetrics:
    """The metrics through ``ray.util.metrics``, for a Ray Serve replica (whose prometheus-client registry
    nothing scrapes). ``observe_finished`` as ServerMetrics; ``refresh()`` sets the engine-level gauges and
    adds to the engine-level counters and histograms what the engine counted since the last refresh (call it
    every second or so). ``metrics_module`` provides Counter, Gauge and Histogram: ray.util.metrics, imported
    here, when None."""

    def __init__(self, engine: LLMEngine, model_name: str, metrics_module: Any = None) -> None:
        if metrics_module is None:
            from ray.util import metrics as metrics_module
        self.engine = engine
        self.model_name = model_name
        self._metrics = {spec.name: _ray_metric(metrics_module, spec) for spec in METRICS}
        self._last: dict[tuple[str, Any], float] = {}  # (metric, label values or observed value) -> last total

    def _tags(self, spec: MetricSpec, label_values: tuple[str, ...]) -> dict[str, str]:
        return {"model_name": self.model_name, **dict(zip(spec.labels, label_values, strict=True))}

    def observe_finished(self, out: RequestOutput) -> None:
        for name, label_values, value in request_observations(out):
            spec, metric = SPECS[name], self._metrics[name]
            if spec.kind == "counter":
                if value > 0:  # Ray refuses increments of zero
                    metric.inc(value, tags=self._tags(spec, label_values))
            else:
                metric.observe(value, tags=self._tags(spec, label_values))

    def refresh(self) -> None:
        stats = self.engine.stats()
        for spec in METRICS:
            if spec.read is None:
                continue
            value, metric = spec.read(stats), self._metrics[spec.name]
            if spec.kind == "gauge":
                for label_values, v in _labelled(spec, value):
                    metric.set(v, tags=self._tags(spec, label_values))
            elif spec.kind == "counter":
                for label_values, v in _labelled(spec, value):
                    if (delta := self._advance((spec.name, label_values), v)) > 0:
                        metric.inc(delta, tags=self._tags(spec, label_values))
            else:
                tags = self._tags(spec, ())
                for x, count in value.items():
                    for _ in range(int(self._advance((spec.name, x), count))):
                        metric.observe(x, tags=tags)

    def _advance(self, key: tuple[str, Any], total: float) -> float:
        """How much ``total`` grew since the last refresh."""
        delta = total - self._last.get(key, 0)
        self._last[key] = total
        return delta


def _ray_metric(module: Any, spec: MetricSpec) -> Any:
    tag_keys = ("model_name", *spec.labels)
    if spec.kind == "histogram":
        return module.Histogram(spec.ray_name, spec.help, boundaries=list(spec.buckets), tag_keys=tag_keys)
    cls = module.Counter if spec.kind == "counter" else module.Gauge
    return cls(spec.ray_name, spec.help, tag_keys=tag_keys)
