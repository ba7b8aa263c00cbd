"""`transformers serve --trust-remote-code` (transformers' own OpenAI-compatible server) on a converted checkpoint.

The server needs transformers' `serving` extra (fastapi, uvicorn, openai): the `dev` extra installs them, so the main
test venv runs this file against the newest transformers release, and `make test-vllm` runs it against vLLM's pinned
one. Without them the test skips.

transformers 5.19 to 5.25 cannot serve a remote-code model: the server picks the model class as
`getattr(transformers, config.architectures[0])`, which ignores `auto_map` and --trust-remote-code, and exits with
"module transformers has no attribute LinearAttentionForCausalLM". The test is a strict xfail until a release
resolves the class through the Auto classes: it then passes, fails as an xfail, and the mark (and the README's
sentence) must go.
"""

import os
import subprocess
import sys

import pytest

SERVING = "transformers serve needs fastapi, uvicorn and openai (pip install transformers[serving])"
pytest.importorskip("fastapi", reason=SERVING)
pytest.importorskip("uvicorn", reason=SERVING)
pytest.importorskip("openai", reason=SERVING)

from helpers import free_port, save_with_tokenizer, teacher, wait_until_healthy  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from hf_linear_attn import convert_to_linear_attention  # noqa: E402

CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
NEW_TOKENS = 8


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="transformers serve resolves the model class in the transformers module, not by auto_map")
def test_chat_completion_equals_generate(tmp_path):
    """A chat completion from a converted checkpoint (the window hybrid), loaded as remote code, with the greedy
    tokens generate() gives for the same chat."""
    import requests

    model = convert_to_linear_attention(teacher("llama"), window_size=8, num_sink_tokens=2, decay="scalar",
                                        feature_map="hedgehog", softmax_layers=[1]).eval()
    save_with_tokenizer(model, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    messages = [{"role": "user", "content": " ".join(f"w{i % 90}" for i in range(0, 120, 7))}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
    expected = tokenizer.decode(model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)[0, prompt.shape[1]:],
                                skip_special_tokens=True)

    port = free_port()
    server = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "transformers"), "serve", str(tmp_path), "--trust-remote-code",
         "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(server, url, "transformers serve", 180)
        body = {"model": str(tmp_path), "messages": messages, "max_tokens": NEW_TOKENS, "temperature": 0,
                "stream": False}
        response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        response.raise_for_status()
        assert response.json()["choices"][0]["message"]["content"] == expected
    finally:
        server.terminate()
        server.wait(timeout=60)
