"""Tiny Qwen3.5-family targets WITH `mtp.*` tensors, and the reference implementation's (mlx-vlm) MTP decoding.

`save_checkpoint(kind, folder)` writes a tiny random fp32 checkpoint in the Hugging Face layout (zero-centred
norms, GatedDeltaNet conv1d as [C, 1, K], fused or per-expert MoE tensors, top-level `mtp.*`), optionally sharded
with a `model.safetensors.index.json`. The weights are drawn so that the MTP agrees with the target often but not
always (small residual branches; `fc` passes the token embedding through), so passes accept some drafts and reject
others. tests/test_mtp.py builds the same checkpoints.

Run as a script, it decodes each kind greedily with the reference implementation (mlx-vlm 0.7.10, importable via
PYTHONPATH), one unchunked prefill so the MTP sees every prompt row, and writes the tokens and the drafts accepted
per pass to tests/fixtures/mtp/<kind>.json:

    PYTHONPATH=/tmp/ref/vlm:/tmp/mtpdeps python benchmarks/mtp_reference.py

`save_deepseek_checkpoint` writes a tiny deepseek_v3 checkpoint whose MTP layer is `model.layers.{N}.*` (the
DeepSeek-V3 layout); `python benchmarks/mtp_reference.py deepseek_v3` records the reference's block outputs on it
to tests/fixtures/mtp/deepseek_v3/block.safetensors (tests/test_mtp_deepseek.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Dict, List

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

VOCAB = 97
_ATTN = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
             vocab_size=VOCAB, max_position_embeddings=1024)
_GDN = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, full_attention_interval=2)
_TEXT = dict(**_ATTN, **_GDN, model_type="qwen3_5_text", num_hidden_layers=4, intermediate_size=96,
             tie_word_embeddings=False, mtp_num_hidden_layers=1,
             rope_parameters={"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                              "mrope_section": [1, 1, 0]})
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
CONFIGS: Dict[str, dict] = {
    "qwen3_5": dict(model_type="qwen3_5", text_config=_TEXT),
    "qwen3_5_moe": dict(model_type="qwen3_5_moe", text_config=dict(_TEXT, **_MOE)),
    "qwen3_next": dict(**_ATTN, **_GDN, **_MOE, model_type="qwen3_next", num_hidden_layers=4, intermediate_size=96,
                       decoder_sparse_step=1, mlp_only_layers=[1], rope_theta=10000.0, partial_rotary_factor=0.5,
                       norm_topk_prob=True, mtp_num_hidden_layers=1),
}
KINDS = tuple(CONFIGS)
PROMPT = [int(x) for x in np.random.default_rng(7).integers(0, VOCAB, size=11)]
MAX_TOKENS = 40
DRAFTS = (1, 2, 3, 5)
FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "mtp"
_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "norm.weight", ".q_norm.weight",
          ".k_norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")
RESIDUAL, MTP_RESIDUAL, HEAD_SCALE, FC_HIDDEN = 0.2, 0.5, 1.0, 2.0  # residual branch scales; the head's logit scale
_RESIDUAL_OUT = ("o_proj.weight", "out_proj.weight", "down_proj.weight")  # the residual branches' last matrices


def _draw(module: nn.Module, rng: np.random.Generator, residual: float) -> None:
    """Norms ~ 1 + 0.2 N, matrices ~ N / sqrt(fan_in), the residual branches' outputs scaled by `residual`."""
    new = []
    for name, p in tree_flatten(module.parameters()):
        z = rng.standard_normal(p.shape).astype(np.float32)
        norm = p.ndim == 1 and "norm" in name.split(".")[-2]
        v = 1.0 + 0.2 * z if norm else z / np.sqrt(p.shape[-1])
        if name.endswith(_RESIDUAL_OUT):
            v = v * residual
        new.append((name, mx.array(v)))
    module.load_weights(new)


