"""Multi-turn streaming chats through the gateway with the real OpenAI Python client.

Usage: openai_chats.py GATEWAY_URL CONVERSATIONS TURNS. Each conversation has its own long
system prompt; every turn streams (with usage), and the assistant's reply joins the
history. Prints one JSON line per turn: conversation, turn, the pod that served it
(`x-pod`, set by the engine), prompt and cached tokens from the stream's usage.
"""

import json
import sys

from openai import OpenAI

url, convs, turns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
client = OpenAI(base_url=url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=30)
for c in range(convs):
    history = [{"role": "system", "content": f"Conversation {c}. " + "You answer about caches, routers and 東京. " * 30}]
    for t in range(turns):
        history.append({"role": "user", "content": f"Question {t} of conversation {c}: why do prefixes matter? 🙂"})
        raw = client.chat.completions.with_raw_response.create(
            model="m", messages=history, max_tokens=12, stream=True, stream_options={"include_usage": True})
        pod = raw.headers.get("x-pod", "")
        text, usage = [], None
        for chunk in raw.parse():
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
            if chunk.usage:
                usage = chunk.usage
        history.append({"role": "assistant", "content": "".join(text)})
        cached = 0
        if usage and usage.prompt_tokens_details:
            cached = usage.prompt_tokens_details.cached_tokens or 0
        print(json.dumps({"conv": c, "turn": t, "pod": pod, "prompt_tokens": usage.prompt_tokens if usage else 0,
                          "cached_tokens": cached}), flush=True)
