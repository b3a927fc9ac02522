"""DraftModelProposer: draft tokens from a smaller model with the target's tokenizer (vLLM's `draft_model` method).

Owns: the draft model's weights and its own KV cache. The draft cache has the target's blocks (same block ids,
same slots: a request's block table serves both models) plus a few scratch blocks of its own, so the draft never
asks the pool for anything:

    every step, after the target's forward:
      observe(model_input)     the draft runs the step's whole flat batch too (prefill chunks, decodes, verified
                               drafts), writing its KV where the target wrote its own
    then, for each request that just sampled (its tokens now end with what the step kept):
      propose_batch(...)       k batched one-token passes: the last token, then each draft in turn; each pass's
                               argmax is the next draft token

Positions past the request's block table (the tokens of this proposal only) go to the scratch blocks. KV the draft
writes at positions the target has not computed yet is rewritten by `observe` before anything reads it, as the
target's own is; so a rolled-back step, a rejected draft or a swapped-out request (whose draft KV is not swapped)
can make later drafts worse, never the output: the target verifies every draft (rejection_sampler.py). Drafts are
the draft model's argmax, so they are certain: the verifier treats q as all on the draft token, which keeps the
output distribution exactly the target's.

`draft_num_layers` keeps only the checkpoint's first layers (and its final norm and LM head): with the target's own
checkpoint, a draft that costs a fraction of a step and needs no download. The target as its own draft (all
layers) proposes exactly what the target would choose: the exactness test.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from minivllm.model.llama import ModelConfig
from minivllm.model.loader import load_model, resolve_model_path
from minivllm.model.attention import model_input_tensors
from minivllm.worker.input_batch import ModelInput


class DraftModelProposer:
    def __init__(self, spec, target_path: Path, target_cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                 backend, block_size: int, max_num_seqs: int):
        path = resolve_model_path(spec.model) if spec.model else Path(target_path)
        cfg = ModelConfig.from_dir(path)
        if spec.draft_num_layers is not None:
            if spec.draft_num_layers > cfg.num_hidden_layers:
                raise ValueError(f"speculative_config draft_num_layers is {spec.draft_num_layers}, but the draft "
                                 f"checkpoint has {cfg.num_hidden_layers} layers.")
            cfg = dataclasses.replace(cfg, num_hidden_layers=spec.draft_num_layers)
        if cfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(f"the draft model's vocabulary has {cfg.vocab_size} tokens, the target's "
                             f"{target_cfg.vocab_size}: a draft must share the target's tokenizer.")
        self.k = spec.num_speculative_tokens
        self.cfg, self.dtype, self.device, self.backend = cfg, dtype, device, backend
        self.block_size = block_size
        self.model = load_model(path, cfg, dtype, device)
        self.scratch_per_seq = -(-(self.k + 1) // block_size) + 1       # blocks a proposal can run past its table
        self.max_num_seqs = max_num_seqs
        self.num_blocks = 0

    def bytes_per_block(self) -> int:
        c = self.cfg
        return 2 * c.num_hidden_layers * self.block_size * c.num_key_value_heads * c.head_dim * self.dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The target's block ids, then max_num_seqs x scratch_per_seq scratch blocks."""
        c = self.cfg
        self.num_blocks = num_blocks
        total = num_blocks + self.max_num_seqs * self.scratch_per_seq
        self.kv_cache = torch.zeros(2, c.num_hidden_layers, total, self.block_size, c.num_key_value_heads,
                                    c.head_dim, dtype=self.dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[0, i], self.kv_cache[1, i]) for i in range(c.num_hidden_layers)]

    def release_memory(self) -> None:
        """At the engine's shutdown (model_runner.release_memory): the draft's weights and KV cache."""
        self.model = self.kv_cache = None
        self.kv_caches = []

    def _forward(self, mi) -> torch.Tensor:
        """The draft model over one flat batch (a ModelInput) on its own cache: hidden (num_tokens, hidden)."""
        input_ids, positions, meta = model_input_tensors(mi, self.device)
        return self.model(input_ids, positions, self.kv_caches, meta, self.backend)

    @torch.inference_mode()
    def observe(self, mi) -> None:
        """Run the step's flat batch (the target's ModelInput) through the draft: its KV where the target's went."""
        if mi.q_lens:
            self._forward(mi)

    @torch.inference_mode()
    def propose_batch(self, requests: list, room: list[int]) -> list[list[int]]:
        """Up to min(k, room[i]) drafts for each request: k one-token passes of the draft, batched."""
        if not requests:
            return []
        bs = self.block_size
        tables, last_pos = [], []
        for row, req in enumerate(requests):
            scratch = [self.num_blocks + row * self.scratch_per_seq + i for i in range(self.scratch_per_seq)]
            tables.append(list(req.block_table) + scratch)      # positions past the table land in scratch
            last_pos.append(req.num_tokens - 1)
        width = max(len(t) for t in tables)
        tables = [t + [0] * (width - len(t)) for t in tables]
        tokens = [req.all_token_ids[-1] for req in requests]
        drafts: list[list[int]] = [[] for _ in requests]
        for j in range(min(self.k, max(room))):
            positions = [p + j for p in last_pos]
            slots = [tables[r][p // bs] * bs + p % bs for r, p in enumerate(positions)]
            step = ModelInput(tokens, positions, slots, [1] * len(requests), [p + 1 for p in positions], tables, [])
            hidden = self._forward(step)
            tokens = self.model.compute_logits(hidden).argmax(dim=-1).tolist()        # (rows,)
            for r, token in enumerate(tokens):
                if j < room[r]:
                    drafts[r].append(token)
        return drafts
