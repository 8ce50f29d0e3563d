"""Hugging Face-format checkpoints: ``save_pretrained`` output loads with the unwrapped
class's ``from_pretrained`` to the wrapped model's logits; ``load_pretrained`` reads only
each rank's own ranges; errors reach every rank.

Every case runs in one spawn of W=2 ranks (``_all_cases``); each is its own pytest item
reporting that case's traceback from every rank.
"""

from __future__ import annotations

import json
import os
import traceback
from types import SimpleNamespace

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import fsdp_lite
from fsdp_lite.addons import hugging_face as hf_checkpoint
from fsdp_lite.addons.state_dict import flat_params, state_dict_layout
from fsdp_lite.testing import run_distributed

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402

WORLD = 2
SMALL = 20_000  # bytes per file: the tiny Llama (~87 kB) needs several


def _llama(tied: bool, device: str = "cpu", seed: int = 0, vocab: int = 97, layers: int = 2):
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        return transformers.LlamaForCausalLM(cfg)


def _gpt2(seed: int = 0):
    cfg = transformers.GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(cfg)


def _wrap(module, **kwargs) -> fsdp_lite.FSDPModule:
    policy = fsdp_lite.wrap.by_type(*fsdp_lite.wrap.transformer_layers(module))
    return fsdp_lite.FSDPModule(module, auto_wrap_policy=policy, **kwargs)


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(seed))


def _trained(make, rank: int):
    """A wrapped model after two AdamW steps on rank-specific data."""
    model = _wrap(make())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x = _tokens(100 * step + rank)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    model.eval()
    return model(input_ids=_tokens(7)).logits


def _check_from_pretrained(cls, directory: str, want: torch.Tensor) -> None:
    """Rank 0: the unwrapped class loads the directory to the same logits."""
    plain = cls.from_pretrained(directory)
    torch.testing.assert_close(_logits(plain), want, rtol=0, atol=1e-6)


def _file_keys(directory: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                out.update({k: name for k in f.keys()})
    return out


# -- the cases ----------------------------------------------------------------------


def llama_tied(rank: int, tmp: str) -> None:
    """Single file, one copy of the tied weight, the same keys and config as HF writes."""
    model = _trained(lambda: _llama(tied=True), rank)
    fsdp_lite.save_pretrained(model, f"{tmp}/tied")
    want = _logits(model)
    if rank == 0:
        files = sorted(os.listdir(f"{tmp}/tied"))
        assert files == ["config.json", "generation_config.json", "model.safetensors"], files
        _check_from_pretrained(transformers.LlamaForCausalLM, f"{tmp}/tied", want)
        plain = transformers.LlamaForCausalLM.from_pretrained(f"{tmp}/tied")
        plain.save_pretrained(f"{tmp}/tied_by_hf")
        assert _file_keys(f"{tmp}/tied") == _file_keys(f"{tmp}/tied_by_hf")
        assert "lm_head.weight" not in _file_keys(f"{tmp}/tied")
        ours, theirs = (json.load(open(f"{tmp}/{d}/config.json")) for d in ("tied", "tied_by_hf"))
        assert ours == theirs, (ours, theirs)


def llama_untied_sharded(rank: int, tmp: str) -> None:
    """Several files and an index HF reads; a later single-file save removes them."""
    model = _trained(lambda: _llama(tied=False), rank)
    directory = f"{tmp}/sharded"
    fsdp_lite.save_pretrained(model, directory, max_shard_size=SMALL)
    want = _logits(model)
    full = model.state_dict()  # collective
    if rank == 0:
        torch.save(full, f"{tmp}/sharded_sd.pt")
        index = json.load(open(f"{directory}/model.safetensors.index.json"))
        keys = _file_keys(directory)
        assert index["weight_map"] == keys and "lm_head.weight" in keys
        count = len(set(keys.values()))
        assert count > 2 and set(keys.values()) == {
            f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)
        }
        sizes = [os.path.getsize(f"{directory}/{n}") for n in set(keys.values())]
        assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in full.values())
        assert max(sizes) < SMALL + 4096, sizes  # + the safetensors header
        _check_from_pretrained(transformers.LlamaForCausalLM, directory, want)
        open(f"{directory}/tokenizer.json", "w").write("{}")
    fsdp_lite.save_pretrained(model, f"{tmp}/resaved", max_shard_size=SMALL)
    fsdp_lite.save_pretrained(model, directory)  # now one file: old shards and index go
    if rank == 0:
        files = sorted(os.listdir(directory))
        assert files == [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
        ], files
        _check_from_pretrained(transformers.LlamaForCausalLM, directory, want)


