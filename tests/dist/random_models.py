"""Random models and FSDP configurations as plain data, for the randomized equivalence test.

A *spec* is a dict of lists, ints, strings and bools: the pytest process draws it from a
seeded ``random.Random`` and passes it to every spawned rank, which builds the same model
from it (``build_model``) and wraps it the same way (``wrap_model``).

Model: ``RandomModel(x, tok) = head(body(x, tok))`` with ``x`` float ``(B, T, in_dim)``,
``tok`` ints ``(B, T)`` and logits ``(B, T, classes)``. ``body`` is a tree of ``Node``s
(nesting depth 1-3) whose leaves are ``Op``s, each holding one torch layer that maps the
hidden ``(B, T, d_in)`` to ``(B, T, d_out)``. A node may call an item twice, call an
earlier item again, hold an item it never calls (its parameters get no gradient), hold
an Op instance already registered elsewhere in the tree, and add a residual. After
construction some parameters are tied to another of the same shape (``setattr``, so both
names stay in ``named_parameters(remove_duplicate=False)``) and some are frozen.

The reference (``build_reference``) is the same model, rounding where fsdp_lite rounds.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fsdp_lite
from fsdp_lite.testing.reference import BF16_ROUNDED, FP16_ROUNDED, FP32, Tolerance

Spec = dict[str, Any]

# Mostly odd sizes: flat params rarely divide by W; biases of 1 or 2 are smaller than W.
DIMS = (1, 2, 3, 5, 7, 9, 13)
# Norms divide by at most 1 / sqrt(0.1): a feature of tiny variance (a few samples per
# channel, a saturated tanh) would otherwise amplify rounding noise past fp32 tolerances.
NORM_EPS = 0.1
OP_KINDS = ("linear", "conv1d", "conv2d", "layernorm", "batchnorm", "embedding")
# Classes a by_type policy may pick, by name (specs hold plain data).
WRAPPABLE = {
    "Node": None,  # filled in below, once the classes exist
    "Op": None,
    "Linear": nn.Linear,
    "Conv1d": nn.Conv1d,
    "Conv2d": nn.Conv2d,
    "LayerNorm": nn.LayerNorm,
    "BatchNorm1d": nn.BatchNorm1d,
    "Embedding": nn.Embedding,
}


# -- modules --------------------------------------------------------------------------


class Op(nn.Module):
    """One torch layer on the hidden ``(B, T, d)``, an optional tanh and buffer scale."""

    def __init__(self, spec: Spec, vocab: int) -> None:
        super().__init__()
        kind, d_in, d_out, bias = spec["kind"], spec["d_in"], spec["d_out"], spec["bias"]
        self.kind, self.act = kind, spec["act"]
        if kind == "linear":
            self.layer = nn.Linear(d_in, d_out, bias=bias)
        elif kind == "conv1d":
            self.layer = nn.Conv1d(d_in, d_out, spec["k"], padding=spec["k"] // 2, bias=bias)
        elif kind == "conv2d":
            k = spec["k"]
            self.layer = nn.Conv2d(d_in, d_out, (k, 1), padding=(k // 2, 0), bias=bias)
        elif kind == "layernorm":
            self.layer = nn.LayerNorm(d_in, NORM_EPS, elementwise_affine=spec["affine"], bias=bias)
        elif kind == "batchnorm":
            self.layer = nn.BatchNorm1d(d_in, NORM_EPS, affine=spec["affine"])
        elif kind == "embedding":
            self.layer = nn.Embedding(vocab, d_in)
        else:
            raise ValueError(f"unknown op kind {kind!r}")
        if spec["buffer"] is not None:
            scale = 1.0 + 0.1 * torch.randn(d_out)
            self.register_buffer("scale", scale, persistent=spec["buffer"] == "persistent")
        else:
            self.scale = None

    def forward(self, h: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        kind = self.kind
        if kind in ("linear", "layernorm"):
            h = self.layer(h)
        elif kind == "conv1d":  # channels first: (B, d, T)
            h = self.layer(h.transpose(1, 2)).transpose(1, 2)
        elif kind == "batchnorm":
            # Residual: BatchNorm cancels a per-channel shift, so a bias right before it
            # would get a gradient of zero (plus rounding noise) in exact arithmetic.
            h = h + self.layer(h.transpose(1, 2)).transpose(1, 2)
        elif kind == "conv2d":  # (B, d, T, 1)
            h = self.layer(h.transpose(1, 2).unsqueeze(-1)).squeeze(-1).transpose(1, 2)
        else:  # embedding: add the tokens' embeddings
            h = h + self.layer(tok)
        if self.act:
            h = torch.tanh(h)
        if self.scale is not None:
            h = h * self.scale.to(h.dtype)
        return h


class Node(nn.Module):
    """``items`` (an ``nn.ModuleList``, which no policy may make a unit) run in ``calls``
    order (an index may repeat); optionally ``+ input``."""

    def __init__(self, spec: Spec, vocab: int, path: str, built: dict[str, nn.Module]) -> None:
        super().__init__()
        self.items = nn.ModuleList()
        for i, item in enumerate(spec["items"]):
            here = f"{path}.items.{i}"
            if item["kind"] == "node":
                module = Node(item, vocab, here, built)
            elif item["kind"] == "shared":  # the Op built at item["of"], registered again
                module = built[item["of"]]
            else:
                module = built[here] = Op(item, vocab)
            self.items.append(module)
        self.calls = list(spec["calls"])
        self.residual = spec["residual"]

    def forward(self, h: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        x = h
        for i in self.calls:
            x = self.items[i](x, tok)
        return x + h if self.residual else x


class RandomModel(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.body = Node(spec["body"], spec["vocab"], "body", {})
        self.head = nn.Linear(spec["body_out"], spec["classes"])

    def forward(self, x: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x, tok))


WRAPPABLE["Node"], WRAPPABLE["Op"] = Node, Op


PRECISIONS: dict[str | None, tuple[fsdp_lite.MixedPrecision | None, Tolerance]] = {
    None: (None, FP32),
    "bf16": (fsdp_lite.MixedPrecision(param_dtype=torch.bfloat16), BF16_ROUNDED),
    "fp16": (fsdp_lite.MixedPrecision(param_dtype=torch.float16), FP16_ROUNDED),
}
# The dtype a case's model is loaded in before wrapping (``spec["loaded"]``): fsdp_lite
# keeps fp32 masters of the loaded values, computes in that dtype and reduces in fp32, so
# the reference emulates it like mixed precision of that dtype, from the rounded values.
LOADED = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(spec: Spec) -> torch.dtype | None:
    """The low-precision dtype a case computes in (loaded or mixed precision), else None."""
    if spec.get("loaded"):
        return LOADED[spec["loaded"]]
    mp = PRECISIONS[spec["precision"]][0]
    return None if mp is None else mp.param_dtype


def tolerance(spec: Spec) -> Tolerance:
    return PRECISIONS[spec.get("loaded") or spec["precision"]][1]


def _resolve(root: nn.Module, path: str) -> nn.Module:
    """The module at ``path`` of the unwrapped model (units are stepped through)."""
    m = root
    for part in path.split(".") if path else []:
        m = m._modules[part]
        while isinstance(m, fsdp_lite.FSDPModule):
            m = m.module
    return m


def build_model(spec: Spec) -> RandomModel:
    """The model of ``spec`` (initialized from torch's global RNG), ties and freezing applied."""
    model = RandomModel(spec)
    for dst, src in spec["ties"]:
        src_mod, src_attr = src.rsplit(".", 1)
        dst_mod, dst_attr = dst.rsplit(".", 1)
        setattr(_resolve(model, dst_mod), dst_attr, getattr(_resolve(model, src_mod), src_attr))
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in spec["frozen"]:
        params[name].requires_grad_(False)
    return model


# -- the reference -------------------------------------------------------------------
# [Note: the reference rounds where fsdp_lite does]
# compare_training runs the reference on each rank's slice and backpropagates the mean
# of the slices' losses. On a tiny random model, rounding differences that a large model
# averages away decide the test: Adam turns a gradient that is rounding noise into an
# lr-sized step, and against an fp32 reference the bf16/fp16 gradients of a small model
# are often mostly noise. So the reference, plain single-process torch, rounds where
# fsdp_lite's documented semantics round:
# - Mixed precision: one cast of each parameter to ``param_dtype`` per forward (like the
#   full param, its gradient sums every use in that dtype), shadowing the parameter
#   (instance attributes come before ``nn.Module.__getattr__``); fp32 modules
#   (BatchNorm) compute in fp32 between casts of their inputs and outputs; float inputs
#   are cast at the root.
# - The 1/W of the mean over slices is applied to each fp32 gradient (``_Unscale``),
#   not before the backward: fsdp_lite averages in the fp32 reduce-scatter, after each
#   rank's gradient was rounded. ``_ScaleGrad`` undoes the 1/W of the loss first.


class _Emulation:
    """Base of the reference's forward (pre-)hooks, so ``strip_emulation`` finds them."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype


# id(parameter) -> its cast, for one forward of the root.
_CASTS: dict[int, torch.Tensor] = {}


class _CastParams(_Emulation):
    def __call__(self, module: nn.Module, args: tuple) -> None:
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in _CASTS:
                    _CASTS[id(p)] = p.to(self.dtype)
                module.__dict__[name] = _CASTS[id(p)]


class _UncastParams(_Emulation):
    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        for name in module._parameters:
            module.__dict__.pop(name, None)


class _CastInputs(_Emulation):
    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        return _cast_floats(args, self.dtype)


class _CastOutput(_Emulation):
    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return _cast_floats(output, self.dtype)


class _RootForward(_Emulation):
    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        _CASTS.clear()
        return args if self.dtype is None else _cast_floats(args, self.dtype)


class _EndRootForward(_Emulation):
    def __init__(self, world: int) -> None:
        super().__init__(None)
        self.world = world

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> torch.Tensor:
        _CASTS.clear()
        return _ScaleGrad.apply(output.float(), float(self.world))


class _ScaleGrad(torch.autograd.Function):
    """Identity; multiplies the gradient by ``scale`` (in fp32, before any cast)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class _Unscale:
    """A parameter's gradient hook: divides each fp32 contribution by W."""

    def __init__(self, world: int) -> None:
        self.world = world

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return grad / self.world


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    if isinstance(tree, tuple):
        return tuple(_cast_floats(t, dtype) for t in tree)
    return tree.to(dtype) if torch.is_floating_point(tree) else tree


def build_reference(spec: Spec, world: int) -> RandomModel:
    """``build_model``, rounding as fsdp_lite does on W ranks (see the note above)."""
    model = build_model(spec)
    mp = PRECISIONS[spec["precision"]][0]
    dtype = compute_dtype(spec)
    if spec.get("loaded"):  # the loaded model's values, held in fp32 as the masters are
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                t.copy_(t.to(dtype))
    model.register_forward_pre_hook(_RootForward(dtype))
    model.register_forward_hook(_EndRootForward(world))
    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(_Unscale(world))
    for module in model.modules() if dtype is not None else []:
        if mp is not None and isinstance(module, mp.fp32_module_types):
            module.register_forward_pre_hook(_CastInputs(torch.float32))
            module.register_forward_hook(_CastOutput(mp.param_dtype))
        elif module._parameters:
            module.register_forward_pre_hook(_CastParams(dtype))
            module.register_forward_hook(_UncastParams(dtype))
    return model


def strip_emulation(model: nn.Module) -> nn.Module:
    """A copy of the reference, back to the plain model (its parameters' gradient hooks
    stay, but fsdp_lite flattens those parameters and never uses them again)."""
    for module in model.modules():
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key in [k for k, h in hooks.items() if isinstance(h, _Emulation)]:
                del hooks[key]
    return model


# -- wrapping -------------------------------------------------------------------------


def make_policy(policy: list | None):
    if policy is None:
        return None
    kind, arg = policy
    if kind == "by_type":
        return fsdp_lite.wrap.by_type(*(WRAPPABLE[name] for name in arg))
    if kind == "by_size":
        return fsdp_lite.wrap.by_size(arg)
    return fsdp_lite.wrap.any_of(*(make_policy(p) for p in arg))


def wrap_kwargs(spec: Spec) -> dict[str, Any]:
    prefetch = spec["prefetch"]
    return {
        "mixed_precision": PRECISIONS[spec["precision"]][0],
        "reshard_after_forward": spec["raf"],
        "prefetch": None if prefetch is None else fsdp_lite.PrefetchPolicy(max_in_flight=prefetch),
        "offload": fsdp_lite.CPUOffload() if spec["offload"] else None,
    }


def wrap_model(spec: Spec, model: nn.Module) -> fsdp_lite.FSDPModule:
    """Wrap ``spec["by_hand"]`` (deepest first), then the root with the auto-wrap policy."""
    model = strip_emulation(model)  # a copy of the reference
    if spec.get("loaded"):  # as from_pretrained(..., torch_dtype=...): fed that dtype too
        dtype = LOADED[spec["loaded"]]
        model.to(dtype)
        model.register_forward_pre_hook(lambda m, args: _cast_floats(args, dtype))
    kwargs = wrap_kwargs(spec)
    for path in sorted(spec["by_hand"], key=lambda p: -p.count(".")):
        module = _resolve(model, path)
        unit = fsdp_lite.FSDPModule(module, **kwargs)
        for holder in list(model.modules()):  # a shared module: the unit goes everywhere
            for name, child in holder._modules.items():
                if child is module:
                    holder._modules[name] = unit
    return fsdp_lite.FSDPModule(model, auto_wrap_policy=make_policy(spec["policy"]), **kwargs)


# -- data -----------------------------------------------------------------------------


def batch(spec: Spec, world: int, step: int) -> tuple[torch.Tensor, ...]:
    """The global batch of ``step``: every rank draws the same and keeps its slice."""
    g = torch.Generator().manual_seed(1000 * spec["id"] + step)
    b, t = spec["per_rank"] * world, spec["seq"]
    x = torch.randn(b, t, spec["in_dim"], generator=g)
    tok = torch.randint(0, spec["vocab"], (b, t), generator=g)
    y = torch.randint(0, spec["classes"], (b, t), generator=g)
    return x, tok, y


def loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, tok, y = batch
    return F.cross_entropy(model(x, tok).float().flatten(0, 1), y.flatten())


# -- drawing specs --------------------------------------------------------------------


def _draw_op(rng: random.Random, d_in: int, kinds: tuple[str, ...] = OP_KINDS) -> Spec:
    if d_in < 3:  # a LayerNorm over 1 or 2 features is constant in its input
        kinds = tuple(k for k in kinds if k != "layernorm") or ("linear",)
    kind = rng.choice(kinds)
    d_out = rng.choice(DIMS) if kind in ("linear", "conv1d", "conv2d") else d_in
    return {
        "kind": kind,
        "d_in": d_in,
        "d_out": d_out,
        "bias": rng.random() < 0.7,
        "affine": rng.random() < 0.8,
        "k": rng.choice((1, 3)),
        "act": rng.random() < 0.5,
        "buffer": rng.choice((None, None, None, "persistent", "transient")),
    }


def _draw_node(
    rng: random.Random, d_in: int, depth: int, max_depth: int, path: str, ops: list
) -> Spec:
    """A node at ``path``; ``ops`` lists ``(path, spec)`` of the Ops drawn before it."""
    items: list[Spec] = []
    calls: list[int] = []
    d = d_in
    for _ in range(rng.randint(1, 3)):
        here = f"{path}.items.{len(items)}"
        earlier = [p for p, op in ops if op["d_in"] == op["d_out"] == d]
        if earlier and rng.random() < 0.12:  # an earlier Op instance, registered here too
            item = {"kind": "shared", "of": rng.choice(earlier), "d_in": d, "d_out": d}
        elif depth < max_depth and rng.random() < 0.5:
            item = _draw_node(rng, d, depth + 1, max_depth, here, ops)
        else:
            item = _draw_op(rng, d)
            ops.append((here, item))
        items.append(item)
        calls.append(len(items) - 1)
        if item["d_out"] == d and rng.random() < 0.2:
            calls.append(len(items) - 1)  # called twice in a row
        d = item["d_out"]
    again = [i for i, s in enumerate(items) if s["d_in"] == s["d_out"] == d]
    if again and rng.random() < 0.2:
        calls.append(rng.choice(again))  # an earlier item called again, later
    if rng.random() < 0.1:
        items.append(_draw_op(rng, d, ("linear", "layernorm")))  # never called
    return {
        "kind": "node",
        "items": items,
        "calls": calls,
        "d_in": d_in,
        "d_out": d,
        "residual": d == d_in and rng.random() < 0.3,
    }


def _draw_policy(rng: random.Random, n_params: int, depth: int = 0) -> list | None:
    kind = rng.choice(("none", "by_type", "by_size", "any_of") if depth == 0 else ("by_type",))
    if kind == "none":
        return None
    if kind == "by_type":
        return ["by_type", rng.sample(sorted(WRAPPABLE), rng.randint(1, 3))]
    if kind == "by_size":
        return ["by_size", rng.randint(1, max(1, n_params))]
    return ["any_of", [_draw_policy(rng, n_params, 1), ["by_size", rng.randint(1, n_params)]]]


def draw_spec(seed: int, case: int) -> Spec:
    """Case ``case`` of the run seeded ``seed``: a model, its ties and frozen parameters,
    a wrapping and an FSDP configuration. Deterministic in ``(seed, case)``."""
    rng = random.Random(f"{seed}-{case}")
    in_dim = rng.choice(DIMS)
    body = _draw_node(rng, in_dim, 1, rng.choice((1, 2, 2, 3, 3)), "body", [])
    accumulate = rng.choice((1, 1, 2))  # micro-batches per step, all but the last in no_sync
    # BatchNorm over two values per channel outputs +-1 whatever its input: no gradient.
    per_micro = rng.choice((2, 3)) if has_batchnorm(body) else rng.choice((1, 2, 3))
    spec: Spec = {
        "id": case,
        "vocab": rng.choice((5, 7, 11)),
        "classes": rng.choice((3, 5, 7)),
        "in_dim": in_dim,
        "body": body,
        "body_out": body["d_out"],
        "seq": rng.choice((2, 3, 5)),
        "per_rank": per_micro * accumulate,
        "accumulate": accumulate,
    }
    model = RandomModel(spec)
    paths: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, Op):
            paths.setdefault(id(m), []).append(name)
    spec["aliases"] = {p[0]: p for p in paths.values() if len(p) > 1}  # shared Ops
    modules = [n for n, m in model.named_modules() if isinstance(m, Node | Op)]
    hand = {n for n in modules if rng.random() < 0.12}
    spec["by_hand"] = sorted(set(_never_called(model)) | hand)
    spec["policy"] = _draw_policy(rng, sum(p.numel() for p in model.parameters()))
    spec["precision"] = rng.choice((None, None, "bf16", "fp16"))
    spec["raf"] = rng.choice((None, True, False))
    spec["prefetch"] = rng.choice((None, 1, 2, 3))
    spec["offload"] = rng.random() < 0.25
    spec["ties"] = _draw_ties(rng, spec, model)
    tied_away = {dst for dst, _ in spec["ties"]}
    live = [n for n, _ in model.named_parameters() if n not in tied_away and n != "head.bias"]
    spec["frozen"] = sorted(n for n in live if rng.random() < 0.15)
    spec["expect_error"] = _split_across_units(spec)
    # Drawn apart, so adding this draw left every earlier case as it was.
    loaded = random.Random(f"{seed}-{case}-loaded").choice((None,) * 6 + tuple(LOADED))
    spec["loaded"] = loaded if spec["precision"] is None and not has_batchnorm(body) else None
    fp16 = "fp16" in (spec["precision"], spec["loaded"])
    spec["scaler"] = fp16 and random.Random(f"{seed}-{case}-scaler").random() < 0.5
    return spec