def build(kind: str, seed: int = 0, vocab_size: int = VOCAB):
    """(config, the mlx-lm target in memory, its MTP block in memory) for `kind`."""
    from mlx_lm.utils import _get_classes

    from dflash_mlx.drafters.mtp import MTPConfig, MTPDrafter, _layer

    config = json.loads(json.dumps(CONFIGS[kind]))
    text = config.get("text_config", config)
    text["vocab_size"] = vocab_size
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(1000 + seed)
    _draw(model, rng, residual=RESIDUAL)
    # A head whose argmax follows a random permutation of the input token (a bigram model the residual branches
    # perturb), so greedy decoding wanders and the MTP, which sees the next token, can guess the one after it.
    lm = getattr(model, "language_model", model)
    embed = np.array(lm.model.embed_tokens.weight)
    rows = embed[rng.permutation(vocab_size)]
    lm.lm_head.weight = mx.array(HEAD_SCALE * rows / np.linalg.norm(rows, axis=1, keepdims=True))
    layer_class, layer_args = _layer(kind, text, 1)
    mtp = MTPDrafter(MTPConfig(kind, text["hidden_size"], vocab_size, text["num_hidden_layers"]), layer_class,
                     layer_args)
    _draw(mtp, rng, residual=MTP_RESIDUAL)
    H = text["hidden_size"]
    # fc passes the token's embedding through, with a little of the hidden state: a usable predictor.
    fc = np.concatenate([np.eye(H), FC_HIDDEN * rng.standard_normal((H, H)) / np.sqrt(H)], axis=1).astype(np.float32)
    mtp.fc.weight = mx.array(fc)
    mx.eval(model.parameters(), mtp.parameters())
    return config, model, mtp


def _hf(kind: str, model: nn.Module, mtp: nn.Module) -> Dict[str, mx.array]:
    """Both blocks' weights in the Hugging Face layout mlx-lm's sanitize (and the reference's) read."""
    out: Dict[str, mx.array] = {}
    for prefix, module in (("", model), ("mtp.", mtp)):
        for name, v in tree_flatten(module.parameters()):
            key = prefix + name
            if key.startswith("language_model.model."):
                key = "model.language_model." + key[len("language_model.model."):]
            elif key.startswith("language_model."):
                key = key[len("language_model."):]
            if key.endswith(_NORMS) and v.ndim == 1 and "linear_attn" not in key:
                v = v - 1.0
            if "conv1d.weight" in key:
                v = v.moveaxis(2, 1)
            if ".switch_mlp." in key:
                base, proj = key.split(".switch_mlp.")
                proj = proj[: -len(".weight")]
                if kind == "qwen3_next":
                    for e in range(v.shape[0]):
                        out[f"{base}.experts.{e}.{proj}.weight"] = v[e]
                elif proj == "down_proj":
                    out[f"{base}.experts.down_proj"] = v
                elif proj == "gate_proj":
                    up = dict(tree_flatten(module.parameters()))[name.replace("gate_proj", "up_proj")]
                    out[f"{base}.experts.gate_up_proj"] = mx.concatenate([v, up], axis=-2)
                continue
            out[key] = v
    return out


def save_checkpoint(kind: str, folder, seed: int = 0, shards: int = 1, vocab_size: int = VOCAB,
                    with_mtp: bool = True) -> Path:
    """A tiny HF-layout checkpoint folder of `kind`; `shards` > 1 writes a sharded index (mtp.* in the last)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config, model, mtp = build(kind, seed, vocab_size)
    weights = _hf(kind, model, mtp)
    if not with_mtp:
        weights = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
        config.get("text_config", config).pop("mtp_num_hidden_layers", None)
    return write_checkpoint(folder, config, weights, "mtp.", shards)


def write_checkpoint(folder: Path, config: dict, weights: dict, mtp_prefix: str, shards: int = 1) -> Path:
    """config.json and the weights; `shards` > 1 writes a sharded index with every MTP tensor (names starting
    with `mtp_prefix`) in the last shard, so a loader reading only that one is checked."""
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    main = sorted(k for k in weights if not k.startswith(mtp_prefix))
    extra = sorted(k for k in weights if k.startswith(mtp_prefix))
    parts = [main + extra] if shards == 1 else [main[i :: shards - 1] for i in range(shards - 1)] + [extra]
    weight_map = {}
    for i, part in enumerate(parts):
        name = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(folder / name), {k: weights[k] for k in part}, metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    if shards > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


# -- the reference implementation ------------------------------------------------------------------------------
def reference_decode(folder: Path, kind: str, prompt: List[int], max_tokens: int, drafts: int):
    """(tokens, drafts accepted per pass) of the reference's greedy MTP decoding (`_mtp_rounds`)."""
    from mlx_lm.utils import load as mlx_lm_load
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import Model as DraftModel
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import ModelConfig as DraftConfig
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.split import Qwen3_5MTPSplitter, Qwen3NextMTPSplitter
    from mlx_vlm.speculative.mtp import _mtp_rounds

    if kind == "qwen3_next":
        raise NotImplementedError("the reference's qwen3_next target path is not run here")
    from mlx_vlm.models.qwen3_5 import language as dense
    from mlx_vlm.models.qwen3_5.config import TextConfig as DenseText
    from mlx_vlm.models.qwen3_5_moe import language as moe
    from mlx_vlm.models.qwen3_5_moe.config import TextConfig as MoeText

    ours, _ = mlx_lm_load(str(folder))  # the target as mlx-lm sanitizes it: the same weights for both
    config = json.loads((folder / "config.json").read_text())
    text_cls, module = (MoeText, moe) if kind == "qwen3_5_moe" else (DenseText, dense)
    from types import SimpleNamespace

    # Text only: token ids beyond the vocabulary for the image markers, so no prompt position is an image's.
    vlm = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2), image_token_id=10**6,
                          video_token_id=10**6 + 1, vision_start_token_id=10**6 + 2)
    lm = module.LanguageModel(text_cls.from_dict(config["text_config"]), vlm)
    lm.load_weights(tree_flatten(ours.language_model.parameters()), strict=True)
    splitter = Qwen3NextMTPSplitter() if kind == "qwen3_next" else Qwen3_5MTPSplitter()
    draft_config, weights = splitter.prepare(folder)
    draft = DraftModel(DraftConfig.from_dict(draft_config))
    draft.load_weights(list(weights.items()), strict=True)
    mx.eval(lm.parameters(), draft.parameters())

    cache = lm.make_cache()
    ids = mx.array([prompt], dtype=mx.int32)
    out = lm(ids, cache=cache, return_hidden=True, return_shared_kv=True)
    first = int(mx.argmax(out.logits[0, -1]).item())
    greedy = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731
    tokens = [first]
    for tok, _ in _mtp_rounds(lm, draft, cache, out.hidden_states[-1], {}, prompt_tokens=ids, first_bonus=first,
                              max_tokens=max_tokens, sampler=greedy, draft_block_size=drafts + 1,
                              greedy_sampling=True):
        tokens.append(int(tok))
    return tokens, [int(a) for a in draft.accept_lens]


