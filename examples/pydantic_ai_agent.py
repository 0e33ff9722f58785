"""A pydantic-ai agent on llama-server, guarded with ``llama_guard.install()`` (no change to the agent's code).

    python examples/pydantic_ai_agent.py                         # starts an emulated llama-server in this process
    python examples/pydantic_ai_agent.py http://127.0.0.1:8080   # your llama-server (or set LLAMA_URL)

pydantic-ai builds its HTTP client itself (httpx2, through the openai SDK). `install()` guards the traffic of every
httpx and httpx2 client in the process to the origins given, and leaves all other traffic exactly as it was. The
same works for LangChain's OpenAI integration, which also goes through the openai SDK.

Needs the examples extra (pydantic-ai and the openai SDK): ``pip install -e '.[examples]'``.
"""

from __future__ import annotations

import asyncio
import sys

from _llama_url import llama_server, missing_extra  # examples/_llama_url.py: your server, or an emulated one

try:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
except ModuleNotFoundError as error:
    missing_extra(error, "examples")

import llama_guard

QUESTIONS = 10


async def ask(agent: Agent[None, str]) -> list[str]:
    """Questions one after another, every other one streamed (as a chat UI would)."""
    answers = []
    for index in range(QUESTIONS):
        if index % 2:
            async with agent.run_stream(f"Question {index}?") as run:
                answers.append(await run.get_output())
        else:
            answers.append((await agent.run(f"Question {index}?")).output)
    return answers


def main() -> int:
    with llama_server() as url:
        installation = llama_guard.install(origins=[url])
        try:
            model = OpenAIChatModel("any", provider=OpenAIProvider(base_url=f"{url}/v1", api_key="none"))
            answers = asyncio.run(ask(Agent(model)))
        finally:
            llama_guard.uninstall()
    stats = installation.stats.snapshot()
    print(f"{len(answers)} answers, e.g. {answers[-1]!r}")
    print(f"through the guard: {stats.requests} requests, {stats.retries} retries, {stats.errors or 'no'} errors")
    return 0 if len(answers) == QUESTIONS and stats.requests == QUESTIONS else 1


if __name__ == "__main__":
    sys.exit(main())
