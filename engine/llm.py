"""The offline API, in vLLM's shape: ``LLM(model=None).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from dataclasses import replace

from lookahead_serve.engine.config import CacheConfig, EngineConfig, ModelConfig
from lookahead_serve.engine.llm_engine import LLMEngine, PromptType
from lookahead_serve.engine.outputs import RequestOutput
from lookahead_serve.scheduler import LookaheadConfig, LookaheadParams, SamplingParams, SchedulerConfig


def _lookahead_config(default, maximum, policy, objective) -> LookaheadConfig:
    """LookaheadConfig's defaults, with what the caller gave."""
    given = dict(default=default, policy=policy, objective=objective)
    if maximum is not None:
        given.update(zip(("max_window_size", "max_ngram_size", "max_verification_set_size"), maximum, strict=True))
    return replace(LookaheadConfig(), **{k: v for k, v in given.items() if v is not None})


class LLM:
    """An engine with the model loaded, for batch generation and streaming in-process.

    model: None for the embedded SmolLM2-135M-Instruct, else a Hugging Face folder or a .gguf file.
    lookahead: the engine's default for requests whose SamplingParams.lookahead is None;
    max_lookahead: the largest (window_size, ngram_size, verification_set_size) a request may ask for.
    lookahead_policy: "adaptive" (the default) treats each request's (W, N, G) as its maximum and chooses
    (w, n, g) each step from a step-cost model (step_cost_model, else measured once per machine, model,
    dtype and backend, and cached on disk) and each request's acceptance; "fixed" runs (W, N, G) as asked. lookahead_objective: what the adaptive policy maximises --
    "makespan" (the default here: ``generate`` returns when its last prompt finishes, so while nothing
    waits a token counts by the chance that its request would finish last) or "throughput" (every token
    alike: the most tokens per second, the servers' choice). log_schedule: log each step's decisions.
    Other keyword arguments fill the config tree (ModelConfig, CacheConfig, SchedulerConfig).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        quantization: str = "auto",
        device: str = "cpu",
        seed: int = 0,
        attention_backend: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gib: float = 1.0,
        enable_prefix_caching: bool = True,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        lookahead: LookaheadParams | None = None,
        max_lookahead: tuple[int, int, int] | None = None,
        lookahead_policy: str | None = None,
        lookahead_objective: str | None = None,
        step_cost_model=None,
        log_schedule: bool = False,
    ) -> None:
        self._init(
            EngineConfig(
                model=ModelConfig(model=model, dtype=dtype, quantization=quantization, device=device, seed=seed, max_model_len=max_model_len,
                                  attention_backend=attention_backend),
                cache=CacheConfig(
                    block_size=block_size,
                    num_blocks=num_kv_blocks,
                    kv_cache_memory_gib=kv_cache_memory_gib,
                    enable_prefix_caching=enable_prefix_caching,
                ),
                scheduler=SchedulerConfig(
                    max_num_batched_tokens=max_num_batched_tokens,
                    max_num_seqs=max_num_seqs,
                    lookahead=_lookahead_config(lookahead, max_lookahead, lookahead_policy, lookahead_objective),
                ),
            ),
            step_cost_model,
            log_schedule,
        )

    @classmethod
    def from_config(cls, config: EngineConfig, step_cost_model=None, log_schedule: bool = False) -> LLM:
        """An LLM over a whole config tree (what the CLI builds from its flags)."""
        llm = cls.__new__(cls)
        llm._init(config, step_cost_model, log_schedule)
        return llm

    def _init(self, config: EngineConfig, step_cost_model, log_schedule: bool) -> None:
        self.engine = LLMEngine(config, cost_model=step_cost_model, log_schedule=log_schedule)
        self.tokenizer = self.engine.tokenizer

    def _add(self, prompts, params) -> list[str]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        if isinstance(params, SamplingParams) or params is None:
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        return [self.engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts. A request that a
        fault inside the engine ended comes back with finish_reason "error" and ``error`` set."""
        ids = self._add(prompts, sampling_params)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Yield partial outputs as the steps produce them (``outputs[0].delta_text`` is the new text)."""
        ids = self._add(prompts, sampling_params)
        try:
            while self.engine.has_unfinished_requests():
                yield from self.engine.step()
        finally:
            self.engine.abort_request(ids)  # the caller stopped early: free what is left

    def chat(
        self, messages: list[dict[str, str]] | list[list[dict[str, str]]], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation (or several), rendered with the model's chat template."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.engine.chat_prompt(c) for c in convs], sampling_params)  # type: ignore[arg-type]
