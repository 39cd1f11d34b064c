"""Prometheus metrics of a server (prometheus-client), on a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ServerMetrics:
    def __init__(self, engine: LLMEngine) -> None:
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
        kv = engine.kv_manager
        Gauge("lookahead_kv_blocks_free", "Free KV blocks", registry=r).set_function(lambda: kv.num_free_blocks)
        Gauge("lookahead_kv_blocks_used", "Used KV blocks", registry=r).set_function(
            lambda: kv.pool.num_blocks - kv.num_free_blocks)
        Gauge("lookahead_requests_waiting", "Queued requests", registry=r).set_function(
            lambda: engine.scheduler.num_waiting)
        Gauge("lookahead_requests_running", "Running requests", registry=r).set_function(
            lambda: engine.scheduler.num_running)

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
