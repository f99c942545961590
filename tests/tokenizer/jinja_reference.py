"""What Jinja2 renders, as transformers configures it, for kvroute's template fidelity test.

The sidecar renders chat templates with minijinja configured to behave as Jinja2 does under
transformers (`tokenize/template.rs`). This script asks the reference itself: each template
is compiled by transformers' own `_compile_jinja_template` (its sandboxed environment,
`trim_blocks`, `lstrip_blocks`, loop controls, its `tojson`, `raise_exception`,
`strftime_now`, `dict` and `namespace`) and rendered over generated contexts; the output,
or the fact that Jinja2 raised, is what the sidecar must reproduce.

Two corpora:
- `chat`: every chat template in vLLM's sdist (`examples/*.jinja`, pinned by hash, fetched
  by make_fixtures.py), 17 model repositories' own templates (the copies llama.cpp keeps,
  from llama-cpp-python's sdist, pinned by hash), the tests' own templates, and CRLF
  copies of two of them, each over
  generated conversations: tool calls with every argument shape (nested objects, lists,
  booleans, null, floats, unicode, control characters), tools with assorted JSON-schema
  shapes, content as a string, as text parts and null, names, reasoning, system-less and
  system-only chats, the generation prompt on and off, and `chat_template_kwargs`;
- `fuzz`: small random templates from Jinja2's grammar (print, if/elif/else, for/else with
  loop variables, set, namespace, macro, filters, tests, methods, whitespace control,
  CRLF sources) over random contexts (every JSON type, missing keys).

Usage: jinja_reference.py OUT_DIR N_CONVERSATIONS N_FUZZ_TEMPLATES. Writes
OUT_DIR/jinja_cases.json: [{"corpus", "name", "source", "cases": [{"ctx", "out"} |
{"ctx", "err"}]}].
"""

import json
import random
import sys
from pathlib import Path

import make_fixtures  # OUT_DIR is its first argument too

HERE = Path(__file__).parent
OUT = Path(sys.argv[1])
N_CHATS = int(sys.argv[2]) if len(sys.argv) > 2 else 40
N_FUZZ = int(sys.argv[3]) if len(sys.argv) > 3 else 300

WORDS = ("the cache prefix token router Paris 東京 naïve café 🙂 👩‍💻 it's \"quoted\" a\\b "
         "tab\there line\nbreak \x1c sep \x7f del \u2028 ls").split(" ")


def word(rng):
    return rng.choice(WORDS)


def text(rng, lo=1, hi=8):
    return " ".join(word(rng) for _ in range(rng.randint(lo, hi)))


def scalar(rng):
    return rng.choice([
        lambda: text(rng, 1, 3), lambda: rng.randint(-5, 1000), lambda: rng.choice([0.5, 1.0, -2.25, 3.14159, 1e-7, 1e21, 100.0]),
        lambda: rng.random() < 0.5, lambda: None, lambda: "", lambda: "'", lambda: "\"'", lambda: "\x00\x1b\t",
        lambda: "🚀" * rng.randint(1, 2),
    ])()


def value(rng, depth=0):
    r = rng.random()
    if depth < 3 and r < 0.2:
        return {f"k{i}" if rng.random() < 0.8 else word(rng): value(rng, depth + 1) for i in range(rng.randint(0, 3))}
    if depth < 3 and r < 0.35:
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return scalar(rng)


def schema(rng, depth=0):
    t = rng.choice(["string", "integer", "number", "boolean", "array", "object", ["string", "null"], None])
    s = {}
    if t is not None:
        s["type"] = t
    if rng.random() < 0.5:
        s["description"] = text(rng, 1, 6)
    if t == "string" and rng.random() < 0.3:
        s["enum"] = [word(rng) for _ in range(rng.randint(1, 3))]
    if t == "array" and depth < 2:
        s["items"] = schema(rng, depth + 1)
    if t == "object" and depth < 2:
        s["properties"] = {f"p{i}": schema(rng, depth + 1) for i in range(rng.randint(0, 3))}
        if s["properties"] and rng.random() < 0.6:
            s["required"] = list(s["properties"])[:1]
    if rng.random() < 0.15:
        s["default"] = scalar(rng)
    return s


def tool(rng, i):
    params = {"type": "object", "properties": {f"arg{j}": schema(rng) for j in range(rng.randint(0, 3))}}
    if params["properties"] and rng.random() < 0.6:
        params["required"] = list(params["properties"])[: rng.randint(1, len(params["properties"]))]
    f = {"name": f"tool_{i}_{word(rng).strip() or 'x'}"[:30], "parameters": params}
    if rng.random() < 0.8:
        f["description"] = text(rng, 1, 10)
    return {"type": "function", "function": f}


