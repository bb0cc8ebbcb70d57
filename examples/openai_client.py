"""Talk to `dflash-mlx serve` with the official openai client: a streamed reply with usage, a second turn served
from the prefix cache, and a forced tool call.

    dflash-mlx serve --port 8080          # in another terminal (default model, shipped drafter)
    python examples/openai_client.py
"""

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="unused")  # pass the server's --api-key if it has one
model = client.models.list().data[0].id

messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
stream = client.chat.completions.create(model=model, messages=messages, max_tokens=200, temperature=0,
                                        stream=True, stream_options={"include_usage": True})
reply = ""
for chunk in stream:
    if chunk.choices:
        reply += chunk.choices[0].delta.content or ""
        print(chunk.choices[0].delta.content or "", end="", flush=True)
    else:  # the last chunk: usage, and the DFlash statistics of the reply
        print(f"\n\nusage: {chunk.usage.prompt_tokens} prompt tokens "
              f"({chunk.usage.prompt_tokens_details.cached_tokens} from the prefix cache), "
              f"{chunk.usage.completion_tokens} generated; tau {chunk.model_extra['dflash']['tau']}")

# The second turn reuses the first one's caches: only the new message is prefilled.
messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Now add type hints."}]
second = client.chat.completions.create(model=model, messages=messages, max_tokens=200, temperature=0)
print(second.choices[0].message.content)
print("cached prompt tokens:", second.usage.prompt_tokens_details.cached_tokens, "of", second.usage.prompt_tokens)

# Tools: the model may call one ("auto"), or `tool_choice` forces a call ("required", or a named function).
tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                   tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                   max_tokens=64, temperature=0)
for call in r.choices[0].message.tool_calls or []:
    print("tool call:", call.function.name, call.function.arguments)
