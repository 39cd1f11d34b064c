"""Scheduler contract in, sampled tokens out: packs every segment into one flat varlen batch.

No padding: the step's tokens are concatenated; positions, slot mapping and prefix slots are computed
with numpy from the segments' start positions and block tables, then the model runs once.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.sampler import Sampler
from kv_cache import build_block_table, compute_slot_mapping
from scheduler import ModelRunnerOutput, SchedulerOutput


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    elem = torch.tensor([], dtype=dtype).element_size()
    return hf_config.num_hidden_layers * 2 * block_size * hf_config.num_key_value_heads * head_dim * elem


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype, seed: int):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.num_kv_heads = cfg.num_key_value_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # Per layer: [2 (key, value), num_blocks * block_size slots, num_kv_heads, head_dim]
        self.kv_caches = [
            torch.zeros(2, num_blocks * block_size, self.num_kv_heads, head_dim, dtype=dtype, device=device)
            for _ in range(cfg.num_hidden_layers)
        ]
        self.sampler = Sampler(seed)

    def _metadata(self, so: SchedulerOutput) -> tuple[np.ndarray, np.ndarray, AttentionMetadata]:
        segs = so.scheduled
        bs = self.block_size
        seg_lens = np.fromiter((len(s.token_ids) for s in segs), dtype=np.int64, count=len(segs))
        starts = np.fromiter((s.start_pos for s in segs), dtype=np.int64, count=len(segs))
        cu = np.zeros(len(segs) + 1, dtype=np.int64)
        np.cumsum(seg_lens, out=cu[1:])
        num_tokens = int(cu[-1])
        seg_of_token = np.repeat(np.arange(len(segs)), seg_lens)
        positions = np.repeat(starts - cu[:-1], seg_lens) + np.arange(num_tokens)
        table = build_block_table([s.block_ids for s in segs])
        slots = compute_slot_mapping(table, seg_of_token, positions, bs)

        is_decode = seg_lens == 1
        decode_segs = np.flatnonzero(is_decode)
        max_ctx = int(starts[decode_segs].max()) if len(decode_segs) else 0
        grid = np.arange(max_ctx)
        ctx = starts[decode_segs]
        prefix_mask = grid[None, :] < ctx[:, None]
        dec_slots = np.where(prefix_mask, table[decode_segs][:, grid // bs] * bs + grid % bs, 0)

        prefix_slots: list[torch.Tensor | None] = [None] * len(segs)
        other_segs = np.flatnonzero(~is_decode).tolist()
        for s in other_segs:
            if starts[s] > 0:
                p = np.arange(starts[s])
                prefix_slots[s] = torch.from_numpy(table[s, p // bs] * bs + p % bs).to(self.device)

        dev = self.device
        meta = AttentionMetadata(
            num_tokens=num_tokens,
            query_start_loc=cu.tolist(),
            context_lens=starts.tolist(),
            block_tables=torch.from_numpy(table).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            block_size=bs,
            decode_segs=decode_segs.tolist(),
            decode_token_idx=torch.from_numpy(cu[decode_segs]).to(dev),
            decode_prefix_slots=torch.from_numpy(dec_slots).to(dev),
            decode_prefix_mask=torch.from_numpy(prefix_mask).to(dev),
            other_segs=other_segs,
            prefix_slots=prefix_slots,
            seg_masks=[None] * len(segs),
        )
        input_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids for s in segs), np.int64, num_tokens)
        return input_ids, positions, meta

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.sampler.forget(so.finished_req_ids)
        segs = so.scheduled
        if not segs:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        input_ids, positions, meta = self._metadata(so)
        hidden = self.model(
            torch.from_numpy(input_ids).to(self.device),
            torch.from_numpy(positions).to(self.device),
            self.kv_caches,
            meta,
        )
        sample_rows = [i for i, s in enumerate(segs) if s.sample]
        sampled: list[list[int]] = [[] for _ in segs]
        if sample_rows:
            last = torch.tensor([meta.query_start_loc[i + 1] - 1 for i in sample_rows], device=self.device)
            logits = self.model.compute_logits(hidden[last])
            tokens = self.sampler.sample(logits, [segs[i] for i in sample_rows])
            for row, token in zip(sample_rows, tokens, strict=True):
                sampled[row] = [token]
        return ModelRunnerOutput(req_ids=[s.req_id for s in segs], sampled_token_ids=sampled)
