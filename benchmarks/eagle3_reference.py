"""Tiny EAGLE-3 drafters built in code for any tiny target, saved in both published layouts, and the reference
implementation's (mlx-vlm) EAGLE-3 decoding recorded as fixtures.

`build_drafter(model, taps)` makes a drafter that predicts well without training: its attention looks at the
drafted token itself (q and k read the token's embedding, sharply), passes that embedding through, and its head
maps each token to the target's usual next token after it (a bigram table read off the target's greedy output and
single-token prompts); the fused target state and the MLP add a little noise. So passes accept some drafts and
reject others, and its tree candidates matter. `save_speculators` / `save_specforge` write the same weights in the
two published layouts (the embedding a frozen copy of the target's, `d2t` int64 and `t2d` bool as published).

Run as a script, it decodes a tiny Qwen3.5 target (GatedDeltaNet hybrid, the reference's family with layer capture;
benchmarks/mtp_reference.py builds it) greedily with the reference's `_eagle3_rounds` (mlx-vlm 0.7.10 installed in
the running Python, e.g. `pip install --no-deps mlx-vlm==0.7.10`) at 1, 2, 3 and 5 drafts, with a full and a
reduced draft vocabulary, and writes the tokens and the drafts accepted per pass to tests/fixtures/eagle3/:

    python benchmarks/eagle3_reference.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from dflash_mlx.drafters.eagle3 import Eagle3Drafter
from dflash_mlx.drafters.eagle3_config import Eagle3Config

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "eagle3"
DRAFTS = (1, 2, 3, 5)
MAX_TOKENS = 40
SHARP, PASS, NOISE = 3.0, 4.0, 0.1  # attention sharpness, the embedding's gain through o_proj, noise scale


def _lm(model):
    return getattr(model, "language_model", model)


def embedding(model) -> nn.Module:
    return _lm(model).model.embed_tokens


def bigram(model, vocab: int, prompts: Sequence[Sequence[int]] = (), steps: int = 60) -> np.ndarray:
    """The target's next token after each token: the most frequent follower in its greedy output from `prompts`,
    else its greedy token after that token alone."""
    from mlx_lm.generate import generate_step

    logits = model(mx.arange(vocab, dtype=mx.int32)[:, None])
    table = np.array(mx.argmax(logits[:, -1], axis=-1))
    counts: Dict[int, Dict[int, int]] = {}
    for prompt in prompts:
        seq = list(prompt) + [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=steps,
                                                                 sampler=lambda x: mx.argmax(x, axis=-1))]
        for a, b in zip(seq[:-1], seq[1:]):
            counts.setdefault(a, {}).setdefault(b, 0)
            counts[a][b] += 1
    for a, follow in counts.items():
        table[a] = max(follow, key=lambda b: (follow[b], -b))
    return table


def hot_follower(model, kept: np.ndarray, prompts: Sequence[Sequence[int]], steps: int = 60) -> np.ndarray:
    """For each token, the target's most likely next token *among `kept`* after it, read at every position of
    its greedy output from `prompts` (elsewhere the likeliest kept token after the token alone)."""
    from mlx_lm.generate import generate_step

    V = int(embedding(model).weight.shape[0])
    alone = np.array(model(mx.arange(V, dtype=mx.int32)[:, None])[:, -1])
    table = kept[np.argmax(alone[:, kept], axis=-1)]
    for prompt in prompts:
        seq = list(prompt) + [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=steps,
                                                                 sampler=lambda x: mx.argmax(x, axis=-1))]
        logits = np.array(model(mx.array([seq]))[0])
        for a, row in zip(seq, logits):
            table[a] = kept[np.argmax(row[kept])]
    return table


def build_drafter(model, taps: Sequence[int], *, seed: int = 0, draft_vocab: Optional[int] = None,
                  block_size: int = 4, prompts: Sequence[Sequence[int]] = (), follow_hot: bool = False
                  ) -> Eagle3Drafter:
    """A steered EAGLE-3 drafter for `model` tapping layer outputs `taps` (see the module docstring), unbound;
    `draft_vocab`: a reduced head over the target's most frequent next tokens; `follow_hot`: it predicts the
    target's likeliest token within that reduced vocabulary (`hot_follower`), not its likeliest overall."""
    E = np.array(embedding(model).weight.astype(mx.float32))
    V, H = E.shape
    big = bigram(model, V, prompts)
    d2t = None
    if draft_vocab:
        freq = np.bincount(big, minlength=V).astype(np.float64) + np.arange(V)[::-1] * 1e-6
        kept = np.sort(np.argsort(-freq, kind="stable")[:draft_vocab])  # draft id i -> target id kept[i]
        d2t = kept - np.arange(draft_vocab)
        if follow_hot:
            big = hot_follower(model, kept, prompts)
    config = Eagle3Config(hidden_size=H, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
                          vocab_size=V, head_dim=H // 4, rope_theta=10000.0, target_layer_ids=list(taps),
                          draft_vocab_size=draft_vocab, block_size=block_size, has_own_lm_head=True)
    drafter = Eagle3Drafter(config)
    rng = np.random.default_rng(500 + seed)
    new = []
    for name, p in tree_flatten(drafter.parameters()):
        if name == "d2t":
            new.append((name, mx.array(d2t, dtype=mx.int32)))
            continue
        z = rng.standard_normal(p.shape).astype(np.float32)
        new.append((name, mx.array(1.0 + 0.2 * z if name.endswith("norm.weight") else z / np.sqrt(p.shape[-1]))))
    drafter.load_weights(new)
    layer = drafter.layers[0]
    eye = np.eye(H, dtype=np.float32)
    read_token = np.concatenate([eye, np.zeros((H, H), np.float32)], axis=1)  # [H, 2H]: the embedding half
    layer.self_attn.q_proj.weight = mx.array(SHARP * read_token)
    layer.self_attn.k_proj.weight = mx.array(SHARP * read_token)
    layer.self_attn.v_proj.weight = mx.array(read_token)
    layer.self_attn.o_proj.weight = mx.array(PASS * eye)
    layer.input_layernorm.weight = mx.ones((H,))
    drafter.fc.weight = drafter.fc.weight * NOISE
    layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * NOISE
    drafter.norm.weight = mx.ones((H,))
    # Head row of token y: the normed embeddings of the tokens the target follows with y.
    unit = E / np.linalg.norm(E, axis=1, keepdims=True)
    head = np.zeros((V, H), np.float32)
    np.add.at(head, big, unit)
    if d2t is not None:
        head = head[kept]
    drafter.lm_head.weight = mx.array(4.0 * head + 0.05 * rng.standard_normal(head.shape).astype(np.float32))
    mx.eval(drafter.parameters())
    return drafter