def _draw_ties(rng: random.Random, spec: Spec, model: RandomModel) -> list[list[str]]:
    """Up to 3 ``[dst, src]`` pairs of parameters of the same shape; ``dst`` becomes ``src``."""
    shapes = {  # not a shared Op's: its parameters are tied already
        n: tuple(p.shape)
        for n, p in model.named_parameters()
        if not any(_inside(n, shared) for shared in spec["aliases"])
    }
    owner = {n: _resolve(model, n.rsplit(".", 1)[0]) for n in shapes}
    fp32 = {n for n in shapes if isinstance(owner[n], nn.BatchNorm1d)}  # fp32 under mixed precision
    norm_biases = {
        n
        for n in shapes
        if n.endswith(".bias") and isinstance(owner[n], nn.BatchNorm1d | nn.LayerNorm)
    }

    def allowed(dst: str, src: str) -> bool:
        if shapes[dst] != shapes[src] or dst == src:
            return False
        if dst.endswith(".weight") and src in norm_biases:
            return False  # a norm weight of zeros: the next norm divides by zero variance
        # Library bug "tie across fp32 modules": a parameter shared by a BatchNorm and a
        # module computing in param_dtype is gathered in one dtype for both and the other
        # module's forward fails (RuntimeError: mixed dtype).
        if spec["precision"] is not None and (dst in fp32) != (src in fp32):
            return False
        # Library bug "tie re-flattened": once a unit has flattened a tied parameter, a
        # second unit holding its other use but not the first unit (a hand-wrapped sibling,
        # or any auto-wrapped unit) accepts it as an empty slot instead of raising the tie
        # error, and forward fails obscurely. Only ties that the root (or a common
        # ancestor unit) meets are drawn across hand-wrapped units, and none under a policy.
        hand = spec["by_hand"]
        only_dst = any(_in_unit(spec, dst, u) and not _in_unit(spec, src, u) for u in hand)
        only_src = any(_in_unit(spec, src, u) and not _in_unit(spec, dst, u) for u in hand)
        if spec["policy"] is not None:
            return not (only_dst or only_src)
        return not (only_dst and only_src)

    ties: list[list[str]] = []
    for _ in range(rng.choice((0, 1, 1, 2, 2, 3))):
        used = {n for t in ties for n in t}
        dsts = [n for n in sorted(shapes) if n != "head.bias" and n not in used]
        pairs = [(d, s) for d in dsts for s in sorted(shapes) if s not in used and allowed(d, s)]
        if pairs:
            ties.append(list(rng.choice(pairs)))
    return ties


