"""Stream tokens as they are committed, with the acceptance of the verify pass each one came from.

    python examples/stream.py [TARGET [DRAFTER]]
"""

from _pair import model_and_drafter

from dflash_mlx import load, stream_generate

target, drafter_ref = model_and_drafter()
model, tokenizer, drafter = load(target, drafter_ref)
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Count from one to twenty."}],
                                       add_generation_prompt=True)
for response in stream_generate(model, tokenizer, prompt, drafter, max_tokens=96, temp=0.7, seed=0):
    print(response.text, end="", flush=True)
print(f"\n\n{response.generation_tps:.1f} tok/s, tau {response.tau:.2f}, finish: {response.finish_reason}")
