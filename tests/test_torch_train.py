"""The PyTorch trainer (`dflash_mlx.torch_train`) against the MLX drafter, on tiny in-code models (fp32, CPU).

Its forward must be ours: the same checkpoint gives the same logits in PyTorch's training forward and in the MLX
drafter's inference forward, block by block; the rows, anchors and labels come from the same seeded recipe; and a
drafter trained in PyTorch loads with our loader and drafts for our engine, losslessly.
"""

import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from dflash_mlx.drafters.io import read_drafter, save_drafter  # noqa: E402
from dflash_mlx.torch_train.checkpoint import load_drafter, save_drafter as torch_save  # noqa: E402
from dflash_mlx.train.vocab import maps  # noqa: E402
from tiny import VOCAB, make_drafter, target  # noqa: E402

MASK = VOCAB - 1


def _inference_logits(drafter, hidden, tokens, anchor):
    cache = drafter.make_cache()
    drafter.append_context(hidden[:, :anchor], cache)
    block = mx.array([[tokens[anchor]] + [MASK] * (drafter.block_size - 1)])
    return drafter(block, cache)[0]


def _torch_embed_head(t):
    # The tiny target's embedding and head as plain matrices (head(I) reads W^T off the head).
    E = torch.tensor(np.asarray(t.embed(mx.arange(VOCAB)[None])[0]))
    W = torch.tensor(np.asarray(t.head(mx.eye(t.hidden_size)[None])[0])).T  # [V, H]
    return (lambda ids: E[ids]), (lambda h: h @ W.T)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("variant", ["full", "reduced_vocab", "gqa_wide"])
def test_torch_training_forward_equals_the_mlx_inference_forward(tmp_path, kind, variant):
    extra = {}
    if variant == "reduced_vocab":
        extra = dict(draft_vocab_size=40)
    if variant == "gqa_wide":
        extra = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, intermediate_size=48)
    drafter, t = make_drafter(target(kind), block_size=5, rope_theta=5000.0, **extra)
    if variant == "reduced_vocab":
        ids = np.sort(np.random.default_rng(0).choice(VOCAB, 40, replace=False))
        drafter.d2t = mx.array(maps(ids, VOCAB)[0])
    save_drafter(drafter, tmp_path / "d")  # fp32 as built
    model = load_drafter(tmp_path / "d").eval()

    tokens = [int(x) for x in np.random.default_rng(1).integers(0, VOCAB - 1, 40)]
    _, hidden = t(mx.array(tokens)[None])
    anchors = [1, 7, 8, 19, 30, 35]  # the first and last possible anchors included (S - B = 35)
    embed, head = _torch_embed_head(t)
    with torch.no_grad():
        h = model.block_hidden(torch.tensor(np.asarray(hidden)), torch.tensor([tokens]), torch.tensor([anchors]), embed)
        logits = model.logits(h, head)[0].numpy()  # [A, B-1, V or N]
    if variant == "reduced_vocab":
        logits = np.asarray(drafter.to_target_vocab(mx.array(logits)))  # draft ids -> target ids (ours)
    for i, a in enumerate(anchors):
        ref = np.asarray(_inference_logits(drafter, hidden, tokens, a))
        finite = np.isfinite(ref)
        assert (finite == np.isfinite(logits[i])).all()
        np.testing.assert_allclose(logits[i][finite], ref[finite], atol=2e-5, rtol=1e-5, err_msg=f"anchor {a}")


def test_torch_checkpoint_round_trips_through_our_loader(tmp_path):
    drafter, _ = make_drafter(target("qwen3"), block_size=4, draft_vocab_size=40)
    drafter.d2t = mx.array(maps(np.arange(0, 80, 2), VOCAB)[0])
    save_drafter(drafter, tmp_path / "mlx")
    model = load_drafter(tmp_path / "mlx")
    torch_save(model, tmp_path / "torch", dtype=torch.float32)
    again = read_drafter(tmp_path / "torch")
    ours, theirs = dict(tree_flatten(drafter.parameters())), dict(tree_flatten(again.parameters()))
    assert ours.keys() == theirs.keys()
    for k in ours:
        np.testing.assert_array_equal(np.asarray(ours[k]), np.asarray(theirs[k]), err_msg=k)
    assert again.config.to_dict() == drafter.config.to_dict()


