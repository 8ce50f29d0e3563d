"""scripts/train.py under torchrun (2 gloo ranks, a tiny GPT, a few steps), and its config
checks in-process.

One uninterrupted run is the reference: a run resumed from its mid-run checkpoint, and
a run whose rank 1 is SIGKILLed mid-step under ``torchrun --max-restarts=1``, must
repeat its losses and end with bitwise the same parameters and optimizer state. A fresh
run never deletes (or resumes) an earlier run's checkpoints: it refuses, unless told
``--resume`` or ``--overwrite``; ``make train`` names every run apart.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "train.py"
CONFIG = ROOT / "configs" / "tiny.yaml"
LLAMA = ROOT / "configs" / "tiny_llama.yaml"
LLAMA_DIR = ROOT / "configs" / "tiny_llama"
sys.path.insert(0, str(ROOT / "scripts"))

from train_config import ConfigError, load_config, markdown_table  # noqa: E402

STEPS, EVERY = 16, 4
TINY = [  # dropout and grad_accum on, so RNG and data position must both resume right
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "model.dropout=0.1",
    "train.batch_size=8",
    "train.grad_accum=2",
    f"train.steps={STEPS}",
    "train.lr=3e-3",
    "train.warmup_steps=2",
    "train.log_every=4",
    f"checkpoint.every={EVERY}",
    "checkpoint.keep=0",
]
SCALARS = {
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "comm/bytes_per_step",
    "comm/all_gather_bytes",
    "comm/reduce_scatter_bytes",
    "memory/peak_bytes/rank0",
    "memory/peak_bytes/rank1",
    "comm/exposed_s/rank1",
}


def torchrun(
    cwd: Path,
    name: str,
    *args: str,
    restarts: int = 0,
    config: Path = CONFIG,
    base: tuple[str, ...] = tuple(TINY),
    ok: bool = True,
    nproc: int = 2,
) -> str:
    """Run the script on ``nproc`` ranks in ``cwd`` with ``config`` and the ``base``
    overrides (the tiny GPT's by default), then ``args``; return its output (raise if it
    failed, or with ``ok=False`` if it did not)."""
    cmd = [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={restarts}",
        "--monitor-interval=0.5",
        str(SCRIPT),
        "--config",
        str(config),
        "--set",
        f"name={name}",
        *base,
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=180, check=False
    )
    out = proc.stdout + proc.stderr
    assert (proc.returncode == 0) == ok, f"{' '.join(cmd)} exit {proc.returncode}:\n{out[-6000:]}"
    return out


def scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def checkpoint_tensors(path: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Model and optimizer-state tensors of a DCP checkpoint, read without any ranks."""
    out = tmp / f"{path.parent.name}_{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    saved = torch.load(out, weights_only=False)
    return {k: v for k, v in saved.items() if k.startswith(("model.", "optim.state."))}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"differ from the uninterrupted run: {differ}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run; its directory holds runs/ref and checkpoints/ref."""
    cwd = tmp_path_factory.mktemp("train")
    out = torchrun(cwd, "ref")
    (cwd / "ref.log").write_text(out)
    return cwd


def test_loss_falls_and_summary_reports_comm_against_theory(reference: Path) -> None:
    losses = [v for _, v in scalars(reference / "runs" / "ref", "loss")]
    assert len(losses) == STEPS
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, losses
    summary = json.loads((reference / "runs" / "ref" / "summary.json").read_text())
    assert summary["parameters"] > 0 and len(summary["shard_bytes_per_rank"]) == 2
    # measured = theory up to padding to a multiple of W and the 4-byte grad-norm all-reduce
    assert summary["comm_bytes_per_step"] == pytest.approx(summary["comm_bytes_theory"], 0.01)
    log = (reference / "ref.log").read_text()
    assert "micro-steps before the last: keep (train.accumulate=auto)" in log, log
    assert "(kept across 2 micro-steps) + 1 reduce-scatter in fp32" in log, log
    assert re.search(r"comm bytes/step .*\n\s+theory .*measured/theory 1\.0", log), log


def test_tensorboard_events_hold_every_scalar_per_step(reference: Path) -> None:
    acc = EventAccumulator(str(reference / "runs" / "ref"), size_guidance={"scalars": 0})
    acc.Reload()
    missing = SCALARS - set(acc.Tags()["scalars"])
    assert not missing, f"missing TensorBoard scalars: {missing}"
    assert [step for step, _ in scalars(reference / "runs" / "ref", "lr")] == list(
        range(1, STEPS + 1)
    )


