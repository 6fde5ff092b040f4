"""Tool calls (grpo/envs/tool_calls.py): the parsers on good and malformed calls, unknown tools, argument checks
against the schema, the calculator, and tools given by name."""
from typing import Literal, Optional

import pytest

from grpo.envs.tool_calls import (TOOL_PARSERS, Tool, ToolCall, calculator, call_tools, load_tools, parse_pythonic,
                                  parse_qwen, register_parser)
from grpo.errors import ConfigError


def test_qwen_calls():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 3"}}\n</tool_call>'
            '\n<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>')
    assert parse_qwen(text) == [ToolCall("calculator", {"expression": "2 * 3"}), ToolCall("python", {"code": "print(1)"})]
    assert parse_qwen("no call here") == []


def test_qwen_malformed_calls_are_errors_not_exceptions():
    bad_json, = parse_qwen('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>')
    assert bad_json.error.startswith("error: the tool call is not valid JSON")
    no_name, = parse_qwen('<tool_call>["calculator"]</tool_call>')
    assert "is a JSON object" in no_name.error
    bad_args, = parse_qwen('<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>')
    assert bad_args.name == "calculator" and "must be a JSON object" in bad_args.error
    unclosed, = parse_qwen('<tool_call>{"name": "calculator", "arguments": {"expression": "1"}}')
    assert unclosed == ToolCall("calculator", {"expression": "1"})


def test_pythonic_calls():
    assert parse_pythonic('[calculator(expression="347 * 2918")]') == [ToolCall("calculator", {"expression": "347 * 2918"})]
    assert parse_pythonic('I will call [a(x=1, y=[1, 2]), b(s="]")] now') == [
        ToolCall("a", {"x": 1, "y": [1, 2]}), ToolCall("b", {"s": "]"})]
    assert parse_pythonic("the answer is [1, 2]") == []


def test_pythonic_malformed_calls():
    positional, = parse_pythonic("[calculator(3)]")
    assert "keyword arguments" in positional.error
    not_literal, = parse_pythonic("[calculator(expression=open('x'))]")
    assert "is not a literal" in not_literal.error
    unclosed, = parse_pythonic('[calculator(expression="1"')
    assert "not a list of calls" in unclosed.error


def test_unknown_tool_and_argument_checks():
    tools = load_tools(["calculator"])
    calls = [ToolCall("calculator", {"expression": "2 ** 10"}), ToolCall("search", {"q": "x"}),
             ToolCall("calculator", {}), ToolCall("calculator", {"expression": 3}),
             ToolCall("calculator", {"expression": "1", "extra": 1}), ToolCall("", error="error: unreadable"),
             ToolCall("calculator", {"expression": "1 / 0"}), ToolCall("calculator", {"expression": "__import__('os')"})]
    results = call_tools(tools, calls)
    assert [r.error for r in results] == [False, True, True, True, True, True, True, True]
    assert results[0].content == "1024"
    assert results[1].content == "error: there is no tool 'search'; the tools are calculator"
    assert results[2].content == "error: calculator needs the argument 'expression'"
    assert results[3].content == "error: calculator's argument 'expression' must be of type string, not int"
    assert "has no argument 'extra'" in results[4].content
    assert results[5].content == "error: unreadable"
    assert results[6].content == "error: ZeroDivisionError: division by zero"
    assert "is not arithmetic" in results[7].content


def typed(n: int, x: float, flag: bool, items: list[str]) -> str:
    """Echo.

    Args:
        n: an integer
        x: a number
        flag: a switch
        items: some strings
    """
    return f"{n} {x} {flag} {items}"


def test_json_types_are_checked_from_the_schema():
    tool = Tool(typed)
    assert tool({"n": 1, "x": 2, "flag": True, "items": ["a"]}).content == "1 2 True ['a']"
    assert "must be of type integer, not bool" in tool({"n": True, "x": 2, "flag": True, "items": []}).content
    assert "must be of type integer, not float" in tool({"n": 1.5, "x": 2, "flag": True, "items": []}).content
    assert "must be of type boolean" in tool({"n": 1, "x": 2, "flag": 1, "items": []}).content


def choose(mode: Literal["fast", "exact"], limit: Optional[int] = None) -> str:
    """Pick.

    Args:
        mode: how
        limit: at most this many
    """
    return f"{mode} {limit}"


def no_return_type(x: str):
    """Echo.

    Args:
        x: anything
    """
    return x


def test_optional_and_literal_arguments_and_the_return_type():
    tool = Tool(choose)
    assert tool({"mode": "fast", "limit": None}).content == "fast None"
    assert "must be one of 'fast', 'exact', not 'zzz'" in tool({"mode": "zzz"}).content
    with pytest.raises(ConfigError, match="must be annotated to return str"):
        Tool(no_return_type)


def test_odd_text_never_crashes_a_parser():
    assert "not valid JSON (RecursionError)" in parse_qwen("<tool_call>" + "[" * 5000 + "</tool_call>")[0].error
    for text in ("[f(x=" + "-" * 500 + "1)]", "[f(x=" + "-" * 100_000 + "1)]", "[f(x=" + "(" * 300 + ")]", "[f(\0)]"):
        calls = parse_pythonic(text)
        assert len(calls) == 1 and calls[0].error


def test_calculator():
    assert calculator("347 * 2918") == "1012546"
    assert calculator("(2 + 3) ** 2 - 7 // 2") == "22"
    assert calculator("1 / 3") == "0.333333333333"
    with pytest.raises(ValueError, match="too large"):
        calculator("9 ** 99999")


def undocumented(x):
    return x


def test_tools_by_name():
    assert set(load_tools(["calculator", "python"])) == {"calculator", "python"}
    assert set(load_tools(["test_tools:typed"])) == {"typed"}
    with pytest.raises(ConfigError, match="unknown tool 'nope'"):
        load_tools(["nope"])
    with pytest.raises(ConfigError, match="cannot import tool"):
        load_tools(["no_such_module:f"])
    with pytest.raises(ConfigError, match="cannot be a tool"):
        load_tools(["test_tools:undocumented"])


def test_register_parser():
    @register_parser("test-upper")
    def upper(text):
        return [ToolCall("calculator", {"expression": text.upper()})] if text.startswith("calc ") else []

    try:
        assert TOOL_PARSERS["test-upper"]("calc 1+1") == [ToolCall("calculator", {"expression": "CALC 1+1"})]
    finally:
        del TOOL_PARSERS["test-upper"]