def load_into_meta(rank: int, tmp: str) -> None:
    """Meta build + no_init, then load_pretrained from the sharded save: parameters equal;
    logits equal once the rotary buffers are set (see below)."""
    want = _llama(tied=False)
    model = _wrap(_llama(tied=False, device="meta"), param_init_fn=fsdp_lite.deferred_init.no_init)
    result = fsdp_lite.load_pretrained(model, f"{tmp}/resaved")
    assert result.missing_keys == [] and result.unexpected_keys == []
    saved = torch.load(f"{tmp}/sharded_sd.pt")
    got = model.state_dict()
    assert list(got) == list(saved)
    for k in saved:
        torch.testing.assert_close(got[k], saved[k], rtol=0, atol=0, msg=k)
    # Non-persistent buffers are in no checkpoint and meta wrapping with no_init leaves
    # rotary inv_freq uninitialized (being fixed separately): set them from an eager build.
    rotary = model.module.model.rotary_emb
    rotary.inv_freq.copy_(want.model.rotary_emb.inv_freq)
    rotary.original_inv_freq.copy_(want.model.rotary_emb.original_inv_freq)
    eager = _wrap(_llama(tied=False, seed=1))  # a different init, overwritten by the load
    fsdp_lite.load_pretrained(eager, f"{tmp}/resaved")
    torch.testing.assert_close(_logits(model), _logits(eager), rtol=0, atol=0)
    if rank == 0:
        plain = transformers.LlamaForCausalLM.from_pretrained(f"{tmp}/resaved")
        torch.testing.assert_close(_logits(plain), _logits(eager), rtol=0, atol=1e-6)
    else:
        _logits(eager)


def reads_own_ranges(rank: int, tmp: str) -> None:
    """load_pretrained reads, of each flattened parameter, exactly the elements this rank's
    shard holds (counted on a wrapper around safe_open), and no parameter whole."""
    read: dict[str, int] = {}
    whole: list[str] = []

    class Sliced:
        def __init__(self, inner, key):
            self.inner, self.key = inner, key

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, index):
            piece = self.inner[index]
            read[self.key] = read.get(self.key, 0) + piece.numel()
            return piece

    class File:
        def __init__(self, path, *args, **kwargs):
            self.inner = safe_open(path, *args, **kwargs)

        def __enter__(self):
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, key):
            return Sliced(self.f.get_slice(key), key)

        def get_tensor(self, key):
            whole.append(key)
            return self.f.get_tensor(key)

    model = _wrap(_llama(tied=True, seed=3))
    real = hf_checkpoint._safetensors
    hf_checkpoint._safetensors = lambda: SimpleNamespace(safe_open=File)
    try:
        fsdp_lite.load_pretrained(model, f"{tmp}/tied")
    finally:
        hf_checkpoint._safetensors = real
    slots, _ = state_dict_layout(model)
    mine: dict[str, int] = {}
    for flat in flat_params(model):
        for i, lo, hi, _ in flat.pieces():
            key = next(k for k, (f, j) in slots.items() if f is flat and j == i)
            mine[key] = mine.get(key, 0) + hi - lo
    assert whole == [], whole
    assert read == mine, (read, mine)
    assert sum(read.values()) <= sum(f.shard_numel for f in flat_params(model))


def gpt2_roundtrip(rank: int, tmp: str) -> None:
    """GPT-2 (Conv1D weights, tied lm_head): save, from_pretrained, load_pretrained."""
    model = _trained(_gpt2, rank)
    fsdp_lite.save_pretrained(model, f"{tmp}/gpt2", max_shard_size="30kB")
    want = _logits(model)
    fresh = _wrap(_gpt2(seed=1))
    fsdp_lite.load_pretrained(fresh, f"{tmp}/gpt2")
    torch.testing.assert_close(_logits(fresh), want, rtol=0, atol=0)
    if rank == 0:
        assert os.path.exists(f"{tmp}/gpt2/model.safetensors.index.json")
        _check_from_pretrained(transformers.GPT2LMHeadModel, f"{tmp}/gpt2", want)