def has_batchnorm(node: Spec) -> bool:
    return any(
        has_batchnorm(s) if s["kind"] == "node" else s["kind"] == "batchnorm" for s in node["items"]
    )


def _never_called(model: RandomModel) -> list[str]:
    """Items no node calls. They are wrapped by hand, so a whole unit gets no gradient:
    inside a flat param that does get one, AdamW would decay their weights (their slots
    read grad 0, not None) where the reference skips them."""
    return [
        f"{name}.items.{i}"
        for name, node in model.named_modules()
        if isinstance(node, Node)
        for i in range(len(node.items))
        if i not in node.calls
    ]


def _inside(name: str, module: str) -> bool:
    return name.startswith(module + ".")


def _in_unit(spec: Spec, name: str, unit: str) -> bool:
    """Whether the parameter or module ``name`` lies in the hand-wrapped ``unit``, which
    is at every place its module is registered (a shared Op's unit is put at each)."""
    return any(_inside(name, path) for path in spec["aliases"].get(unit, [unit]))


def _owner(spec: Spec, name: str) -> str | None:
    """The innermost hand-wrapped unit holding the parameter ``name`` (a shared Op's unit
    is at each of its places), or None: left to the policy and the root."""
    best, depth = None, -1
    for unit in spec["by_hand"]:
        for path in spec["aliases"].get(unit, [unit]):
            if _inside(name, path) and path.count(".") > depth:
                best, depth = unit, path.count(".")
    return best


