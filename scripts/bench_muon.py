"""Muon on sharded parameters: fsdp_lite's whole-parameter layout against FSDP2 + gather.

    make bench-muon [ARGS='--steps 10 --rounds 5']
    .venv/bin/python scripts/bench_muon.py [--steps 10 --warmup 2 --rounds 5]
        [--layers 8 --dim 128 --heads 4 --vocab 512 --seq 64 --batch 2] [--fake-world 8]

One GPT (tied head off, no dropout, fp32), a unit per Block plus the root, built with the
same seed before wrapping and fed the same batches (``--batch`` sequences per rank), in
four cases:

1. ``default + AdamW``: fsdp_lite's default layout (even flat shards), one AdamW.
2. ``whole + AdamW``: ``optimizer_params="whole"`` (each rank owns whole original parameters),
   one AdamW over ``model.parameters()``.
3. ``whole + Muon``: ``optimizer_params="whole"``, ``torch.optim.Muon`` on the blocks' 2-D
   matrices this rank owns, AdamW on the rest; Muon communicates nothing.
4. ``FSDP2 + Muon (gather)``: torch's ``fully_shard`` on each Block and the root; Muon as
   FSDP2 users write it (``GatherMuon`` below): momentum on the local dim-0 shard, the
   Nesterov update all-gathered to the full matrix, Newton-Schulz on it (every rank, every
   matrix), this rank's rows applied; AdamW on the rest. Same hyperparameters as
   ``torch.optim.Muon``'s defaults (its ``adjust_lr_fn=None``: lr * sqrt(max(1, A/B))).

Measured at W=2 on real gloo ranks (spawned, one thread each; losses comparable across
cases) and at W=8 on torch's fake process group (one process per simulated rank, run one
after another; collectives move nothing, so losses mean nothing there -- fsdp_lite's
uneven gathers leave other ranks' rows unwritten -- but bytes, host time and each rank's
optimizer time do). Per case:

- communication per step: bytes of every collective the rank issues, observed at the
  ProcessGroup methods (``bench_measure.count_collectives``, the same for both systems;
  full buffer each call spans, broadcast rows summed), and of those, the bytes issued
  inside the optimizer step (FSDP2 + Muon's gathers; 0 for fsdp_lite);
- step time (zero_grad + forward + backward + optimizer): per step the slowest rank, the
  median of each round's steps, the median over ``--rounds`` rounds in which the cases
  are interleaved (round k runs case 1, 2, 3, 4, each ``--warmup`` + ``--steps`` steps);
- optimizer step time per rank (median as above), its max over ranks and max/mean;
- ratios against ``default + AdamW`` of the same run.

A second table (fake process group, rank 0, one process per W = 2..8): all-gather +
reduce-scatter bytes per step of the default layout and of whole params (fsdp_lite's own
accounting, ``fsdp_lite.stats()``), the bytes each rank owns under whole params (max and
max/mean, from every FlatParam's ``bounds``), and what gathering and reduce-scattering
every flat param padded to its largest per-rank piece (W x that piece) would move instead
of uneven per-rank collectives. Prints markdown; writes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # measure this checkout's fsdp_lite

import bench_measure as bm  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_systems import make_batches, tied_gpt_config  # noqa: E402
from torch import nn  # noqa: E402

import fsdp_lite  # noqa: E402
from fsdp_lite.core.tree import units_of  # noqa: E402
from fsdp_lite.testing.models import GPT, Block, GPTConfig  # noqa: E402
from fsdp_lite.testing.spawn import run_distributed  # noqa: E402

CASES = ("default + AdamW", "whole + AdamW", "whole + Muon", "FSDP2 + Muon (gather)")
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)  # torch.optim.Muon's (Keller Jordan's quintic)
NS_STEPS = 5
NS_EPS = 1e-7
# torch >= 2.13 names it all_gather_single (the old name warns); older releases lack it.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclasses.dataclass(frozen=True)
class MuonBenchConfig:
    """Everything a rank needs; picklable."""

    layers: int = 8
    dim: int = 128
    heads: int = 4
    vocab: int = 512
    seq: int = 64
    batch: int = 2  # sequences per rank per step
    steps: int = 10  # timed steps per case per round
    warmup: int = 2  # untimed steps per case per round, before the timed ones
    rounds: int = 5
    seed: int = 1234
    muon_lr: float = 0.02
    adamw_lr: float = 1e-3
    timeout_s: float = 600.0  # a collective's, before the process group fails it

    def gpt_config(self) -> GPTConfig:
        return dataclasses.replace(tied_gpt_config(self), tie_weights=False)


# -- Muon for FSDP2, as its users write it -----------------------------------------------------


def newton_schulz(grad: torch.Tensor, steps: int = NS_STEPS, eps: float = NS_EPS) -> torch.Tensor:
    """Orthogonalize a 2-D matrix like ``torch.optim.Muon``: bf16, divided by its Frobenius
    norm, tall matrices transposed, ``steps`` quintic iterations."""
    a, b, c = NS_COEFFICIENTS
    x = grad.bfloat16()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, update, x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, shape: torch.Size) -> float:
    """``torch.optim.Muon``'s default (``adjust_lr_fn=None``, "original") scaling."""
    rows, cols = shape[:2]
    return lr * math.sqrt(max(1, rows / cols))


