"""Generate a complete reply with DFlash, printing speed and acceptance (like `mlx_lm.generate(..., verbose=True)`).

    python examples/generate.py                       # tiny offline demo pair
    python examples/generate.py Qwen3.5-9B            # a registry name brings its drafter
    python examples/generate.py TARGET_DIR DRAFTER_DIR
"""

from _pair import model_and_drafter

from dflash_mlx import generate, load

target, drafter_ref = model_and_drafter()
model, tokenizer, drafter = load(target, drafter_ref)
messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
text = generate(model, tokenizer, prompt, drafter, max_tokens=128, verbose=True)
