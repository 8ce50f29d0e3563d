"""Small models for tests and the training script: a GPT (tied embedding, LayerNorm,
one block per unit) and a ConvNet with BatchNorm and sizes not divisible by W."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard


@dataclass
class GPTConfig:
    vocab_size: int = 64
    block_size: int = 16
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    tie_weights: bool = True


class Linear(nn.Linear):
    """nn.Linear initialized GPT-style by its own reset_parameters(): N(0, std), zero bias.

    Initializing in reset_parameters (not in a pass over the model afterwards) makes the
    eager build and a meta-device build initialized by fsdp_lite draw the same numbers."""

    def __init__(self, *args, std: float = 0.02, **kwargs) -> None:
        self.std = std
        super().__init__(*args, **kwargs)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding initialized N(0, 0.02) by its reset_parameters()."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = Linear(cfg.n_embd, cfg.n_embd, std=_residual_std(cfg))
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # chunk and -1 heads: under tensor parallelism (parallelize_gpt) each rank holds
        # its heads of q, k and v, (B, T, 3 C / tp)
        q, k, v = self.qkv(x).chunk(3, dim=2)
        # (B, nh, T, hs)
        q, k, v = (t.view(B, T, -1, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = Linear(4 * cfg.n_embd, cfg.n_embd, std=_residual_std(cfg))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


def _residual_std(cfg: GPTConfig) -> float:
    """GPT-2's scaled init for layers that write into the residual stream."""
    return 0.02 / math.sqrt(2 * cfg.n_layer)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """nanoGPT-style decoder; ``forward(idx, targets)`` returns ``(logits, loss)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight

    def get_input_embeddings(self) -> nn.Module:  # named as Hugging Face names them
        return self.wte

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


class ConvNet(nn.Module):
    """Two conv+BatchNorm stages and a linear head; odd channel counts so no size divides W.

    The convolutions have no bias: BatchNorm cancels it, so its gradient would be pure
    rounding noise, which Adam amplifies into lr-sized steps and no comparison survives.
    """

    def __init__(self, in_ch: int = 3, num_classes: int = 5) -> None:
        super().__init__()
        self.stage1 = nn.Sequential(
            nn.Conv2d(in_ch, 7, 3, padding=1, bias=False), nn.BatchNorm2d(7), nn.ReLU()
        )
        self.stage2 = nn.Sequential(
            nn.Conv2d(7, 11, 3, padding=1, bias=False), nn.BatchNorm2d(11), nn.ReLU()
        )
        self.head = nn.Linear(11, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.stage1(x))
        return self.head(x.mean(dim=(2, 3)))


# -- tensor parallelism --------------------------------------------------------------


class FusedColwiseParallel(ColwiseParallel):
    """``ColwiseParallel`` for a projection that stacks ``pieces`` outputs on dim 0 (q, k
    and v): each rank holds its slice of every piece (``_StridedShard``), so that
    ``chunk(pieces)`` of its local output gives its heads of each."""

    def __init__(self, pieces: int) -> None:
        super().__init__()
        self.pieces = pieces

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            placement = _StridedShard(0, split_factor=self.pieces)
            value = distribute_tensor(param.detach(), device_mesh, [placement])
            module.register_parameter(param_name, nn.Parameter(value, param.requires_grad))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local()  # (B, T, pieces * C / tp): this rank's slice of each


def parallelize_gpt(model: GPT, tp: DeviceMesh) -> GPT:
    """Megatron's plan for the GPT on the ``tp`` mesh: q/k/v (fused) and the MLP's first
    layer colwise, their output projections rowwise, the token embedding rowwise and the
    head colwise (vocab-sharded, tied again after); norms and positions replicated."""
    parallelize_module(model, tp, {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    })  # fmt: skip
    for block in model.blocks:
        parallelize_module(block, tp, {
            "attn.qkv": FusedColwiseParallel(3),
            "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(),
        })  # fmt: skip
    if model.cfg.tie_weights:  # parallelize_module made each a new parameter
        model.lm_head.weight = model.wte.weight
    return model
