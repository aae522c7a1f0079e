"""A real SGLang server launched with an API key (--sglang-api-key): the run's engine generates and updates weights
with it; a client without it is refused (SGLang's middleware leaves /health open and answers 401 elsewhere), and
attaching without the key, or with another, fails at start naming the URL and the flag. The run's launch line in
the server log hides the key; SGLang's own start-up line shows it, so the log is private (mode 0600). (Without
SGLang: tests/cpu/test_sglang_api_key.py.)"""

import os
import secrets
import stat

import pytest
import requests
from conftest import SPEC

from megatron_rl.models import weight_map
from megatron_rl.models.safetensors_io import HFCheckpoint
from megatron_rl.rollout.local.engine import LocalEngine
from megatron_rl.rollout.sglang.engine import start_replica_engine
from megatron_rl.rollout.sglang.server import SGLangServer, SGLangServerError
from megatron_rl.rollout.types import SamplingParams

KEY = "sk-" + secrets.token_hex(12)
PROMPTS = [[1, 5, 9, 13], [3, 100]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)


def _greedy(path):
    return [o.token_ids for o in LocalEngine.from_hf(path, max_seq_len=2048).generate(PROMPTS, GREEDY)]


def test_a_server_launched_with_the_key_serves_the_run_and_refuses_clients_without_it(model_a, model_b, tmp_path):
    log = tmp_path / "server.log"
    engine = start_replica_engine(SPEC, 1, None, True, model_a, str(log), load_format="auto", api_key=KEY)
    try:
        url = engine.server.url
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == _greedy(model_a)
        engine.pause("retract")  # a weight update: pause, begin, update_weights_from_tensor, end, continue
        engine.begin_weight_update()
        reader = HFCheckpoint(model_b)
        engine.load_weights((name, weight_map.assemble(shard, reader.get_slice))
                            for name, shard in weight_map.sglang_shards(SPEC, 1, 0).items())
        engine.end_weight_update(version=1)
        engine.continue_generation()
        outs = engine.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == _greedy(model_b) and all(o.versions == [1] * 4 for o in outs)

        assert requests.get(url + "/health", timeout=30).status_code == 200  # open, as SGLang documents
        assert requests.get(url + "/server_info", timeout=30).status_code == 401
        assert requests.post(url + "/generate", json={"input_ids": PROMPTS[0]}, timeout=30).status_code == 401
        assert requests.post(url + "/pause_generation", json={"mode": "abort"}, timeout=30).status_code == 401
        wrong = {"Authorization": "Bearer not-the-key"}
        assert requests.post(url + "/update_weights_from_tensor", json={}, headers=wrong, timeout=30).status_code == 401
        for key, why in [(None, "it requires an API key: give its --api-key with --sglang-api-key"),
                         ("not-the-key", r"the API key of --sglang-api-key \(or env SGLANG_API_KEY\) is not its")]:
            with pytest.raises(SGLangServerError,
                               match=rf"SGLang server {url} refused /server_info \(HTTP 401\): {why}"):
                SGLangServer.attach(url, 30.0, api_key=key)
        assert SGLangServer.attach(url, 30.0, api_key=KEY).get("/server_info")["tp_size"] == 1
    finally:
        engine.shutdown()
    text = log.read_text()
    start = [line for line in text.splitlines() if line.startswith("===== megatron-rl: starting")]
    assert len(start) == 1 and "--api-key <redacted>" in start[0] and KEY not in start[0]
    # SGLang 0.5.23 logs its server arguments, the key among them ("server_args={...}"): the log is kept private.
    assert KEY in text and stat.S_IMODE(os.stat(log).st_mode) == 0o600
