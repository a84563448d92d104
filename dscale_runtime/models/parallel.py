"""Tensor parallelism inside the models (Megatron's split, over one `torch.distributed` group).

`shard_dim` says which parameters a rank holds a slice of; `TensorParallel` is a rank's place in its group
and the collectives of a sharded forward:
- column-parallel q/k/v and gate/up: each rank its own query and key/value heads and MLP columns, no
  communication (the heads of a GQA group stay on one rank, so attention is rank-local);
- row-parallel o/down: each rank's partial product, `all_reduce`, then the bias once;
- vocab-parallel embedding: each rank looks up the token ids inside its rows (zeros elsewhere), `all_reduce`:
  exact, every sum adds zeros to the one rank's row;
- vocab-parallel LM head: each rank's logit columns, gathered to the whole vocabulary on every rank: exact.
So every rank holds the same residual stream and the same full logits, and all that follows the logits
(drafts, the DVL decision, sampling, acceptance, the scheduler's host work) runs replicated, identically.
The collectives are the in-place c10d ones, which NCCL can capture in CUDA graphs (gloo runs them eagerly on
the CPU). A model built without a `TensorParallel`, or with one of size 1, runs none of this.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})  # output rows split
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})  # input columns split (their bias is whole on every rank)
VOCAB_PARALLEL = frozenset({"embed_tokens", "lm_head"})  # vocabulary rows split, the last part padded

# NOTE: torch 2.13 renames all_gather_into_tensor (same semantics); the project supports torch >= 2.11.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def shard_dim(name: str) -> int | None:
    """The dimension of parameter `name` (Hugging Face / z-lab names) that tensor parallelism splits, or None
    when every rank holds all of it (norms, the drafter's `fc`, row-parallel biases)."""
    module, _, leaf = name.rpartition(".")
    module = module.rpartition(".")[2]
    if module in COLUMN_PARALLEL or module in VOCAB_PARALLEL:
        return 0
    if module in ROW_PARALLEL and leaf == "weight":
        return 1
    return None


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in a tensor-parallel group, and the collectives its sharded layers run."""

    group: dist.ProcessGroup
    """The group the model is split over (every rank of it runs the same forward)."""
    rank: int
    """This process's rank inside `group`."""
    size: int
    """Ranks in `group`."""

    @classmethod
    def of(cls, group: dist.ProcessGroup | None = None) -> "TensorParallel":
        """The caller's place in `group` (None: the whole world) of an initialised process group."""
        group = group if group is not None else dist.group.WORLD
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def split(self, full: int) -> tuple[int, int, int]:
        """This rank's part [start, stop) of a dimension of length `full` cut into `size` parts of
        ceil(full / size) (the last parts shorter when it does not divide), and that part length."""
        part = -(-full // self.size)
        start = min(self.rank * part, full)
        return start, min(start + part, full), part

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the group, in place; returns it."""
        dist.all_reduce(x, group=self.group)
        return x

    def row_parallel(self, x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
        """x [T, in / size] through a row-parallel `linear` -> [T, out]: partial products summed over the
        group, the bias added once after the sum."""
        y = self.all_reduce(F.linear(x, linear.weight))
        return y if linear.bias is None else y + linear.bias

    def embed(self, token_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Token ids [T] (whole vocabulary) through this rank's embedding rows `weight` [part, d] -> [T, d]."""
        local = token_ids - self.rank * weight.shape[0]
        outside = (local < 0) | (local >= weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside.unsqueeze(-1), 0)
        return self.all_reduce(x)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """This rank's logit columns [R, part] -> the whole vocabulary's [R, vocab_size] on every rank."""
        rows, part = logits.shape
        stacked = logits.new_empty(self.size * rows, part)  # [size * R, part], rank-major (gloo takes no 3-D form)
        _all_gather_single(stacked, logits.contiguous(), group=self.group)
        full = stacked.view(self.size, rows, part).permute(1, 0, 2).reshape(rows, self.size * part)
        return full if self.size * part == vocab_size else full[:, :vocab_size].contiguous()


def active(tp: TensorParallel | None) -> TensorParallel | None:
    """`tp` when it splits anything (size > 1), else None: a group of one runs the unsharded model."""
    return tp if tp is not None and tp.size > 1 else None
