"""verl's function tool file for the multi-turn test (`multi_turn.function_tool_path`): a tool that
answers every call with the same 20 words, and a tool parser that reads a call in every turn.

verl executes this file in each agent-loop worker (Ray actor) before its tool agent loop asks for
its parser, so the parser's registration runs where the loop looks it up. The parser's stop tokens
(most word ids) end every policy turn within a few tokens, so a conversation has several short
turns, each prompted with the whole history: the prompt, the turns and the tool's answers."""

from __future__ import annotations

from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser
from verl.tools.function_tool import function_tool

ANSWER = " ".join(f"w{10 + i}" for i in range(20))
PARSER = "specrl_every_turn"


@function_tool
def lookup(query: str) -> str:
    """Look a query up.

    Args:
        query: What to look up.
    """
    return ANSWER


@ToolParser.register(PARSER)
class EveryTurnParser(ToolParser):
    """Every turn is a call of `lookup`."""

    @property
    def stop_token_ids(self) -> list[int]:
        return list(range(3, 60))

    async def extract_tool_calls(self, responses_ids, tools=None):  # type: ignore[no-untyped-def]
        return "", [FunctionCall(name="lookup", arguments='{"query": "w3"}')]