def bf16_weights(rank: int, tmp: str) -> None:
    """dtype=torch.bfloat16 writes bf16 weights and config, HF loads them in bf16."""
    model = _wrap(_llama(tied=True))
    fsdp_lite.save_pretrained(model, f"{tmp}/bf16", dtype=torch.bfloat16)
    full = model.state_dict()
    if rank == 0:
        with safe_open(f"{tmp}/bf16/model.safetensors", "pt") as f:
            for key in f.keys():
                assert f.get_tensor(key).dtype == torch.bfloat16, key
                torch.testing.assert_close(f.get_tensor(key), full[key].bfloat16(), rtol=0, atol=0)
        plain = transformers.LlamaForCausalLM.from_pretrained(f"{tmp}/bf16")
        assert plain.dtype == torch.bfloat16


def errors(rank: int, tmp: str) -> None:
    """Every rank raises a clear error (none hangs), and nothing is loaded."""
    llama = _wrap(_llama(tied=True))
    before = llama.state_dict()
    with pytest.raises(fsdp_lite.CheckpointError, match="neither model.safetensors"):
        fsdp_lite.load_pretrained(llama, f"{tmp}/nowhere")
    with pytest.raises(fsdp_lite.CheckpointError, match="nothing was loaded.*missing keys"):
        fsdp_lite.load_pretrained(llama, f"{tmp}/gpt2")
    with pytest.raises(fsdp_lite.CheckpointError, match="wrong shapes: model.embed_tokens"):
        fsdp_lite.load_pretrained(_wrap(_llama(tied=True, vocab=98)), f"{tmp}/tied", strict=False)
    after = llama.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    if rank == 0:
        open(f"{tmp}/a_file", "w").write("not a directory")
    torch.distributed.barrier()
    with pytest.raises(fsdp_lite.CheckpointError, match="failed writing .*a_file"):
        fsdp_lite.save_pretrained(llama, f"{tmp}/a_file")
    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(_llama(tied=False), peft.LoraConfig(target_modules=["q_proj"]))
    with pytest.raises(TypeError, match="PEFT adapters.*merge_and_unload"):
        fsdp_lite.save_pretrained(fsdp_lite.FSDPModule(lora), f"{tmp}/peft")


def save_memory(rank: int, tmp: str) -> dict[str, int]:
    """Peak CPU bytes save_pretrained allocates above the sharded model (MemTracker)."""
    model = _wrap(_llama(tied=False, layers=4))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        base = tracker.get_tracker_snapshot("current").get(torch.device("cpu"), {}).get("Total", 0)
        fsdp_lite.save_pretrained(model, f"{tmp}/memory", max_shard_size=SMALL)
    peak = tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {}).get("Total", 0)
    flats = flat_params(model)
    figures = {
        "peak above sharded": peak - base,
        "largest flat param": max(f.padded_numel * 4 for f in flats),
        "model fp32": sum(f.numel * 4 for f in flats),
    }
    largest_file = SMALL + figures["largest flat param"]  # a tensor may overflow a file
    # one gathered flat param (two, should c10d free the previous gather's output late),
    # plus on rank 0 one output file of CPU copies
    flats_live = 2 * figures["largest flat param"]
    bound = flats_live + (largest_file if rank == 0 else 0) + 16 * 1024
    assert figures["peak above sharded"] <= bound, figures
    assert figures["peak above sharded"] < figures["model fp32"], figures
    return figures


CASES = [
    llama_tied,
    llama_untied_sharded,
    load_into_meta,
    reads_own_ranges,
    gpt2_roundtrip,
    bf16_weights,
    errors,
    save_memory,
]


def _all_cases(rank: int, world: int, tmp: str) -> dict[str, object]:
    """``{case: traceback or figures}``; a failed case does not stop the later ones (the
    cases raise alike on every rank, so the ranks stay in step)."""
    out: dict[str, object] = {}
    for case in CASES:
        try:
            out[case.__name__] = ("ok", case(rank, tmp))
        except Exception:  # noqa: BLE001 - report every case by name
            out[case.__name__] = ("failed", traceback.format_exc(limit=-8))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, object]]:
    return run_distributed(_all_cases, WORLD, str(tmp_path_factory.mktemp("hf")), timeout=300)


@pytest.mark.parametrize("case", [c.__name__ for c in CASES])
def test_hf_checkpoint(results, case: str) -> None:
    failed = {rank: out[case][1] for rank, out in enumerate(results) if out[case][0] != "ok"}
    assert not failed, "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failed.items())
    if case == "save_memory":
        print({rank: out[case][1] for rank, out in enumerate(results)})
