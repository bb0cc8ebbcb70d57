"""Side by side with mlx-lm on the same target: identical greedy tokens, and the decode speed of each.

    python examples/compare_mlx_lm.py [TARGET [DRAFTER]]

For a full measurement (many prompts, alternating methods, mlx-lm speculative decoding, the oracle ceiling),
use `dflash-mlx bench`.
"""

import time

import mlx.core as mx
from _pair import model_and_drafter
from mlx_lm.generate import generate_step

from dflash_mlx import load, stream_generate

target, drafter_ref = model_and_drafter()
model, tokenizer, drafter = load(target, drafter_ref)
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Explain recursion in two sentences."}],
                                       add_generation_prompt=True)
n = 64

tic = time.perf_counter()
plain = [t for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]
plain_s = time.perf_counter() - tic

tic = time.perf_counter()
responses = list(stream_generate(model, tokenizer, prompt, drafter, max_tokens=n))
dflash_s = time.perf_counter() - tic
ours = [r.token for r in responses]

same = ours == plain[: len(ours)]
print(f"identical tokens: {same} ({len(ours)} tokens)")
print(f"mlx-lm: {len(plain) / plain_s:.1f} tok/s   dflash: {len(ours) / dflash_s:.1f} tok/s "
      f"(tau {responses[-1].tau:.2f}; both include prefill)")