def test_checkpoints_are_written_every_n_steps(reference: Path) -> None:
    steps = sorted(p.name for p in (reference / "checkpoints" / "ref").iterdir())
    assert steps == [f"step_{s:07d}" for s in range(EVERY, STEPS + 1, EVERY)]
    assert all((reference / "checkpoints" / "ref" / s / ".metadata").is_file() for s in steps)


def test_resumed_run_repeats_the_uninterrupted_losses(reference: Path, tmp_path: Path) -> None:
    mid = STEPS // 2
    (tmp_path / "checkpoints" / "res").mkdir(parents=True)
    shutil.copytree(
        reference / "checkpoints" / "ref" / f"step_{mid:07d}",
        tmp_path / "checkpoints" / "res" / f"step_{mid:07d}",
    )
    out = torchrun(tmp_path, "res", "--resume")
    assert f"resumed from checkpoints/res/step_{mid:07d} at step {mid}" in out, out
    expected = scalars(reference / "runs" / "ref", "loss")[mid:]
    assert scalars(tmp_path / "runs" / "res", "loss") == expected
    final = f"step_{STEPS:07d}"
    assert_bitwise_equal(
        checkpoint_tensors(tmp_path / "checkpoints" / "res" / final, tmp_path),
        checkpoint_tensors(reference / "checkpoints" / "ref" / final, tmp_path),
    )


def test_rank_killed_under_max_restarts_ends_equal_to_uninterrupted_run(
    reference: Path, tmp_path: Path
) -> None:
    crash_at = EVERY + 2  # after a checkpoint, before the next
    out = torchrun(tmp_path, "crash", f"debug.crash_at_step={crash_at}", restarts=1)
    assert f"resumed from checkpoints/crash/step_{EVERY:07d} at step {EVERY}" in out, out
    # TensorBoard shows one curve: the restart purged the first attempt's later steps
    assert scalars(tmp_path / "runs" / "crash", "loss") == scalars(
        reference / "runs" / "ref", "loss"
    )
    final = f"step_{STEPS:07d}"
    assert_bitwise_equal(
        checkpoint_tensors(tmp_path / "checkpoints" / "crash" / final, tmp_path),
        checkpoint_tensors(reference / "checkpoints" / "ref" / final, tmp_path),
    )


def test_feature_knobs_train_checkpoint_and_match_theoretical_comm(tmp_path: Path) -> None:
    """bf16 gathers, activation checkpointing, SSD offload (optimizer moments too), units
    by size, two-deep prefetch, all units resharded: trains, saves, accounts as predicted."""
    knobs = [
        "fsdp.mixed_precision=bf16",
        "fsdp.activation_checkpointing=true",
        "fsdp.offload=ssd",
        f"fsdp.offload_dir={tmp_path / 'ssd'}",
        "fsdp.wrap=size",
        "fsdp.wrap_min_params=5000",
        "fsdp.prefetch=2",
        "fsdp.reshard_after_forward=true",
        "train.steps=8",
    ]
    out = torchrun(tmp_path, "knobs", *knobs)
    # The planner does not model SSD offload: without an estimate, auto means no_sync.
    assert "micro-steps before the last: no_sync (train.accumulate=auto)" in out, out
    assert "2 gathers in bf16 x 2 micro-steps + 1 reduce-scatter in fp32" in out, out
    summary = json.loads((tmp_path / "runs" / "knobs" / "summary.json").read_text())
    assert summary["units"] > 1 and summary["last_loss"] < summary["first_loss"]
    assert summary["comm_bytes_per_step"] == pytest.approx(summary["comm_bytes_theory"], 0.01)
    assert (tmp_path / "checkpoints" / "knobs" / "step_0000008" / ".metadata").is_file()


def test_tensor_parallel_run_continues_without_tp(tmp_path: Path) -> None:
    """parallel.tp=2 on 4 ranks (dp 2 x tp 2, no dropout: TP ranks draw other masks): the
    loss falls and the comm matches its theory on local sizes; its mid-run checkpoint,
    resumed on 2 ranks without TP, repeats the TP run's later losses."""
    knobs = ["model.dropout=0.0", "train.steps=8", "checkpoint.every=4"]
    out = torchrun(tmp_path, "tp", *knobs, "parallel.tp=2", nproc=4)
    assert "on this rank (parallel.tp=2): measured/theory 1.0" in out, out
    summary = json.loads((tmp_path / "runs" / "tp" / "summary.json").read_text())
    assert summary["last_loss"] < summary["first_loss"]
    (tmp_path / "checkpoints" / "dp").mkdir(parents=True)
    shutil.copytree(
        tmp_path / "checkpoints" / "tp" / "step_0000004",
        tmp_path / "checkpoints" / "dp" / "step_0000004",
    )
    torchrun(tmp_path, "dp", *knobs, "--resume")
    tp_losses = scalars(tmp_path / "runs" / "tp", "loss")[4:]
    dp_losses = scalars(tmp_path / "runs" / "dp", "loss")
    assert [s for s, _ in dp_losses] == [s for s, _ in tp_losses]
    for (step, a), (_, b) in zip(dp_losses, tp_losses, strict=True):
        assert a == pytest.approx(b, rel=1e-5), (step, a, b)


