"""Tools a model can call in a multi-turn episode (`rollout.environment=tools`, grpo/envs/tools.py), and the
parsers that find its calls in its own chat format.

A tool is a plain typed Python function with a docstring, as in transformers' tool use: its JSON schema (what
the chat template shows the model) comes from `transformers.utils.get_json_schema`, and it returns its result as
a string. Built-ins are named in `TOOLS` (`calculator`, `python`); any importable `module:function` works too.

A parser turns the text of one model turn into the calls it makes: `TOOL_PARSERS` names them (`tools.parser`),
`register_parser` adds one. Built-ins:
- `qwen`: Qwen2.5 / Qwen3 (Hermes) style, one JSON object per `<tool_call>…</tool_call>`:
  `<tool_call>{"name": "calculator", "arguments": {"expression": "2 * 3"}}</tool_call>`;
- `pythonic`: a Python list of calls with keyword arguments, as Llama 3.2 writes them (and the bundled
  `tiny-tools` model): `[calculator(expression="347 * 2918")]`.

Whatever the model writes, a call never crashes the run: a malformed call, an unknown tool, missing, unknown or
wrongly typed arguments, a tool that raises or one that runs past its timeout each give an error message as the
tool's result (`ToolResult.error` is set, and the episode counts it). Only a tool that returns something other
than a string is a programming error of the tool's author, and stops the run with one line.
"""
from __future__ import annotations

import ast
import json
import operator
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from grpo.errors import ConfigError, DataError
from grpo.imports import import_callable


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: a tool name and its arguments, or `error` when the text could not be read as a
    call at all (the error is the tool result the model sees)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""


@dataclass(frozen=True)
class ToolResult:
    name: str
    content: str    # what the model reads
    error: bool     # the call failed (malformed, unknown tool, bad arguments, raised, timed out)


# ---------------------------------------------------------------------------------------------------------
# parsers: the text of one model turn -> its calls

Parser = Callable[[str], list[ToolCall]]
TOOL_PARSERS: dict[str, Parser] = {}


def register_parser(name: str) -> Callable[[Parser], Parser]:
    """Decorator: make `fn(text) -> list[ToolCall]` the parser `tools.parser=<name>` selects."""
    def add(fn: Parser) -> Parser:
        TOOL_PARSERS[name] = fn
        return fn
    return add


_QWEN_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@register_parser("qwen")
def parse_qwen(text: str) -> list[ToolCall]:
    """Calls as Qwen2.5 / Qwen3 chat templates ask for them: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`,
    one JSON object per tag (an unclosed last tag is read to the end of the turn)."""
    calls = []
    for m in _QWEN_CALL.finditer(text):
        body = m.group(1).strip()
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError, MemoryError) as e:
            why = e.msg if isinstance(e, json.JSONDecodeError) else type(e).__name__
            calls.append(ToolCall("", error=f"error: the tool call is not valid JSON ({why}): {body[:200]}"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall("", error='error: a tool call is a JSON object {"name": ..., "arguments": {...}}'))
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except (ValueError, RecursionError, MemoryError):
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(obj["name"], error=f"error: the arguments of {obj['name']} must be a JSON object"))
            continue
        calls.append(ToolCall(obj["name"], args))
    return calls


_PYTHONIC_START = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")


@register_parser("pythonic")
def parse_pythonic(text: str) -> list[ToolCall]:
    """Calls as a Python list of function calls with keyword arguments of literal values, as Llama 3.2 writes
    them: `[calculator(expression="2 * 3"), search(query="x")]`. The first such list in the turn is read."""
    m = _PYTHONIC_START.search(text)
    if m is None:
        return []
    start = m.start()
    for end in (i for i, ch in enumerate(text) if ch == "]" and i > start):
        try:
            node = ast.parse(text[start:end + 1], mode="eval").body
            if isinstance(node, ast.List) and node.elts and all(isinstance(e, ast.Call) for e in node.elts):
                return [_pythonic_call(e) for e in node.elts]
        except (SyntaxError, ValueError, RecursionError, MemoryError):  # deep nesting, a null byte, ...
            continue
    head = text[start:start + 200]
    return [ToolCall("", error=f"error: the tool call is not a list of calls name(arg=value): {head}")]


