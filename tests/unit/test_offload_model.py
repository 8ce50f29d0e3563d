"""OffloadModel, single process: losses, gradients and AdamW training equal the plain
model's (with and without checkpointing, one and several microbatches, dropout and
BatchNorm), at most one slice is on the device at any time, grads land on the offloaded
parameters, and every unsupported use fails clearly before anything changes.

With several microbatches the reference is the plain model run the same way: slice by
slice, each slice over the chunks in order, so dropout draws the same masks and
BatchNorm sees the same chunks."""

from __future__ import annotations

import copy
import weakref
from collections import OrderedDict

import pytest
import torch
from torch import nn

from fsdp_lite import OffloadModel
from fsdp_lite.addons.offload_slices import partition as _partition

CPU = torch.device("cpu")
MODES = [pytest.param(False, id="keep"), pytest.param(True, id="checkpoint")]


def mlp(seed: int = 0, dropout: float = 0.25) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.ReLU(),
        nn.Dropout(dropout),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Dropout(dropout),
        nn.GELU(),
        nn.Linear(16, 4),
    )


def bn_net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Linear(16, 16),
        nn.BatchNorm1d(16, momentum=None),  # cumulative average: counts batches
        nn.Dropout(0.2),
        nn.Linear(16, 4),
    )


def reference(plain: nn.Sequential, slices: tuple, x: torch.Tensor, m: int) -> torch.Tensor:
    """The plain model over the chunks of ``x``, slice-major, as OffloadModel runs it."""
    if m == 1:
        return plain(x)
    for names in slices:
        outs = []
        for h in x.split(x.shape[0] // m):
            for name in names:
                h = plain._modules[name](h)
            outs.append(h)
        x = torch.cat(outs)
    return x


def pair(make=mlp, **kwargs) -> tuple[nn.Sequential, OffloadModel]:
    plain = make()
    kwargs.setdefault("num_slices", 3)
    return plain, OffloadModel(copy.deepcopy(plain), CPU, **kwargs)


def step(fn, x: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    loss = fn(x).square().mean()
    loss.backward()
    return loss.detach()


def assert_equal(got, want, exact: bool) -> None:
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("m", [1, 2, 4])
def test_loss_and_grads_equal_plain_model(checkpoint: bool, m: int) -> None:
    plain, om = pair(checkpoint_activation=checkpoint, num_microbatches=m)
    x = torch.randn(8, 8, requires_grad=True)
    want = step(lambda t: reference(plain, om.slices, t, m), x, seed=1)
    want_x, x.grad = x.grad, None
    got = step(om, x, seed=1)
    exact = m <= 2  # more chunks: the reference sums their grads in another order
    assert_equal(got, want, exact=True)
    assert_equal(x.grad, want_x, exact=True)
    for (name, p), q in zip(om.named_parameters(), plain.parameters(), strict=True):
        assert p.grad is not None, name
        assert_equal(p.grad, q.grad, exact)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("m", [1, 3])
def test_adamw_training_matches_plain_model(checkpoint: bool, m: int) -> None:
    plain, om = pair(checkpoint_activation=checkpoint, num_microbatches=m)
    opts = [torch.optim.AdamW(mod.parameters(), lr=1e-2) for mod in (plain, om)]
    for i in range(5):
        x = torch.randn(6, 8)
        losses = []
        for fn, opt in ((lambda t: reference(plain, om.slices, t, m), opts[0]), (om, opts[1])):
            opt.zero_grad()
            losses.append(step(fn, x, seed=100 + i))
            opt.step()
        assert_equal(losses[1], losses[0], exact=m == 1)
    for p, q in zip(om.parameters(), plain.parameters(), strict=True):
        assert p.device == CPU
        assert_equal(p, q, exact=m == 1)


def test_checkpointing_does_not_change_results() -> None:
    results = []
    for checkpoint in (False, True):
        _, om = pair(checkpoint_activation=checkpoint, num_microbatches=4)
        x = torch.randn(8, 8, requires_grad=True)
        loss = step(om, x, seed=3)
        results.append([loss, x.grad, *(p.grad for p in om.parameters())])
    for a, b in zip(*results, strict=True):
        assert_equal(a, b, exact=True)


@pytest.mark.parametrize("checkpoint", MODES)
def test_batchnorm_sees_the_same_chunks_and_updates_stats_once_per_chunk(checkpoint: bool) -> None:
    m = 2
    plain, om = pair(bn_net, checkpoint_activation=checkpoint, num_microbatches=m)
    opts = [torch.optim.SGD(mod.parameters(), lr=0.1) for mod in (plain, om)]
    for i in range(3):
        x = torch.randn(8, 8)
        want = step(lambda t: reference(plain, om.slices, t, m), x, seed=i)
        got = step(om, x, seed=i)
        assert_equal(got, want, exact=False)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, b), c in zip(om.named_buffers(), plain.buffers(), strict=True):
        assert_equal(b, c, exact=False)
        if name.endswith("num_batches_tracked"):
            assert b.item() == 3 * m
    om.eval(), plain.eval()
    x = torch.randn(6, 8)
    assert_equal(om(x), plain(x), exact=False)  # eval: running stats, chunks do not matter


@pytest.mark.parametrize("checkpoint", MODES)
def test_at_most_one_slice_resident_during_forward_and_backward(checkpoint: bool) -> None:
    plain, om = pair(checkpoint_activation=checkpoint, num_microbatches=2)
    owner = {name: i for i, names in enumerate(om.slices) for name in names}
    seen: list[tuple[str, str, tuple[int, ...]]] = []

    def watch(name: str):
        def hook(module, args, out):
            seen.append(("forward", name, om.resident_slices))
            if out.requires_grad:  # with checkpointing: in the recompute
                out.register_hook(lambda g: seen.append(("backward", name, om.resident_slices)))

        return hook

    for name, layer in om.named_children():
        layer.register_forward_hook(watch(name))
    loads = []
    for method in ("_load_slice", "_refill_slice"):
        original = getattr(om, method)

        def record(r, *args, _original=original, **kwargs):
            loads.append(r.index)
            return _original(r, *args, **kwargs)

        setattr(om, method, record)
    out = om(torch.randn(4, 8))
    assert om.resident_slices == () and loads == [0, 1, 2]
    out.sum().backward()
    assert om.resident_slices == () and loads == [0, 1, 2, 2, 1, 0]
    assert {phase for phase, _, _ in seen} == {"forward", "backward"}
    for phase, name, resident in seen:
        assert resident == (owner[name],), (phase, name, resident)


def test_layers_compute_on_device_copies_and_grads_land_on_offloaded_params() -> None:
    _, om = pair(num_microbatches=2)
    masters = {name: p for name, p in om.named_parameters()}
    copies = []

    def check(module, args, name):
        for pname, t in module.named_parameters(prefix=name):
            assert t is not masters[pname] and t.data_ptr() != masters[pname].data_ptr()
            copies.append(weakref.ref(t))

    for name, layer in om.named_children():
        layer.register_forward_pre_hook(lambda mod, args, _n=name: check(mod, args, _n))
    step(om, torch.randn(4, 8), seed=0)
    assert copies
    for ref in copies:  # copies got no .grad (or are gone already)
        assert ref() is None or ref().grad is None
    for p in om.parameters():
        assert p.device == CPU and p.grad is not None and p.grad.device == CPU


@pytest.mark.parametrize("checkpoint", MODES)
def test_grads_accumulate_across_backward_calls(checkpoint: bool) -> None:
    plain, om = pair(checkpoint_activation=checkpoint)
    for i in range(2):
        x = torch.randn(4, 8)
        step(plain, x, seed=i)
        step(om, x, seed=i)
    for p, q in zip(om.parameters(), plain.parameters(), strict=True):
        assert_equal(p.grad, q.grad, exact=True)


@pytest.mark.parametrize("checkpoint", MODES)
def test_backward_leaves_rng_state_as_plain_model(checkpoint: bool) -> None:
    plain, om = pair(checkpoint_activation=checkpoint, num_microbatches=2)
    x = torch.randn(4, 8)
    step(lambda t: reference(plain, om.slices, t, 2), x, seed=5)
    want = torch.get_rng_state()
    step(om, x, seed=5)
    assert torch.equal(torch.get_rng_state(), want)


@pytest.mark.parametrize("checkpoint", MODES)
def test_eval_and_no_grad_forwards_match_plain_and_leave_no_slice_resident(checkpoint: bool):
    plain, om = pair(checkpoint_activation=checkpoint)
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.manual_seed(0)
        want = plain(x)
        torch.manual_seed(0)
        got = om(x)
    assert not got.requires_grad and om.resident_slices == ()
    assert_equal(got, want, exact=True)
    plain.eval(), om.eval()
    got = om(x)
    assert_equal(got, plain(x), exact=True)
    assert om.resident_slices == ()
    got.sum().backward()
    assert all(p.grad.device == CPU for p in om.parameters())


def test_state_dict_keys_and_values_match_plain_model() -> None:
    plain, om = pair(bn_net)
    assert list(om.state_dict()) == list(plain.state_dict())
    other = bn_net(seed=7).eval()
    params = list(om.parameters())
    om.load_state_dict(other.state_dict())
    assert all(a is b for a, b in zip(params, om.parameters(), strict=True))
    for (k, v), w in zip(om.state_dict().items(), other.state_dict().values(), strict=True):
        assert v.device == CPU and torch.equal(v, w), k
    om.eval()
    x = torch.randn(3, 8)
    assert_equal(om(x), other(x), exact=True)


def test_frozen_layers_get_no_grad_and_the_rest_match_plain_model() -> None:
    plain, om = pair()
    for mod in (plain, om):
        for p in mod._modules["0"].parameters():
            p.requires_grad_(False)
    x = torch.randn(4, 8)
    step(plain, x, seed=0), step(om, x, seed=0)
    for p, q in zip(om.parameters(), plain.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            assert_equal(p.grad, q.grad, exact=True)


@pytest.mark.parametrize("checkpoint", MODES)
def test_layer_shared_by_two_slices_gets_the_sum_of_its_grads(checkpoint: bool) -> None:
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        shared = nn.Linear(8, 8)
        return nn.Sequential(shared, nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), shared)

    plain, om = pair(make, checkpoint_activation=checkpoint)
    assert om.slices == (("0", "1"), ("2", "3"), ("4",))
    x = torch.randn(4, 8)
    assert_equal(step(om, x, seed=0), step(plain, x, seed=0), exact=True)
    for p, q in zip(om.parameters(), plain.parameters(), strict=True):
        assert_equal(p.grad, q.grad, exact=True)


class ScaleInPlace(nn.Module):
    """Modifies its input in place, as the plain model allows for a non-leaf input."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((8,), 1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2) * self.w


@pytest.mark.parametrize("checkpoint", MODES)
def test_layer_modifying_its_input_in_place_at_a_slice_start(checkpoint: bool) -> None:
    def make() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), ScaleInPlace(), nn.Linear(8, 2))

    plain, om = pair(make, checkpoint_activation=checkpoint, num_slices=2)
    assert om.slices[1][0] == "1"
    x = torch.randn(4, 8, requires_grad=True)
    assert_equal(step(om, x, seed=0), step(plain, x.detach(), seed=0), exact=True)
    for p, q in zip(om.parameters(), plain.parameters(), strict=True):
        assert_equal(p.grad, q.grad, exact=True)


def test_slices_balance_parameter_count() -> None:
    widths = [4, 32, 8, 64, 16, 16, 8, 32, 4]
    layers = []
    for a, b in zip(widths[:-1], widths[1:], strict=True):
        layers += [nn.Linear(a, b), nn.ReLU()]
    om = OffloadModel(nn.Sequential(*layers), CPU, num_slices=3)
    assert [n for names in om.slices for n in names] == [str(i) for i in range(len(layers))]
    sizes = [
        sum(p.numel() for n in names for p in om._modules[n].parameters()) for names in om.slices
    ]
    biggest = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
    assert max(sizes) - min(sizes) <= biggest
    assert all(names[0] != "1" and int(names[0]) % 2 == 0 for names in om.slices)
    assert _partition([0, 0, 0, 0], 2) == [0, 2, 4]
    assert _partition([5, 1, 1], 3) == [0, 1, 2, 3]
    assert _partition([1, 1, 1, 100], 2) == [0, 3, 4]
    assert _partition([80, 72, 0, 0, 18], 3) == [0, 1, 4, 5]  # param-free stay behind


def test_rejects_bad_configuration_at_construction() -> None:
    with pytest.raises(TypeError, match="nn.Sequential"):
        OffloadModel(nn.ModuleList([nn.Linear(2, 2)]), CPU)
    with pytest.raises(TypeError, match="nn.Sequential"):
        OffloadModel(nn.Linear(2, 2), CPU)
    for n in (0, -1, 10, 2.0):
        with pytest.raises(ValueError, match="num_slices"):
            OffloadModel(mlp(), CPU, num_slices=n)
    for m in (0, 1.5):
        with pytest.raises(ValueError, match="num_microbatches"):
            OffloadModel(mlp(), CPU, num_microbatches=m)
    clash = nn.Sequential(OrderedDict(device=nn.Linear(2, 2), b=nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="clashes"):
        OffloadModel(clash, CPU, num_slices=1)


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


def snapshot(om: OffloadModel) -> list[torch.Tensor]:
    return [b.clone() for b in om.buffers()] + [torch.get_rng_state()]


def unchanged(om: OffloadModel, before: list[torch.Tensor]) -> bool:
    after = snapshot(om)
    same = all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    return same and om.resident_slices == () and all(p.grad is None for p in om.parameters())


@pytest.mark.parametrize("checkpoint", MODES)
def test_layer_returning_a_non_tensor_fails_first_call_before_anything_changes(checkpoint: bool):
    model = bn_net()
    model.append(Pair())
    om = OffloadModel(model, CPU, checkpoint_activation=checkpoint, num_microbatches=2)
    x = torch.randn(4, 8)
    before = snapshot(om)
    with pytest.raises(TypeError, match=r"layer '7' \(Pair\) returned tuple"):
        om(x)
    assert unchanged(om, before)
    with pytest.raises(TypeError, match="single tensor"):
        om([torch.randn(4, 8)])


def test_indivisible_batch_fails_before_anything_changes() -> None:
    _, om = pair(bn_net, num_microbatches=3)
    x = torch.randn(4, 8)
    before = snapshot(om)
    with pytest.raises(ValueError, match="batch of 4 does not split into num_microbatches=3"):
        om(x)
    assert unchanged(om, before)


def test_moving_the_wrapper_to_another_device_fails_and_dtype_casts_work() -> None:
    plain, om = pair()
    with pytest.raises(RuntimeError, match="offload_device=cpu"):
        om.to("meta")
    assert all(p.device == CPU for p in om.parameters())
    om.double(), plain.double()
    plain.eval(), om.eval()
    x = torch.randn(3, 8, dtype=torch.float64)
    assert_equal(om(x), plain(x), exact=True)


def test_backward_twice_needs_checkpointing() -> None:
    for checkpoint in (False, True):
        plain, om = pair(checkpoint_activation=checkpoint)
        x = torch.randn(4, 8)
        torch.manual_seed(0)
        loss = om(x).sum()
        loss.backward(retain_graph=True)
        if not checkpoint:
            with pytest.raises(RuntimeError, match="checkpoint_activation=True to backward twice"):
                loss.backward()
            continue
        loss.backward()
        torch.manual_seed(0)
        plain(x).sum().mul(2).backward()
        for p, q in zip(om.parameters(), plain.parameters(), strict=True):
            assert_equal(p.grad, q.grad, exact=False)


@pytest.mark.cuda
@pytest.mark.parametrize("checkpoint", MODES)
def test_cuda_memory_holds_about_one_slice(checkpoint: bool) -> None:
    cuda = torch.device("cuda")
    width, depth, slices, batch = 1024, 8, 4, 64
    torch.manual_seed(0)
    om = OffloadModel(
        nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]),
        cuda,
        num_slices=slices,
        checkpoint_activation=checkpoint,
    )
    assert all(p.is_pinned() for p in om.parameters())
    slice_bytes = (width * width + width) * 4 * depth // slices
    act_bytes = batch * width * 4
    x = torch.randn(batch, width, device=cuda)
    # The first matmul of a thread on a stream takes cuBLAS's workspace (32 MiB on Hopper)
    # from the caching allocator; forward and backward (the autograd thread) each take
    # theirs here, before measuring: it is not OffloadModel's memory.
    w = torch.ones(8, 8, device=cuda, requires_grad=True)
    (w @ w).sum().backward()
    del w
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = om(x)
    peak = torch.cuda.max_memory_allocated() - base
    assert slice_bytes <= peak <= slice_bytes + (3 * depth + 4) * act_bytes
    assert torch.cuda.memory_allocated() - base <= (3 * depth + 2) * act_bytes  # no slice left
    torch.cuda.reset_peak_memory_stats()
    out.square().mean().backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= 2 * slice_bytes + (3 * depth + 4) * act_bytes  # copies and their grads
    assert om.resident_slices == ()
    assert all(p.grad.device == CPU for p in om.parameters())


@pytest.mark.cuda
@pytest.mark.parametrize("checkpoint", MODES)
def test_cuda_losses_and_grads_equal_plain_model_on_cuda(checkpoint: bool) -> None:
    m, cuda = 2, torch.device("cuda")
    plain = mlp().to(cuda)
    om = OffloadModel(
        copy.deepcopy(plain), cuda, checkpoint_activation=checkpoint, num_microbatches=m
    )
    x = torch.randn(8, 8, device=cuda)
    want = step(lambda t: reference(plain, om.slices, t, m), x, seed=1)
    got = step(om, x.cpu(), seed=1)
    assert got.device.type == "cuda"
    assert_equal(got, want, exact=False)
    for p, q in zip(om.parameters(), plain.parameters(), strict=True):
        assert p.device == CPU and p.grad.device == CPU
        assert_equal(p.grad, q.grad.cpu(), exact=False)