def test_compiled_blocks_train_like_eager_blocks(tmp_path: Path) -> None:
    """fsdp.compile: every block's forward is compiled before wrapping, the script says so,
    and the losses equal an eager run's (dropout off: inductor draws its own masks)."""
    args = ("model.dropout=0.0", "train.steps=3", "checkpoint.every=0")
    torchrun(tmp_path, "eager", *args)
    out = torchrun(tmp_path, "compiled", *args, "fsdp.compile=true")
    said = "fsdp.compile: torch.compile (inductor, fullgraph) of the forward of 2 blocks (Block)"
    assert f"{said}, blocks.0 .. blocks.1" in out, out
    eager = scalars(tmp_path / "runs" / "eager", "loss")
    compiled = scalars(tmp_path / "runs" / "compiled", "loss")
    assert [s for s, _ in compiled] == [s for s, _ in eager] == [1, 2, 3]
    assert [v for _, v in compiled] == pytest.approx([v for _, v in eager], rel=1e-5)


def test_compile_with_units_by_size_is_refused() -> None:
    """A unit by size could sit inside a compiled block, whose hooks cannot be traced."""
    with pytest.raises(ConfigError, match=r"fsdp.compile must be false with fsdp.wrap=size"):
        load_config(str(CONFIG), ["fsdp.compile=true", "fsdp.wrap=size"], world_size=2)


