"""vLLM's own Anthropic Messages conversion, compiled from its sdist for the fidelity test.

vLLM's server turns a `/v1/messages` body into a chat-completion request before its chat
template runs (`AnthropicServingMessages.to_chat_completion_request`). Its modules import
the whole engine (torch, fastapi, ...), so only what the conversion runs is compiled from
vLLM's source text: the request models of `entrypoints/anthropic/protocol.py` (pydantic,
with their validators: a tool's schema gains `"type": "object"`, ...), the conversion's
classmethods of `AnthropicServingMessages`, and the tool models the converted tools are
dumped from (`FunctionDefinition`, `ChatCompletionToolsParam`). What is written here is
only glue: stubs for imports the compiled code does not run, and the three lines of
`ChatCompletionRequest.build_chat_params` that pass `reasoning_effort` to the template.
"""

import ast
import json
import sys
import time
import types
from typing import Annotated, Any, ClassVar, Literal, get_args

import jinja2
import jinja2.ext
import jinja2.sandbox
import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

CONVERSION = [
    "_detect_merge_inline_system", "_convert_image_source_to_url", "_convert_system_message",
    "_extract_system_text", "_convert_messages", "_convert_message_content", "_convert_block",
    "_convert_tool_use_block", "_convert_tool_result_block", "_convert_user_tool_result",
    "_resolve_tools",
]


def _strip_annotations(fn):
    fn.returns = None
    for a in fn.args.args + fn.args.kwonlyargs:
        a.annotation = None
    return fn


def _classes(src, names):
    tree = ast.parse(src)
    return [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in names]


def load(sources):
    """`sources`: vLLM path → source text. Returns (request model, converter class,
    tools param model)."""
    # The request models, with the imports they do not need stubbed.
    proto = sources["vllm/entrypoints/anthropic/protocol.py"]
    tree = ast.parse(proto)
    tree.body = [n for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom))
                 or (isinstance(n, ast.ImportFrom) and n.module in ("typing", "pydantic", "http"))]
    # A module of its own, so pydantic resolves the models' forward references in it.
    mod = types.ModuleType("vllm_anthropic_protocol")
    sys.modules[mod.__name__] = mod
    ns = mod.__dict__
    ns.update({"envs": types.SimpleNamespace(VLLM_MAX_STOP_STRINGS=1024), "MMPayload": Any,
               "resolve_return_mm_kwargs_alias": lambda d: d, "time": time})
    exec(compile(tree, "vllm/entrypoints/anthropic/protocol.py", "exec"), ns)
    for v in list(ns.values()):
        if isinstance(v, type) and issubclass(v, BaseModel) and v is not BaseModel:
            v.model_rebuild()
    # The tool models the conversion dumps (their base is vLLM's OpenAIBaseModel: extra
    # fields allowed).
    class OpenAIBaseModel(BaseModel):
        model_config = ConfigDict(extra="allow")

    tns = {"OpenAIBaseModel": OpenAIBaseModel, "Any": Any, "Literal": Literal,
           "model_serializer": model_serializer, "model_validator": model_validator,
           "Field": Field}
    for path, names in [("vllm/entrypoints/generate/base/protocol.py", {"FunctionDefinition"}),
                        ("vllm/entrypoints/openai/chat_completion/protocol.py", {"ChatCompletionToolsParam"})]:
        mod = ast.Module(body=_classes(sources[path], names), type_ignores=[])
        exec(compile(mod, path, "exec"), tns)
    # The conversion's classmethods, in a class of their own.
    serving = sources["vllm/entrypoints/anthropic/serving.py"]
    cls = _classes(serving, {"AnthropicServingMessages"})[0]
    methods = [_strip_annotations(m) for m in cls.body
               if isinstance(m, ast.FunctionDef) and m.name in CONVERSION]
    conv = ast.ClassDef(name="Conversion", bases=[], keywords=[], body=methods, decorator_list=[],
                        type_params=[])
    ast.copy_location(conv, cls)
    ast.fix_missing_locations(conv)
    cns = {"json": json, "time": time, "jinja2": jinja2, "Any": Any,
           "AnthropicToolChangeDefinition": ns["AnthropicToolChangeDefinition"]}
    exec(compile(ast.Module(body=[conv], type_ignores=[]), "vllm/entrypoints/anthropic/serving.py", "exec"), cns)
    return ns["AnthropicMessagesRequest"], cns["Conversion"], tns["ChatCompletionToolsParam"]


def chat_request(models, body, chat_template, disabled_effort):
    """A Messages body as (messages, tools, template kwargs), as vLLM renders it."""
    Request, Conversion, ToolsParam = models
    req = Request.model_validate(body)
    merge = Conversion._detect_merge_inline_system(chat_template)
    messages = []
    Conversion._convert_system_message(req, messages, merge_inline_system=merge)
    Conversion._convert_messages(req.messages, messages, merge_inline_system=merge)
    tools = None
    resolved = Conversion._resolve_tools(req)
    if resolved is not None:
        tools = [ToolsParam.model_validate({"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema,
            "strict": t.strict, "defer_loading": t.defer_loading}}).model_dump() for t in resolved]
    kwargs = dict(req.chat_template_kwargs or {})
    effort = None
    if req.output_config and req.output_config.effort is not None:
        effort = req.output_config.effort
    if req.thinking is not None and req.thinking.type == "disabled":
        effort = disabled_effort
    # ChatCompletionRequest.build_chat_params: the effort reaches the template and sets
    # enable_thinking unless the caller did; "auto" and None count as unset.
    if effort not in (None, "auto"):
        if "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = effort != "none"
        kwargs["reasoning_effort"] = effort
    return messages, tools, kwargs