def content(rng):
    r = rng.random()
    if r < 0.65:
        return text(rng, 1, 12)
    if r < 0.85:
        return [{"type": "text", "text": text(rng, 1, 6)} for _ in range(rng.randint(1, 3))]
    if r < 0.93:
        return ""
    return None


def tool_call(rng, i, tools):
    name = rng.choice(tools)["function"]["name"] if tools and rng.random() < 0.8 else f"fn_{i}"
    args = {f"a{j}": value(rng) for j in range(rng.randint(0, 3))}
    return {"id": f"call_{i:09d}", "type": "function", "function": {"name": name, "arguments": args}}


def conversation(rng, tools):
    msgs = []
    if rng.random() < 0.6:
        msgs.append({"role": "system", "content": content(rng) if rng.random() < 0.9 else text(rng)})
    if rng.random() < 0.08:
        return msgs or [{"role": "system", "content": text(rng)}]  # system-only
    for t in range(rng.randint(1, 4)):
        u = {"role": "user", "content": content(rng)}
        if rng.random() < 0.1:
            u["name"] = word(rng)
        msgs.append(u)
        if rng.random() < 0.15 and t > 0:
            break  # ends on a user turn
        a = {"role": "assistant", "content": content(rng)}
        if rng.random() < 0.25:
            a["reasoning_content"] = text(rng, 1, 6)
        if rng.random() < 0.4:
            a["tool_calls"] = [tool_call(rng, len(msgs) * 10 + k, tools) for k in range(rng.randint(1, 2))]
            if rng.random() < 0.5:
                a["content"] = None if rng.random() < 0.5 else ""
            msgs.append(a)
            for c in a["tool_calls"]:
                r = {"role": "tool", "content": content(rng) if rng.random() < 0.8 else json.dumps(value(rng)),
                     "tool_call_id": c["id"]}
                if rng.random() < 0.3:
                    r["name"] = c["function"]["name"]
                msgs.append(r)
            continue
        msgs.append(a)
    if msgs[-1]["role"] == "assistant" and rng.random() < 0.5:
        msgs.append({"role": "user", "content": content(rng)})
    return msgs