def char_tokenizer_dir(directory: Path) -> None:
    """Save into ``directory`` an HF tokenizer that maps each character to the id the
    script's character tokenizer gives it (so a model trained on one reads the other)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from train_config import CharData, synthetic_corpus
    from transformers import PreTrainedTokenizerFast

    chars = CharData(synthetic_corpus())
    tok = Tokenizer(models.WordLevel(dict(chars.stoi), unk_token=" "))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(directory))


def corpus_loss(model: torch.nn.Module, block: int = 64, rows: int = 16) -> float:
    """Next-character cross-entropy of ``model`` on the start of the synthetic corpus."""
    from train_config import CharData, synthetic_corpus

    data = CharData(synthetic_corpus()).data[: rows * (block + 1)].view(rows, block + 1)
    with torch.no_grad():
        logits = model(input_ids=data[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten()).item()


def test_hf_llama_trains_exports_and_continues_from_its_export(tmp_path: Path) -> None:
    """model.hf: a tiny Llama from its config trains on characters and is exported for
    LlamaForCausalLM.from_pretrained; a second run starts from that export (weights) with
    an HF tokenizer added to it and carries on from the trained loss."""
    from transformers import LlamaForCausalLM

    steps = ("train.steps=30", "train.warmup_steps=5", "train.log_every=10")
    out = torchrun(tmp_path, "llama", f"model.hf={LLAMA_DIR}", config=LLAMA, base=steps)
    export = tmp_path / "checkpoints" / "llama" / "hf_final"
    assert "final model (Hugging Face format) saved to checkpoints/llama/hf_final" in out, out
    summary = json.loads((tmp_path / "runs" / "llama" / "summary.json").read_text())
    assert summary["units"] == 5  # the root, the embedding, the head, one per LlamaDecoderLayer
    assert summary["last_loss"] < summary["first_loss"] - 1.0, summary
    model, info = LlamaForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    trained = corpus_loss(model.eval())
    assert trained < summary["first_loss"] - 1.0, (trained, summary)

    char_tokenizer_dir(export)
    torchrun(tmp_path, "again", f"model.hf={export}", config=LLAMA, base=steps[:1])
    again = json.loads((tmp_path / "runs" / "again" / "summary.json").read_text())
    assert again["first_loss"] == pytest.approx(summary["last_loss"], abs=0.3), again
    assert (tmp_path / "checkpoints" / "again" / "hf_final" / "tokenizer.json").is_file()


# -- a fresh run and an earlier run's checkpoints --------------------------------------

SHORT = ("train.steps=4", "checkpoint.every=2")  # after TINY: checkpoints at steps 2 and 4


def listing(root: Path) -> dict[str, int]:
    """Every path under ``root`` with its modification time (ns)."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    """A finished run named ``run``: checkpoints/run/step_0000002 and step_0000004."""
    cwd = tmp_path_factory.mktemp("first")
    torchrun(cwd, "run", *SHORT)
    return cwd


def copy_of(first_run: Path, cwd: Path) -> Path:
    shutil.copytree(first_run / "checkpoints", cwd / "checkpoints")
    return cwd / "checkpoints" / "run"


REFUSAL = (
    "error: checkpoints/run holds what an earlier run named 'run' left (step_0000002, "
    "step_0000004); a fresh run neither deletes nor resumes checkpoints it did not write. "
    "Continue that run with --resume, start a new one under another name (--set "
    "name=run-2), or start over with --overwrite, which deletes them."
)


def test_second_fresh_run_of_a_name_refuses_and_leaves_the_first_runs_files(
    first_run: Path, tmp_path: Path
) -> None:
    root = copy_of(first_run, tmp_path)
    before = listing(root)
    out = torchrun(tmp_path, "run", *SHORT, ok=False)
    assert out.count(REFUSAL) == 1, out
    assert listing(root) == before
    assert not (tmp_path / "runs").exists()  # refused before building anything


def test_restarts_of_a_refused_run_refuse_too(first_run: Path, tmp_path: Path) -> None:
    """torchrun restarts a job whatever failed; a restart must not resume the earlier run."""
    root = copy_of(first_run, tmp_path)
    before = listing(root)
    out = torchrun(tmp_path, "run", *SHORT, restarts=1, ok=False)
    assert out.count(REFUSAL) == 2, out  # the first attempt and its restart
    assert "resumed from" not in out, out
    after = listing(root)
    assert after.pop(".refused") and after == before


def test_overwrite_deletes_the_earlier_run_and_starts_over(first_run: Path, tmp_path: Path) -> None:
    root = copy_of(first_run, tmp_path)
    out = torchrun(tmp_path, "run", "train.steps=2", "checkpoint.every=2", "--overwrite")
    assert "--overwrite: deleted 2 checkpoint(s) of an earlier run from checkpoints/run" in out
    assert "starting fresh" in out, out
    assert sorted(p.name for p in root.iterdir()) == ["step_0000002"]
    assert (root / "step_0000002" / ".metadata").stat().st_mtime_ns > max(
        listing(first_run / "checkpoints").values()
    )


def test_resume_continues_the_earlier_run(first_run: Path, tmp_path: Path) -> None:
    root = copy_of(first_run, tmp_path)
    out = torchrun(tmp_path, "run", "train.steps=6", "checkpoint.every=2", "--resume")
    assert "resumed from checkpoints/run/step_0000004 at step 4" in out, out
    assert sorted(p.name for p in root.iterdir()) == [f"step_{s:07d}" for s in (2, 4, 6)]


def make_train_argv(*make_args: str) -> list[str]:
    """The command ``make train`` runs (dry run, the venv taken as built)."""
    proc = subprocess.run(
        ["make", "-s", "-n", "-o", "venv", "train", *make_args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return shlex.split(proc.stdout)


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_train_twice_gives_two_runs_side_by_side(tmp_path: Path) -> None:
    """Each ``make train`` is a new run, <config stem>-<date>-<time>: a second one in a
    row trains beside the first and deletes nothing."""
    names = []
    for _ in range(2):
        argv = make_train_argv()
        assert argv[argv.index("--config") + 1] == "configs/tiny.yaml" and "--overwrite" not in argv
        names.append(argv[argv.index("--set") + 1].removeprefix("name="))
        time.sleep(1.1)  # the name has a one-second resolution
    assert all(re.fullmatch(r"tiny-\d{8}-\d{6}", n) for n in names) and names[0] != names[1]
    llama = make_train_argv("CONFIG=configs/tiny_llama.yaml")
    assert re.fullmatch(r"name=tiny_llama-\d{8}-\d{6}", llama[llama.index("--set") + 1])
    for name in names:
        torchrun(tmp_path, name, "train.steps=2", "checkpoint.every=2")
    for name in names:
        assert (tmp_path / "checkpoints" / name / "step_0000002" / ".metadata").is_file()


# -- config validation, in-process ---------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        (["train.stepz=3"], 2, "unknown key 'train.stepz' (known: train.steps,"),
        (["bogus.x=1"], 2, "unknown key 'bogus'"),
        (["train.steps=ten"], 2, "train.steps must be int, got 'ten'"),
        (["fsdp.activation_checkpointing=3"], 2, "must be bool, got 3"),
        (["model.n_embd=30"], 2, "model.n_embd must be a multiple of n_head, got 30"),
        (["fsdp.offload=gpu"], 2, "fsdp.offload must be none or cpu or ssd, got 'gpu'"),
        (["fsdp.shard_size=2"], 3, "fsdp.shard_size=2 must divide the world size 3"),
        (["parallel.tp=2"], 3, "parallel.tp=2 must divide the world size 3"),
        (["parallel.tp=3"], 3, "parallel.tp must be >= 1 and divide model.n_head, got 3"),
        (["parallel.tp=2", "optim.name=muon"], 4, "parallel.tp must be 1 with model.hf"),
        (
            ["train.global_batch_size=64"],
            3,
            "must be a multiple of train.batch_size x data-parallel size = 16 x 3 = 48",
        ),
        (
            ["debug.crash_at_step=3", "checkpoint.every=2", "debug.crash_rank=1"],
            1,
            "debug.crash_rank=1 does not exist with 1 rank(s)",
        ),
        (["train.steps"], 2, "--set expects section.key=value"),
        (["model.hf=no/such/dir"], 2, "model.hf must be an HF model directory or config"),
    ],
)
def test_bad_config_fails_at_start_naming_the_key(overrides, world, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(str(CONFIG), overrides, world_size=world)


def test_corpus_smaller_than_a_global_batch_is_refused(tmp_path: Path) -> None:
    from train_config import load_data

    text = tmp_path / "small.txt"
    text.write_text("hello world\n" * 60)  # 720 chars: 10 sequences of 64
    cfg = load_config(str(CONFIG), [f"data.path={text}", "train.batch_size=4"], world_size=2)
    load_data(cfg, world_size=2)
    with pytest.raises(ConfigError, match=r"fewer than one global batch .* 4 x 3"):
        load_data(cfg, world_size=3)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"vocab_size": 16}, "vocab_size 16 is smaller than the character vocabulary of the "),
        ({"max_position_embeddings": 32}, "model.block_size=64 exceeds the model's max_pos"),
    ],
)
def test_hf_config_that_cannot_take_the_corpus_is_refused(tmp_path, changes, message) -> None:
    """model.hf as a single config file: its vocab must cover the characters, its
    positions the block size."""
    import train

    config = json.loads((LLAMA_DIR / "config.json").read_text()) | changes
    (tmp_path / "small.json").write_text(json.dumps(config))
    cfg = load_config(str(LLAMA), [f"model.hf={tmp_path / 'small.json'}"], world_size=2)
    with pytest.raises(ConfigError, match=re.escape(message)):
        train._load_data(cfg, world=2)


def test_global_batch_size_sets_grad_accum() -> None:
    cfg = load_config(str(CONFIG), ["train.global_batch_size=96"], world_size=3)
    assert cfg.train.grad_accum == 2


def test_docs_config_table_lists_every_key() -> None:
    doc = (ROOT / "docs" / "training-script.md").read_text()
    section = doc.split("<!-- train:begin -->")[1].split("<!-- train:end -->")[0]
    assert markdown_table() in section, (
        "docs/training-script.md's table is stale: python scripts/train_config.py"
    )


def test_muon_trains_the_tiny_gpt_and_llama_over_whole_params(tmp_path: Path) -> None:
    """optim.name=muon: Muon on the blocks' matrices over whole-parameter shards, AdamW on
    the rest; the tiny GPT (with a checkpoint, resumed) and the tiny Llama both learn."""
    args = ("optim.name=muon", "train.steps=30", "train.warmup_steps=5", "checkpoint.every=15")
    torchrun(tmp_path, "muon", *args)
    gpt = json.loads((tmp_path / "runs" / "muon" / "summary.json").read_text())
    assert gpt["last_loss"] < gpt["first_loss"] - 0.5, gpt
    path = tmp_path / "checkpoints" / "muon" / "step_0000015"
    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    assert any(k.startswith("optim.state.") and k.endswith(".momentum_buffer") for k in saved)
    assert any(k.startswith("optim1.state.") and k.endswith(".exp_avg") for k in saved)
    out = torchrun(tmp_path, "muon", *args, "train.steps=33", "--resume")
    assert "resumed" in out.lower(), out[-2000:]
    steps = ("train.steps=30", "train.warmup_steps=5", "optim.name=muon", "checkpoint.every=0")
    torchrun(tmp_path, "llama", f"model.hf={LLAMA_DIR}", config=LLAMA, base=steps)
    llama = json.loads((tmp_path / "runs" / "llama" / "summary.json").read_text())
    assert llama["last_loss"] < llama["first_loss"] - 0.5, llama
