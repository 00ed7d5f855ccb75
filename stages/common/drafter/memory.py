"""A fine-tune's peak GPU memory per rank, estimated on any machine (a laptop, the login node) before the GPU-days.

In: the drafter's config (its target's vocab and width in it), micro-batch and length, TTT steps, the ZeRO stage and the
rank layout. Out: bytes per GPU, in three parts:
- `model_states`: bf16 weights and gradients, fp32 master weights and Adam's two moments, as DeepSpeed's own ZeRO
  estimators count them per GPU (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_...`, without offload).
  ZeRO-0 partitions nothing (ZeRO-2's count on one GPU); ZeRO-1, which partitions less than ZeRO-2, is counted as
  ZeRO-2 (a lower bound by the gradients' share, 2 bytes a parameter x (1 - 1/GPUs)).
- `step`: the peak of one micro-batch's TTT forward and backward, measured by running the real code
  (`ttt_forward`, the target head's `TargetSignals.from_hidden`) on the meta device, where every tensor has a
  size and no data, and adding up the bytes of live storages op by op (`LiveBytes`). Attention is routed to the
  kernel a GPU runs for a masked SDPA, memory-efficient attention (its output and log-sum-exp, and its backward),
  as its meta functions size them; on the meta device SDPA would otherwise decompose to the math kernel and count
  [B, heads, T, keys] scores a GPU never builds.
- `target_side`: the target's token embeddings and lm_head, held on every rank in the training dtype.
It leaves out the CUDA context, NCCL's buffers and the caching allocator's fragmentation, which is why a check
against a GPU's memory keeps `HEADROOM` of it free.

    estimate = fine_tune_memory(config, micro_batch=1, seq=2048, ttt_steps=5, zero_stage=2, gpus_per_node=8)
    estimate.total / 2**30      # GiB a rank needs
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from stages.common.contract.hardware import MEMORY_HEADROOM
from stages.common.drafter.config import DrafterConfig
from stages.common.drafter.eagle3 import Eagle3Drafter
from stages.common.drafter.target import TargetHead
from stages.common.drafter.ttt import draft_vocab_ids, ttt_forward
from stages.common.drafter.vocab import VocabMap

HEADROOM = MEMORY_HEADROOM
META = torch.device("meta")


@dataclass(frozen=True)
class MemoryEstimate:
    model_states: int  # bytes per GPU
    step: int
    target_side: int

    @property
    def total(self) -> int:
        return self.model_states + self.step + self.target_side

    def fits(self, gpu_bytes: float) -> bool:
        """Whether a rank's total stays under the GPU's memory less `HEADROOM`."""
        return self.total <= (1 - HEADROOM) * gpu_bytes

    def as_dict(self) -> dict[str, int]:
        return {"model_states": self.model_states, "step": self.step, "target_side": self.target_side,
                "total": self.total}


class LiveBytes(TorchDispatchMode):
    """The bytes of every storage an op creates, counted while the storage lives; `peak` is their largest sum."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, weakref.ref] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self.count(tensor.untyped_storage())
        return out

    def count(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self.live:
            return
        size = storage.nbytes()
        self.live[key] = weakref.ref(storage, lambda _, key=key, size=size: self.release(key, size))
        self.now += size
        self.peak = max(self.peak, self.now)

    def release(self, key: int, size: int) -> None:
        if self.live.pop(key, None) is not None:
            self.now -= size


class EfficientAttention(TorchFunctionMode):
    """Every SDPA call as memory-efficient attention, the fused kernel a GPU picks for a masked SDPA (a bool mask
    becomes its additive bias; grouped key heads are expanded, as that kernel wants them)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        query, key, value = args[:3]
        mask = (kwargs or {}).get("attn_mask", args[3] if len(args) > 3 else None)
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        bias = None
        if mask is not None:
            bias = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(~mask, float("-inf"))
            bias = bias.expand(query.shape[0], query.shape[1], *mask.shape[-2:])
        return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, bias, True)[0]


def meta_drafter(config: DrafterConfig, dtype: torch.dtype) -> Eagle3Drafter:
    """The drafter with sizes and no data, on a map of the first draft_vocab_size target ids (any map has its size)."""
    vocab_map = VocabMap.from_target_ids(torch.arange(config.draft_vocab_size), config.vocab_size)
    with torch.device(META):
        drafter = Eagle3Drafter(config).to(dtype)
    drafter.d2t, drafter.t2d = vocab_map.d2t.to(META), vocab_map.t2d.to(META)
    return drafter


def step_peak(config: DrafterConfig, micro_batch: int, seq: int, ttt_steps: int,
              dtype: torch.dtype = torch.bfloat16) -> int:
    """Peak bytes of one micro-batch's TTT forward and backward beyond the weights: the batch as it arrives, the
    target head's signals, the unrolled drafter's activations, and its full bf16 gradients (ZeRO-2 and 3 free
    theirs bucket by bucket as they are reduced, and `model_states` counts them too: an upper bound by up to 2
    bytes a parameter)."""
    drafter, target_hidden = meta_drafter(config, dtype), config.aux_hidden_size
    head = TargetHead.of(torch.empty(config.vocab_size, target_hidden, dtype=dtype, device=META),
                         torch.empty(config.vocab_size, target_hidden, dtype=dtype, device=META))
    with LiveBytes() as tracked, EfficientAttention():
        batch = {"input_ids": torch.zeros(micro_batch, seq, dtype=torch.long, device=META),
                 "loss_mask": torch.ones(micro_batch, seq, dtype=torch.long, device=META),
                 "aux_hidden": torch.empty(micro_batch, seq, 3 * target_hidden, dtype=dtype, device=META),
                 "last_hidden": torch.empty(micro_batch, seq, target_hidden, dtype=dtype, device=META)}
        features = head.batch_features(batch, draft_ids=draft_vocab_ids(drafter))
        stats = ttt_forward(drafter, head.embed, batch["input_ids"], batch["loss_mask"], features.aux_hidden,
                            features.signals, ttt_steps)
        stats.loss.backward()
    return tracked.peak


def model_state_bytes(params: int, largest_layer: int, zero_stage: int, gpus_per_node: int, nodes: int) -> int:
    """Per GPU, by DeepSpeed's ZeRO estimators without offload (see the module docstring for stages 0 and 1)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    if zero_stage == 3:
        return estimate_zero3_model_states_mem_needs(params, largest_layer, gpus_per_node, nodes, cpu_offload=False,
                                                     cpu_offload_params=False)[1]
    if zero_stage == 0:
        gpus_per_node, nodes = 1, 1
    return estimate_zero2_model_states_mem_needs(params, gpus_per_node, nodes, cpu_offload=False)[1]


def fine_tune_memory(config: DrafterConfig, micro_batch: int, seq: int, ttt_steps: int,
                     zero_stage: int, gpus_per_node: int, nodes: int = 1,
                     dtype: torch.dtype = torch.bfloat16) -> MemoryEstimate:
    """What one rank of the fine-tune holds at its peak, in bytes (module docstring)."""
    drafter = meta_drafter(config, dtype)
    params = sum(param.numel() for param in drafter.parameters())
    largest = max(param.numel() for param in drafter.parameters())
    itemsize = torch.empty((), dtype=dtype).element_size()
    return MemoryEstimate(model_states=model_state_bytes(params, largest, zero_stage, gpus_per_node, nodes),
                          step=step_peak(config, micro_batch, seq, ttt_steps, dtype),
                          target_side=2 * config.vocab_size * config.aux_hidden_size * itemsize)
