"""lm-evaluation-harness's ``local-completions`` model (the real package, ``lm-eval``) against the emulator, under
``llama_guard.install()``.

With ``num_concurrent=1`` the model sends each request with the module-level ``requests.post`` (a new Session, so a
new connection, per request); with ``num_concurrent>1`` it sends through an aiohttp session. install() covers both:
every request goes through the guard (its counters see each one), and the answers are the server's. The tokenizer is
left out (``tokenizer_backend=None``, ``tokenized_requests=False``): generate_until needs none, and the harness's
Hugging Face tokenizer would need transformers and a download. lm-eval comes with the `dev` extra (an optional package
of the version matrix, tests/conftest.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI

import llama_guard
from llama_guard.testing import LlamaServerEmulator

PROMPTS = 6
#: The emulator's generated text for 4 tokens (`llama_guard.testing.generated_text`).
ANSWER = "The quick brown fox"


@pytest.fixture(autouse=True)
def uninstalled_afterwards() -> Iterator[None]:
    yield
    llama_guard.uninstall()


@pytest.mark.parametrize("num_concurrent", [1, 3])
def test_local_completions_goes_through_the_guard(num_concurrent: int) -> None:
    with LlamaServerEmulator(stream_close="on_reuse", pool_bug=False) as server:
        installation = llama_guard.install(origins=[server.url])
        model = LocalCompletionsAPI(
            base_url=server.url + "/v1/completions",
            model="emulated-model.gguf",
            tokenizer_backend=None,
            tokenized_requests=False,
            max_gen_toks=4,
            num_concurrent=num_concurrent,
            eos_string="</s>",
        )
        requests = [
            Instance(
                request_type="generate_until",
                doc={},
                arguments=(f"Question {index}:", {"until": ["\n\n"], "max_gen_toks": 4}),
                idx=index,
            )
            for index in range(PROMPTS)
        ]
        answers = model.generate_until(requests, disable_tqdm=True)
        assert answers == [ANSWER] * PROMPTS
        stats = installation.stats.snapshot()
        assert stats.requests == PROMPTS
        assert stats.errors == {}
        assert server.stats().completions_finished == PROMPTS
