"""`dflash-mlx serve` on a real model: SmolLM2-135M (installed offline: `dflash-mlx models install smollm2-135m`)
with a random drafter built in code, through the real openai client on 127.0.0.1.

In the default run (about 30 s of CPU): a reply asked for whole and then streamed with `include_usage` equals
`dflash_mlx.generate` on the same prompt tokens, and the streamed one reports the prompt it took from the prefix
cache. Slow-marked: a two-turn chat whose second turn reuses the first.
"""

import openai
import pytest
from mlx_lm import load as mlx_lm_load

from dflash_mlx import generate
from dflash_mlx.models.offline import get_model, model_dir
from dflash_mlx.server import ServerSettings, create_app, start_in_thread
from tiny import make_drafter

PATH = model_dir(get_model("smollm2-135m"))
MODEL = "smollm2"

pytestmark = pytest.mark.skipif(not (PATH / "config.json").is_file(),
                                reason=f"smollm2-135m is not installed in {PATH} "
                                       "(install it with: dflash-mlx models install smollm2-135m)")


@pytest.fixture(scope="module")
def pair():
    model, tokenizer = mlx_lm_load(str(PATH))
    # One layer and a small MLP: the drafter's cost stays small next to the 30-layer target's.
    drafter, _ = make_drafter(model, hidden_size=576, num_hidden_layers=1, num_attention_heads=9,
                              num_key_value_heads=3, head_dim=64, intermediate_size=256, vocab_size=49152,
                              mask_token_id=0, block_size=4)
    return model, tokenizer, drafter


@pytest.fixture(scope="module")
def client(pair):
    running = start_in_thread(create_app(*pair, ServerSettings(model_name=MODEL)))
    yield openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=600)
    running.stop()


def test_whole_and_streamed_replies_equal_generate(pair, client):
    model, tokenizer, drafter = pair
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    want = generate(model, tokenizer, ids, drafter, max_tokens=8)
    assert want.strip()  # a real reply, not an immediate end of turn

    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert whole.choices[0].message.content == want
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens == len(ids) and 1 <= whole.usage.completion_tokens <= 8
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    assert whole.model_extra["dflash"]["prefilled_tokens"] == len(ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    assert usage.prompt_tokens == len(ids) and usage.completion_tokens == whole.usage.completion_tokens
    # The same prompt again: all but its last token come from the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in final] == [whole.choices[0].finish_reason]
    assert final[0].model_extra["dflash"]["prefilled_tokens"] == 1


@pytest.mark.slow
def test_two_turns_on_smollm2(pair, client):
    model, tokenizer, drafter = pair
    messages = [{"role": "user", "content": "Name a colour."}]
    r1 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    ids1 = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    reply = r1.choices[0].message.content
    assert reply == generate(model, tokenizer, ids1, drafter, max_tokens=12)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And another one?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    ids2 = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert r2.choices[0].message.content == generate(model, tokenizer, ids2, drafter, max_tokens=12)
    assert r2.usage.prompt_tokens_details.cached_tokens >= len(ids1)
