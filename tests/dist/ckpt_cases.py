"""Models, optimizers and comparisons shared by the checkpoint and optimizer-state tests."""

from __future__ import annotations

import copy
import io
from typing import Any

import torch
import torch.distributed as dist
from cases import token_batch
from torch import nn

import fsdp_lite
from fsdp_lite.core.tree import unit_of
from fsdp_lite.testing.models import Block

GLOBAL_ROWS = 6  # divisible by W = 1, 2, 3: the same global batch at every world size
LR, NORM_LR, WD = 1e-3, 2e-3, 0.1


def pack(obj: Any) -> bytes:
    """Tensors cannot come back from spawned ranks that exit: send bytes instead."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(GLOBAL_ROWS // 2, step)  # per_rank=2 rows x 3 = 6 rows


def local_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(t.chunk(world)[rank] for t in global_batch(step))  # type: ignore[return-value]


def wrap_blocks_and_norms(module: nn.Module, **kwargs: Any) -> fsdp_lite.FSDPModule:
    """A unit per Block and per LayerNorm: norms get flat params of their own, so they can
    sit in an optimizer group without weight decay."""
    policy = fsdp_lite.wrap.by_type(Block, nn.LayerNorm)
    return fsdp_lite.FSDPModule(module, auto_wrap_policy=policy, **kwargs)


def fsdp_optimizer(model: fsdp_lite.FSDPModule, lr: float = LR) -> torch.optim.AdamW:
    """Two groups: decay for everything but the LayerNorm units, which get none."""
    norms = [
        p
        for u in model.modules()
        if unit_of(u) and isinstance(u.module, nn.LayerNorm)
        for p in u.parameters()
    ]
    ids = {id(p) for p in norms}
    rest = [p for p in model.parameters() if id(p) not in ids]
    groups = [{"params": rest}, {"params": norms, "weight_decay": 0.0, "lr": 2 * lr}]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=WD, eps=1e-6)


def reference_optimizer(model: nn.Module, lr: float = LR) -> torch.optim.AdamW:
    norms = [p for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters()]
    ids = {id(p) for p in norms}
    rest = [p for p in model.parameters() if id(p) not in ids]
    groups = [{"params": rest}, {"params": norms, "weight_decay": 0.0, "lr": 2 * lr}]
    return torch.optim.AdamW(groups, lr=lr, weight_decay=WD, eps=1e-6)


def named_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """A plain optimizer's state_dict with parameter names in place of indices."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    sd = copy.deepcopy(optimizer.state_dict())  # it holds the live state tensors
    state = {name_of[id(params[i])]: dict(s) for i, s in sd["state"].items()}
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [name_of[id(params[i])] for i in g["params"]],
        }
        for g in sd["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def plain_optim_state(model: nn.Module, optimizer: torch.optim.Optimizer, osd: dict) -> dict:
    """A name-keyed optimizer state dict in a plain optimizer's own (index) format."""
    index = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            index[id(p)] = len(index)
    by_name = dict(model.named_parameters())
    state = {index[id(by_name[n])]: dict(s) for n, s in osd["state"].items()}
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [index[id(by_name[n])] for n in g["params"]],
        }
        for g in osd["param_groups"]
    ]
    return {"state": state, "param_groups": groups}


def assert_state_dicts(got: dict, want: dict, atol: float = 0.0, what: str = "") -> None:
    assert list(got) == list(want), f"{what}: keys {list(got)} vs {list(want)}"
    for k in want:
        assert got[k].dtype == want[k].dtype, f"{what} {k}: dtype {got[k].dtype} vs {want[k].dtype}"
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=atol, msg=f"{what} {k}")


def assert_optim_states(got: dict, want: dict, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Name-keyed optimizer state dicts: same parameters, keys, shapes, values and groups."""
    assert sorted(got["state"]) == sorted(want["state"]), (list(got["state"]), list(want["state"]))
    for name, st in want["state"].items():
        assert sorted(got["state"][name]) == sorted(st), (name, list(got["state"][name]), list(st))
        for k, v in st.items():
            torch.testing.assert_close(
                got["state"][name][k], v, rtol=rtol, atol=atol, msg=f"{name}.{k}"
            )
    assert len(got["param_groups"]) == len(want["param_groups"])
    for g, w in zip(got["param_groups"], want["param_groups"], strict=True):
        assert sorted(g["params"]) == sorted(w["params"]), (g["params"], w["params"])
        assert {k: v for k, v in g.items() if k != "params"} == {
            k: v for k, v in w.items() if k != "params"
        }


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch) -> torch.Tensor:
    loss = model(*batch)[1]
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def mean_loss(loss: torch.Tensor) -> float:
    """The global loss from each rank's local mean (equal local batch sizes)."""
    total = loss.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()