class GatherMuon:
    """Muon over FSDP2 parameters (DTensors sharded on dim 0): momentum on the local shard,
    the Nesterov update all-gathered to the full matrix (each rank's rows padded to FSDP2's
    chunk), orthogonalized on every rank, this rank's rows applied with decoupled weight
    decay. One all-gather per matrix per step."""

    def __init__(
        self,
        params: list[nn.Parameter],
        lr: float = 0.02,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
    ) -> None:
        self.params = params
        self.lr, self.weight_decay, self.momentum = lr, weight_decay, momentum
        self.bufs: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            group = p.device_mesh.get_group()
            world, rank = dist.get_world_size(group), dist.get_rank(group)
            rows, cols = p.shape
            chunk = -(-rows // world)  # FSDP2's dim-0 shards: ceil(rows / W), the last short
            grad, local = p.grad.to_local(), p.to_local()
            buf = self.bufs.get(id(p))
            if buf is None:
                buf = self.bufs[id(p)] = torch.zeros_like(grad)
            buf.lerp_(grad, 1 - self.momentum)
            update = grad.lerp(buf, self.momentum)  # Nesterov
            padded = update.new_zeros(chunk, cols)
            padded[: update.shape[0]] = update
            full = update.new_empty(world * chunk, cols)
            _all_gather_flat(full, padded, group=group)
            start = min(rank * chunk, rows)
            mine = newton_schulz(full[:rows])[start : start + local.shape[0]]
            local.mul_(1 - self.lr * self.weight_decay)
            local.add_(mine, alpha=-adjusted_lr(self.lr, p.shape))

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


# -- the cases ---------------------------------------------------------------------------------


Optimizer = torch.optim.Optimizer | GatherMuon


def split_matrices(named: list[tuple[str, nn.Parameter]]) -> tuple[list, list]:
    """(the blocks' 2-D matrices, everything else)."""
    mats = [p for n, p in named if p.ndim == 2 and "blocks." in n]
    rest = [p for n, p in named if not (p.ndim == 2 and "blocks." in n)]
    return mats, rest


def build_case(case: str, cfg: MuonBenchConfig) -> tuple[nn.Module, list[Optimizer]]:
    """The seeded GPT wrapped for ``case`` and its optimizers (none over an empty list: under
    whole params a rank may own no matrix, or nothing else)."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg.gpt_config())
    world = dist.get_world_size()
    if case == CASES[3]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        mats, rest = split_matrices(list(model.named_parameters()))
        return model, [GatherMuon(mats, lr=cfg.muon_lr), torch.optim.AdamW(rest, lr=cfg.adamw_lr)]
    whole = case != CASES[0]
    # A group of its own per model: whole params balance owners over everything wrapped on a
    # group in this process, and cases 2 and 3 must get the same layout.
    group = dist.new_group(list(range(world)))
    model = fsdp_lite.FSDPModule(
        model,
        process_group=group,
        auto_wrap_policy=fsdp_lite.wrap.by_type(Block),
        optimizer_params="whole" if whole else "flat",
    )
    if case != CASES[2]:
        params = list(model.parameters())
        return model, [torch.optim.AdamW(params, lr=cfg.adamw_lr)] if params else []
    mats, rest = split_matrices(list(model.named_parameters()))
    opts: list[Optimizer] = []
    if mats:
        opts.append(torch.optim.Muon(mats, lr=cfg.muon_lr))
    if rest:
        opts.append(torch.optim.AdamW(rest, lr=cfg.adamw_lr))
    return model, opts


def train_step(
    model: nn.Module, opts: list[Optimizer], batch: tuple, opt_counts: dict | None = None
) -> tuple[float, float, float]:
    """One step; (seconds in all, seconds in the optimizer step, loss). With ``opt_counts``,
    the optimizer step's collectives are added to it."""
    x, y = batch
    watch = bm.Stopwatch()
    for opt in opts:
        opt.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    loss.backward()
    fwd_bwd = watch.wall()
    if opt_counts is None:
        for opt in opts:
            opt.step()
    else:
        with bm.count_collectives() as counts:
            for opt in opts:
                opt.step()
        bm.add_counts(opt_counts, counts)
    step = watch.wall()
    return step, step - fwd_bwd, loss.item()


def comm_total(counts: dict, steps: int) -> dict[str, Any]:
    """Per step: full-buffer bytes and calls per collective kind, and their sum."""
    per_kind = bm.per_step(counts, steps)
    return {"bytes": sum(c["bytes"] for c in per_kind.values()), "kinds": per_kind}


def run_cases(rank: int, world: int, cfg: MuonBenchConfig) -> dict[str, Any]:
    """One rank (gloo or fake): build every case, run ``cfg.rounds`` interleaved rounds, the
    same ``warmup + steps`` batches each round."""
    batches = make_batches(cfg, rank, cfg.warmup + cfg.steps, torch.device("cpu"))
    built = {case: build_case(case, cfg) for case in CASES}
    out: dict[str, Any] = {
        c: {"step_s": [], "opt_s": [], "losses": [], "lib_bytes": None} for c in CASES
    }
    comm = {c: bm.new_counts() for c in CASES}
    opt_comm = {c: bm.new_counts() for c in CASES}
    for _ in range(cfg.rounds):
        for case in CASES:
            model, opts = built[case]
            r = out[case]
            steps_s, opt_s = [], []
            for i, batch in enumerate(batches):
                timed = i >= cfg.warmup
                dist.barrier()  # ranks start each step together: the slowest rank is the step
                fsdp_lite.reset_stats()
                if timed:
                    with bm.count_collectives() as counts:
                        step_s, o_s, loss = train_step(model, opts, batch, opt_comm[case])
                    bm.add_counts(comm[case], counts)
                    steps_s.append(step_s)
                    opt_s.append(o_s)
                else:
                    _, _, loss = train_step(model, opts, batch)
                r["losses"].append(loss)
            if case != CASES[3]:  # fsdp_lite's own accounting of the last step
                lib = fsdp_lite.stats()["collectives"]
                ops = ("all_gather", "reduce_scatter", "all_reduce")
                r["lib_bytes"] = sum(lib[op]["bytes"] for op in ops if op in lib)
            r["step_s"].append(steps_s)
            r["opt_s"].append(opt_s)
    timed = cfg.rounds * cfg.steps
    for case in CASES:
        out[case]["comm"] = comm_total(comm[case], timed)
        out[case]["opt_comm"] = comm_total(opt_comm[case], timed)
    return out


def layout(rank: int, world: int, cfg: MuonBenchConfig) -> dict[str, Any]:
    """Rank ``rank`` of ``world`` on the fake process group: per-step all-gather +
    reduce-scatter bytes of the default layout and of whole params, and the whole layout's
    pieces."""
    batch = make_batches(cfg, rank, cfg.warmup + cfg.steps, torch.device("cpu"))[0]
    result: dict[str, Any] = {"world": world}
    for case in CASES[:2]:
        model, opts = build_case(case, cfg)
        for _ in range(2):  # the first step also runs the divergence check in lockstep
            fsdp_lite.reset_stats()
            train_step(model, opts, batch)
        stats = fsdp_lite.stats()
        ops = ("all_gather", "reduce_scatter")
        flats = [f for u in units_of(model) for f in u.flat_params]
        owned = [0] * world
        for f in flats:
            for r in range(world):
                owned[r] += (f.bounds[r + 1] - f.bounds[r]) * f.shard.element_size()
        # Per unit: what its gathers and reduce-scatters would move were every flat
        # param padded to W x its largest per-rank piece.
        padded = 0.0
        for u in units_of(model):
            moved = sum(stats["units"].get(u.name, {}).get(op, {}).get("bytes", 0) for op in ops)
            full = sum(f.bounds[-1] * f.shard.element_size() for f in u.flat_params)
            pad = sum(
                world
                * max(b - a for a, b in zip(f.bounds, f.bounds[1:], strict=False))
                * f.shard.element_size()
                for f in u.flat_params
            )
            padded += moved * pad / full if full else 0.0
        result[case] = {
            "bytes": sum(stats["collectives"].get(op, {}).get("bytes", 0) for op in ops),
            "owned": owned,
            "padded_bytes": padded,
        }
        del model, opts
    return result


# -- driving and reporting ---------------------------------------------------------------------


def run_gloo(cfg: MuonBenchConfig, world: int) -> list[dict[str, Any]]:
    """Every case on ``world`` real gloo ranks, one thread each."""
    return run_distributed(run_cases, world, cfg, timeout=cfg.timeout_s)


def run_fake(cfg: MuonBenchConfig, world: int) -> list[dict[str, Any]]:
    """Every case on each of ``world`` fake-PG ranks, one rank after another."""
    return [bm.fake_rank(run_cases, r, world, cfg) for r in range(world)]


def run_layouts(cfg: MuonBenchConfig, worlds: list[int]) -> list[dict[str, Any]]:
    """The layout figures of rank 0 at each world size."""
    return [bm.fake_rank(layout, 0, w, cfg) for w in worlds]


def summarize(ranks: list[dict[str, Any]], case: str) -> dict[str, float]:
    """One case over its ranks: slowest rank per step, median per round, median of rounds."""
    rounds = len(ranks[0][case]["step_s"])
    step = bm.median_of_rounds(
        bm.slowest_per_step(r[case]["step_s"][k] for r in ranks) for k in range(rounds)
    )
    opt = [bm.median_of_rounds(r[case]["opt_s"]) for r in ranks]
    return {
        "step_s": step,
        "opt_max_s": max(opt),
        "opt_mean_s": statistics.fmean(opt),
        "comm_bytes": max(r[case]["comm"]["bytes"] for r in ranks),
        "opt_comm_bytes": max(r[case]["opt_comm"]["bytes"] for r in ranks),
        "lib_bytes": ranks[0][case]["lib_bytes"],
        "loss_first": statistics.fmean(r[case]["losses"][0] for r in ranks),
        "loss_last": statistics.fmean(r[case]["losses"][-1] for r in ranks),
    }


def case_table(ranks: list[dict[str, Any]], world: int, fake: bool) -> list[str]:
    cols = (
        "case", "comm MiB/step", "vs default", "in optimizer MiB", "ms/step", "vs default",
        "optimizer ms (max rank)", "vs default", "optimizer max/mean", "loss first -> last",
    )  # fmt: skip
    rows = []
    figures = {case: summarize(ranks, case) for case in CASES}
    ref = figures[CASES[0]]
    for case, f in figures.items():
        loss = "-" if fake else f"{f['loss_first']:.6f} -> {f['loss_last']:.6f}"
        cells = [
            case,
            f"{f['comm_bytes'] / bm.MIB:.2f}",
            bm.ratio(f["comm_bytes"], ref["comm_bytes"]),
            f"{f['opt_comm_bytes'] / bm.MIB:.2f}",
            f"{f['step_s'] * 1e3:.1f}",
            bm.ratio(f["step_s"], ref["step_s"]),
            f"{f['opt_max_s'] * 1e3:.2f}",
            bm.ratio(f["opt_max_s"], ref["opt_max_s"]),
            f"{f['opt_max_s'] / f['opt_mean_s']:.2f}" if f["opt_mean_s"] else "-",
            loss,
        ]
        rows.append(cells)
    rows = bm.md_table(cols, rows, "l" + "r" * (len(cols) - 1))
    lib = ", ".join(f"{case} {figures[case]['lib_bytes'] / bm.MIB:.2f} MiB" for case in CASES[:3])
    rows += ["", f"fsdp_lite's own accounting (rank 0, last step): {lib}."]
    return rows


def layout_table(layouts: list[dict[str, Any]]) -> list[str]:
    cols = (
        "W", "default AG+RS MiB/step", "whole AG+RS MiB/step", "whole/default",
        "owned MiB/rank max", "owned max/mean", "padded to max piece MiB/step",
        "padded/default",
    )  # fmt: skip
    rows = []
    for lay in layouts:
        d, w = lay[CASES[0]], lay[CASES[1]]
        owned = w["owned"]
        cells = [
            str(lay["world"]),
            f"{d['bytes'] / bm.MIB:.2f}",
            f"{w['bytes'] / bm.MIB:.2f}",
            bm.ratio(w["bytes"], d["bytes"]),
            f"{max(owned) / bm.MIB:.3f}",
            f"{max(owned) / statistics.fmean(owned):.2f}",
            f"{w['padded_bytes'] / bm.MIB:.2f}",
            bm.ratio(w["padded_bytes"], d["bytes"]),
        ]
        rows.append(cells)
    return bm.md_table(cols, rows, "r" * len(cols))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = bm.make_parser(__doc__)
    defaults = MuonBenchConfig()
    p.add_argument("--steps", type=int, default=defaults.steps, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed steps per round")
    p.add_argument("--rounds", type=int, default=defaults.rounds, help="interleaved rounds")
    bm.add_config_args(p, defaults, ("layers", "dim", "heads", "vocab", "seq", "batch", "seed"))
    p.add_argument("--world", type=int, default=2, help="real gloo ranks")
    p.add_argument("--fake-world", type=int, default=8, help="simulated ranks (fake PG)")
    p.add_argument("--max-layout-world", type=int, default=8, help="second table: W=2..this")
    args = p.parse_args(argv)
    if min(args.steps, args.rounds) < 1 or args.warmup < 0 or min(args.world, args.fake_world) < 2:
        p.error("need --steps, --rounds >= 1, --warmup >= 0, --world and --fake-world >= 2")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = bm.config_from_args(MuonBenchConfig, args)
    with bm.stage("[bench-muon] total"):
        run_and_print(args, cfg, bm.command_line("scripts/bench_muon.py", argv))


def run_and_print(args: argparse.Namespace, cfg: MuonBenchConfig, command: str) -> None:
    """Run every part; print the tables."""
    info = bm.machine()
    psi = bm.count_params(lambda: GPT(cfg.gpt_config()))
    with bm.stage(f"[bench-muon] W={args.world} gloo"):
        gloo = run_gloo(cfg, args.world)
    with bm.stage(f"[bench-muon] W={args.fake_world} fake PG"):
        fake = run_fake(cfg, args.fake_world)
    with bm.stage("[bench-muon] layouts"):
        layouts = run_layouts(cfg, list(range(2, args.max_layout_world + 1)))
    lines = [
        f"{bm.run_line(bm.now(), info)}, load average at start {info['load_avg']}, at end "
        f"{bm.load_avg()}:",
        "",
        f"    {command}",
        "",
        f"GPT {cfg.layers} blocks, dim {cfg.dim}, {cfg.heads} heads, vocab {cfg.vocab}, "
        f"untied, seq {cfg.seq}, {cfg.batch} sequences/rank, fp32, Ψ = {psi:,}; a unit per "
        f"Block plus the root. Muon lr {cfg.muon_lr} (torch defaults otherwise), AdamW lr "
        f"{cfg.adamw_lr}. Median over {cfg.rounds} interleaved rounds of the per-round median "
        f"of {cfg.steps} steps after {cfg.warmup} warm-up; ms/step: slowest rank per step. "
        "Communication: full-buffer bytes of every ProcessGroup collective per step and "
        "rank (max over ranks); 'in optimizer': issued inside the optimizer step.",
        "",
        f"**W={args.world}, gloo** (real ranks, 1 thread each)",
        "",
        *case_table(gloo, args.world, fake=False),
        "",
        f"**W={args.fake_world}, fake process group** (one process per rank, run in turn; "
        "no data moves, losses meaningless)",
        "",
        *case_table(fake, args.fake_world, fake=True),
        "",
        "**Whole-parameter layout vs the default** (fake process group, rank 0; fsdp_lite's "
        "accounting of one step; padded: every flat param gathered and reduce-scattered as "
        "W x its largest per-rank piece instead of uneven per-rank collectives)",
        "",
        *layout_table(layouts),
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
