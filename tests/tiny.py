"""Tiny random fp32 models built in code, and the reference decoders the core tests compare against.

Nothing here needs weights or a network: every target is an mlx-lm model built from a config dict (so mlx-lm's own
model-type remapping applies, e.g. "mistral" runs llama's module), with every parameter re-drawn from a fixed seed
(norm weights included, so a missing or misplaced norm shows up in the numbers).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import _get_classes

from dflash_mlx.drafters.config import DFlashConfig
from dflash_mlx.drafters.dflash import DFlashDrafter, TargetBinding
from dflash_mlx.decode.loop import dflash_generate_step
from dflash_mlx.decode.step import Pass
from dflash_mlx.decode.state import DecodeState
from dflash_mlx.drafters.oracle import OracleDrafter
from dflash_mlx.targets import TargetModel

VOCAB = 97
HIDDEN = 64

_COMMON = dict(
    hidden_size=HIDDEN,
    num_hidden_layers=4,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    vocab_size=VOCAB,
    max_position_embeddings=1024,
    rope_theta=10000.0,
)

# name -> mlx-lm config.json contents
TARGET_CONFIGS: Dict[str, dict] = {
    "llama": dict(_COMMON, model_type="llama", tie_word_embeddings=True),
    "llama_untied": dict(_COMMON, model_type="llama", tie_word_embeddings=False, num_hidden_layers=3),
    "mistral": dict(_COMMON, model_type="mistral", tie_word_embeddings=False, num_key_value_heads=1,
                    head_dim=16),
    "qwen2": dict(_COMMON, model_type="qwen2", tie_word_embeddings=True),  # q/k/v carry biases
    "qwen2_untied": dict(_COMMON, model_type="qwen2", tie_word_embeddings=False, num_hidden_layers=2),
    "qwen3": dict(_COMMON, model_type="qwen3", tie_word_embeddings=False, head_dim=16),
    "qwen3_tied": dict(_COMMON, model_type="qwen3", tie_word_embeddings=True, head_dim=24, num_hidden_layers=3),
    # Sliding-window layers get mlx-lm RotatingKVCaches of `sliding_window` entries.
    "llama_swa": dict(_COMMON, model_type="llama", tie_word_embeddings=True, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
}

# The four families the brief names, each in one variant (the lossless matrix runs over these).
CORE_KINDS = ("llama", "mistral", "qwen2", "qwen3")
ALL_KINDS = tuple(TARGET_CONFIGS)


def randomize(module: nn.Module, seed: int) -> nn.Module:
    """Redraw every parameter: norms and scales ~ 1 + 0.2 N, biases ~ 0.1 N, matrices ~ N / sqrt(fan_in)."""
    rng = np.random.default_rng(seed)
    new = []
    for name, p in tree_flatten(module.parameters()):
        z = rng.standard_normal(p.shape).astype(np.float32)
        if name.endswith(("norm.weight", "scale", "scalar")):
            v = 1.0 + 0.2 * z
        elif name.endswith("bias"):
            v = 0.1 * z
        else:
            v = z / np.sqrt(p.shape[-1])
        new.append((name, mx.array(v)))
    module.update(tree_unflatten(new))
    mx.eval(module.parameters())
    return module


def build_target(kind: str, seed: int = 0, **overrides) -> nn.Module:
    """A fresh tiny mlx-lm model (uncached: callers may mutate it)."""
    config = dict(TARGET_CONFIGS[kind], **overrides)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    return randomize(model, seed)


@functools.lru_cache(maxsize=None)
def target(kind: str, seed: int = 0) -> nn.Module:
    """A shared tiny target per kind (do not mutate)."""
    return build_target(kind, seed)


def num_layers(model: nn.Module) -> int:
    return len(model.layers)


def make_drafter(
    model: nn.Module,
    *,
    block_size: int = 4,
    mask_token_id: int = VOCAB - 1,
    target_layer_ids: Optional[Sequence[int]] = None,
    seed: int = 1,
    drafter_class: type = DFlashDrafter,
    **config,
) -> Tuple[DFlashDrafter, TargetModel]:
    """A random DFlash drafter bound to `model`, and the tapped `TargetModel` for it."""
    n = num_layers(model)
    if target_layer_ids is None:
        target_layer_ids = sorted({min(1, n - 1), n - 1})
    values = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=VOCAB,
        head_dim=16,
        rope_theta=10000.0,
        num_target_layers=n,
    )
    values.update(config)
    cfg = DFlashConfig(block_size=block_size, target_layer_ids=list(target_layer_ids),
                       mask_token_id=mask_token_id, **values)
    drafter = randomize(drafter_class(cfg), seed)
    t = TargetModel(model, cfg.target_layer_ids)
    drafter.bind(TargetBinding(t.embed, t.head))
    return drafter, t


def prompt_ids(length: int, seed: int = 0, vocab: int = VOCAB) -> List[int]:
    rng = np.random.default_rng(1000 + seed)
    return [int(x) for x in rng.integers(0, vocab, size=length)]


_GREEDY: Dict[Tuple[str, Tuple[int, ...]], List[int]] = {}


def _greedy_cached(kind: str, prompt: Tuple[int, ...], max_tokens: int) -> List[int]:
    # Greedy decoding is prefix-consistent, so one long enough run serves every shorter request.
    known = _GREEDY.get((kind, prompt))
    if known is None or len(known) < max_tokens:
        known = greedy(target(kind), prompt, max(max_tokens, 24))
        _GREEDY[(kind, prompt)] = known
    return known[:max_tokens]


def greedy(model: nn.Module, prompt: Sequence[int], max_tokens: int, stop_tokens: Sequence[int] = ()) -> List[int]:
    """mlx-lm's own greedy decoding (`generate_step`, default argmax sampler), stopping after a stop token."""
    out: List[int] = []
    stops = set(stop_tokens)
    for token, _ in generate_step(mx.array(list(prompt), dtype=mx.int32), model, max_tokens=max_tokens):
        out.append(int(token))
        if out[-1] in stops:
            break
    return out


