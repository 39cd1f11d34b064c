"""Metrics: the spec table, both exporters (Prometheus text; Ray through fake metric classes, no cluster) and
lookahead's draft counts on a tiny model run."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from dataclasses import replace

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from lookahead_serve.engine import LLM, LookaheadParams, SamplingParams
from lookahead_serve.engine.llm_engine import EngineStats
from lookahead_serve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from lookahead_serve.proto.metrics import METRICS, SPECS, RayServerMetrics, ServerMetrics, request_observations

VLLM_NAMES = {
    "gauge": ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"],
    "counter": ["prompt_tokens", "generation_tokens", "request_success", "num_preemptions", "prefix_cache_queries",
                "prefix_cache_hits", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                "spec_decode_num_accepted_tokens"],
    "histogram": ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                  "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
                  "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                  "iteration_tokens_total", "request_time_per_output_token_seconds"],
}


def _stats(**kw) -> EngineStats:
    fields = dict(num_steps=0, step_tokens_total=0, step_seconds_total=0.0, step_predicted_seconds_total=0.0,
                  step_abs_error_seconds_total=0.0, last_step_seconds=0.0, last_predicted_seconds=None,
                  lookahead_chosen={}, num_preemptions=0, num_free_kv_blocks=10, num_used_kv_blocks=0, num_running=0,
                  num_waiting=0, num_prompt_tokens=0, num_generation_tokens=0, num_drafts=0, num_draft_tokens=0,
                  num_accepted_tokens=0, num_prefix_cache_queries=0, num_prefix_cache_hits=0, step_token_counts={})
    return EngineStats(**{**fields, **kw})


class FakeEngine:
    def __init__(self, stats: EngineStats) -> None:
        self.current = stats

    def stats(self) -> EngineStats:
        return self.current


def _repetitive_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts of a repeated phrase, so the n-gram pool has candidates that verify."""
    rng = random.Random(seed)
    return [[rng.randrange(96) for _ in range(5)] * 4 for _ in range(n)]


def _finished(reason: str = "length", n: int = 4) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, finished_time=13.5,
                             num_steps=3, num_output_tokens=n, last_token_time=13.0, num_drafts=2, num_draft_tokens=4,
                             num_accepted_tokens=1, inter_token_latencies=[1.0, 1.0])
    return RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, "", list(range(n)), finish_reason=reason)], True,
                         metrics)


# ---- the table ----------------------------------------------------------------------------------


def test_spec_table_has_vllm_names_and_valid_definitions():
    assert len(SPECS) == len(METRICS)
    for kind, names in VLLM_NAMES.items():
        for name in names:
            assert SPECS[name].kind == kind, name
    assert SPECS["request_success"].labels == ("finished_reason",)
    assert SPECS["segments"].labels == ("config",)
    for spec in METRICS:
        assert spec.kind in ("gauge", "counter", "histogram")
        assert spec.prometheus_name == "lookahead:" + spec.name
        assert re.fullmatch(r"lookahead_[a-z0-9_]+", spec.ray_name)  # Ray: no ':'
        assert "model_name" not in spec.labels
        if spec.kind == "histogram":
            assert spec.buckets and spec.buckets[0] > 0 and list(spec.buckets) == sorted(set(spec.buckets))
        else:
            assert not spec.buckets
            assert not spec.name.endswith("_total")  # counters get _total from the exporter


def test_request_observations_feed_exactly_the_request_level_metrics():
    out = _finished()
    seen = {name for name, _, _ in request_observations(out)}
    assert seen == {spec.name for spec in METRICS if spec.read is None}
    obs = list(request_observations(out))
    assert ("request_success", ("length",), 1) in obs
    assert ("time_to_first_token_seconds", (), 1.0) in obs
    assert ("request_queue_time_seconds", (), 0.5) in obs
    assert ("request_prefill_time_seconds", (), 0.5) in obs
    assert ("request_decode_time_seconds", (), 2.0) in obs
    assert ("request_inference_time_seconds", (), 2.5) in obs
    assert ("e2e_request_latency_seconds", (), 3.5) in obs
    assert ("request_time_per_output_token_seconds", (), 2.0 / 3) in obs
    assert [v for name, _, v in obs if name == "inter_token_latency_seconds"] == [1.0, 1.0]
    assert ("tokens_per_step", (), 4 / 3) in obs