def chat_context(rng, engine_view):
    tools = [tool(rng, i) for i in range(rng.randint(1, 3))] if rng.random() < 0.5 else None
    ctx = {"messages": engine_view(conversation(rng, tools or [])), "tools": tools, "documents": None,
           "add_generation_prompt": rng.random() < 0.8,
           "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None}
    if rng.random() < 0.3:
        ctx["enable_thinking"] = rng.random() < 0.5
    if rng.random() < 0.1:
        ctx["tools_in_user_message"] = rng.random() < 0.5
    if rng.random() < 0.1:
        ctx["date_string"] = "26 Jul 2024"
    return ctx


# ---- the template fuzzer ----------------------------------------------------------

VARS = ["s", "n", "f", "b", "z", "l", "d", "e", "missing", "d.a", "d['b']", "l[0]", "l[-1]", "d.missing",
        "l[1:]", "s[::-1]", "s[1:3]", "ns.v"]
# What chat templates use (counted over vLLM's examples and the tests' templates), and a
# few neighbours of it.
FILTERS = ["length", "trim", "upper", "lower", "string", "first", "last", "list", "tojson", "join",
           "join(', ')", "default('dflt')", "default('x', true)", "items", "reverse", "sort", "int", "float",
           "capitalize", "replace('a', 'b')", "map(attribute='a')", "selectattr('a')", "rejectattr('a')",
           "selectattr('a', 'defined')", "selectattr('a', 'equalto', 1)", "map('string')", "map('trim')",
           "unique", "count", "abs", "tojson(indent=2)", "first | string", "items | list", "trim | length",
           "join(attribute='a')"]
TESTS = ["defined", "undefined", "none", "string", "number", "integer", "float", "mapping", "iterable",
         "sequence", "true", "false", "boolean", "in ['a', 'x']", "eq 1", "equalto 'a'", "sameas none",
         "ne 'x'"]
METHODS = [".strip()", ".lstrip()", ".rstrip('x')", ".split()", ".split(',')", ".startswith('a')",
           ".endswith('}')", ".upper()", ".lower()", ".replace(' ', '_')", ".items()", ".keys()",
           ".values()", ".get('a')", ".get('q', 3)", ".title()", ".splitlines()", ".split('\\n')[0]"]
LITERALS = ["1", "0", "-1", "2.5", "'a'", "\"x\\ny\"", "'\\x1c'", "[1, 'a', none]", "{'k': 1, 'j': [true]}",
            "('t', 1)", "true", "false", "none", "True", "None", "''", "[]", "{}"]


class Fuzz:
    def __init__(self, rng):
        self.rng = rng
        self.macros = []

    def atom(self, depth):
        r = self.rng.random()
        if r < 0.45:
            return self.rng.choice(VARS)
        if r < 0.7:
            return self.rng.choice(LITERALS)
        if r < 0.8 and self.macros:
            return f"{self.rng.choice(self.macros)}({self.expr(depth + 1)})"
        if r < 0.85:
            return "loop_var"  # replaced inside loops, else undefined
        return f"({self.expr(depth + 1)})"

    def expr(self, depth=0):
        e = self.atom(depth)
        if depth > 2:
            return e
        r = self.rng.random()
        if r < 0.25:
            e = f"{e} | {self.rng.choice(FILTERS)}"
        elif r < 0.35:
            e = f"{e}{self.rng.choice(METHODS)}"
        elif r < 0.45:
            e = f"{e} is {'not ' if self.rng.random() < 0.3 else ''}{self.rng.choice(TESTS)}"
        elif r < 0.6:
            op = self.rng.choice(["+", "-", "*", "~", "==", "!=", "<", "and", "or", "in", "not in", "//", "%", "**"])
            e = f"{e} {op} {self.expr(depth + 1)}"
        elif r < 0.65:
            e = f"not {e}"
        elif r < 0.7:
            e = f"{self.expr(depth + 1)} if {e} else {self.expr(depth + 1)}"
        elif r < 0.75:
            e = e + '[' + self.rng.choice(['0', '-1', '1:', ':2', "'a'", 'n']) + ']'
        return e

    def ws(self):
        return self.rng.choice(["", "", "-", "+"]) if self.rng.random() < 0.4 else ""

    def block(self, depth=0, loop=None):
        out = []
        for _ in range(self.rng.randint(1, 4 if depth < 2 else 2)):
            r = self.rng.random()
            nl = self.rng.choice(["", "\n", "  \n", "\n  ", " "])
            if r < 0.35 or depth > 2:
                e = self.expr()
                if loop:
                    e = e.replace("loop_var", loop)
                out.append(f"{nl}{{{{{self.ws()} {e} {self.ws()}}}}}")
            elif r < 0.45:
                out.append(nl + self.rng.choice(["text", " sp ", "<|tag|>", "日本", "\t", "a\nb"]))
            elif r < 0.6:
                c = self.expr()
                body = self.block(depth + 1, loop)
                tail = ""
                if self.rng.random() < 0.3:
                    tail += f"{{%{self.ws()} elif {self.expr()} {self.ws()}%}}{self.block(depth + 1, loop)}"
                if self.rng.random() < 0.4:
                    tail += f"{{%{self.ws()} else {self.ws()}%}}{self.block(depth + 1, loop)}"
                out.append(f"{nl}{{%{self.ws()} if {c} {self.ws()}%}}{body}{tail}{{%{self.ws()} endif {self.ws()}%}}")
            elif r < 0.75:
                var = f"it{depth}"
                seq = self.rng.choice(["l", "d", "s", "d.items()", "l | reverse", "range(3)", "e", "missing", "n",
                                       "l if l else []", "d.a", "z"])
                inner = self.rng.choice(["", f"{{{{ loop.index }}}}", f"{{{{ loop.first }}}}", "{{ loop.last }}",
                                         "{{ loop.length }}", "{{ loop.revindex0 }}", "{{ loop.previtem }}",
                                         "{% if loop.index > 1 %}{% break %}{% endif %}",
                                         "{% if loop.first %}{% continue %}{% endif %}"])
                cond = f" if {var}" if self.rng.random() < 0.15 else ""
                els = f"{{% else %}}{self.block(depth + 1, loop)}" if self.rng.random() < 0.2 else ""
                out.append(f"{nl}{{%{self.ws()} for {var} in {seq}{cond} {self.ws()}%}}{inner}"
                           f"{self.block(depth + 1, var)}{els}{{%{self.ws()} endfor {self.ws()}%}}")
            elif r < 0.85:
                e = self.expr()
                if loop:
                    e = e.replace("loop_var", loop)
                target = self.rng.choice(["x", "ns.v", "s"])
                out.append(f"{nl}{{%{self.ws()} set {target} = {e} {self.ws()}%}}")
            elif r < 0.9 and depth == 0:
                name = f"m{len(self.macros)}"
                out.append(f"{nl}{{% macro {name}(a, b='B') %}}[{{{{ a }}}}|{{{{ b }}}}]{{% endmacro %}}")
                self.macros.append(name)
            else:
                out.append(f"{nl}{{# a comment #}}")
        return "".join(out)

    def template(self):
        src = "{% set ns = namespace(v=1) %}" + self.block()
        if self.rng.random() < 0.2:
            src += "\n"
        if self.rng.random() < 0.15:
            src = src.replace("\n", "\r\n")
        return src.replace("loop_var", "x")


def fuzz_context(rng):
    ctx = {"s": text(rng, 0, 3), "n": rng.randint(-3, 12), "f": rng.choice([0.5, 2.0, -1.25, 1e21]),
           "b": rng.random() < 0.5, "z": None, "l": [value(rng, 2) for _ in range(rng.randint(0, 4))],
           "d": {k: value(rng, 2) for k in rng.sample(["a", "b", "c", "Z"], rng.randint(0, 4))},
           "e": [{"a": value(rng, 2)} for _ in range(rng.randint(0, 3))]}
    for k in list(ctx):
        if rng.random() < 0.1:
            del ctx[k]  # missing keys
    return ctx


def render_all(compiled, ctxs):
    cases = []
    for ctx in ctxs:
        try:
            out = compiled.render(**ctx)
            if " at 0x" in out.lower():
                continue  # a generator or object printed with its address (in any case): no template means that
            cases.append({"ctx": ctx, "out": out})
        except Exception as e:  # Jinja2 raised: the sidecar must refuse too
            cases.append({"ctx": ctx, "err": type(e).__name__})
    return cases


# The instant `strftime_now` reads on both sides (template_fidelity.rs's NOW).
NOW = 1767225600


def main():
    import datetime as dt
    import transformers.utils.chat_template_utils as ctu

    class Clock(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return dt.datetime.fromtimestamp(NOW, tz)
    ctu.datetime = Clock  # what transformers' strftime_now calls
    from transformers.utils.chat_template_utils import _alias_reasoning_fields, _compile_jinja_template
    import vllm_messages
    sources = make_fixtures.vllm_sources()
    parse = vllm_messages.chat_parser(sources)
    detect = vllm_messages.content_format_detector(sources)
    templates = [(p.name, p.read_text()) for p in make_fixtures.vllm_examples()]
    templates += [(p.name, p.read_text()) for p in sorted((HERE / "templates").glob("*.jinja"))]
    templates += [(p.name, p.read_text()) for p in make_fixtures.model_templates()]
    # Templates saved with Windows line endings (as some widely copied ones are).
    templates += [(n + ".crlf", s.replace("\n", "\r\n")) for n, s in templates
                  if n in ("template_chatml.jinja", "tool_chat_template_hermes.jinja")]
    out = []
    for name, src in templates:
        rng = random.Random(name)
        compiled = _compile_jinja_template(src)
        fmt = detect(src)

        def engine_view(msgs):
            # The messages as the template sees them on the engine: vLLM's chat parser for
            # this template's content format, then transformers' reasoning aliases.
            return _alias_reasoning_fields(parse(msgs, fmt))
        ctxs = [chat_context(rng, engine_view) for _ in range(N_CHATS)]
        out.append({"corpus": "chat", "name": name, "source": src, "cases": render_all(compiled, ctxs)})
    rng = random.Random(26)
    made = 0
    while made < N_FUZZ:
        src = Fuzz(rng).template()
        try:
            compiled = _compile_jinja_template(src)
        except Exception:
            continue  # not a template Jinja2 accepts: nothing to compare
        ctxs = [fuzz_context(rng) for _ in range(4)]
        out.append({"corpus": "fuzz", "name": f"fuzz-{made}", "source": src, "cases": render_all(compiled, ctxs)})
        made += 1
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "jinja_cases.json").write_text(json.dumps(out, ensure_ascii=False))
    total = sum(len(t["cases"]) for t in out)
    errs = sum(1 for t in out for c in t["cases"] if "err" in c)
    print(json.dumps({"templates": len(out), "cases": total, "raised": errs}))


if __name__ == "__main__":
    main()
