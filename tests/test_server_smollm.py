"""A check on a real model (SmolLM2-135M, installed offline) with a random drafter built in code: a two-turn
chat through the openai client equals `generate`, and the second turn reuses the first from the prefix cache.
Slow-marked: minutes of CPU on a shared machine."""

from pathlib import Path

import openai
import pytest
from mlx_lm import load as mlx_lm_load

from dflash_mlx import generate
from dflash_mlx.server import ServerSettings, create_app, start_in_thread
from tiny import make_drafter

PATH = Path.home() / ".cache" / "dflash-mlx" / "models" / "smollm2-135m"

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not (PATH / "config.json").is_file(),
                                reason="smollm2-135m is not installed (dflash-mlx models path smollm2-135m)")]


def test_two_turns_on_smollm2():
    model, tokenizer = mlx_lm_load(str(PATH))
    drafter, _ = make_drafter(model, hidden_size=576, num_hidden_layers=1, num_attention_heads=9,
                              num_key_value_heads=3, head_dim=64, intermediate_size=256, vocab_size=49152,
                              mask_token_id=0, block_size=4)
    running = start_in_thread(create_app(model, tokenizer, drafter, ServerSettings(model_name="smollm2")))
    try:
        client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=300)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        r1 = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0)
        ids1 = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        reply = r1.choices[0].message.content
        assert reply == generate(model, tokenizer, ids1, drafter, max_tokens=12)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And of Italy?"}]
        r2 = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, temperature=0)
        ids2 = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert r2.choices[0].message.content == generate(model, tokenizer, ids2, drafter, max_tokens=12)
        assert r2.usage.prompt_tokens_details.cached_tokens >= len(ids1)
    finally:
        running.stop()
