"""Second-turn time to first token of `dflash-mlx serve`, with and without the prefix cache, side by side.

Two servers share one loaded model (one with the cache, one with --prompt-cache-bytes 0). Each runs the same
two-turn chat on a long first turn; the second turn's time to first token is measured by the openai client
(request sent -> first content chunk), alternating the servers, and the medians are printed with their ratio.

    python examples/server_ttft.py                       # default target and its shipped drafter
    python examples/server_ttft.py --model PATH --draft DRAFTER --context-chars 4000 --repeats 3
    python examples/server_ttft.py --model smollm2-135m --random-drafter   # any target, untrained drafter
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from openai import OpenAI

from dflash_mlx import load
from dflash_mlx.models.offline import DEFAULT_MODEL
from dflash_mlx.server import ServerSettings, create_app, start_in_thread


def _context(chars: int) -> str:
    # Real code makes a realistic long first turn: this package's own engine.
    import dflash_mlx.decode.engine as engine

    return Path(engine.__file__).read_text()[:chars]


def _random_pair(name: str, block_size: int = 8):
    """The target with an untrained drafter that fits it (acceptance is near zero; prefill cost is what counts)."""
    from mlx_lm import load as mlx_lm_load

    from dflash_mlx.models import offline as models
    from dflash_mlx.drafters.config import DFlashConfig
    from dflash_mlx.drafters.dflash import DFlashDrafter

    path = name if Path(name).is_dir() else str(models.ensure_offline_model(name))
    model, tokenizer = mlx_lm_load(path)
    a = model.args
    heads = a.num_attention_heads
    config = DFlashConfig(hidden_size=a.hidden_size, num_hidden_layers=1, num_attention_heads=heads,
                          num_key_value_heads=a.num_key_value_heads,
                          head_dim=getattr(a, "head_dim", None) or a.hidden_size // heads,
                          intermediate_size=a.intermediate_size, vocab_size=a.vocab_size, rope_theta=a.rope_theta,
                          num_target_layers=a.num_hidden_layers, block_size=block_size,
                          target_layer_ids=[1, a.num_hidden_layers - 2], mask_token_id=0)
    return model, tokenizer, DFlashDrafter(config)


def _ttft(client: OpenAI, model: str, messages, max_tokens: int):
    tic = time.perf_counter()
    first, text, usage = None, "", None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            piece = chunk.choices[0].delta.content or ""
            if first is None and (piece or chunk.choices[0].finish_reason):
                first = time.perf_counter() - tic
            text += piece
        elif chunk.usage is not None:
            usage = chunk.usage
    return first, text, usage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--context-chars", type=int, default=3000, help="length of the first turn's code")
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--random-drafter", action="store_true", help="an untrained drafter built for the target")
    args = parser.parse_args()

    if args.random_drafter:
        model, tokenizer, drafter = _random_pair(args.model)
    else:
        model, tokenizer, drafter = load(args.model, args.draft)
    servers = {}
    for name, budget in (("cache on", 2 << 30), ("cache off", 0)):
        app = create_app(model, tokenizer, drafter, ServerSettings(model_name="m", prompt_cache_bytes=budget))
        running = start_in_thread(app)
        servers[name] = (running, OpenAI(base_url=running.url, api_key="unused", max_retries=0, timeout=3600))
    code = _context(args.context_chars)
    times = {name: [] for name in servers}
    first_turn = {name: [] for name in servers}
    tokens = {}
    try:
        for r in range(args.repeats):
            for name, (_, client) in servers.items():
                messages = [{"role": "user", "content": f"Here is some code (run {r}):\n\n{code}\n\n"
                                                        "Summarize it in one sentence."}]
                ttft1, reply, _ = _ttft(client, "m", messages, args.reply_tokens)
                first_turn[name].append(ttft1)
                messages += [{"role": "assistant", "content": reply},
                             {"role": "user", "content": "Which function runs the prefill?"}]
                first, _, usage = _ttft(client, "m", messages, 8)
                times[name].append(first)
                tokens[name] = (usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens)
                print(f"run {r} {name:9s}: first-turn TTFT {ttft1:.3f} s, second-turn TTFT {first:.3f} s "
                      f"({usage.prompt_tokens} prompt tokens, {usage.prompt_tokens_details.cached_tokens} cached)",
                      flush=True)
    finally:
        for running, _ in servers.values():
            running.stop()
    on, off = statistics.median(times["cache on"]), statistics.median(times["cache off"])
    print(f"\n{args.model}: second turn of a {tokens['cache off'][0]}-token chat, median of {args.repeats}")
    print(f"  prefix cache on : {on:.3f} s  ({tokens['cache on'][1]} prompt tokens from the cache)")
    print(f"  prefix cache off: {off:.3f} s")
    print(f"  speedup: {off / on:.2f}x")
    print(f"  (first turn, nothing to reuse: {statistics.median(first_turn['cache on']):.3f} s with the cache on, "
          f"{statistics.median(first_turn['cache off']):.3f} s off)")


if __name__ == "__main__":
    main()