# -- a run end to end: tiny Hugging Face target, PyTorch training, our converter, loader and engine ---------------
def _tiny_hf_target(path):
    """A 4-layer Qwen2 in a Hugging Face folder with a byte-level tokenizer (transformers rebuilds a Qwen2
    tokenizer from its files as byte-level BPE): it loads in transformers and mlx-lm alike. Returns a folder of text data."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    # Printable ASCII only (space is "\u0120" in byte-level form), so any ids decode and encode back unchanged.
    vocab = {c: i for i, c in enumerate(["\u0120"] + [chr(b) for b in range(33, 127)])}
    vocab.update({"<eos>": len(vocab), "<mask>": len(vocab) + 1})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer, tok.decoder = ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", additional_special_tokens=["<mask>"])
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(vocab) + 1, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=vocab["<eos>"], initializer_range=0.2)  # + Qwen2's own <|endoftext|>
    model = Qwen2ForCausalLM(config)
    # A target whose greedy choice follows the last token through a fixed permutation (its layers add nothing and
    # its head row perm(t) is t's embedding): its answers are chains a drafter can learn in a few hundred steps.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.01)
            layer.mlp.down_proj.weight.mul_(0.01)
        perm = torch.tensor(np.random.default_rng(1).permutation(95))
        head = model.lm_head.weight
        head[perm] = model.model.embed_tokens.weight[:95]
    model.save_pretrained(path)
    # The recipe's data: the target's own greedy answers (here to random 6-byte prompts).
    rng = np.random.default_rng(0)
    data = path.parent / "data"
    data.mkdir()
    prompts = torch.tensor(rng.integers(0, 95, (24, 6)))
    with torch.no_grad():
        out = model.generate(prompts, max_new_tokens=58, min_new_tokens=58, do_sample=False, pad_token_id=0,
                             suppress_tokens=list(range(95, config.vocab_size)))  # no special tokens in the text
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok)
    for i, row in enumerate(out.tolist()):
        (data / f"doc{i}.txt").write_text(tokenizer.decode(row))
    return data


def test_a_drafter_trained_in_torch_drafts_for_our_engine_losslessly(tmp_path):
    import mlx_lm

    from dflash_mlx import generate, load
    from dflash_mlx.models.loading import prepare
    from dflash_mlx.torch_train.train import main
    from dflash_mlx.train.trainer import held_out_tau
    from convert.drafter import convert_drafter

    data = _tiny_hf_target(tmp_path / "target")
    out = tmp_path / "run"
    common = ["--target", str(tmp_path / "target"), "--data", str(data), "--out", str(out), "--block-size", "4",
              "--num-layers", "2", "--intermediate-size", "96", "--rows", "2", "--anchors", "16", "--seq-len", "64",
              "--lr", "3e-3", "--eval-prompts", "4", "--eval-every", "0", "--dtype", "fp32", "--device", "cpu"]
    assert main(common + ["--steps", "160", "--checkpoint-every", "80"]) == 0
    log = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert losses[-1] < 0.7 * losses[0], losses

    convert_drafter(str(out), tmp_path / "converted", dtype="float32")
    model, tokenizer, drafter = load(str(tmp_path / "target"), drafter=str(tmp_path / "converted"))
    assert drafter.config.mask_token_id == 96  # the tokenizer's unused "<mask>"
    prompts = json.loads((out / "eval_prompts.json").read_text())
    untrained = tmp_path / "untrained"
    assert main([*common[:5], str(untrained), *common[6:], "--steps", "1"]) == 0
    _, _, raw = load(str(tmp_path / "target"), drafter=str(untrained))
    trained_tau = held_out_tau(prepare(model, drafter), drafter, prompts, max_tokens=32)["tau"]
    raw_tau = held_out_tau(prepare(model, raw), raw, prompts, max_tokens=32)["tau"]
    print(f"held-out tau: trained {trained_tau:.2f}, untrained {raw_tau:.2f}")
    assert trained_tau > raw_tau + 1.0, (trained_tau, raw_tau)
    for prompt in prompts:  # lossless: the engine with this drafter writes what mlx-lm writes alone
        want = mlx_lm.generate(model, tokenizer, prompt, max_tokens=32)
        assert generate(model, tokenizer, prompt, drafter, max_tokens=32) == want


def test_torch_answers_are_the_targets_greedy_output(tmp_path):
    import mlx_lm

    from dflash_mlx.torch_train.answer import main

    _tiny_hf_target(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    asks = ["abc", "xyz+1", "Hello"]
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": a}]}) + "\n" for a in asks))
    out = tmp_path / "answers.jsonl"
    assert main(["--target", str(tmp_path / "target"), "--prompts", str(prompts), "--out", str(out),
                 "--max-tokens", "12", "--batch", "2", "--device", "cpu"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    model, tokenizer = mlx_lm.load(str(tmp_path / "target"))
    assert sorted(r["messages"][0]["content"] for r in records) == sorted(asks)
    for r in records:  # batched with left padding in PyTorch = one prompt alone in mlx-lm
        want = mlx_lm.generate(model, tokenizer, tokenizer.encode(r["messages"][0]["content"] + " "), max_tokens=12)
        assert r["messages"][1] == {"role": "assistant", "content": want}


def test_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    from safetensors.numpy import load_file

    from dflash_mlx.torch_train.train import main

    data = _tiny_hf_target(tmp_path / "target")
    common = ["--target", str(tmp_path / "target"), "--data", str(data), "--block-size", "4", "--num-layers", "1",
              "--intermediate-size", "64", "--rows", "2", "--anchors", "8", "--seq-len", "64", "--eval-prompts", "2",
              "--eval-every", "0", "--dtype", "fp32", "--device", "cpu", "--draft-vocab", "64"]
    assert main(common + ["--out", str(tmp_path / "whole"), "--steps", "6"]) == 0
    assert main(common + ["--out", str(tmp_path / "cut"), "--steps", "6", "--checkpoint-every", "3",
                          "--minutes", "0.00001"]) == 0  # stops after its first step: the deadline has passed
    assert json.loads((tmp_path / "cut/log.jsonl").read_text().splitlines()[-1])["step"] < 6
    assert main(common + ["--out", str(tmp_path / "cut"), "--resume", "--steps", "6"]) == 0
    whole, cut = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("whole", "cut"))
    for name in whole:
        np.testing.assert_array_equal(whole[name], cut[name], err_msg=name)
    assert main(common + ["--out", str(tmp_path / "whole"), "--steps", "6"]) == 2  # a run is there: --resume or not


def test_the_pytorch_target_from_a_real_gguf_is_ours(tmp_path):
    """SmolLM2-135M's GGUF through the PyTorch trainer's loader (our numpy converter, then transformers) gives the
    features and greedy choices our MLX target computes from the same file."""
    import os
    import shutil

    from dflash_mlx.errors import DFlashError
    from dflash_mlx.models.loading import load_target as mlx_load
    from dflash_mlx.models.offline import ensure_gguf, ensure_offline_model
    from dflash_mlx.targets import TargetModel
    from dflash_mlx.torch_train.target import load_torch_target

    try:
        folder = ensure_offline_model("smollm2-135m", progress=False, quiet=True)
        source = ensure_gguf("smollm2-135m", progress=False, quiet=True)
    except DFlashError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"offline model smollm2-135m is not available here: {e}")
    gguf = tmp_path / "smollm2.gguf"
    shutil.copy(source, gguf)  # the PyTorch folder is made beside it
    target = load_torch_target(str(gguf), torch.device("cpu"), torch.float32)
    model, tokenizer = mlx_load(folder)
    ids = tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")
    assert target.tokenizer.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n") == ids
    taps = [1, 10, 20]
    theirs = target.features(torch.tensor([ids]), taps)[0].numpy()
    logits, hidden = TargetModel(model, taps)(mx.array([ids]))
    scale = np.abs(np.asarray(hidden[0])).max()
    assert np.abs(theirs - np.asarray(hidden[0])).max() < 1e-4 * scale
    np.testing.assert_array_equal(target.argmax_rows(np.array([ids]))[0], np.asarray(logits[0].argmax(-1)))


def test_until_fills_the_time_left_and_stops_by_it(tmp_path, capsys):
    """`--until T` fixes the step count (and the schedule) from the time left once the target and data are loaded,
    and the run has saved before T; a T already past is one clear line."""
    import time

    from dflash_mlx.torch_train.train import main

    data = _tiny_hf_target(tmp_path / "target")
    common = ["--target", str(tmp_path / "target"), "--data", str(data), "--block-size", "4", "--num-layers", "1",
              "--intermediate-size", "64", "--rows", "2", "--anchors", "8", "--seq-len", "64", "--eval-prompts", "2",
              "--eval-every", "0", "--dtype", "fp32", "--device", "cpu", "--draft-vocab", "64"]
    assert main(common + ["--out", str(tmp_path / "past"), "--until", str(time.time() - 5)]) == 2
    assert "--until is" in capsys.readouterr().err and not (tmp_path / "past").exists()
    until = time.time() + 12
    assert main(common + ["--out", str(tmp_path / "run"), "--until", str(until)]) == 0
    assert time.time() < until + 1  # the last step, its evaluation and the save fit before T
    planned = int(re.search(r"-> (\d+) steps", capsys.readouterr().out).group(1))
    last = [json.loads(line) for line in (tmp_path / "run/log.jsonl").read_text().splitlines() if '"lr"' in line][-1]
    assert planned > 10 and planned * 0.5 < last["step"]  # the schedule was sized to the time, not cut short
    assert last["lr"] < 0.55 * 6e-4  # ... and re-planned as it went: the run ended in the cosine's second half
    assert (tmp_path / "run/model.safetensors").is_file()


def test_replanned_schedule_reaches_its_floor_when_steps_are_slower_than_calibrated():
    """The second GPU stay calibrated 0.048 s a step and ran at 0.066 s: a fixed step count stopped the cosine at 74%.
    Re-planning every few steps from the pace so far ends the schedule at the budget's end instead."""
    from dflash_mlx.torch_train.train import REPLAN_EVERY, lr_at, replan_steps

    budget, calibrated, real, peak = 146.0, 0.048, 0.066, 3e-4
    steps = int(budget / calibrated)
    warmup = max(1, round(0.04 * steps))
    fixed_t = min(1.0, (budget / real - warmup) / (steps - warmup))
    assert fixed_t < 0.75  # what a fixed plan reaches
    step, clock = 0, 0.0
    while step < steps and clock + real <= budget:
        lr = lr_at(step, steps, peak, 0.1, warmup)
        step, clock = step + 1, clock + real
        if step % REPLAN_EVERY == 0:
            steps = max(replan_steps(step, steps, clock, budget - clock), step + 1)
    assert step == steps and lr < 0.1 * peak * 1.01  # ended on the plan, at the floor
    assert replan_steps(5, 100, 1.0, 50.0) == 100  # too few steps to measure a pace: the plan stands