def _pythonic_call(node: ast.Call) -> ToolCall:
    name = ast.unparse(node.func)
    if node.args:
        return ToolCall(name, error=f"error: call {name} with keyword arguments, name(arg=value)")
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            return ToolCall(name, error=f"error: call {name} with keyword arguments, name(arg=value)")
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return ToolCall(name, error=f"error: the value of {kw.arg} is not a literal: {ast.unparse(kw.value)[:100]}")
    return ToolCall(name, args)


# ---------------------------------------------------------------------------------------------------------
# tools

_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                            "boolean": (bool,), "array": (list, tuple), "object": (dict,),
                                            "null": (type(None),)}


class Tool:
    """A typed Python function the model may call, with its JSON schema and a timeout per call."""

    def __init__(self, fn: Callable[..., str], *, timeout_s: float = 10.0, max_chars: int = 2000):
        from transformers.utils import get_json_schema

        try:
            self.schema = get_json_schema(fn)
        except Exception as e:  # noqa: BLE001 - transformers' DocstringParsingException, TypeHintParsingException
            name = getattr(fn, "__name__", repr(fn))
            raise ConfigError(f"tools: {name} cannot be a tool: {' '.join(str(e).split())[:300]} (a tool is a "
                              "function with type hints and a docstring that describes every argument)") from None
        if self.schema["function"].get("return", {}).get("type") != "string":
            raise ConfigError(f"tools: {self.schema['function']['name']} cannot be a tool: it must be annotated to "
                              "return str (its result is the text the model reads)")
        self.fn = fn
        self.name = self.schema["function"]["name"]
        self.parameters = self.schema["function"].get("parameters", {})
        self.timeout_s = timeout_s
        self.max_chars = max_chars

    def check(self, arguments: dict[str, Any]) -> str:
        """Why these arguments do not fit the schema ('' when they do)."""
        props = self.parameters.get("properties", {})
        unknown = [k for k in arguments if k not in props]
        if unknown:
            return f"error: {self.name} has no argument {unknown[0]!r}; its arguments are {', '.join(props) or 'none'}"
        missing = [k for k in self.parameters.get("required", []) if k not in arguments]
        if missing:
            return f"error: {self.name} needs the argument {missing[0]!r}"
        for k, v in arguments.items():
            if not _fits(v, props[k]):
                if "enum" in props[k]:
                    allowed = ", ".join(map(repr, props[k]["enum"]))
                    return f"error: {self.name}'s argument {k!r} must be one of {allowed}, not {v!r}"[:300]
                want = props[k].get("type", "any")
                return f"error: {self.name}'s argument {k!r} must be of type {want}, not {type(v).__name__}"
        return ""

    def __call__(self, arguments: dict[str, Any]) -> ToolResult:
        bad = self.check(arguments)
        if bad:
            return ToolResult(self.name, bad, True)
        box: list = []

        def run() -> None:
            try:
                box.append((True, self.fn(**arguments)))
            except BaseException as e:  # noqa: BLE001 - the model's call failed; it reads why
                box.append((False, e))

        worker = threading.Thread(target=run, name=f"grpo-tool-{self.name}", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if not box:  # still running: left behind as a daemon thread, and the model is told
            return ToolResult(self.name, f"error: {self.name} did not finish within {self.timeout_s:g} s", True)
        ok, value = box[0]
        if not ok:
            return ToolResult(self.name, f"error: {type(value).__name__}: {value}"[:self.max_chars], True)
        if not isinstance(value, str):
            raise DataError(f"tool {self.name!r} returned {type(value).__name__}, not a string; a tool returns its "
                            "result as text")
        return ToolResult(self.name, _truncate(value, self.max_chars), False)


def _fits(value: Any, prop: dict) -> bool:
    if value is None and prop.get("nullable"):
        return True  # Optional[...]
    if "enum" in prop and value not in prop["enum"]:
        return False  # Literal[...]
    kinds = prop.get("type")
    if kinds is None:
        return True
    kinds = [kinds] if isinstance(kinds, str) else list(kinds)
    for kind in kinds:
        types = _JSON_TYPES.get(kind, (object,))
        if isinstance(value, bool) and kind in ("integer", "number"):
            continue  # JSON true is not a number
        if isinstance(value, types):
            return True
    return False


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + " …[truncated]"


def call_tools(tools: dict[str, Tool], calls: Sequence[ToolCall]) -> list[ToolResult]:
    """Run each call (in order) and return its result; never raises for anything the model wrote."""
    out = []
    for call in calls:
        if call.error:
            out.append(ToolResult(call.name or "tool", call.error, True))
        elif call.name not in tools:
            out.append(ToolResult(call.name, f"error: there is no tool {call.name!r}; the tools are "
                                             f"{', '.join(tools)}", True))
        else:
            out.append(tools[call.name](call.arguments))
    return out


# ---------------------------------------------------------------------------------------------------------
# built-in tools

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return its value.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, for example "347 * 2918" or "(2 + 3) ** 2".
    """
    def value(node: ast.AST):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
                raise ValueError("the power is too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"{ast.unparse(node)!r} is not arithmetic")

    if len(expression) > 200:
        raise ValueError("the expression is longer than 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"{expression!r} is not an arithmetic expression") from None
    result = value(tree.body)
    if isinstance(result, float):
        return f"{result:.12g}"
    return str(result)


def python_tool(limits=None) -> Callable[[str], str]:
    """The `python` tool: each call runs its program in `grpo.sandbox` under `limits` (`grpo.sandbox.Limits`;
    None: the defaults)."""
    from grpo.sandbox import Limits, ensure_available, python_tool_result, run_python

    limits = limits or Limits()
    ensure_available()  # a machine the sandbox refuses stops the run here, not in every call the model makes

    def python(code: str) -> str:
        """Run a Python program in a sandbox and return what it prints (standard output, then errors).

        Args:
            code: The program; print the values you want to see.
        """
        return python_tool_result(run_python(code, limits=limits))

    return python


# name -> the tool's function, or for `python` a factory taking the sandbox limits
TOOLS: dict[str, Callable] = {"calculator": calculator, "python": python_tool}


def load_tools(names: Sequence[str | Callable[..., str]], *, timeout_s: float = 10.0, max_chars: int = 2000,
               sandbox_limits=None, field: str = "tools.names") -> dict[str, Tool]:
    """The configured tools: built-ins by name (`TOOLS`), importable 'module:function's, or Python functions
    themselves (`grpo.train(tools=[fn])`). `sandbox_limits` (`grpo.sandbox.Limits`) bound the `python` tool's
    executions; `field` is what errors name (`tools.names`, or `tools` for the Python API)."""
    out: dict[str, Tool] = {}
    for name in names:
        if callable(name):
            fn = name
        elif not isinstance(name, str):
            raise ConfigError(f"{field}: {name!r} is not a tool: give a built-in name ({', '.join(TOOLS)}), an "
                              "importable 'module:function' or a Python function")
        elif name in TOOLS:
            fn = python_tool(sandbox_limits) if name == "python" else TOOLS[name]
        elif ":" in name:
            fn = import_callable(name, field=field, what="tool")
        else:
            raise ConfigError(f"{field}: unknown tool {name!r}; built-in tools are {', '.join(TOOLS)}, or give "
                              "an importable 'module:function'")
        tool = Tool(fn, timeout_s=timeout_s, max_chars=max_chars)
        if tool.name in out:
            raise ConfigError(f"{field}: two tools are named {tool.name!r}")
        out[tool.name] = tool
    return out
