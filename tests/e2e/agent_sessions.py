"""Agent sessions through the gateway with the real Anthropic and OpenAI Python clients.

Usage: agent_sessions.py GATEWAY_URL SESSIONS TURNS [PHASE]. Per session, alternately:

- Anthropic Messages (`messages.create`, and `messages.stream` on odd turns) with a long
  system prompt as text blocks (a moving `cache_control` marker and a billing header, as
  Claude Code sends them), tools, and every turn's tool use and tool result in the
  history, the session in `x-claude-code-session-id`;
- OpenAI Responses (`responses.create`, streamed on odd turns) where every later turn
  sends only its new input and `previous_response_id`;
- OpenAI Responses as Codex sends them with `store: false` (`responses_full`): every turn
  resends the whole conversation as items (input_text messages, the assistant's output
  messages, function calls and their outputs), with function tools and a reasoning effort.

Prints one JSON line per turn: api, session, turn, the pod that served it (`x-pod`, set by
the engine), prompt and cached tokens from the API's own usage fields. PHASE names the
sessions' Responses keys; a later run continues the same sessions (Messages by their
session ids, Responses from the ids saved in the file named by KVROUTE_RESP_STATE).
KVROUTE_APIS lists the kinds to run (default `messages,responses`).
"""

import json
import os
import sys

import anthropic
from openai import OpenAI

url, sessions, turns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
phase = sys.argv[4] if len(sys.argv) > 4 else "a"
base = url.rstrip("/")
claude = anthropic.Anthropic(base_url=base, api_key="unused", max_retries=0, timeout=30)
oai = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=30)
state_file = os.environ.get("KVROUTE_RESP_STATE")
state = {}
if state_file and os.path.exists(state_file) and os.path.getsize(state_file):
    state = json.load(open(state_file))

TOOLS = [{"name": "read_file", "description": "Read a file from the repository.",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}},
                           "required": ["path"]}}]


def system(turn):
    return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={turn:05x};"},
            {"type": "text", "text": "You are a coding agent. " + "Follow the repository's conventions. " * 40,
             "cache_control": {"type": "ephemeral"}}]


def messages_session(s):
    history = []
    sid = f"claude-session-{s}"
    for t in range(turns):
        if history:
            # Claude Code moves the marker to the newest message.
            for m in history:
                if isinstance(m["content"], list):
                    for b in m["content"]:
                        b.pop("cache_control", None)
        history.append({"role": "user", "content": [
            {"type": "text", "text": f"Session {s}, step {t}: look at src/lib.rs and tell me what changed. 🙂",
             "cache_control": {"type": "ephemeral"}}]})
        kw = dict(model="m", max_tokens=8, system=system(t), tools=TOOLS, messages=history,
                  metadata={"user_id": f"user_x_account_y_session_{s}"},
                  extra_headers={"x-claude-code-session-id": sid})
        if t % 2:
            with claude.messages.stream(**kw) as st:
                text = "".join(st.text_stream)
                msg = st.get_final_message()
                pod = st.response.headers.get("x-pod", "")
        else:
            raw = claude.messages.with_raw_response.create(**kw)
            msg = raw.parse()
            pod = raw.headers.get("x-pod", "")
            text = "".join(b.text for b in msg.content if b.type == "text")
        u = msg.usage
        cached = u.cache_read_input_tokens or 0
        prompt = u.input_tokens + cached + (u.cache_creation_input_tokens or 0)
        print(json.dumps({"api": "messages", "session": s, "turn": t, "pod": pod,
                          "prompt_tokens": prompt, "cached_tokens": cached}), flush=True)
        # The agent calls a tool and sends its result back next turn.
        history.append({"role": "assistant", "content": [
            {"type": "text", "text": text},
            {"type": "tool_use", "id": f"toolu_{s}_{t}", "name": "read_file", "input": {"path": "src/lib.rs"}}]})
        history.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"toolu_{s}_{t}",
             "content": [{"type": "text", "text": "pub fn main() {} // " + "line of code " * 20}]}]})


def create_response(kw, stream):
    """One `responses.create`, streamed or not: the pod that served it (`x-pod`), the
    response, and the cached tokens its usage reports."""
    if stream:
        raw = oai.responses.with_raw_response.create(stream=True, **kw)
        resp = None
        for ev in raw.parse():
            if ev.type == "response.completed":
                resp = ev.response
    else:
        raw = oai.responses.with_raw_response.create(**kw)
        resp = raw.parse()
    u = resp.usage
    cached = u.input_tokens_details.cached_tokens if u.input_tokens_details else 0
    return raw.headers.get("x-pod", ""), resp, cached


def responses_session(s):
    key = f"{phase}-{s}"
    prev = state.get(str(s))
    for t in range(turns):
        text_in = f"Responses session {s}, turn {t}: run the tests and summarize. " + ("context " * 60 if prev is None else "")
        kw = dict(model="m", max_output_tokens=8, input=[{"role": "user", "content": text_in}],
                  instructions="You are Codex, a coding agent. " + "Be precise and terse. " * 30,
                  prompt_cache_key=f"codex-{s}")
        if prev:
            kw["previous_response_id"] = prev
        pod, resp, cached = create_response(kw, stream=bool(t % 2))
        u = resp.usage
        print(json.dumps({"api": "responses", "session": s, "turn": t, "pod": pod, "key": key,
                          "prompt_tokens": u.input_tokens, "cached_tokens": cached,
                          "continued": prev is not None}), flush=True)
        prev = resp.id
    state[str(s)] = prev


FUNCTIONS = [{"type": "function", "name": "shell", "description": "Run a command in the sandbox.",
              "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                             "required": ["command"]}, "strict": False}]


def responses_full_session(s):
    items = []
    for t in range(turns):
        items.append({"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": f"Codex session {s}, step {t}: fix the failing test. " + ("context " * 60 if t == 0 else "")}]})
        kw = dict(model="m", max_output_tokens=8, input=items, store=False, tools=FUNCTIONS,
                  reasoning={"effort": "low"}, prompt_cache_key=f"codex-full-{s}",
                  instructions="You are Codex, a coding agent. " + "Be precise and terse. " * 30)
        pod, resp, cached = create_response(kw, stream=bool(t % 2))
        u = resp.usage
        print(json.dumps({"api": "responses_full", "session": s, "turn": t, "pod": pod,
                          "prompt_tokens": u.input_tokens, "cached_tokens": cached}), flush=True)
        # The agent's reply and a tool call with its output, resent with the next turn.
        items.append({"type": "message", "role": "assistant", "id": f"msg_{s}_{t}", "status": "completed",
                      "content": [{"type": "output_text", "text": resp.output_text, "annotations": []}]})
        items.append({"type": "function_call", "call_id": f"call_{s}_{t}", "name": "shell",
                      "arguments": json.dumps({"command": ["cargo", "test"]})})
        items.append({"type": "function_call_output", "call_id": f"call_{s}_{t}",
                      "output": "test result: ok. " + "running 12 tests " * 10})


apis = os.environ.get("KVROUTE_APIS", "messages,responses").split(",")
for s in range(sessions):
    if "messages" in apis:
        messages_session(s)
    if "responses" in apis:
        responses_session(s)
    if "responses_full" in apis:
        responses_full_session(s)
if state_file:
    json.dump(state, open(state_file, "w"))
