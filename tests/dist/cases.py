"""Models, batches and wrap functions shared by the distributed tests."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp_lite
from fsdp_lite.testing import GPT, ConvNet, GPTConfig
from fsdp_lite.testing.models import Block
from fsdp_lite.testing.reference import BF16, FP16, FP32, Run, Tolerance

B_PER_RANK = 2
SEQ = 16

PRECISIONS = {
    "fp32": (None, FP32),
    "bf16": (fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16), BF16),
    "fp16": (fsdp_lite.MixedPrecision(param_dtype=torch.float16), FP16),
}


# The ConvNet against its fp32 reference rounds far more than the GPT (BatchNorm over
# 4 samples per rank divides by a variance computed in low precision): measured worst,
# bf16: grad 0.191 (W=1), update 0.100, loss 3.24e-4; fp16: grad 0.133, update 0.0158,
# loss 5.28e-5. So its mixed-precision runs cannot see a gradient scale error below
# ~0.4; the GPT runs beside them in every matrix can (see test_mutations).
CONVNET_TOL = {
    "fp32": FP32,
    "bf16": Tolerance(loss_rtol=1e-3, update_rtol=0.25, grad_rtol=0.4),
    "fp16": Tolerance(loss_rtol=2e-4, update_rtol=0.05, grad_rtol=0.3),
}


def gpt(**overrides) -> GPT:
    return GPT(GPTConfig(**overrides))


def token_batch(world: int, step: int, per_rank: int = B_PER_RANK, vocab: int = 64):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, vocab, (per_rank * world, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


def image_batch(world: int, step: int, per_rank: int = 4):
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(per_rank * world, 3, 6, 6, generator=g), torch.randint(
        0, 5, (per_rank * world,), generator=g
    )


def gpt_loss(model, batch) -> torch.Tensor:
    return model(*batch)[1]


def class_loss(model, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def local_part(batch: tuple, rank: int, world: int) -> tuple:
    """This rank's slice of a global batch."""
    return tuple(t.chunk(world)[rank] for t in batch)


def mean_over_ranks(x: torch.Tensor) -> float:
    """A per-rank loss averaged over the ranks: the global batch's loss."""
    x = x.detach().float().clone()
    dist.all_reduce(x)
    return x.item() / dist.get_world_size()


def assert_close_loss(what: str, got: float, want: float, rtol: float) -> None:
    if abs(got - want) > rtol * max(abs(want), 1e-8):
        raise AssertionError(f"{what}: fsdp {got:.8g} vs reference {want:.8g}")


def wrap_blocks(module, **kwargs) -> fsdp_lite.FSDPModule:
    return fsdp_lite.FSDPModule(module, auto_wrap_policy=fsdp_lite.wrap.by_type(Block), **kwargs)


def wrap_stages(module, **kwargs) -> fsdp_lite.FSDPModule:
    """ConvNet: each Sequential stage its own unit, the head stays in the root."""
    policy = fsdp_lite.wrap.by_type(torch.nn.Sequential)
    return fsdp_lite.FSDPModule(module, auto_wrap_policy=policy, **kwargs)


def gpt_run(name: str, world: int, precision: str = "fp32", raf: bool | None = None, **kw) -> Run:
    mp, tol = PRECISIONS[precision]
    return Run(
        name=f"{name} W={world} {precision} raf={raf}",
        make_model=kw.pop("make_model", gpt),
        batch=kw.pop("batch", functools.partial(token_batch, world)),
        loss=kw.pop("loss", gpt_loss),
        wrap=kw.pop(
            "wrap",
            functools.partial(wrap_blocks, mixed_precision=mp, reshard_after_forward=raf),
        ),
        tol=tol,
        **kw,
    )


def convnet_run(world: int, precision: str = "fp32", raf: bool | None = None, **kw) -> Run:
    mp, tol = PRECISIONS[precision][0], CONVNET_TOL[precision]
    return Run(
        name=f"convnet W={world} {precision} raf={raf}",
        make_model=ConvNet,
        batch=functools.partial(image_batch, world),
        loss=class_loss,
        wrap=functools.partial(wrap_stages, mixed_precision=mp, reshard_after_forward=raf),
        tol=tol,
        split_reference=True,  # BatchNorm normalizes per rank: the reference does the same
        **kw,
    )


class TwiceCalled(torch.nn.Module):
    """An embedding, one block applied twice in the same forward, a head."""

    def __init__(self) -> None:
        super().__init__()
        cfg = GPTConfig()
        self.emb = torch.nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.block = Block(cfg)
        self.head = torch.nn.Linear(cfg.n_embd, cfg.vocab_size)

    def forward(self, idx, targets):
        logits = self.head(self.block(self.block(self.emb(idx))))
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def frozen_gpt() -> GPT:
    """wpe and one LayerNorm frozen: units hold a trainable and a frozen flat param."""
    model = gpt()
    model.wpe.weight.requires_grad_(False)
    for p in model.blocks[0].ln1.parameters():
        p.requires_grad_(False)
    return model


def cross_tied_gpt() -> GPT:
    """A weight shared by two blocks (two units): it must live in their common ancestor."""
    model = gpt(n_layer=3)
    model.blocks[2].mlp.fc.weight = model.blocks[0].mlp.fc.weight
    return model


def two_forwards_loss(model, batch) -> torch.Tensor:
    x, y = batch
    half = x.shape[0] // 2
    return model(x[:half], y[:half])[1] + model(x[half:], y[half:])[1]


def wrap_by_hand(module, **kwargs) -> fsdp_lite.FSDPModule:
    for i, block in enumerate(module.blocks):
        module.blocks[i] = fsdp_lite.FSDPModule(block, **kwargs)
    return fsdp_lite.FSDPModule(module, **kwargs)


def shared_block_gpt() -> GPT:
    """The same Block registered at two positions: one unit, run twice per forward."""
    model = gpt(n_layer=3)
    model.blocks[2] = model.blocks[0]
    return model