def reference_mtp_argmax(folder: Path, kind: str, prompt: List[int]) -> List[int]:
    """The reference MTP block alone (its own loader, from the checkpoint) over the prompt: argmax of the head
    at every position, given (target's final-normed hidden at t, token t+1). Runs for every kind."""
    from mlx_lm.utils import load as mlx_lm_load
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import Model as DraftModel
    from mlx_vlm.speculative.drafters.qwen3_5_mtp import ModelConfig as DraftConfig
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.split import Qwen3_5MTPSplitter, Qwen3NextMTPSplitter

    model, _ = mlx_lm_load(str(folder))
    splitter = Qwen3NextMTPSplitter() if kind == "qwen3_next" else Qwen3_5MTPSplitter()
    draft_config, weights = splitter.prepare(folder)
    draft = DraftModel(DraftConfig.from_dict(draft_config))
    draft.load_weights(list(weights.items()), strict=True)
    draft.bind(model)
    lm = getattr(model, "language_model", model)
    ids = mx.array([prompt], dtype=mx.int32)
    hidden = lm.model(ids)  # final-normed, as the reference's targets hand it over
    T = len(prompt) - 1
    out = draft._forward_hidden(draft._input_embed(ids[:, 1:]), hidden[:, :T], draft.make_cache(),
                                mx.arange(T)[None])
    return mx.argmax(draft._lm_head_fn(out)[0], axis=-1).tolist()


def plain_greedy(folder: Path, prompt: List[int], max_tokens: int) -> List[int]:
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load as mlx_lm_load

    model, _ = mlx_lm_load(str(folder))
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, -1))
    return [int(t) for t, _ in steps]


def main() -> None:
    import tempfile

    FIXTURES.mkdir(parents=True, exist_ok=True)
    for kind in sys.argv[1:] or KINDS:
        with tempfile.TemporaryDirectory() as tmp:
            folder = save_checkpoint(kind, Path(tmp) / kind)
            plain = plain_greedy(folder, PROMPT, MAX_TOKENS)
            mtp_argmax = reference_mtp_argmax(folder, kind, PROMPT + plain)
            runs = {}
            # The reference's qwen3_next target hands over no hidden states: its MTP decoding does not run.
            for k in DRAFTS if kind != "qwen3_next" else ():
                tokens, accepted = reference_decode(folder, kind, PROMPT, MAX_TOKENS, k)
                runs[str(k)] = {"tokens": tokens, "accepted": accepted}
                print(f"{kind} k={k}: lossless={tokens == plain} passes={len(accepted)} "
                      f"accepted={sum(accepted)}/{sum(min(k, len(tokens)) for _ in accepted)}")
        record = {"kind": kind, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "plain": plain, "runs": runs,
                  "mtp_argmax": mtp_argmax,
                  "reference": "mlx-vlm 0.7.10 speculative.mtp._mtp_rounds, greedy, unchunked prefill"}
        (FIXTURES / f"{kind}.json").write_text(json.dumps(record, separators=(",", ":")) + "\n")


