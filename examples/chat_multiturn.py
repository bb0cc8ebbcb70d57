"""A multi-turn conversation in code: the caches carry over, so each turn prefills only its new tokens.

    python examples/chat_multiturn.py [TARGET [DRAFTER]]
"""

from _pair import model_and_drafter

from dflash_mlx import load
from dflash_mlx.chat import ChatSession

target, drafter_ref = model_and_drafter()
model, tokenizer, drafter = load(target, drafter_ref)
session = ChatSession(model, tokenizer, drafter, system="You are terse.", max_tokens=64)
for question in ("Name a prime number.", "And the next one?", "Their sum?"):
    print(f">> {question}")
    reply = "".join(session.send(question))
    print(reply)
    print(f"   [{session.last_prefill_tokens} prompt tokens prefilled this turn]")
print(session.stats_text())
