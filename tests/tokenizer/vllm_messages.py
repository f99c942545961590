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
import jinja2.nodes
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


def _functions(src, names, path, ns):
    """Compile the top-level functions `names` (and assignments to names in `names`)
    of vLLM's `src` into `ns`, annotations and decorators dropped."""
    tree = ast.parse(src)
    body = []
    for n in tree.body:
        if isinstance(n, ast.FunctionDef) and n.name in names:
            n.decorator_list = []
            body.append(_strip_annotations(n))
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            if any(isinstance(t, ast.Name) and t.id in names for t in targets):
                body.append(n if isinstance(n, ast.Assign) else
                            ast.copy_location(ast.Assign(targets=[n.target], value=n.value), n))
    mod = ast.Module(body=body, type_ignores=[])
    ast.fix_missing_locations(mod)
    exec(compile(mod, path, "exec"), ns)
    return ns


def chat_parser(sources):
    """vLLM's chat parser (`parse_chat_messages` without its multimodal tracker): a
    function (messages, content_format) -> the conversation the template gets, after
    `_postprocess_messages`. Text parts only; a media part raises."""
    import logging
    from typing import Iterable, cast as tcast

    class VLLMValidationError(ValueError):
        def __init__(self, msg, parameter=None, value=None):
            super().__init__(msg)

    class Tracker:
        def create_parser(self, mm_processor_kwargs=None):
            class P:
                model_config = types.SimpleNamespace(enable_prompt_embeds=False)

                def mm_placeholder_storage(self):
                    return {}

                def __getattr__(self, name):
                    raise ValueError("media parts are refused by this reference")
            return P()

    ident = lambda x: x  # vLLM's `partial(cast, TypedDict)` parsers return their input
    ns = {"logger": logging.getLogger("vllm"), "VLLMValidationError": VLLMValidationError,
          "cast": tcast, "Iterable": Iterable, "Any": Any, "json": json,
          "ConversationMessage": dict, "ChatCompletionContentPartParam": dict,
          "ChatCompletionContentPartTextParam": dict, "ContentPart": Any,
          "PROMPT_EMBEDS_PLACEHOLDER_TOKEN": "<|prompt_embeds|>",
          "_KNOWN_CONTENT_PART_FIELDS": frozenset({"type", "text", "image_url", "input_audio",
                                                   "refusal", "file", "uuid", "thinking"})}
    for p in ["_TextParser", "_ImageEmbedsParser", "_AudioEmbedsParser", "_VideoEmbedsParser",
              "_PromptEmbedsParser", "_InputAudioParser", "_RefusalParser", "_PILImageParser",
              "_ThinkParser", "_AssistantParser", "_ToolParser", "_ImageParser", "_AudioParser",
              "_VideoParser", "_ResponsesInputImageParser"]:
        ns[p] = ident
    names = {"MM_PARSER_MAP", "PART_TYPES_TO_SKIP_NONE_CONTENT", "TEXT_PART_TYPES",
             "_CLAUDE_CODE_BILLING_HEADER", "_reject_reserved_placeholder_in_text",
             "_collect_extra_fields", "parse_chat_message_content_mm_part",
             "parse_chat_message_content_parts", "parse_chat_message_content_part",
             "_strip_claude_code_billing_header", "parse_chat_message_content",
             "_postprocess_messages", "_RESERVED_PLACEHOLDER_IN_TEXT_ERROR"}
    path = "vllm/renderers/chat_utils/chat_message.py"
    _functions(sources[path], names, path, ns)

    def parse(messages, content_format):
        conversation = []
        for msg in messages:
            conversation.extend(ns["parse_chat_message_content"](
                msg, Tracker(), content_format, interleave_strings=False))
        ns["_postprocess_messages"](conversation)
        return conversation
    return parse


def content_format_detector(sources):
    """vLLM's `_detect_content_format` (the template's syntax tree: a loop over a
    message's content means "openai"), from `vllm/renderers/hf.py`."""
    import logging
    from collections import deque
    names = {"_is_var_access", "_is_attr_access", "_is_var_or_elems_access", "_attr_dotted_name",
             "_iter_nodes_assign_var_or_elems", "_iter_nodes_assign_messages_item",
             "_iter_nodes_assign_content_item", "_try_extract_ast", "_detect_content_format"}
    ns = {"jinja2": jinja2, "deque": deque, "logger": logging.getLogger("vllm")}
    path = "vllm/renderers/hf.py"
    _functions(sources[path], names, path, ns)
    return lambda template: ns["_detect_content_format"](template, default="string")
