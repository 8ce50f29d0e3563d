"""Misuse that used to train silently wrong raises a named error before anything is lost
(W=2, gloo): only the blocks wrapped (several roots, parameters outside every unit),
hybrid replicas initialized differently, a local error inside a collective call
(reported as itself, not as a dead peer), and torch's distributed state-dict helpers on
an optimizer of shards (a checkpoint that would not load)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_lite
from fsdp_lite.core import collectives
from fsdp_lite.testing import run_distributed
from fsdp_lite.testing.subtests import assert_subtests_passed, run_subtests


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x).square().mean()


def _net_blocks_wrapped() -> Net:
    torch.manual_seed(0)
    net = Net()
    for i, block in enumerate(net.blocks):
        net.blocks[i] = fsdp_lite.FSDPModule(block)
    return net


def _only_blocks_wrapped() -> None:
    net = _net_blocks_wrapped()
    before = {k: v.clone() for k, v in net.embed.state_dict().items()}
    want = (
        r"inputs of the root unit '<root Linear>' were computed from 2 trainable "
        r"parameter\(s\) of no fsdp_lite unit \(shapes \(16, 8\), \(16,\)\).*2 ranks.*"
        r"Wrap the whole model"
    )
    with pytest.raises(RuntimeError, match=want):
        net(torch.randn(4, 8))
    assert all(torch.equal(v, net.embed.state_dict()[k]) for k, v in before.items())


def _blocks_called_from_a_loop() -> None:
    """No enclosing module, and the inputs carry no gradient (the head after the blocks
    is outside every unit): the optimizer's first step refuses the plain parameters."""
    net = _net_blocks_wrapped()
    x = net.embed(torch.randn(4, 8)).detach()
    for block in net.blocks:
        x = block(x)
    net.head(x).sum().backward()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    before = net.head.weight.detach().clone()
    with pytest.raises(RuntimeError, match=r"4 trainable parameter\(s\) of no fsdp_lite unit.*"
                       r"averaged over 2 ranks.*Wrap the whole model"):  # fmt: skip
        opt.step()
    assert torch.equal(before, net.head.weight)


def _legitimate_roots() -> None:
    """Two whole models, each wrapped (a GAN's generator and critic), in one step; and
    blocks wrapped inside a module whose own parameters are frozen: no error."""
    torch.manual_seed(0)
    gen = fsdp_lite.FSDPModule(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8)))
    critic = fsdp_lite.FSDPModule(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)))
    opt = torch.optim.SGD([*gen.parameters(), *critic.parameters()], lr=0.1)
    critic(gen(torch.randn(4, 4))).mean().backward()
    opt.step()
    net = _net_blocks_wrapped()
    for module in (net.embed, net.head):
        module.requires_grad_(False)
    net(torch.randn(4, 8)).backward()
    torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1).step()


def _ddp_head_beside_a_wrapped_trunk() -> None:
    """One optimizer over an fsdp_lite trunk and a DistributedDataParallel head: DDP
    averages the head's gradients, so neither the forward nor the optimizer's check
    refuses it, and training equals one process's on the global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref_trunk, ref_head = nn.Sequential(nn.Linear(8, 16), nn.Tanh()), nn.Linear(16, 1)
    trunk = fsdp_lite.FSDPModule(copy.deepcopy(ref_trunk))
    head = nn.parallel.DistributedDataParallel(copy.deepcopy(ref_head))
    opt = torch.optim.SGD([*trunk.parameters(), *head.parameters()], lr=0.1)
    ref_opt = torch.optim.SGD([*ref_trunk.parameters(), *ref_head.parameters()], lr=0.1)
    for step in range(3):
        x = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(step))
        head(trunk(x.chunk(world)[rank])).square().mean().backward()
        ref_head(ref_trunk(x)).square().mean().backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    got = {**trunk.state_dict(), **{f"head.{k}": v for k, v in head.module.state_dict().items()}}
    want = {**ref_trunk.state_dict(), **{f"head.{k}": v for k, v in ref_head.state_dict().items()}}
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, msg=name)


def _hybrid_replicas_differ() -> None:
    """Refused at the first forward, before any step; a load after wrapping (the way to
    resume) makes them agree and is allowed."""
    shard, replicate = fsdp_lite.hybrid_groups(1)  # W=2: each rank a replica of the other
    torch.manual_seed(dist.get_rank())  # a different init on each replica
    model = fsdp_lite.FSDPModule(Net(), process_group=(shard, replicate))
    with pytest.raises(ValueError, match="replicas of unit .* hold different values.*"
                       "sync_module_states=True"):  # fmt: skip
        model(torch.randn(4, 8))
    torch.manual_seed(0)
    saved = Net().state_dict()
    for sync in (True, False):
        torch.manual_seed(dist.get_rank())
        model = fsdp_lite.FSDPModule(
            Net(), process_group=(shard, replicate), sync_module_states=sync
        )
        if not sync:
            model.load_state_dict(saved)
        model(torch.randn(4, 8)).backward()


def _local_error_is_not_a_peer_error() -> None:
    """A collective refused locally (wrong output size) is raised as itself: a PeerError
    would tell torchrun's user to look for a dead rank and restart in a loop."""
    group = dist.group.WORLD
    with pytest.raises(Exception) as info:  # noqa: PT011 - any error but PeerError
        collectives.all_gather_flat(torch.empty(5), torch.ones(2), group)
    assert not isinstance(info.value, collectives.PeerError), info.value
    with pytest.raises(Exception) as info:  # noqa: PT011
        collectives.reduce_scatter_flat(torch.empty(3), torch.ones(4), group).wait()
    assert not isinstance(info.value, collectives.PeerError), info.value
    dist.barrier()


