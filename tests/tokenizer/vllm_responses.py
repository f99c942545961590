"""vLLM's own OpenAI Responses conversion, compiled from its sdist for the fidelity test.

vLLM's server turns a `/v1/responses` body (without `previous_response_id`, and not a
Harmony model) into chat messages before its chat template runs
(`OnlineRenderer.render_responses`): the request model parses `input` (pydantic, into the
`openai` package's item types: which item becomes a typed object and which stays a dict
decides the conversion's branches), `construct_input_messages` and the functions it calls
(`vllm/entrypoints/openai/responses/utils.py`) build the messages, `construct_tool_dicts`
the function tools, and `ResponsesRequest.build_chat_params` the template's switches
(`merge_kwargs`, `map_reasoning_effort` from `vllm/renderers/params.py`). All of that is
compiled here from vLLM's source text; what is written here is only glue: the trimmed
request model keeps the fields the conversion reads, and stubs stand in for imports the
compiled code does not run.
"""

import ast
import json
import logging
import types
from collections.abc import Iterable
from typing import Annotated, Any, Literal, TypeAlias

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_serializer, model_validator

from vllm_messages import _classes, _functions, _strip_annotations

REQUEST_FIELDS = {"input", "instructions", "tools", "tool_choice", "reasoning", "chat_template_kwargs",
                  "previous_response_id", "media_io_kwargs"}
CONVERSION = {"_item_type", "_item_dict", "should_continue_final_message", "construct_input_messages",
              "construct_chat_messages_with_tool_call", "_construct_message_from_response_item",
              "encode_custom_tool_input", "convert_tool_responses_to_completions_format",
              "construct_tool_dicts"}


class VLLMValidationError(ValueError):
    def __init__(self, msg, parameter=None, value=None):
        super().__init__(msg)


class OpenAIBaseModel(BaseModel):
    # vLLM's base model: extra fields allowed.
    model_config = ConfigDict(extra="allow")


def _imports(tree, modules):
    """The module's `from X import ...` statements for X starting with one of `modules`."""
    return [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module
            and any(n.module == m or n.module.startswith(m + ".") for m in modules)]