def reference(kind: str, prompt: Sequence[int], max_tokens: int, stop_tokens: Sequence[int] = ()) -> List[int]:
    """Greedy output of the shared target `kind`, memoized; stop tokens truncate after their first occurrence."""
    out = _greedy_cached(kind, tuple(int(t) for t in prompt), max_tokens)
    stops = set(stop_tokens)
    for i, t in enumerate(out):
        if t in stops:
            return out[: i + 1]
    return out


def run_dflash(
    prompt: Sequence[int],
    t: TargetModel,
    drafter=None,
    *,
    stop_after: Optional[int] = None,
    **kwargs,
) -> Tuple[List[int], List[Pass]]:
    """Run `dflash_generate_step`; return all committed tokens and the cycles. `stop_after` closes it early."""
    tokens: List[int] = []
    cycles: List[Pass] = []
    gen = dflash_generate_step(mx.array(list(prompt), dtype=mx.int32), t, drafter, **kwargs)
    for cycle in gen:
        cycles.append(cycle)
        tokens.extend(cycle.tokens)
        if stop_after is not None and len(cycles) >= stop_after:
            gen.close()
            break
    return tokens, cycles


def corrupt_every(k: int, phase: int = 0) -> Callable[[int, int], bool]:
    """A corruption rule for steered drafters: spoil the proposal at absolute position p when (p + phase) % k == 0."""
    return lambda position, slot: (position + phase) % k == 0


class SteeredOracle(OracleDrafter):
    """An oracle that proposes the reference continuation but spoils chosen positions: partial acceptances."""

    def __init__(self, sequence, vocab_size, block_size, mask_token_id, spoil: Callable[[int, int], bool]):
        super().__init__(sequence, vocab_size, block_size, mask_token_id)
        self.spoil = spoil

    def __call__(self, block_ids: mx.array, cache) -> mx.array:
        start, block = cache[0].offset, block_ids.shape[1]
        return _steer(self.sequence, self.vocab_size, start, block, self.spoil)


class SteeredDFlashDrafter(DFlashDrafter):
    """A real DFlash drafter (its context cache grows exactly as in production) whose proposals are overridden
    by a spoiled oracle, so acceptance lengths vary. Call `steer(sequence, spoil)` before decoding."""

    def steer(self, sequence: Sequence[int], spoil: Callable[[int, int], bool]) -> "SteeredDFlashDrafter":
        # A plain object: nn.Module would file a list attribute under its parameters.
        self.steering = SimpleNamespace(sequence=[int(t) for t in sequence], spoil=spoil)
        return self

    def __call__(self, block_ids: mx.array, cache) -> mx.array:
        real = super().__call__(block_ids, cache)
        start, block = cache[0].offset, block_ids.shape[1]
        steer = _steer(self.steering.sequence, real.shape[-1], start, block, self.steering.spoil)
        return steer + 0.0 * real  # keep the real forward in the graph

    def greedy_draft(self, block_ids: mx.array, cache) -> mx.array:
        return mx.argmax(self(block_ids, cache), axis=-1).astype(mx.int32)  # the steered proposals


def _steer(sequence, vocab, start, block, spoil) -> mx.array:
    proposals = []
    for slot in range(1, block):
        p = start + slot
        tok = sequence[p] if p < len(sequence) else 0
        if spoil(p, slot):
            tok = (tok + 1) % vocab
        proposals.append(tok)
    hot = mx.array(proposals, dtype=mx.int32)[:, None] == mx.arange(vocab)[None]
    return mx.where(hot, 30.0, -30.0)[None]


__all__ = [
    "ALL_KINDS", "CORE_KINDS", "DecodeState", "HIDDEN", "OracleDrafter", "SteeredDFlashDrafter", "SteeredOracle",
    "TARGET_CONFIGS", "VOCAB", "build_target", "corrupt_every", "greedy", "make_drafter", "prompt_ids",
    "randomize", "reference", "run_dflash", "target",
]


def training_pair(root) -> Tuple["Path", "Path"]:
    """A tiny demo target (its folder) and a folder of six small text files to train a drafter on."""
    from dflash_mlx.demo import CORPUS, make_tiny_pair

    target_dir, _ = make_tiny_pair(root / "pair")
    data = root / "data"
    data.mkdir()
    for i in range(6):
        (data / f"f{i}.txt").write_text("\n".join(CORPUS[i:] + CORPUS[:i]) * 3)
    return target_dir, data