# -- DeepSeek-V3 layout: the MTP layer as model.layers.{num_hidden_layers}.* ----------------------------------------
DEEPSEEK = dict(_ATTN, model_type="deepseek_v3", num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32,
                num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=32,
                q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, first_k_dense_replace=1,
                n_group=1, topk_group=1, rope_theta=10000.0, num_nextn_predict_layers=1)
DEEPSEEK_FIXTURE = FIXTURES / "deepseek_v3" / "block.safetensors"
DEEPSEEK_PREFILL = 30  # the block fixture: this many positions in one call, then one position per call


def build_deepseek(seed: int = 1, vocab_size: int = VOCAB, own_embed: bool = False, own_head: bool = False,
                   **overrides):
    """(config, the mlx-lm deepseek_v3 target in memory, its MTP layer in memory): as `build`, for the DeepSeek
    layout. `own_embed` / `own_head`: the layer carries `embed_tokens` / `shared_head.head` (copies of the
    target's, as the DeepSeek-V3 release ships them); `overrides` change the config (DEEPSEEK)."""
    from mlx_lm.models import deepseek_v3

    from dflash_mlx.drafters.mtp import MTPConfig
    from dflash_mlx.drafters.mtp_deepseek import DeepseekMTPDrafter

    config = dict(DEEPSEEK, vocab_size=vocab_size, **overrides)
    args = deepseek_v3.ModelArgs.from_dict(config)
    model = deepseek_v3.Model(args)
    rng = np.random.default_rng(2000 + seed)
    _draw(model, rng, residual=RESIDUAL)
    embed = np.array(model.model.embed_tokens.weight)
    rows = embed[rng.permutation(vocab_size)]
    model.lm_head.weight = mx.array(HEAD_SCALE * rows / np.linalg.norm(rows, axis=1, keepdims=True))
    H, N = config["hidden_size"], config["num_hidden_layers"]
    mtp = DeepseekMTPDrafter(MTPConfig("deepseek_v3", H, vocab_size, N), args, own_embed, own_head)
    _draw(mtp, rng, residual=MTP_RESIDUAL)
    eh = np.concatenate([np.eye(H), FC_HIDDEN * rng.standard_normal((H, H)) / np.sqrt(H)], axis=1)
    mtp.eh_proj.weight = mx.array(eh.astype(np.float32))
    if own_embed:
        mtp.embed_tokens.weight = model.model.embed_tokens.weight
    if own_head:
        mtp.shared_head.head.weight = model.lm_head.weight
    mx.eval(model.parameters(), mtp.parameters())
    return config, model, mtp


def _hf_deepseek(config: dict, model: nn.Module, mtp: nn.Module) -> Dict[str, mx.array]:
    """Target and MTP layer in the Hugging Face layout: per-expert tensors, fused `kv_b_proj`."""
    N, nope = config["num_hidden_layers"], config["qk_nope_head_dim"]
    flat = dict(tree_flatten(model.parameters()))
    for name, v in tree_flatten(mtp.parameters()):
        flat[f"model.layers.{N}." + (name[len("layers.0."):] if name.startswith("layers.0.") else name)] = v
    out: Dict[str, mx.array] = {}
    for key, v in flat.items():
        if ".switch_mlp." in key:
            base, proj = key.split(".switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{base}.experts.{e}.{proj}"] = v[e]
        elif key.endswith("self_attn.embed_q.weight"):
            base = key[: -len("embed_q.weight")]
            wk, wv = v.swapaxes(-1, -2), flat[base + "unembed_out.weight"]  # [heads, nope | v_head, kv_lora_rank]
            out[base + "kv_b_proj.weight"] = mx.concatenate([wk, wv], axis=1).reshape(-1, wk.shape[-1])
            assert wk.shape[1] == nope
        elif not key.endswith("self_attn.unembed_out.weight"):
            out[key] = v
    return out