def test_importing_metrics_imports_neither_ray_nor_torch():
    code = "import sys, lookahead_serve.proto.metrics; print('ray' in sys.modules, 'torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() == [
        "False", "False"]


# ---- Prometheus ---------------------------------------------------------------------------------


def _samples(registry) -> dict[tuple[str, tuple], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_prometheus_export_labels_every_metric_with_the_model_name():
    engine = FakeEngine(_stats(num_running=2, num_used_kv_blocks=3, num_free_kv_blocks=1, num_drafts=5,
                               lookahead_chosen={"5,3,5": 7}, step_token_counts={1: 2, 40: 1}))
    metrics = ServerMetrics(engine, "tiny")
    metrics.observe_finished(_finished("stop"))
    s = _samples(metrics.registry)
    m = (("model_name", "tiny"),)
    assert s["lookahead:num_requests_running", m] == 2
    assert s["lookahead:kv_cache_usage_perc", m] == 0.75
    assert s["lookahead:spec_decode_num_drafts_total", m] == 5
    assert s["lookahead:segments_total", (("config", "5,3,5"), *m)] == 7
    assert s["lookahead:request_success_total", (("finished_reason", "stop"), *m)] == 1
    assert s["lookahead:iteration_tokens_total_bucket", (("le", "1.0"), *m)] == 2
    assert s["lookahead:iteration_tokens_total_bucket", (("le", "32.0"), *m)] == 2
    assert s["lookahead:iteration_tokens_total_bucket", (("le", "64.0"), *m)] == 3
    assert s["lookahead:iteration_tokens_total_sum", m] == 42
    assert s["lookahead:time_to_first_token_seconds_count", m] == 1
    assert s["lookahead:inter_token_latency_seconds_count", m] == 2
    names = {name for name, _ in s}
    for spec in METRICS:
        suffix = {"gauge": "", "counter": "_total", "histogram": "_count"}[spec.kind]
        assert spec.prometheus_name + suffix in names
    assert all(dict(labels).get("model_name") == "tiny" for _, labels in s)


# ---- Ray (fake metric classes) ------------------------------------------------------------------


class FakeRayMetrics:
    """Stands in for ray.util.metrics: records each call as (metric name, method, value, tags)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float, dict]] = []
        self.created: dict[str, dict] = {}
        outer = self

        class _Metric:
            def __init__(self, name, description="", boundaries=None, tag_keys=None):
                if boundaries is not None:
                    assert all(b > 0 for b in boundaries) and boundaries == sorted(boundaries)
                outer.created[name] = dict(kind=type(self).__name__, tag_keys=tag_keys, boundaries=boundaries)
                self.name = name

            def _call(self, method, value, tags):
                assert set(tags) == set(outer.created[self.name]["tag_keys"])
                outer.calls.append((self.name, method, value, tags))

            def inc(self, value=1.0, tags=None):
                assert value > 0
                self._call("inc", value, tags)

            def set(self, value, tags=None):
                self._call("set", value, tags)

            def observe(self, value, tags=None):
                self._call("observe", value, tags)

        self.Counter = type("Counter", (_Metric,), {})
        self.Gauge = type("Gauge", (_Metric,), {})
        self.Histogram = type("Histogram", (_Metric,), {})

    def take(self) -> list[tuple[str, str, float, dict]]:
        calls, self.calls = self.calls, []
        return calls


def test_ray_metrics_are_the_same_table_with_underscores():
    fake = FakeRayMetrics()
    RayServerMetrics(FakeEngine(_stats()), "tiny", fake)
    assert set(fake.created) == {spec.ray_name for spec in METRICS}
    for spec in METRICS:
        created = fake.created[spec.ray_name]
        assert created["kind"] == spec.kind.capitalize()
        assert created["tag_keys"] == ("model_name", *spec.labels)
        if spec.kind == "histogram":
            assert created["boundaries"] == list(spec.buckets)


def test_ray_refresh_pushes_gauges_and_counter_deltas():
    fake = FakeRayMetrics()
    engine = FakeEngine(_stats(num_running=1, num_generation_tokens=10, lookahead_chosen={"5,3,5": 2},
                               step_token_counts={1: 3}))
    metrics = RayServerMetrics(engine, "tiny", fake)
    metrics.refresh()
    calls = fake.take()
    tiny = {"model_name": "tiny"}
    assert ("lookahead_num_requests_running", "set", 1, tiny) in calls
    assert ("lookahead_generation_tokens", "inc", 10, tiny) in calls
    assert ("lookahead_segments", "inc", 2, {"model_name": "tiny", "config": "5,3,5"}) in calls
    assert calls.count(("lookahead_iteration_tokens_total", "observe", 1, tiny)) == 3
    assert not any(name == "lookahead_prompt_tokens" for name, *_ in calls)  # nothing to add: no inc(0)

    engine.current = replace(engine.current, num_running=0, num_generation_tokens=14,
                             lookahead_chosen={"5,3,5": 2, "7,4,7": 1}, step_token_counts={1: 3, 9: 1})
    metrics.refresh()
    calls = fake.take()
    assert ("lookahead_num_requests_running", "set", 0, tiny) in calls
    assert ("lookahead_generation_tokens", "inc", 4, tiny) in calls
    incs = [c for c in calls if c[1] == "inc"]
    assert ("lookahead_segments", "inc", 1, {"model_name": "tiny", "config": "7,4,7"}) in incs
    assert not any(c[0] == "lookahead_segments" and c[3]["config"] == "5,3,5" for c in incs)
    assert [c for c in calls if c[0] == "lookahead_iteration_tokens_total"] == [
        ("lookahead_iteration_tokens_total", "observe", 9, tiny)]

    metrics.refresh()
    assert not [c for c in fake.take() if c[1] != "set"]  # nothing changed: only the gauges are set again


def test_ray_observe_finished_tags_each_observation():
    fake = FakeRayMetrics()
    RayServerMetrics(FakeEngine(_stats()), "tiny", fake).observe_finished(_finished("stop"))
    calls = fake.take()
    assert ("lookahead_request_success", "inc", 1, {"model_name": "tiny", "finished_reason": "stop"}) in calls
    assert ("lookahead_time_to_first_token_seconds", "observe", 1.0, {"model_name": "tiny"}) in calls
    assert len(calls) == len(list(request_observations(_finished("stop"))))


# ---- lookahead's draft counts on a tiny model ---------------------------------------------------


def test_draft_counts_on_a_tiny_model_run(tiny_llama):
    llm = LLM(tiny_llama, lookahead=LookaheadParams(5, 3, 5), lookahead_policy="fixed")
    metrics = ServerMetrics(llm.engine, "tiny")
    prompts = _repetitive_prompts(4, seed=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=24))
    candidate_len = 3 - 1
    for out in outs:
        m = out.metrics
        assert m.num_drafts == m.pool_hits
        assert m.num_draft_tokens == candidate_len * m.num_drafts  # not times the number of candidates
        assert 0 <= m.num_accepted_tokens <= m.num_draft_tokens
        assert m.num_accepted_tokens == sum((k - 1) * n for k, n in m.accepted_lengths.items())
        # every step gives one token plus what it accepted; the last step may drop some past max_tokens
        assert 0 <= m.num_steps + m.num_accepted_tokens - m.num_output_tokens <= candidate_len
        assert len(m.inter_token_latencies) == m.num_steps - 1
        assert m.time_to_first_token <= m.e2e_latency
        metrics.observe_finished(out)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0  # lookahead really accepted tokens

    stats = llm.engine.stats()
    assert stats.num_drafts == sum(o.metrics.num_drafts for o in outs)
    assert stats.num_draft_tokens == sum(o.metrics.num_draft_tokens for o in outs)
    assert stats.num_accepted_tokens == sum(o.metrics.num_accepted_tokens for o in outs)
    assert stats.num_generation_tokens == sum(o.metrics.num_output_tokens for o in outs) == 4 * 24
    assert stats.num_prompt_tokens == sum(map(len, prompts))
    assert sum(stats.step_token_counts.values()) == stats.num_steps
    assert sum(k * n for k, n in stats.step_token_counts.items()) == stats.step_tokens_total

    s = _samples(metrics.registry)
    m = (("model_name", "tiny"),)
    assert s["lookahead:spec_decode_num_accepted_tokens_total", m] == stats.num_accepted_tokens
    assert s["lookahead:generation_tokens_total", m] == 4 * 24
    assert s["lookahead:request_success_total", (("finished_reason", "length"), *m)] == 4
    assert s["lookahead:request_generation_tokens_sum", m] == 4 * 24
    assert s["lookahead:num_requests_running", m] == 0