def _split_across_units(spec: Spec) -> str | None:
    """A parameter reached under several names (tied, or inside a shared Op) whose names
    lie in different hand-wrapped units, or some in one and some in none, cannot be
    placed: the unit wrapped first shards it before its other use is seen, and wrapping is
    refused. Returns such a name, or None when every parameter can be placed (names outside
    every hand-wrapped unit are left to the policy, which places ties)."""
    where: dict[int, list[str]] = {}
    for name, p in build_model(spec).named_parameters(remove_duplicate=False):
        where.setdefault(id(p), []).append(name)
    for names in where.values():
        owners = [_owner(spec, n) for n in names]
        if len(set(owners)) > 1:
            return next(n for n, o in zip(names, owners, strict=True) if o is not None)
    return None


def describe(spec: Spec) -> str:
    """One line with what a case exercises, for failure messages."""
    return (
        f"case {spec['id']}: policy={spec['policy']} by_hand={spec['by_hand']} "
        f"precision={spec['precision']} raf={spec['raf']} prefetch={spec['prefetch']} "
        f"offload={spec['offload']} accumulate={spec['accumulate']} ties={spec['ties']} "
        f"frozen={spec['frozen']} loaded={spec.get('loaded')} "
        f"scaler={spec.get('scaler')}"
    )