# -- the two published layouts ---------------------------------------------------------------------------------
def _layer_config(config: Eagle3Config) -> dict:
    return dict(model_type="llama", hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                num_hidden_layers=1, num_attention_heads=config.num_attention_heads,
                num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
                rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
                max_position_embeddings=config.max_position_embeddings, vocab_size=config.vocab_size,
                hidden_act="silu", tie_word_embeddings=False)


def _published(drafter: Eagle3Drafter, model, prefix: str) -> Dict[str, mx.array]:
    out = {}
    for name, v in tree_flatten(drafter.parameters()):
        if name.startswith("layers.0."):
            name = prefix + name[len("layers.0."):]
        out[name] = v
    config = drafter.config
    out["embed_tokens.weight"] = embedding(model).weight  # the frozen copy published checkpoints carry
    if config.draft_vocab_size:
        d2t = np.array(out.pop("d2t")).astype(np.int64)
        t2d = np.zeros(config.vocab_size, dtype=bool)
        t2d[np.arange(d2t.size) + d2t] = True
        out["d2t"], out["t2d"] = mx.array(d2t), mx.array(t2d)
    return out


def save_speculators(drafter: Eagle3Drafter, model, folder, speculative_tokens: int = 3) -> Path:
    """vLLM speculators layout: `layers.0.*`, taps as the inputs of layers (our ids + 1)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = drafter.config
    config = dict(speculators_model_type="eagle3", architectures=["Eagle3Speculator"],
                  transformer_layer_config=_layer_config(c), draft_vocab_size=c.draft_vocab_size or c.vocab_size,
                  norm_before_residual=c.norm_before_residual,
                  eagle_aux_hidden_state_layer_ids=[i + 1 for i in c.target_layer_ids],
                  speculators_config=dict(algorithm="eagle3", proposal_methods=[
                      dict(proposal_type="greedy", speculative_tokens=speculative_tokens)],
                      default_proposal_method="greedy", verifier=dict(name_or_path="tiny", architectures=[])))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    mx.save_safetensors(str(folder / "model.safetensors"), _published(drafter, model, "layers.0."))
    return folder


def save_specforge(drafter: Eagle3Drafter, model, folder, state_taps: bool = True,
                   architecture: str = "LlamaForCausalLMEagle3") -> Path:
    """SpecForge / SGLang layout: `midlayer.*`, a flat Llama config, taps as layer outputs in `eagle_config`
    (left out with `state_taps=False`, as some releases do)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = drafter.config
    config = dict(_layer_config(c), architectures=[architecture],
                  draft_vocab_size=c.draft_vocab_size or c.vocab_size)
    if state_taps:
        config["eagle_config"] = dict(eagle_aux_hidden_state_layer_ids=list(c.target_layer_ids),
                                      use_aux_hidden_state=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    mx.save_safetensors(str(folder / "model.safetensors"), _published(drafter, model, "midlayer."))
    return folder


# -- the reference implementation ------------------------------------------------------------------------------
def reference_decode(folder: Path, drafter_folder: Path, prompt: List[int], max_tokens: int, drafts: int):
    """(tokens, drafts accepted per pass) of the reference's greedy EAGLE-3 decoding (`_eagle3_rounds`) of the
    Qwen3.5 checkpoint in `folder` with the speculators drafter in `drafter_folder`, unchunked prefill."""
    from types import SimpleNamespace

    from mlx_lm.utils import load as mlx_lm_load
    from mlx_vlm.models.qwen3_5 import language as dense
    from mlx_vlm.models.qwen3_5.config import TextConfig as DenseText
    from mlx_vlm.speculative.drafters.eagle3 import Model as DraftModel
    from mlx_vlm.speculative.drafters.eagle3 import ModelConfig as DraftConfig
    from mlx_vlm.speculative.eagle3 import _eagle3_capture_layer_ids, _eagle3_rounds

    ours, _ = mlx_lm_load(str(folder))
    config = json.loads((folder / "config.json").read_text())
    vlm = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2), image_token_id=10**6,
                          video_token_id=10**6 + 1, vision_start_token_id=10**6 + 2)
    lm = dense.LanguageModel(DenseText.from_dict(config["text_config"]), vlm)
    lm.load_weights(tree_flatten(ours.language_model.parameters()), strict=True)
    draft_config = json.loads((drafter_folder / "config.json").read_text())
    draft = DraftModel(DraftConfig.from_dict(draft_config))
    weights = draft.sanitize(mx.load(str(drafter_folder / "model.safetensors")))
    draft.load_weights(list(weights.items()), strict=True)
    mx.eval(lm.parameters(), draft.parameters())

    cache = lm.make_cache()
    ids = mx.array([prompt], dtype=mx.int32)
    out = lm(ids, cache=cache, capture_layer_ids=_eagle3_capture_layer_ids(draft))
    hidden = mx.concatenate(out.hidden_states, axis=-1)
    first = int(mx.argmax(out.logits[0, -1]).item())
    tokens = [first]
    for tok, _ in _eagle3_rounds(lm, draft, cache, hidden, prompt_tokens=ids, first_bonus=first,
                                 max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, axis=-1),
                                 draft_block_size=drafts + 1, greedy_sampling=True):
        tokens.append(int(tok))
    return tokens, [int(a) for a in draft.accept_lens]


