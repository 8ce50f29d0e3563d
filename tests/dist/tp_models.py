"""Small models with tensor-parallel plans (torchtitan's style), for the 2-D tests.

``Transformer`` is a pre-norm decoder whose attention and MLP projections are separate
``nn.Linear`` layers, so ``parallelize`` can give them colwise/rowwise plans, with
sequence parallel (norms on sequence shards) on or off, and tied or untied embeddings.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

VOCAB, DIM, HEADS, SEQ = 32, 16, 4, 8


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wv = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        # No key bias: its gradient is zero in exact arithmetic (softmax ignores a shift
        # per query), so Adam would turn rounding noise into full-size steps.
        self.wk = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]  # (B, T, C), global under TP

        def heads(y: torch.Tensor) -> torch.Tensor:  # (B, T, C / tp) -> (B, nh / tp, T, hs)
            return y.view(b, t, -1, DIM // HEADS).transpose(1, 2)

        q, k, v = heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 3 * DIM)
        self.w2 = nn.Linear(3 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.LayerNorm(DIM), Attention()
        self.ffn_norm, self.ffn = nn.LayerNorm(DIM), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, n_layers: int = 2, tied: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(n_layers))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.tied = tied
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def parallelize(
    model: Transformer, tp: DeviceMesh, sp: bool, loss_parallel: bool = False
) -> Transformer:
    """torchtitan's plan: colwise q/k/v/w1, rowwise wo/w2, a rowwise embedding and a
    colwise head; with ``sp`` the norms work on sequence shards between them; with
    ``loss_parallel`` the logits stay a DTensor sharded on the vocab (torch's
    ``loss_parallel`` takes them)."""
    seq = Shard(1) if sp else Replicate()
    head = (
        ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
        if loss_parallel
        else ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    )
    parallelize_module(model, tp, {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "head": head,
        **({"norm": SequenceParallel()} if sp else {}),
    })  # fmt: skip
    for block in model.layers:
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "ffn.w1": ColwiseParallel(),
            "ffn.w2": RowwiseParallel(output_layouts=seq),
        }
        if sp:
            to_replicate = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
            plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": to_replicate, "ffn": to_replicate,
            })  # fmt: skip
        parallelize_module(block, tp, plan)
    if model.tied:  # parallelize_module made a new parameter of each: tie them again
        model.head.weight = model.tok.weight
    return model


def mlp() -> nn.Sequential:
    """The last layer's 7 outputs split 4 + 3 over a 2-way tp dim: uneven TP shards."""
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 9), nn.Tanh(), nn.Linear(9, 7))


def parallelize_mlp(model: nn.Sequential, tp: DeviceMesh) -> nn.Sequential:
    parallelize_module(model, tp, {
        "0": ColwiseParallel(), "2": RowwiseParallel(),
        "4": ColwiseParallel(output_layouts=Replicate()),
    })  # fmt: skip
    return model


# -- experts on their own mesh ---------------------------------------------------------

EXPERTS = 2


class Experts(nn.Module):
    """Dense mixture of experts: every token goes through every expert, weighted by its
    gate. With ``weight`` a DTensor sharded over an ep mesh, each rank computes its own
    experts for the tokens of every ep rank (all-gathered), and the outputs go back to
    their ranks summed (reduce-scatter): expert parallelism without the routing."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, DIM, DIM) * 0.2)  # (E, C, C)

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not isinstance(w, DTensor):  # (B, T, C), (B, T, E)
            return torch.einsum("bte,ecd,btd->btc", gates, w, x)
        ep = w.device_mesh
        local = w.to_local()  # (E / ep, C, C): this rank's experts
        first = ep.get_local_rank() * local.shape[0]
        xs = funcol.all_gather_tensor_autograd(x, 0, ep)  # (ep * B, T, C)
        gs = funcol.all_gather_tensor_autograd(gates, 0, ep)[..., first : first + local.shape[0]]
        y = torch.einsum("bte,ecd,btd->btc", gs, local, xs)
        return funcol.reduce_scatter_tensor_autograd(y, "sum", 0, ep)  # (B, T, C)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, DIM)
        self.gate = nn.Linear(DIM, EXPERTS)
        self.experts = Experts()
        self.head = nn.Linear(DIM, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        return self.head(h + self.experts(h, torch.softmax(self.gate(h), dim=-1)))


def shard_experts(model: MoE, ep: DeviceMesh) -> MoE:
    """The experts' weight as a DTensor split by expert over ``ep``."""
    weight = model.experts.weight.detach()
    model.experts.weight = nn.Parameter(distribute_tensor(weight, ep, [Shard(0)]))
    return model
