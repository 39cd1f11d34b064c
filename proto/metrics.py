"""Prometheus metrics of a server (prometheus-client), on a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lookahead_serve.engine.llm_engine import LLMEngine
from lookahead_serve.engine.outputs import RequestOutput

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ScheduleCollector(Collector):
    """The lookahead scheduler's decisions, the KV cache and the queues: one engine.stats() per scrape."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def collect(self):
        e = self.engine.stats()
        yield CounterMetricFamily("lookahead_engine_steps", "Engine steps (forward passes)", value=e.num_steps)
        yield CounterMetricFamily("lookahead_engine_step_tokens", "Tokens in engine steps, summed", value=e.step_tokens_total)
        yield CounterMetricFamily("lookahead_engine_step_seconds", "Observed engine step time, summed",
                                  value=e.step_seconds_total)
        yield CounterMetricFamily("lookahead_engine_step_predicted_seconds",
                                  "Step time the step-cost model predicted, summed", value=e.step_predicted_seconds_total)
        yield CounterMetricFamily("lookahead_engine_step_abs_error_seconds",
                                  "|predicted - observed| step time, summed", value=e.step_abs_error_seconds_total)
        chosen = CounterMetricFamily("lookahead_segments", "Lookahead segments run, by (w, n, g)", labels=["config"])
        for label, n in sorted(e.lookahead_chosen.items()):
            chosen.add_metric([label], n)
        yield chosen
        yield GaugeMetricFamily("lookahead_engine_last_step_seconds", "Observed time of the latest step",
                                value=e.last_step_seconds)
        yield GaugeMetricFamily("lookahead_kv_blocks_free", "Free KV blocks", value=e.num_free_kv_blocks)
        yield GaugeMetricFamily("lookahead_kv_blocks_used", "Used KV blocks", value=e.num_used_kv_blocks)
        yield GaugeMetricFamily("lookahead_requests_waiting", "Queued requests", value=e.num_waiting)
        yield GaugeMetricFamily("lookahead_requests_running", "Running requests", value=e.num_running)


class ServerMetrics:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("lookahead_time_to_first_token_seconds", "Time to first token", registry=r, buckets=_LATENCY)
        self.tpot = Histogram("lookahead_time_per_output_token_seconds", "Time per output token after the first",
                              registry=r, buckets=_LATENCY)
        self.tokens_per_step = Histogram("lookahead_tokens_per_step", "Output tokens per decoding step, per request",
                                         registry=r, buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 6, 8))
        self.requests = Counter("lookahead_requests", "Finished requests", ["finish_reason"], registry=r)
        self.generated = Counter("lookahead_generated_tokens", "Generated tokens", registry=r)
        self.steps = Counter("lookahead_decoding_steps", "Decoding steps summed over requests", registry=r)
        self.accepted = Counter("lookahead_accepted_draft_tokens", "Tokens beyond one per step from lookahead",
                                registry=r)
        r.register(ScheduleCollector(engine))

    def observe_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        n = m.num_output_tokens
        self.requests.labels(out.outputs[0].finish_reason or "unknown").inc()
        self.generated.inc(n)
        self.steps.inc(m.num_steps)
        self.accepted.inc(max(n - m.num_steps, 0))
        if m.num_steps:
            self.tokens_per_step.observe(m.tokens_per_step)
        if m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
            if n > 1 and m.finished_time is not None and m.first_token_time is not None:
                self.tpot.observe((m.finished_time - m.first_token_time) / (n - 1))
