"""checkpoint_wrapper on its own: arguments and outputs of any shape pass through, the
gradients equal the unwrapped module's, a checkpointed module may run twice, state-dict
keys are unchanged, activation memory falls; make_viewless_tensor releases the base."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import fsdp_lite
from fsdp_lite import apply_activation_checkpointing, checkpoint_wrapper
from fsdp_lite.addons.activation_checkpointing import make_viewless_tensor
from fsdp_lite.testing import GPT, GPTConfig
from fsdp_lite.testing.models import Block


class Fancy(nn.Module):
    """Keyword, optional and non-tensor arguments in; a dict holding a list out."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, *, scale: float, mask: torch.Tensor | None = None, tag: str = ""):
        h = self.drop(self.lin(x)) * scale
        if mask is not None:
            h = h * mask
        return {"out": h, "extra": [h.sum(), tag, 3]}


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("offload", [False, True])
def test_arguments_outputs_and_grads_pass_through(reentrant: bool, offload: bool) -> None:
    torch.manual_seed(0)
    plain = Fancy()
    wrapped = checkpoint_wrapper(
        copy.deepcopy(plain), use_reentrant=reentrant, offload_to_cpu=offload
    )
    x = torch.randn(3, 4, requires_grad=True)
    mask = torch.rand(3, 4, requires_grad=True)
    grads = []
    for module in (plain, wrapped):
        torch.manual_seed(1)  # same dropout masks
        out = module(x, scale=2.0, mask=mask, tag="t")
        out = module(out["out"], scale=0.5, mask=mask)  # called twice in one forward
        assert out["extra"][1:] == ["", 3]
        (out["out"].square().sum() + out["extra"][0]).backward()
        grads.append([t.grad.clone() for t in (x, mask, *module.parameters())])
        x.grad = mask.grad = None
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_state_dict_keys_unchanged_and_loadable() -> None:
    plain = GPT(GPTConfig())
    wrapped = apply_activation_checkpointing(copy.deepcopy(plain), fsdp_lite.wrap.by_type(Block))
    assert isinstance(wrapped.blocks[0], fsdp_lite.CheckpointWrapper)
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    wrapped.load_state_dict(plain.state_dict())
    plain.load_state_dict(wrapped.state_dict())


def test_no_grad_forward_runs_plainly() -> None:
    wrapped = checkpoint_wrapper(nn.Linear(2, 2))
    with torch.no_grad():
        assert wrapped(torch.ones(1, 2)).grad_fn is None


def _peak_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(x, x)[1].backward()
    peaks = tracker.get_tracker_snapshot("peak")
    device = next(iter(peaks))
    return peaks[device]["Activation"]


def test_checkpointing_every_block_lowers_peak_activation_memory(world1) -> None:
    cfg = GPTConfig(n_layer=4, n_embd=64, block_size=64, vocab_size=128)
    x = torch.randint(0, 128, (4, 64))
    peaks = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        gpt = GPT(cfg)
        if checkpointed:
            apply_activation_checkpointing(gpt, fsdp_lite.wrap.by_type(Block))
        model = fsdp_lite.FSDPModule(gpt, auto_wrap_policy=fsdp_lite.wrap.by_type(Block))
        peaks[checkpointed] = _peak_activation_bytes(model, x)
    print(
        f"peak activation bytes: without {peaks[False]:,}, every block checkpointed {peaks[True]:,}"
    )
    assert peaks[True] < 0.6 * peaks[False], peaks


def test_make_viewless_tensor_releases_base() -> None:
    base = torch.arange(1000.0, requires_grad=True) * 1.0
    view = base[10:20]
    ref = weakref.ref(base)
    for keep_graph in (False, True):
        out = make_viewless_tensor(view, requires_grad=True, keep_graph=keep_graph)
        assert out._base is None and torch.equal(out, view)
    out = make_viewless_tensor(view, requires_grad=False, keep_graph=False)
    del base, view
    gc.collect()
    assert ref() is None  # the base tensor object is gone; only the storage is shared
    assert out[0].item() == 10.0
    plain = torch.ones(3)
    assert make_viewless_tensor(plain, False, False) is plain


def test_make_viewless_tensor_keeps_graph() -> None:
    x = torch.ones(6, requires_grad=True)
    y = (x * 2)[2:4]
    make_viewless_tensor(y, requires_grad=True, keep_graph=True).sum().backward()
    assert x.grad.tolist() == [0, 0, 2, 2, 0, 0]