def _torch_state_dict_helpers() -> None:
    """FSDP2's checkpoint habit, get_state_dict + dcp.save, on an optimizer stepping
    fsdp_lite shards (flat and pieces): refused before anything is read, written or changed,
    naming fsdp_lite.save_checkpoint; the rank's own optimizer.state_dict() still works."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_state_dict,
    )

    for layout in ("flat", "pieces"):
        torch.manual_seed(0)
        policy = fsdp_lite.wrap.by_type(nn.Linear)
        model = fsdp_lite.FSDPModule(Net(), auto_wrap_policy=policy, optimizer_params=layout)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(4, 8)).backward()
        opt.step()
        local = opt.state_dict()
        before = copy.deepcopy(local["state"])
        msd = get_model_state_dict(model)  # full tensors under the original names
        assert msd["embed.weight"].shape == (16, 8), {k: v.shape for k, v in msd.items()}
        loads = {"model_state_dict": msd, "optim_state_dict": local}
        for helper, kwargs in (
            (get_state_dict, {}),
            (get_optimizer_state_dict, {}),
            (set_state_dict, loads),
        ):
            name = helper.__name__
            want = rf"state_dict\.{name} cannot read or write the state of this AdamW: it "
            with pytest.raises(RuntimeError, match=want + r".*fsdp_lite\.save_checkpoint"):
                helper(model, opt, **kwargs)
        after = opt.state_dict()["state"]
        assert after.keys() == before.keys(), layout
        for i, state in before.items():
            assert all(torch.equal(v, after[i][k]) for k, v in state.items()), (layout, i)


def _cases(rank: int, world: int) -> dict:
    return run_subtests(
        [
            ("only the blocks wrapped: refused at the first forward", _only_blocks_wrapped),
            ("blocks called from a loop: refused at the first step", _blocks_called_from_a_loop),
            ("several whole-model roots, frozen outer params: allowed", _legitimate_roots),
            ("a DDP head beside a wrapped trunk, one optimizer", _ddp_head_beside_a_wrapped_trunk),
            (
                "hybrid replicas initialized differently: refused at forward",
                _hybrid_replicas_differ,
            ),
            ("a local error in a collective is not a PeerError", _local_error_is_not_a_peer_error),
            ("torch's get_state_dict / set_state_dict: refused", _torch_state_dict_helpers),
        ]
    )


def test_misuse_raises_named_errors() -> None:
    assert_subtests_passed(run_distributed(_cases, 2, timeout=120))


class _NcclLike:
    """A process group whose backend takes CUDA tensors only (as NCCL's)."""

    _device_types = [torch.device("cuda")]


def test_collectives_run_on_the_process_groups_device(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    nccl = _NcclLike()
    assert collectives.comm_device(nccl, torch.device("cpu")) == torch.device("cuda", 3)
    assert collectives.comm_device(nccl, torch.device("cuda", 1)) == torch.device("cuda", 1)
    gloo = type("GlooLike", (), {"_device_types": [torch.device("cpu")]})()
    assert collectives.comm_device(gloo, torch.device("cpu")) == torch.device("cpu")
