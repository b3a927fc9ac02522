"""Pipeline parallelism on one rank: its stage's share of a step, and the tensors that cross between stages.

Owns: the point-to-point traffic of a pipeline (hidden states and residuals to the next stage, logits back to
rank 0) and the sends still under way. ModelRunner takes it as a mixin (as vLLM's runner takes its KV-connector
and LoRA mixins): with pipeline_parallel_size 1 none of it runs, and the runner's own file never mentions it past
one branch in `execute_model`. The layers a stage holds are decided in distributed.py (pp_layer_partition).

A send is non-blocking and waited for at this stage's next step, so a stage never blocks on a neighbour still
busy with an earlier batch (with several batches in flight, two blocking sends in a cycle would deadlock).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from minivllm.model.attention import model_input_tensors
from minivllm.worker.input_batch import ModelInput


class PipelineStageMixin:
    """ModelRunner's pipeline-parallel steps. Reads the runner's model, KV caches, backend, dtype, device, tp and
    pp; owns `_sends` and appends to `stage_times` when `record_stage_times` is on (the runner sets all three)."""

    def _execute_stage(self, mi: ModelInput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Pipeline parallelism, one step on this stage: receive (hidden, residual) from the previous stage, run this
        stage's layers, send them on; the last stage computes the logits and sends them to rank 0, which samples.

            rank 0 (stage 0)  --hidden, residual-->  stage 1  --> ... -->  last stage
                  ^                                                            |
                  +----------------------- logits (rows, vocab) --------------+
        Each message's shape follows from the ModelInput every rank has, so only tensors cross. Sends are
        non-blocking (waited for at the next step); on rank 0 the logits are received later, by `receive_logits`,
        so that rank 0 can run stage 0 of the next batch while the later stages work on this one."""
        pp = self.pp
        self._wait_sends()
        input_ids, positions, meta = model_input_tensors(mi, self.device)
        intermediate = None
        if not pp.is_first:
            shape = (len(mi.input_ids), self.model_cfg.hidden_size)
            hidden = torch.empty(shape, dtype=self.dtype, device=self.device)
            residual = torch.empty(shape, dtype=self.dtype, device=self.device)
            dist.recv(hidden, pp.prev_rank)
            dist.recv(residual, pp.prev_rank)
            intermediate = (hidden, residual)
        started = time.time()
        out = self.model(input_ids, positions, self.kv_caches, meta, self.backend, intermediate)
        prompt_rows = [r for s in mi.prompt_logprob_spans for r in range(s.first_row, s.first_row + s.num_rows)]
        rows = mi.sample_rows + prompt_rows
        logits = None
        last_stage_root = (pp.size - 1) * self.tp.size                   # the last stage's TP rank 0
        if pp.broadcast_logits:                                          # torchrun: every rank samples
            if not pp.is_last:
                dist.send(out[0].contiguous(), pp.next_rank)
                dist.send(out[1].contiguous(), pp.next_rank)
            if not rows:
                return None, None
            logits = (self.model.compute_logits(out[rows]) if pp.is_last else
                      torch.empty(len(rows), self.model_cfg.vocab_size, dtype=torch.float32, device=self.device))
            dist.broadcast(logits, last_stage_root)
            num_sampling = len(mi.sample_rows)
            return (logits[:num_sampling] if num_sampling else None), (logits[num_sampling:] if prompt_rows else None)
        if pp.is_last:
            # (rows, vocab) fp32, all-gathered under TP; with no rows a one-number answer, so that rank 0 always
            # knows when every stage is done with a batch (what "in flight" means)
            out = (self.model.compute_logits(out[rows]) if rows else
                   torch.zeros(1, dtype=torch.float32, device=self.device)),
        if self.record_stage_times:                  # noted before sending: the next stage cannot start earlier
            self.stage_times.append((mi.step_id, started, time.time()))
        if not pp.is_last:
            self._isend(out[0].contiguous(), pp.next_rank)
            self._isend(out[1].contiguous(), pp.next_rank)
        elif self.tp.rank == 0:
            self._isend(out[0].contiguous(), pp.driver_rank)
        return None, None

    def receive_logits(self, mi: ModelInput) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Rank 0 under pipeline parallelism: the logits the last stage computed for `mi` (the same pair as
        `execute_model` returns). Batches come back in the order they were sent into the pipe."""
        prompt_rows = sum(s.num_rows for s in mi.prompt_logprob_spans)
        num_rows = len(mi.sample_rows) + prompt_rows
        if not mi.q_lens:                                                # only block copies: no stage computed
            return None, None
        shape = (num_rows, self.model_cfg.vocab_size) if num_rows else (1,)      # (1,): "done", nothing to sample
        logits = torch.empty(shape, dtype=torch.float32, device=self.device)
        dist.recv(logits, (self.pp.size - 1) * self.tp.size)             # the last stage's TP rank 0
        if not num_rows:
            return None, None
        num_sampling = len(mi.sample_rows)
        return (logits[:num_sampling] if num_sampling else None), (logits[num_sampling:] if prompt_rows else None)

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        self._sends.append((dist.isend(tensor, dst), tensor))

    def _wait_sends(self) -> None:
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
