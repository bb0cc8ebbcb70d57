"""The prefix cache on a hybrid target (qwen3_5: GatedDeltaNet + attention), whose recurrent state cannot be cut
back: a two-turn chat prefills only the new turn, and every reply equals `generate` on the whole prompt."""

import re

import mlx.core as mx
import openai
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.utils import _get_classes

from cache_compare import CONFIGS
from dflash_mlx import stream_generate
from dflash_mlx.demo import make_tiny_pair
from dflash_mlx.server import ServerSettings, create_app, start_in_thread
from dflash_mlx.targets import TargetModel
from tiny import make_drafter, randomize


# ChatML, except that a reply follows "assistant" after one space: the model's first token (" word") then reads
# back as itself, although streaming detokenizers drop the leading space of a reply.
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant ' + m['content'] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant' }}{% endif %}"
)


class CountingTarget(TargetModel):
    """Counts the tokens every target forward pass processes (prefill chunks and verify blocks alike)."""

    tokens = 0

    def __call__(self, ids, cache=None):
        CountingTarget.tokens += ids.shape[1]
        return super().__call__(ids, cache)

    def forward_segments(self, segments):  # verify passes (and a batch's rounds) enter here
        CountingTarget.tokens += sum(s.width for s in segments)
        return super().forward_segments(segments)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    target_dir, _ = make_tiny_pair(tmp_path_factory.mktemp("hybrid"))
    tokenizer = load_tokenizer(target_dir)
    tokenizer.chat_template = TEMPLATE
    vocab = len(tokenizer)
    text = dict(CONFIGS["qwen3_5"]["text_config"], vocab_size=vocab, eos_token_id=tokenizer.eos_token_id)
    config = dict(CONFIGS["qwen3_5"], text_config=text)
    model_class, args_class = _get_classes(config)
    model = randomize(model_class(args_class.from_dict(config)), 7)
    # Random weights babble bytes that do not survive decode + encode, so a client could never send a reply back
    # as the same tokens. Keep whole-word tokens only: any sequence of them re-tokenizes to itself.
    words = [i for i in range(vocab) if re.fullmatch(r" [a-z]+", tokenizer.decode([i]))
             and tokenizer.encode(tokenizer.decode([i]), add_special_tokens=False) == [i]]
    head = model.language_model.lm_head
    keep = mx.zeros((vocab, 1)).at[mx.array(words)].add(1.0)
    head.weight = head.weight * keep
    mx.eval(head.weight)
    drafter, _ = make_drafter(model, vocab_size=vocab, mask_token_id=tokenizer.convert_tokens_to_ids("<|mask|>"))
    return model, tokenizer, drafter


@pytest.fixture(scope="module")
def live(hybrid):
    # Chains: the prefill is counted as the target's tokens less the verified rows (a tree pass verifies more
    # nodes than its width).
    app = create_app(*hybrid, ServerSettings(model_name="hybrid", tree_budget=None))
    app.state.server.generator.target.__class__ = CountingTarget
    running = start_in_thread(app)
    yield running, app.state.server
    running.stop()


def _reference(hybrid, ids, max_tokens):
    model, tokenizer, drafter = hybrid
    tokens, text = [], ""
    for r in stream_generate(model, tokenizer, ids, drafter, max_tokens=max_tokens):
        tokens.append(r.token)
        text += r.text
    return tokens, text


def _chat(client, messages, max_tokens):
    before = CountingTarget.tokens
    r = client.chat.completions.create(model="hybrid", messages=messages, max_tokens=max_tokens, temperature=0)
    stats = r.model_extra["dflash"]
    verified = sum(int(w) * n for w, n in stats["verify_widths"].items())
    prefilled = CountingTarget.tokens - before - verified  # tokens the target saw outside verify passes
    return r, prefilled


def test_second_turn_prefills_only_the_new_turn(hybrid, live):
    running, server = live
    assert not server.generator.cuttable  # recurrent layers: exact-length snapshots only
    client = openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=120)
    tokenizer = hybrid[1]
    first = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]
    ids1 = tokenizer.apply_chat_template(first, add_generation_prompt=True)
    r1, prefilled1 = _chat(client, first, 6)
    gen1, text1 = _reference(hybrid, ids1, 6)
    assert r1.choices[0].message.content == text1
    assert r1.usage.prompt_tokens_details.cached_tokens == 0 and prefilled1 == len(ids1)

    second = first + [{"role": "assistant", "content": text1}, {"role": "user", "content": "And then?"}]
    ids2 = tokenizer.apply_chat_template(second, add_generation_prompt=True)
    r2, prefilled2 = _chat(client, second, 6)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # The first turn's end state (its prompt and reply, minus the newest token, which is never in the cache).
    seen = ids1 + gen1[:-1]
    assert ids2[: len(seen)] == seen, "the reply should re-render to the same tokens in this conversation"
    assert cached == len(seen)
    assert prefilled2 == len(ids2) - cached == r2.model_extra["dflash"]["prefilled_tokens"]
    assert r2.choices[0].message.content == _reference(hybrid, ids2, 6)[1]

    # A different second turn branches off at the end of the first turn's prompt.
    branch = first + [{"role": "assistant", "content": "Something else."}, {"role": "user", "content": "Why?"}]
    ids3 = tokenizer.apply_chat_template(branch, add_generation_prompt=True)
    r3, prefilled3 = _chat(client, branch, 4)
    assert r3.usage.prompt_tokens_details.cached_tokens == len(ids1)
    assert prefilled3 == len(ids3) - len(ids1)
    assert r3.choices[0].message.content == _reference(hybrid, ids3, 4)[1]

    # A new conversation with the same system prompt starts from the system-message snapshot.
    other = [first[0], {"role": "user", "content": "Different question"}]
    ids4 = tokenizer.apply_chat_template(other, add_generation_prompt=True)
    system_end = len(tokenizer.apply_chat_template(first[:1], add_generation_prompt=False))
    r4, prefilled4 = _chat(client, other, 4)
    assert r4.usage.prompt_tokens_details.cached_tokens == system_end
    assert prefilled4 == len(ids4) - system_end
    assert r4.choices[0].message.content == _reference(hybrid, ids4, 4)[1]
    mx.clear_cache()
