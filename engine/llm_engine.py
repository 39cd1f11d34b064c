"""The step loop: schedule -> execute -> update, plus request intake and outputs."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from lookahead_serve.engine.attention import BACKENDS, get_backend
from lookahead_serve.engine.config import EngineConfig, resolve_dtype
from lookahead_serve.engine.detokenizer import IncrementalDetokenizer
from lookahead_serve.engine.loader import (cache_root, gguf_source, load_hf_config, load_state_dict, load_tokenizer,
                                           resolve_model)
from lookahead_serve.engine.model_runner import ModelRunner, kv_bytes_per_block
from lookahead_serve.engine.models.llama import LlamaForCausalLM, head_dim
from lookahead_serve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from lookahead_serve.engine.quant import load_packed, resolve_quantization
from lookahead_serve.engine.step_profile import cached_step_cost
from lookahead_serve.kv_cache import KVCacheManager
from lookahead_serve.scheduler import LookaheadConfig, Request, RequestStatus, SamplingParams, Scheduler
from lookahead_serve.scheduler.request import describe_error
from lookahead_serve.scheduler.cost import StepCostModel

logger = logging.getLogger(__name__)
schedule_logger = logging.getLogger("lookahead_serve.schedule")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

PromptType = str | dict[str, Any] | Sequence[int]


@dataclass
class _Tracked:
    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer
    num_sent_tokens: int = 0
    sent_text: str = ""


def lookahead_label(p) -> str:
    return f"{p.window_size},{p.ngram_size},{p.verification_set_size}"


@dataclass(frozen=True)
class ModelInfo:
    """What the engine serves and its limits (LLMEngine.model_info)."""

    model_path: str
    dtype: str  # "float32", "bfloat16" or "float16"
    device: str
    max_model_len: int
    vocab_size: int
    block_size: int  # tokens per KV block
    num_kv_blocks: int
    attention_backend: str  # engine.attention.BACKENDS name
    quantization: str  # "gguf" (block-quantized linears) or "none"
    lookahead: LookaheadConfig  # the default (W, N, G) and the most a request may ask for
    lookahead_policy: str  # "fixed" or "adaptive"
    lookahead_objective: str  # "throughput" or "makespan"


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's running totals and queues (LLMEngine.stats).

    Taken without a lock, also from other threads (a metrics scrape): each field is read once, so fields may
    straddle a step, but none is torn."""

    num_steps: int
    step_tokens_total: int
    step_seconds_total: float
    step_predicted_seconds_total: float  # over the steps the cost model predicted
    step_abs_error_seconds_total: float
    last_step_seconds: float
    last_predicted_seconds: float | None
    lookahead_chosen: dict[str, int]  # "w,n,g" -> lookahead segments run
    num_preemptions: int
    num_free_kv_blocks: int
    num_used_kv_blocks: int
    num_running: int
    num_waiting: int
    num_prompt_tokens: int  # of requests that reached their first token
    num_generation_tokens: int
    num_drafts: int  # lookahead drafts (scheduler.request.DraftCounts), summed over requests
    num_draft_tokens: int
    num_accepted_tokens: int
    num_prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    num_prefix_cache_hits: int  # of those, tokens found
    step_token_counts: dict[int, int]  # tokens in a step -> steps

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use (cached blocks nobody uses count as free), 0..1."""
        total = self.num_free_kv_blocks + self.num_used_kv_blocks
        return self.num_used_kv_blocks / total if total else 0.0


class LLMEngine:
    """cost_model: the step-cost model for the adaptive lookahead policy; None measures one at start-up
    (only when the policy is adaptive). log_schedule: log every step's tokens, chosen (w, n, g) and
    predicted vs observed time at INFO (logger ``engine.schedule``)."""

    def __init__(self, config: EngineConfig, cost_model: StepCostModel | None = None, log_schedule: bool = False) -> None:
        self.config = config
        mc = config.model
        start = time.perf_counter()
        self.model_path = resolve_model(mc.model)
        self.hf_config = load_hf_config(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.device = torch.device(mc.device)
        gguf_file = gguf_source(mc.model)
        self.quantization = resolve_quantization(mc.quantization, gguf_file, mc.device)
        packed = {}
        if self.quantization == "gguf":
            try:
                packed = load_packed(gguf_file, self.hf_config, self.model_path / "blockq")
            except (ValueError, RuntimeError) as e:  # a layer type the kernel does not hold; no build
                if mc.quantization == "gguf":
                    raise
                logger.info("weights dequantized: %s", e)
                self.quantization = "none"
        self.dtype = _DTYPES[resolve_dtype(mc.dtype, mc.device, self.quantization)]

        model_max = int(getattr(self.hf_config, "max_position_embeddings", 2048))
        max_model_len = mc.max_model_len or model_max
        if max_model_len > model_max:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's {model_max} positions")
        sched_cfg = replace(config.scheduler, max_model_len=max_model_len)

        torch.manual_seed(mc.seed)
        backend = get_backend(mc.attention_backend, mc.device, self.dtype, head_dim(self.hf_config))
        self._backend_name = next(name for name, cls in BACKENDS.items() if type(backend) is cls)
        with torch.device("meta"):  # no random init: every parameter is overwritten by the checkpoint
            model = LlamaForCausalLM(self.hf_config, backend, max_model_len)
        # Module.to_empty's empty_like on meta tensors runs a Python reference (~1 s here); torch.empty does not
        model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=self.device))
        skip = model.block_weight_names(packed)
        model.load_weights(load_state_dict(self.model_path, skip), skip)
        if packed:
            model.use_block_weights(packed)
        self.model = model.to(dtype=self.dtype).eval()
        if packed and (reason := self.model.use_native_step()) is not None:
            logger.info("decoder step in modules: %s", reason)

        cc = config.cache
        num_blocks = cc.num_blocks or max(
            1, int(cc.kv_cache_memory_gib * (1 << 30)) // kv_bytes_per_block(self.hf_config, cc.block_size, self.dtype)
        )
        self.kv_manager = KVCacheManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        self.runner = ModelRunner(self.model, num_blocks, cc.block_size, self.device, self.dtype, mc.seed)
        if cost_model is None and sched_cfg.lookahead.policy == "adaptive":
            cost_model = cached_step_cost(self.runner, self.model_path, backend.cost_key,
                                          sched_cfg.max_num_batched_tokens, cache_root() / "step-cost", self.quantization)
        self.scheduler = Scheduler(sched_cfg, self.kv_manager, cost_model)
        self.log_schedule = log_schedule
        self.lookahead_chosen: Counter[str] = Counter()  # (w,n,g) label -> lookahead segments run
        self.step_tokens_total = 0
        self.step_token_counts: Counter[int] = Counter()  # tokens in a step -> steps
        self.step_seconds_total = 0.0
        self.step_predicted_seconds_total = 0.0  # over the steps the cost model predicted
        self.step_abs_error_seconds_total = 0.0
        self.last_step_seconds = 0.0
        self.last_predicted_seconds: float | None = None
        self.eos_token_ids = self._eos_ids()
        self._tracked: dict[str, _Tracked] = {}
        self._next_id = 0
        self.num_steps = 0
        self.load_seconds = time.perf_counter() - start
        logger.info("loaded %s in %.1f s, %d KV blocks of %d", self.model_path, self.load_seconds, num_blocks, cc.block_size)

    def _eos_ids(self) -> frozenset[int]:
        ids = getattr(self.hf_config, "eos_token_id", None)
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return frozenset(ids)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    # ---- facade for the layers above (server, metrics) ------------------------------------------
    def model_info(self) -> ModelInfo:
        cfg = self.scheduler.config  # read live: a caller may replace it between runs
        return ModelInfo(
            model_path=str(self.model_path),
            dtype=next(name for name, dt in _DTYPES.items() if dt == self.dtype),
            device=str(self.device),
            max_model_len=cfg.max_model_len,
            vocab_size=self.vocab_size,
            block_size=self.kv_manager.block_size,
            num_kv_blocks=self.kv_manager.pool.num_blocks,
            attention_backend=self._backend_name,
            quantization=self.quantization,
            lookahead=cfg.lookahead,
            lookahead_policy=cfg.lookahead.policy,
            lookahead_objective=cfg.lookahead.objective,
        )

    def stats(self) -> EngineStats:
        free = self.kv_manager.num_free_blocks
        sched, drafts = self.scheduler, self.scheduler.drafts
        return EngineStats(
            num_steps=self.num_steps,
            step_tokens_total=self.step_tokens_total,
            step_seconds_total=self.step_seconds_total,
            step_predicted_seconds_total=self.step_predicted_seconds_total,
            step_abs_error_seconds_total=self.step_abs_error_seconds_total,
            last_step_seconds=self.last_step_seconds,
            last_predicted_seconds=self.last_predicted_seconds,
            lookahead_chosen=dict(self.lookahead_chosen),
            num_preemptions=self.scheduler.num_preemptions,
            num_free_kv_blocks=free,
            num_used_kv_blocks=self.kv_manager.pool.num_blocks - free,
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            num_prompt_tokens=sched.num_prompt_tokens,
            num_generation_tokens=sched.num_generation_tokens,
            num_drafts=drafts.num_drafts,
            num_draft_tokens=drafts.num_draft_tokens,
            num_accepted_tokens=drafts.num_accepted_tokens,
            num_prefix_cache_queries=self.kv_manager.num_prefix_query_tokens,
            num_prefix_cache_hits=self.kv_manager.num_prefix_hit_tokens,
            step_token_counts=dict(self.step_token_counts),
        )

    # ---- intake --------------------------------------------------------------------------------
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
            return prompt, list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:  # with "prompt" too, that is their text (the output's prompt)
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise ValueError("prompt must be a string")
                return text, self._checked_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        return None, self._checked_ids(prompt)

    def _checked_ids(self, ids) -> list[int]:
        ids = list(ids)
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt_token_ids must be ints in [0, {self.vocab_size})")
        return ids

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template may reject a role or an order of messages (jinja2 raises its own types)
            raise ValueError(f"chat: the model's chat template rejects these messages: {e}") from None

    def chat_prompt(self, messages: list[dict[str, str]]) -> dict:
        """A conversation as a prompt: the chat template's text and its token ids, tokenized without the
        tokenizer's own special tokens (the template writes every one it wants: no second BOS)."""
        text = self.apply_chat_template(messages)
        return {"prompt": text, "prompt_token_ids": list(self.tokenizer(text, add_special_tokens=False).input_ids)}

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        params = params or SamplingParams()
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be ints in [0, {self.vocab_size})")
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        req = Request(request_id, ids, params, frozenset() if params.ignore_eos else self.eos_token_ids)
        self.scheduler.add_request(req)
        detok = IncrementalDetokenizer(
            self.tokenizer, params.skip_special_tokens, params.stop_strs, params.include_stop_str_in_output
        )
        self._tracked[request_id] = _Tracked(req, text, detok)
        return request_id

    def abort_request(self, request_ids: str | Sequence[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        aborted = self.scheduler.abort_requests(ids)
        return [self._output(self._tracked.pop(r.request_id)) for r in aborted]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one forward pass over everything scheduled; return outputs of requests that advanced.

        A fault raised for one request (its sampling, verification, commit, bookkeeping or detokenization)
        ends that request with finish_reason "error" and leaves the others' tokens as they would have been.
        A fault no request can be blamed for ends the step's requests; the engine goes on serving."""
        try:
            sched_out = self.scheduler.schedule()
        except Exception as e:
            logger.exception("scheduling failed; failing the running requests")
            return self._fail({r.request_id: describe_error(e) for r in list(self.scheduler.running)})
        # Requests the scheduler ended itself (outgrown the KV cache) report here; an id reused by a new
        # request since then names the new one, which is not finished.
        outputs = [self._output(self._tracked.pop(r)) for r in sched_out.finished_req_ids
                   if r in self._tracked and self._tracked[r].request.status.finished]
        if sched_out.is_empty:
            if not outputs and self.scheduler.has_unfinished_requests():
                raise RuntimeError("scheduler made no progress with requests waiting (KV cache too small?)")
            return outputs
        try:
            self._run(sched_out, outputs)
        except Exception as e:  # outputs keeps what was produced before the fault: those requests are done
            logger.exception("engine step failed; failing its requests")
            outputs += self._fail({s.req_id: describe_error(e) for s in sched_out.scheduled})
        return outputs

    def _run(self, sched_out, outputs: list[RequestOutput]) -> None:
        """Execute a scheduled step and append its outputs to ``outputs``."""
        t0 = time.perf_counter()
        runner_out = self.runner.execute(sched_out)
        self.last_step_seconds = time.perf_counter() - t0
        stats = replace(sched_out.stats, seconds=self.last_step_seconds) if sched_out.stats else None
        self.last_predicted_seconds = stats.predicted_seconds if stats else None
        self.num_steps += 1
        self.step_tokens_total += sched_out.num_scheduled_tokens
        self.step_token_counts[sched_out.num_scheduled_tokens] += 1
        self.step_seconds_total += self.last_step_seconds
        if self.last_predicted_seconds is not None:
            self.step_predicted_seconds_total += self.last_predicted_seconds
            self.step_abs_error_seconds_total += abs(self.last_predicted_seconds - self.last_step_seconds)
        chosen = [lookahead_label(p) for p in stats.lookahead] if stats else []
        self.lookahead_chosen.update(chosen)
        if self.log_schedule:
            self._log_step(sched_out, chosen)
        outputs += self._fail(runner_out.failed)
        for req in self.scheduler.update_from_output(sched_out, runner_out, stats):
            tracked = self._tracked[req.request_id]
            try:
                tracked.detok.update(req.output_token_ids, req.status.finished)
                if tracked.detok.stopped_by is not None and not req.status.finished:
                    self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, tracked.detok.stopped_by)
                elif tracked.detok.stopped_by is not None and req.status == RequestStatus.FINISHED_LENGTH:
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, tracked.detok.stopped_by
            except Exception as e:
                logger.exception("detokenizing failed for request %s", req.request_id)
                self.scheduler.fail_requests({req.request_id: describe_error(e)})
            outputs.append(self._output(tracked))
            if req.status.finished:
                del self._tracked[req.request_id]

    def _fail(self, errors: dict[str, str]) -> list[RequestOutput]:
        """End these requests with their errors; their final outputs."""
        if errors:
            logger.error("ending %d request(s) with an internal error: %s", len(errors), errors)
        self.scheduler.fail_requests(errors)
        return [self._output(self._tracked.pop(r)) for r in errors if r in self._tracked]

    def _log_step(self, sched_out, chosen: list[str]) -> None:
        segs = sched_out.scheduled
        n_prefill = sum(len(s.token_ids) > 1 and s.lookahead is None for s in segs)
        n_plain = sum(len(s.token_ids) == 1 for s in segs)
        configs = ", ".join(f"{k} x{v}" for k, v in sorted(Counter(chosen).items())) or "-"
        predicted = "-" if self.last_predicted_seconds is None else f"{self.last_predicted_seconds * 1e3:.1f}"
        schedule_logger.info(
            "step %d: %d tokens (%d prefill chunks, %d plain decodes, %d lookahead: %s); predicted %s ms, observed "
            "%.1f ms; lookahead cost checked at %.2fx the model's",
            self.num_steps, sched_out.num_scheduled_tokens, n_prefill, n_plain, len(chosen), configs, predicted,
            self.last_step_seconds * 1e3, sched_out.stats.cost_scale if sched_out.stats else 1.0,
        )

    def _output(self, tracked: _Tracked) -> RequestOutput:
        req = tracked.request
        ids = req.output_token_ids
        delta_ids = ids[tracked.num_sent_tokens :]
        tracked.num_sent_tokens = len(ids)
        previous, text = tracked.sent_text, tracked.detok.text
        tracked.sent_text = text
        t = req.timing
        return RequestOutput(
            request_id=req.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=0,
                    text=text,
                    token_ids=list(ids),
                    finish_reason=req.status.finish_reason,
                    stop_reason=req.stop_reason,
                    delta_text=text[len(previous) :],
                    delta_token_ids=delta_ids,
                )
            ],
            finished=req.status.finished,
            error=req.error,
            metrics=RequestMetrics(
                arrival_time=t.arrival,
                first_scheduled_time=t.first_scheduled,
                first_token_time=t.first_token,
                finished_time=t.finished,
                last_token_time=t.last_token,
                num_steps=req.num_steps,
                num_output_tokens=req.num_output_tokens,
                num_preemptions=req.num_preemptions,
                accepted_lengths=dict(sorted(req.accepted_lengths.items())),
                pool_hits=req.lookahead.num_pool_hits if req.lookahead else 0,
                num_drafts=req.drafts.num_drafts,
                num_draft_tokens=req.drafts.num_draft_tokens,
                num_accepted_tokens=req.drafts.num_accepted_tokens,
                inter_token_latencies=list(t.inter_token) if req.status.finished else [],
            ),
        )