def load(sources):
    """Returns `chat_request(body) -> (messages, tools, template kwargs, add_generation_prompt,
    continue_final_message)`, as vLLM renders a Responses body."""
    # The tool models the conversion dumps (vLLM's `FunctionDefinition`,
    # `ChatCompletionToolsParam`).
    tns = {"OpenAIBaseModel": OpenAIBaseModel, "Any": Any, "Literal": Literal,
           "model_serializer": model_serializer, "model_validator": model_validator, "Field": Field}
    for path, names in [("vllm/entrypoints/generate/base/protocol.py", {"FunctionDefinition"}),
                        ("vllm/entrypoints/openai/chat_completion/protocol.py", {"ChatCompletionToolsParam"})]:
        mod = ast.Module(body=_classes(sources[path], names), type_ignores=[])
        exec(compile(mod, path, "exec"), tns)

    # `merge_kwargs`, `map_reasoning_effort`.
    pns = {"Any": Any}
    _functions(sources["vllm/renderers/params.py"], {"merge_kwargs", "map_reasoning_effort"},
               "vllm/renderers/params.py", pns)

    # The Responses tool helpers (`get_function_tools` and what it calls).
    path = "vllm/tool_parsers/utils.py"
    tree = ast.parse(sources[path])
    uns = {"Any": Any, "VLLMValidationError": VLLMValidationError,
           "ChatCompletionToolsParam": tns["ChatCompletionToolsParam"], "json": json}
    exec(compile(ast.Module(body=_imports(tree, ["openai"]), type_ignores=[]), path, "exec"), uns)
    _functions(sources[path], {"_NAMESPACE_TOOL_SEPARATOR", "flat_namespace_tool_name", "get_function_tools",
                               "iter_response_function_tool_dicts", "custom_tool_as_function_dict",
                               "CUSTOM_TOOL_INPUT_KEY", "CUSTOM_TOOL_DESCRIPTION_SUFFIX"}, path, uns)

    # The request model: its imports from openai, typing and pydantic; the item union and
    # its validator; the class with only the fields the conversion reads.
    path = "vllm/entrypoints/openai/responses/protocol.py"
    tree = ast.parse(sources[path])
    mod = types.ModuleType("vllm_responses_protocol")
    import sys
    sys.modules[mod.__name__] = mod
    ns = mod.__dict__
    ns.update({"OpenAIBaseModel": OpenAIBaseModel, "VLLMValidationError": VLLMValidationError,
               "merge_kwargs": pns["merge_kwargs"], "map_reasoning_effort": pns["map_reasoning_effort"],
               "ChatParams": lambda **kw: types.SimpleNamespace(**kw),
               "ChatTemplateContentFormatOption": Any, "ModelConfig": Any, "TokenizeParams": Any})
    body = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
            and isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] in ("openai", "typing", "pydantic")]
    for n in tree.body:
        if isinstance(n, (ast.Assign, ast.AnnAssign)):
            t = n.targets[0] if isinstance(n, ast.Assign) else n.target
            if isinstance(t, ast.Name) and t.id in ("ResponseInputOutputItem",):
                body.append(n)
        elif isinstance(n, ast.FunctionDef) and n.name == "_default_input_image_details":
            body.append(n)
        elif isinstance(n, ast.ClassDef) and n.name == "ResponsesRequest":
            n.body = [s for s in n.body
                      if (isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.target.id in REQUEST_FIELDS)
                      or (isinstance(s, ast.FunctionDef) and s.name == "build_chat_params")]
            body.append(n)
    m = ast.Module(body=body, type_ignores=[])
    ast.fix_missing_locations(m)
    exec(compile(m, path, "exec"), ns)
    Request = ns["ResponsesRequest"]
    Request.model_rebuild()

    # The conversion, with `should_continue_final_message` importable as the request's
    # method imports it (`from .utils import ...`).
    path = "vllm/entrypoints/openai/responses/utils.py"
    tree = ast.parse(sources[path])
    quiet = logging.getLogger("vllm.responses")
    quiet.setLevel(logging.ERROR)  # its warning for summary-only reasoning, once per item
    cns = {"logger": quiet, "VLLMValidationError": VLLMValidationError,
           "Iterable": Iterable, "Any": Any, "json": json,
           "FunctionDefinition": tns["FunctionDefinition"],
           "ChatCompletionToolsParam": tns["ChatCompletionToolsParam"],
           "ChatCompletionMessageParam": dict,
           "CUSTOM_TOOL_INPUT_KEY": uns.get("CUSTOM_TOOL_INPUT_KEY"),
           "flat_namespace_tool_name": uns["flat_namespace_tool_name"],
           "iter_response_function_tool_dicts": uns["iter_response_function_tool_dicts"]}
    exec(compile(ast.Module(body=_imports(tree, ["openai"]), type_ignores=[]), path, "exec"), cns)
    _functions(sources[path], CONVERSION, path, cns)
    utils_mod = types.ModuleType("vllm_responses_protocol.utils")
    utils_mod.should_continue_final_message = cns["should_continue_final_message"]
    sys.modules[utils_mod.__name__] = utils_mod
    mod.__path__ = []  # a package, so `from .utils import` resolves
    ns["__package__"] = mod.__name__

    def chat_request(body):
        req = Request.model_validate(body)
        tools = cns["construct_tool_dicts"](req.tools, req.tool_choice)
        messages = cns["construct_input_messages"](request_instructions=req.instructions,
                                                   request_input=req.input)
        # pydantic hands an output's part list on as a one-pass iterator, which vLLM's chat
        # parser reads once; the reference copies messages, so it is read into a list here.
        for m in messages:
            c = m.get("content")
            if c is not None and not isinstance(c, (str, list, dict)) and isinstance(c, Iterable):
                m["content"] = list(c)
        params = req.build_chat_params(None, "auto", None)
        kwargs = dict(params.chat_template_kwargs)
        add = kwargs.pop("add_generation_prompt")
        cont = kwargs.pop("continue_final_message")
        return messages, tools, kwargs, add, cont

    return chat_request
