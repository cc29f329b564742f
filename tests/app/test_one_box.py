"""``hpipe serve --model M`` with no cluster file and no plan: it starts a local daemon, profiles,
plans, answers an OpenAI client with the tokens of single-process generation, and on SIGTERM
stops the daemon it started."""

import signal
import subprocess
import sys

import pytest

from hpipe.app.one_box import LOCAL_PORT
from hpipe.model.generate.local import LocalModel, generate
from runtime.wire.channels import DaemonClient, Security
from tests.app.serve_helpers import await_served, free_port

pytestmark = pytest.mark.slow  # it starts a daemon process (through hpipe serve)


def test_serve_with_only_a_model_answers_an_openai_client(smollm2):
    from openai import OpenAI

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "hpipe", "serve", "--model", "smollm2-135m", "--max-len", "256",
                               "--port", str(port)], stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        await_served(base, server, 600)  # the first run profiles the daemon (cached afterwards)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        answer = OpenAI(base_url=f"{base}/v1", api_key="unused").chat.completions.create(
            model="smollm2-135m", messages=question, max_tokens=12, temperature=0)
        want = generate(LocalModel(smollm2).open, smollm2.tokenizer(), question[0]["content"], context=256,
                        eos_ids=smollm2.eos_token_ids(), chat=True, max_new_tokens=12)
        assert answer.choices[0].message.content == want.text
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        log = server.stderr.read()
        assert "no --plan: planning smollm2-135m" in log and "stopping the daemons this started" in log
        client = DaemonClient(f"127.0.0.1:{LOCAL_PORT}", Security())
        assert not client.health(timeout=1.0)  # the daemon it started is gone
        client.close()
    finally:
        if server.poll() is None:
            server.kill()