def _gpu_drafter():
    """benchmarks/gpu_drafter.py as a module (benchmarks are scripts, not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_drafter.py"
    spec = importlib.util.spec_from_file_location("gpu_drafter", script)
    module = sys.modules["gpu_drafter"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_drafter_packed_without_its_head_is_restored_whole(tmp_path):
    """benchmarks/gpu_drafter.py: the GPU machine returns the drafter without its head rows (the target's own rows,
    picked by d2t); restoring them from the same target gives the trained file back tensor for tensor, and a
    different target is refused."""
    from safetensors.torch import load_file, save_file

    from dflash_mlx.torch_train.train import main

    gpu_drafter = _gpu_drafter()

    data = _tiny_hf_target(tmp_path / "target")
    assert main(["--target", str(tmp_path / "target"), "--data", str(data), "--block-size", "4", "--num-layers", "1",
                 "--intermediate-size", "64", "--rows", "2", "--anchors", "8", "--seq-len", "64", "--eval-prompts", "2",
                 "--eval-every", "0", "--device", "cpu", "--draft-vocab", "64", "--steps", "3",
                 "--out", str(tmp_path / "run")]) == 0
    gpu_drafter.pack(tmp_path / "run", tmp_path / "back", file_mib=0.05)
    assert len(list((tmp_path / "back").glob("layers-*.safetensors"))) > 1  # cut to the size asked
    assert all("lm_head.weight" not in load_file(str(f)) for f in (tmp_path / "back").glob("layers-*"))
    gpu_drafter.restore(tmp_path / "back", tmp_path / "target", tmp_path / "whole")
    trained, restored = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("run", "whole"))
    assert trained.keys() == restored.keys()
    for name in trained:
        assert torch.equal(trained[name], restored[name]), name
    assert (tmp_path / "whole/config.json").read_text() == (tmp_path / "run/config.json").read_text()

    other = tmp_path / "other"
    other.mkdir()
    weights = load_file(str(tmp_path / "target/model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 1.01
    save_file(weights, str(other / "model.safetensors"))
    with pytest.raises(SystemExit, match="another target"):
        gpu_drafter.restore(tmp_path / "back", other, tmp_path / "wrong")


def test_a_shipped_quantized_drafter_packs_back_for_a_continued_run(tmp_path):
    """`gpu_drafter.py init`: a converted 8-bit drafter becomes the trainer's bf16 layout again (layers dequantized,
    head rows the target's exact ones), packs without its head, restores, and a run starts from it (`--init`)."""
    from safetensors.torch import load_file

    from dflash_mlx.convert.drafter import convert_drafter
    from dflash_mlx.torch_train.train import main

    gpu_drafter = _gpu_drafter()

    data = _tiny_hf_target(tmp_path / "target")
    common = ["--target", str(tmp_path / "target"), "--data", str(data), "--block-size", "4", "--rows", "2",
              "--anchors", "8", "--seq-len", "64", "--eval-prompts", "2", "--eval-every", "0", "--device", "cpu",
              "--steps", "2"]
    assert main(common + ["--num-layers", "1", "--intermediate-size", "64", "--draft-vocab", "64",
                          "--out", str(tmp_path / "run")]) == 0
    convert_drafter(str(tmp_path / "run"), tmp_path / "q8", q_bits=8, q_group_size=32)
    gpu_drafter.init(tmp_path / "q8", tmp_path / "target", tmp_path / "pack")
    gpu_drafter.restore(tmp_path / "pack", tmp_path / "target", tmp_path / "init")
    trained, back = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("run", "init"))
    assert torch.equal(back["lm_head.weight"], trained["lm_head.weight"])  # exact rows, not their 8-bit rounding
    assert torch.equal(back["d2t"].long(), trained["d2t"].long())
    w = trained["layers.0.mlp.up_proj.weight"].float()
    assert (back["layers.0.mlp.up_proj.weight"].float() - w).abs().max() < 0.02 * w.abs().max()
    assert main(common + ["--init", str(tmp_path / "init"), "--out", str(tmp_path / "more")]) == 0