def qwen35_pair(root: Path, draft_vocab: Optional[int] = None):
    """(target folder, the mlx-lm target, the steered drafter) for the tiny Qwen3.5 target of
    benchmarks/mtp_reference.py, tapping the outputs of its layers 0, 1 and 2."""
    from mlx_lm.utils import load as mlx_lm_load

    from benchmarks.mtp_reference import PROMPT, save_checkpoint

    folder = save_checkpoint("qwen3_5", root / "qwen3_5")
    model, _ = mlx_lm_load(str(folder))
    drafter = build_drafter(model, [0, 1, 2], draft_vocab=draft_vocab, prompts=[PROMPT, PROMPT[3:]])
    return folder, model, drafter


VOCABS = {"full": None, "reduced": 48}


def main() -> None:
    import tempfile

    from benchmarks.mtp_reference import PROMPT, plain_greedy

    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name in sys.argv[1:] or VOCABS:
        with tempfile.TemporaryDirectory() as tmp:
            folder, model, drafter = qwen35_pair(Path(tmp), VOCABS[name])
            spec = save_speculators(drafter, model, Path(tmp) / "drafter")
            plain = plain_greedy(folder, PROMPT, MAX_TOKENS)
            runs = {}
            for k in DRAFTS:
                tokens, accepted = reference_decode(folder, spec, PROMPT, MAX_TOKENS, k)
                runs[str(k)] = {"tokens": tokens, "accepted": accepted}
                print(f"{name} k={k}: lossless={tokens == plain} passes={len(accepted)} accepted={sum(accepted)}")
        record = {"vocab": name, "draft_vocab": VOCABS[name], "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                  "plain": plain, "runs": runs,
                  "reference": "mlx-vlm 0.7.10 speculative.eagle3._eagle3_rounds, greedy, unchunked prefill"}
        (FIXTURES / f"qwen3_5_{name}.json").write_text(json.dumps(record, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
