"""Draft trees: the same prompt decoded with chains and with DDTree trees of a few budgets; the tokens are the same
(greedy), the tokens per pass (tau) and the speed are what changes.

    python examples/trees.py [TARGET [DRAFTER]]

On a machine where a verify row is nearly free (Apple GPUs) trees of 4-16 pay wherever the drafter's runner-up
is often right; on a CPU each row costs, which `tree_budget="auto"` measures. Side by side over many prompts:
`dflash-mlx bench --tree-budget 4,8,auto`.
"""

import time

from _pair import model_and_drafter

from dflash_mlx import load, stream_generate

target, drafter_ref = model_and_drafter()
model, tokenizer, drafter = load(target, drafter_ref)
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a list."}],
                                       add_generation_prompt=True)
chain = None
for budget in (None, 4, 8, "auto"):
    tic = time.perf_counter()
    responses = list(stream_generate(model, tokenizer, prompt, drafter, max_tokens=64, lookup=False,
                                     tree_budget=budget))
    seconds = time.perf_counter() - tic
    tokens = [r.token for r in responses]
    chain = tokens if chain is None else chain
    print(f"tree_budget={str(budget):5}  tau {responses[-1].tau:.2f}  {len(tokens) / seconds:6.1f} tok/s  "
          f"same tokens as chains: {tokens == chain}")
