"""The openai SDK (3.x, built on httpx2) against llama-server, guarded two ways.

    python examples/openai_sdk.py                            # starts an emulated llama-server in this process
    python examples/openai_sdk.py http://127.0.0.1:8080      # your llama-server (or set LLAMA_URL)

1. Pass the SDK a guarded client: ``http_client=httpx2.Client(transport=llama_guard.httpx2.GuardTransport())``.
2. Or guard every client in the process, the SDK's own included, with ``llama_guard.install()``: for code that
   builds its SDK clients where you cannot reach them (frameworks, libraries).

Needs the examples extra (the openai SDK and httpx2): ``pip install -e '.[examples]'``.

The SDK's retries are turned off (``max_retries=0``) so that what recovers a lost request is the guard; in
production you may keep both: the guard retries only what is safe, below the SDK.
"""

from __future__ import annotations

import sys

from _llama_url import llama_server, missing_extra  # examples/_llama_url.py: your server, or an emulated one

try:
    import httpx2
    import openai
except ModuleNotFoundError as error:
    missing_extra(error, "examples")

import llama_guard
import llama_guard.httpx2

REQUESTS = 20


def chat(client: openai.OpenAI, index: int) -> str:
    """One short chat completion (odd ones streamed); its text."""
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": f"Say hello ({index})."}
    ]
    if index % 2:
        stream = client.chat.completions.create(model="any", messages=messages, max_tokens=8, stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    completion = client.chat.completions.create(model="any", messages=messages, max_tokens=8)
    return completion.choices[0].message.content or ""


def main() -> int:
    with llama_server() as url:
        # 1. A guarded http_client.
        transport = llama_guard.httpx2.GuardTransport()
        client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="none", max_retries=0, http_client=httpx2.Client(transport=transport)
        )
        with client:
            texts = [chat(client, index) for index in range(REQUESTS)]
        print(f"guarded http_client: {len(texts)} answers, e.g. {texts[-1]!r}; guard stats: {transport.stats}")

        # 2. install(): the SDK builds its own client, and the guard is in its path anyway.
        installation = llama_guard.install(origins=[url])
        try:
            with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0) as client:
                texts += [chat(client, index) for index in range(REQUESTS)]
        finally:
            llama_guard.uninstall()
        guarded = installation.stats.snapshot().requests
        print(f"install(): {guarded} of {REQUESTS} SDK requests went through the guard; stats: {installation.stats}")
    return 0 if len(texts) == 2 * REQUESTS and guarded == REQUESTS else 1


if __name__ == "__main__":
    sys.exit(main())