def save_deepseek_checkpoint(folder, seed: int = 1, shards: int = 1, vocab_size: int = VOCAB,
                             with_mtp: bool = True, own_embed: bool = False, own_head: bool = False,
                             **overrides) -> Path:
    """A tiny HF-layout deepseek_v3 checkpoint folder whose MTP layer is model.layers.{N}.*; `shards` > 1 writes a
    sharded index with that layer alone in the last shard."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config, model, mtp = build_deepseek(seed, vocab_size, own_embed, own_head, **overrides)
    weights = _hf_deepseek(config, model, mtp)
    layer = f"model.layers.{config['num_hidden_layers']}."
    if not with_mtp:
        weights = {k: v for k, v in weights.items() if not k.startswith(layer)}
    return write_checkpoint(folder, config, weights, layer, shards)


def load_deepseek_target(folder: Path):
    """The target as mlx-lm loads it. Non-strict: mlx-lm's sanitize drops only `model.layers.61` (DeepSeek-V3's
    own depth), so a tiny checkpoint's MTP layer would otherwise be an unexpected tensor."""
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(folder), strict=False)
    return model


def reference_deepseek_block(folder: Path, prompt: List[int]) -> Dict[str, mx.array]:
    """The reference's DeepSeek-layout MTP block (mlx-vlm's GlmMoeDsaMTP: enorm / hnorm / eh_proj, one MLA + MoE
    decoder layer, shared_head norm), its tensors mapped from the checkpoint by the reference's own splitter, over
    (target's final-normed hidden at t, token t+1): DEEPSEEK_PREFILL positions in one call, then one per call.
    Its DSA indexer selects every position here (index_topk > length), which makes its attention plain MLA."""
    from dataclasses import asdict

    from mlx_lm.models import deepseek_v3
    from mlx_vlm.models.cache import CacheList, KVCache
    from mlx_vlm.models.glm_moe_dsa.config import ModelConfig as DsaConfig
    from mlx_vlm.models.glm_moe_dsa.language import GlmMoeDsaMTP
    from mlx_vlm.speculative.drafters.glm_moe_dsa_mtp.split import GlmMoeDsaMTPSplitter

    target = load_deepseek_target(folder)
    config = json.loads((folder / "config.json").read_text())
    text = asdict(deepseek_v3.ModelArgs.from_dict(config))
    text.update(index_head_dim=16, index_n_heads=2, index_topk=10**6,
                rope_parameters={"rope_theta": text["rope_theta"], "rope_type": "default"})
    text = {k: v for k, v in text.items() if k not in ("rope_scaling", "rope_theta")}
    draft_config, weights = GlmMoeDsaMTPSplitter().prepare(folder)
    block = nn.Module()
    block.mtp = GlmMoeDsaMTP(DsaConfig.from_dict(dict(draft_config["text_config"], **text)))
    block.load_weights(list(weights.items()), strict=False)
    loaded = set(weights)
    assert all(k in loaded for k, _ in tree_flatten(block.parameters()) if ".indexer." not in k)
    ids = mx.array([prompt], dtype=mx.int32)
    hidden = target.model(ids)[:, :-1]  # final-normed, as the reference's targets hand it over
    tokens = ids[:, 1:]
    embed = target.model.embed_tokens(tokens)
    cache = CacheList(KVCache(), KVCache())
    P = DEEPSEEK_PREFILL
    from mlx_vlm.models.base import create_attention_mask

    outs = [block.mtp(hidden[:, :P], embed[:, :P], create_attention_mask(embed[:, :P], None, return_array=True),
                      cache)]
    for t in range(P, tokens.shape[1]):
        outs.append(block.mtp(hidden[:, t : t + 1], embed[:, t : t + 1], None, cache))
    out = mx.concatenate(outs, axis=1)
    return {"tokens": tokens, "hidden": hidden, "out": out,
            "argmax": mx.argmax(target.lm_head(out), axis=-1).astype(mx.int32)}


def deepseek_main() -> None:
    import tempfile

    DEEPSEEK_FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = save_deepseek_checkpoint(Path(tmp) / "deepseek_v3")
        model = load_deepseek_target(folder)
        steps = generate_plain(model, PROMPT, MAX_TOKENS)
        record = reference_deepseek_block(folder, PROMPT + steps)
        mx.eval(record)
        mx.save_safetensors(str(DEEPSEEK_FIXTURE), record, metadata={
            "reference": "mlx-vlm 0.7.10 models.glm_moe_dsa.language.GlmMoeDsaMTP, GlmMoeDsaMTPSplitter",
            "prefill": str(DEEPSEEK_PREFILL)})
        print(f"deepseek_v3 block: {record['out'].shape[1]} positions -> {DEEPSEEK_FIXTURE}")


def generate_plain(model: nn.Module, prompt: List[int], max_tokens: int) -> List[int]:
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, -1))
    return [int(t) for t, _ in steps]


if __name__ == "__main__":
    deepseek_main() if sys.argv[1:] == ["deepseek_v3"] else main()
