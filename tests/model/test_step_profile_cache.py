"""The adaptive policy's step-cost profile is measured once per machine, model, dtype, backend, block size
and step budget, then read from the cache directory: a later engine starts without profiling."""

from __future__ import annotations

import pytest

from lookahead_serve.engine import LLM, step_profile


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "lookahead-serve" / "step-cost"


def _adaptive(path):
    return LLM(path, dtype="float32", attention_backend="sdpa", lookahead_policy="adaptive", max_num_batched_tokens=32,
               num_kv_blocks=32, block_size=8)


def test_a_second_engine_reads_the_saved_profile_and_a_broken_one_is_measured_again(tiny_llama, cache_home, monkeypatch):
    engine = _adaptive(tiny_llama).engine
    first = engine.scheduler.planner.cost_model
    files = list(cache_home.glob("*.json"))
    assert len(files) == 1
    key = step_profile.profile_key(engine.runner, engine.model_path, "SDPABackend", 32)
    assert files[0].stem == key
    assert step_profile.profile_key(engine.runner, engine.model_path, "SDPABackend", 64) != key
    assert step_profile.profile_key(engine.runner, engine.model_path, "TorchReferenceBackend", 32) != key
    assert step_profile.profile_key(engine.runner, engine.model_path, "SDPABackend", 32, "gguf") != key

    profiled = []
    measure = step_profile.profile_step_cost
    monkeypatch.setattr(step_profile, "profile_step_cost", lambda *a, **k: profiled.append(1) or measure(*a, **k))
    second = _adaptive(tiny_llama).engine.scheduler.planner.cost_model
    assert not profiled
    assert (second.knots, second.seconds, second.per_segment, second.per_decode, second.decode_overhead) == (
        first.knots, first.seconds, first.per_segment, first.per_decode, first.decode_overhead)

    files[0].write_text("{not json")
    _adaptive(tiny_llama)
    assert profiled == [1]
    assert files[0].read_text().startswith('{"knots"')
