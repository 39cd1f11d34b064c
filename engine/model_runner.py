"""Scheduler contract in, sampled tokens out: packs every segment into one flat varlen batch.

No padding: the step's tokens are concatenated; positions, slot mapping and prefix slots are computed
with numpy from the segments' start positions, offsets and block tables, then the model runs once.
Prefill chunks and plain decodes write their keys and values to the cache as the layers run. A
lookahead segment's tokens are transient: after verification only x and the accepted candidate tokens
are committed to the cache, from the step's own keys and values.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import mmap
from dataclasses import dataclass

import numpy as np
import torch

from lookahead_serve.engine.attention import CommonAttentionMetadata, SegmentKind
from lookahead_serve.engine.models.llama import head_dim
from lookahead_serve.engine.sampler import Sampler, processed_probs
from lookahead_serve.engine.verify import Verdict, verify_greedy, verify_sampling
from lookahead_serve.kv_cache import build_block_table, compute_slot_mapping
from lookahead_serve.scheduler import LookaheadLayout, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from lookahead_serve.scheduler.request import describe_error

logger = logging.getLogger(__name__)


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    elem = torch.tensor([], dtype=dtype).element_size()
    return hf_config.num_hidden_layers * 2 * block_size * hf_config.num_key_value_heads * head_dim * elem


@functools.lru_cache(maxsize=256)
def tree_layout(layout: LookaheadLayout) -> tuple[np.ndarray, np.ndarray]:
    """Offsets [n] and tree mask [n, n] (True = may attend) of a lookahead segment; shared, read-only."""
    offsets, parents = layout.tree()
    n = len(offsets)
    mask = np.zeros((n, n), dtype=bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] = mask[parent]
        mask[i, i] = True
    offsets_arr = np.asarray(offsets, dtype=np.int64)
    offsets_arr.flags.writeable = mask.flags.writeable = False
    return offsets_arr, mask


@dataclass
class StepInputs:
    input_ids: np.ndarray  # [T]
    positions: np.ndarray  # [T]
    meta: CommonAttentionMetadata


def _kind(seg: ScheduledRequest) -> SegmentKind:
    if seg.lookahead is not None:
        return SegmentKind.LOOKAHEAD
    # One committed token attends to its prefix and itself, all in the cache once written: a decode.
    return SegmentKind.DECODE if len(seg.token_ids) == 1 else SegmentKind.PREFILL


def build_step_inputs(segs: list[ScheduledRequest], block_size: int, device: torch.device) -> StepInputs:
    """Token ids, positions and the backend-neutral attention metadata of one packed step, on the host."""
    bs = block_size
    n_segs = len(segs)
    seg_lens = np.fromiter((len(s.token_ids) for s in segs), dtype=np.int64, count=n_segs)
    starts = np.fromiter((s.start_pos for s in segs), dtype=np.int64, count=n_segs)
    cu = np.zeros(n_segs + 1, dtype=np.int64)
    np.cumsum(seg_lens, out=cu[1:])
    num_tokens = int(cu[-1])
    seg_of_token = np.repeat(np.arange(n_segs), seg_lens)
    offsets = np.arange(num_tokens) - np.repeat(cu[:-1], seg_lens)
    tree_masks: list[np.ndarray | None] = [None] * n_segs
    transient = np.zeros(num_tokens, dtype=bool)
    for s, seg in enumerate(segs):
        if seg.lookahead is not None:
            offsets[cu[s] : cu[s + 1]], tree_masks[s] = tree_layout(seg.lookahead)
            transient[cu[s] : cu[s + 1]] = True
    positions = starts[seg_of_token] + offsets
    table = build_block_table([s.block_ids for s in segs])
    # Transient tokens may lie past the blocks the request owns: clip, then mark them unwritten.
    block_idx = np.minimum(positions // bs, table.shape[1] - 1)
    slots = np.where(transient, -1, table[seg_of_token, block_idx] * bs + positions % bs)
    meta = CommonAttentionMetadata(
        num_tokens=num_tokens,
        block_size=bs,
        device=device,
        kinds=[_kind(s) for s in segs],
        query_start_loc=cu.tolist(),
        context_lens=starts.tolist(),
        positions=positions,
        block_table=table,
        slot_mapping=slots,
        tree_masks=tree_masks,
    )
    input_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in segs), np.int64, num_tokens)
    return StepInputs(input_ids, positions, meta)


@contextlib.contextmanager
def _without_onednn():
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


def _zeroed(count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """``count`` zero tensors. On the CPU they share one anonymous memory map, which the OS hands out
    zero-filled page by page as it is first touched: zeroing a cache of a GiB up front takes about 0.5 s
    of start-up. (Masked padding reads slots nothing wrote: they must be finite, so zeros, never
    torch.empty's leftovers.)"""
    if device.type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(count)]
    per = math.prod(shape)
    memory = mmap.mmap(-1, count * per * dtype.itemsize)
    flat = torch.frombuffer(memory, dtype=dtype)  # the tensor keeps the map alive
    return [flat[i * per:(i + 1) * per].view(shape) for i in range(count)]


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype, seed: int):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        # Per layer: [2 (key, value), num_blocks * block_size slots, num_kv_heads, head_dim]
        shape = (2, num_blocks * block_size, cfg.num_key_value_heads, head_dim(cfg))
        self.kv_caches = _zeroed(cfg.num_hidden_layers, shape, dtype, device)
        self.sampler = Sampler(seed)
        # bfloat16 / float16 on CPU: ATen's own GEMM, one float32 dot product per output, so a row's bits do
        # not depend on how many rows share the call. oneDNN (taken on avx512_bf16 / AMX CPUs) picks its
        # blocking by shape. A no-op where oneDNN would not take the GEMM anyway (docs/batch-invariance.md).
        self._kernels = _without_onednn if device.type == "cpu" and dtype != torch.float32 else contextlib.nullcontext

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. A request whose own part raises (sampling, verification, its commit) is reported in
        ``failed`` and the rest of the step stands. If the shared part raises (inputs, the forward pass), each
        segment runs again alone: those that still raise are the culprits, the others keep their results.
        Rerunning is safe: a failed pass has sampled nothing, and rewriting a key or value slot is idempotent."""
        self.sampler.forget(so.finished_req_ids)
        segs = so.scheduled
        if not segs:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        try:
            return self._execute(segs)
        except Exception as e:
            if len(segs) == 1:
                logger.exception("step failed for request %s", segs[0].req_id)
                return ModelRunnerOutput([segs[0].req_id], [[]], failed={segs[0].req_id: describe_error(e)})
            logger.exception("step of %d segments failed; running each alone to find the culprit", len(segs))
        outs = []
        for seg in segs:
            try:
                outs.append(self._execute([seg]))
            except Exception as e:
                logger.exception("step failed for request %s", seg.req_id)
                outs.append(ModelRunnerOutput([seg.req_id], [[]], failed={seg.req_id: describe_error(e)}))
        has_lookahead = any(s.lookahead is not None for s in segs)
        return ModelRunnerOutput(
            req_ids=[s.req_id for s in segs],
            sampled_token_ids=[o.sampled_token_ids[0] for o in outs],
            lookahead_outputs=[(o.lookahead_outputs or [[]])[0] for o in outs] if has_lookahead else None,
            failed={k: v for o in outs for k, v in o.failed.items()},
        )

    def _execute(self, segs: list[ScheduledRequest]) -> ModelRunnerOutput:
        with self._kernels():
            return self._execute_step(segs)

    def _execute_step(self, segs: list[ScheduledRequest]) -> ModelRunnerOutput:
        inputs = build_step_inputs(segs, self.block_size, self.device)
        has_lookahead = inputs.meta.has_lookahead
        hidden = self.model(
            torch.from_numpy(inputs.input_ids).to(self.device),
            torch.from_numpy(inputs.positions).to(self.device),
            self.kv_caches,
            inputs.meta,
        )
        starts = inputs.meta.query_start_loc
        sampled: list[list[int]] = [[] for _ in segs]
        window_outs: list[list[int]] = [[] for _ in segs]
        failed: dict[str, str] = {}

        plain = [i for i, s in enumerate(segs) if s.sample and s.lookahead is None]
        la_segs = [i for i, s in enumerate(segs) if s.lookahead is not None]
        la_rows = [self._lookahead_rows(segs[i].lookahead, starts[i]) for i in la_segs]
        # One output-layer call for the plain rows and every lookahead segment's rows: it is the step's
        # largest matmul, and each call costs a fixed overhead (several ms on a CPU).
        rows = [starts[i + 1] - 1 for i in plain] + list(itertools.chain(*la_rows))
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)]) if rows else None
        if plain:
            tokens, failed = self.sampler.sample(logits[: len(plain)], [segs[i] for i in plain])
            for i, token in zip(plain, tokens, strict=True):
                if segs[i].req_id not in failed:
                    sampled[i] = [token]

        commits: list[tuple[int, int, int]] = []  # (segment, first token index, num tokens from x)
        la_logits = logits[len(plain) :] if la_segs else None
        lo = 0
        for i, rows in zip(la_segs, la_rows, strict=True):
            seg = segs[i]
            try:
                verdict, window_outs[i] = self._lookahead(seg, la_logits[lo : lo + len(rows)])
            except Exception as e:
                logger.exception("verification failed for request %s", seg.req_id)
                failed[seg.req_id] = describe_error(e)
            else:
                sampled[i] = verdict.tokens
                commits.append((i, verdict.candidate, verdict.num_matched))
            lo += len(rows)
        if commits:
            try:
                self._commit(segs, inputs, commits)
            except Exception:  # commit each alone: only a culprit's own slots can be at fault
                for commit in commits:
                    try:
                        self._commit(segs, inputs, [commit])
                    except Exception as e:
                        logger.exception("committing the step failed for request %s", segs[commit[0]].req_id)
                        failed[segs[commit[0]].req_id] = describe_error(e)
        for i, seg in enumerate(segs):
            if seg.req_id in failed:
                sampled[i], window_outs[i] = [], []
        return ModelRunnerOutput(
            req_ids=[s.req_id for s in segs],
            sampled_token_ids=sampled,
            lookahead_outputs=window_outs if has_lookahead else None,
            failed=failed,
        )

    @staticmethod
    def _lookahead_rows(lay: LookaheadLayout, lo: int) -> list[int]:
        """Rows of the step whose logits a lookahead segment needs: x, the newest level, the candidates."""
        top = lay.level_start(lay.num_levels - 1) if lay.num_levels else 1
        cand_lo = lay.num_window_tokens
        return ([lo] + list(range(lo + top, lo + top + lay.num_last_level))
                + list(range(lo + cand_lo, lo + cand_lo + lay.num_candidates * lay.candidate_len)))

    def _lookahead(self, seg: ScheduledRequest, logits: torch.Tensor) -> tuple[Verdict, list[int]]:
        """Verify one lookahead segment from the logits at its rows (``_lookahead_rows``); also return the
        model's argmax at its newest window level."""
        lay = seg.lookahead
        assert lay is not None
        g, m = lay.num_candidates, lay.candidate_len
        cand_lo = lay.num_window_tokens
        argmax = logits.argmax(dim=-1).tolist()
        window = argmax[1 : 1 + lay.num_last_level]
        toks = seg.token_ids[cand_lo:]
        candidates = [toks[j * m : (j + 1) * m] for j in range(g)]
        if seg.temperature < 1e-5:
            cand_arg = argmax[1 + lay.num_last_level :]
            verdict = verify_greedy(argmax[0], candidates, [cand_arg[j * m : (j + 1) * m] for j in range(g)])
        else:
            pick = [0] + list(range(1 + lay.num_last_level, logits.shape[0]))
            n = len(pick)
            probs = processed_probs(
                logits[pick],
                torch.full((n,), seg.temperature),
                torch.full((n,), seg.top_k),
                torch.full((n,), seg.top_p),
            ).cpu()
            # x sits at start_pos: the token drawn ``depth`` places after its successor is at start_pos + 1 + depth
            verdict = verify_sampling(probs[0], candidates, probs[1:].view(g, m, probs.shape[-1]),
                                      lambda p, depth: self.sampler.draw_at(p, seg, seg.start_pos + 1 + depth))
        return verdict, window

    def _commit(self, segs, inputs: StepInputs, commits) -> None:
        """Write x's and the accepted candidate tokens' keys and values (recorded by every layer in
        ``inputs.meta.transient_kv``) to their slots."""
        starts = inputs.meta.query_start_loc
        token_idx: list[int] = []
        seg_rows: list[int] = []
        positions: list[int] = []
        for i, cand, k in commits:
            lo, lay, p = starts[i], segs[i].lookahead, segs[i].start_pos
            cand_start = lo + lay.candidate_start(cand) if k else 0
            token_idx += [lo] + [cand_start + d for d in range(k)]
            positions += list(range(p, p + k + 1))
            seg_rows += [i] * (k + 1)
        slots = compute_slot_mapping(inputs.meta.block_table, np.asarray(seg_rows), np.asarray(positions),
                                     self.block_size)
        idx = torch.tensor(token_idx, device=self.device)
        slot_t = torch.from_numpy(slots).to(self.device)
        record = inputs.meta.transient_kv
        for layer, kv_cache in enumerate(self.kv_caches):
            k, v = record[layer]
            kv_cache[0].index_copy_(0, slot_t, k[idx])
            kv_cache[1].index_copy_(0, slot_t, v[idx])
