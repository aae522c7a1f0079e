"""API keys for SGLang servers (--sglang-api-key, or env SGLANG_API_KEY), without SGLang: a real HTTP server in this
process checks keys as SGLang 0.5.23's middleware does (sglang/srt/utils/auth.py: `Authorization: Bearer <key>` on
every endpoint but /health, /ready and /metrics, else 401). Every request of the engine's server (generation,
pauses, weight updates, health checks) carries the key; a missing or wrong key stops an attached server at start,
naming its URL and the flag, before any other request; launched servers get the key as --api-key, and megatron-rl
writes it nowhere it logs (the launch line, error messages with the server log's tail, the wandb config, the dry
run). Against a real SGLang server: tests/sglang/test_sglang_engine.py."""

import json
import os
import secrets
import stat
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_rl.config.arguments import parse_args
from megatron_rl.config.setup import build_run_setup
from megatron_rl.data.tokenizer import build_char_tokenizer
from megatron_rl.models.spec import get_model_spec
from megatron_rl.observability.metrics import run_config
from megatron_rl.rollout.sglang.arguments import redact_argv
from megatron_rl.rollout.sglang.engine import start_replica_engine
from megatron_rl.rollout.sglang.server import SGLangServer, SGLangServerError, launch_command, write_model_dir
from megatron_rl.rollout.types import SamplingParams

KEY = "sk-test-" + secrets.token_hex(8)
SPEC = get_model_spec("tiny-llama")
OPEN_PATHS = ("/health", "/ready", "/metrics")  # SGLang's middleware lets these through without a key


class FakeSGLang(ThreadingHTTPServer):
    """The endpoints the engine uses, behind SGLang's key check; `seen` records (path, Authorization header)."""

    def __init__(self, key: str | None, info: dict):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.key, self.info, self.seen = key, info, []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def authorized(self, header: str | None) -> bool:
        if not self.key:
            return True
        scheme, _, token = (header or "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token, self.key)


class _Handler(BaseHTTPRequestHandler):
    def _serve(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        header = self.headers.get("Authorization")
        self.server.seen.append((self.path, header))
        if not self.path.startswith(OPEN_PATHS) and not self.server.authorized(header):
            status, body = 401, {"error": "Unauthorized"}
        elif self.path == "/server_info":
            status, body = 200, self.server.info
        elif self.path == "/generate":  # one token, served by weight version 0
            status, body = 200, {"output_ids": [7], "meta_info": {
                "output_token_logprobs": [[-0.5, 7, None]], "weight_versions": [[0, 0, 1]],
                "finish_reason": {"type": "length"}}}
        else:
            status, body = 200, {"success": True}
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _serve

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server(tmp_path):
    info = {"tp_size": 1, "dp_size": 1, "skip_tokenizer_init": True,
            "model_path": write_model_dir(SPEC, str(tmp_path / "model"))}
    servers = []

    def start(key=KEY, **changes):
        server = FakeSGLang(key, {**info, **changes})
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def _attach_engine(url, api_key):
    return start_replica_engine(SPEC, 1, None, True, None, None, url=url, api_key=api_key, timeout_s=10.0)


def test_every_request_of_the_engine_carries_the_key(fake_server):
    server = fake_server()
    engine = _attach_engine(server.url, KEY)
    try:
        [out] = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=1))
        assert out.token_ids == [7] and out.versions == [0]
        engine.pause("retract")
        engine.begin_weight_update()
        engine._post_weights(["handle-of-rank-0"], 0)  # end_weight_update's HTTP part (the rest needs SGLang)
        engine.continue_generation()
        engine.stall_timeout_s = -1.0
        engine._check_alive()  # the stall check's /health
    finally:
        engine.shutdown()
    paths = [path for path, _ in server.seen]
    for path in ("/health", "/server_info", "/generate", "/pause_generation", "/begin_weight_update",
                 "/update_weights_from_tensor", "/end_weight_update", "/continue_generation"):
        assert path in paths
    assert {header for _, header in server.seen} == {f"Bearer {KEY}"}


@pytest.mark.parametrize("key,pattern", [
    ("wrong-key", r"the API key of --sglang-api-key \(or env SGLANG_API_KEY\) is not its --api-key"),
    (None, r"it requires an API key: give its --api-key with --sglang-api-key or env SGLANG_API_KEY"),
])
def test_an_attached_server_that_refuses_the_key_stops_the_start_naming_url_and_flag(fake_server, key, pattern):
    server = fake_server()
    with pytest.raises(SGLangServerError, match=r"generator replica failed to start its SGLang engine: "
                                                rf"SGLangServerError: SGLang server {server.url} refused /server_info "
                                                rf"\(HTTP 401\): {pattern}$") as error:
        _attach_engine(server.url, key)
    assert KEY not in str(error.value) and "wrong-key" not in str(error.value)
    assert [path for path, _ in server.seen] == ["/health", "/server_info"]  # nothing else was sent
    with pytest.raises(SGLangServerError, match=pattern):  # SGLangServer.attach alone checks it too
        SGLangServer.attach(server.url, 10.0, api_key=key)


def test_a_server_without_a_key_still_serves_a_run_without_one(fake_server):
    server = fake_server(key=None)
    _attach_engine(server.url, None).shutdown()
    assert {header for _, header in server.seen} == {None}


def test_an_attached_server_with_an_admin_key_is_refused(fake_server):
    # With --admin-api-key SGLang takes only that key for weight updates and pauses (ADMIN_OPTIONAL endpoints).
    server = fake_server(admin_api_key="admin-secret")
    with pytest.raises(SGLangServerError, match=r"admin_api_key is set \(SGLang then takes only the admin key for "
                                                r"weight updates and pauses") as error:
        _attach_engine(server.url, KEY)
    assert "admin-secret" not in str(error.value)


# ---- launched servers --------------------------------------------------------------------------------------------

def _flag_values(argv, flag):
    return [argv[i + 1] for i, word in enumerate(argv) if word == flag]


def test_a_launched_server_gets_the_key_as_api_key_on_the_loopback_address_and_not_in_its_environment():
    argv, env = launch_command("/models/m", 1, 30000, environ={"SGLANG_API_KEY": KEY, "PATH": "/usr/bin"},
                               cuda_available=False, api_key=KEY)
    assert _flag_values(argv, "--api-key") == [KEY] and _flag_values(argv, "--host") == ["127.0.0.1"]
    assert "SGLANG_API_KEY" not in env and env["PATH"] == "/usr/bin"
    argv, _ = launch_command("/models/m", 1, 30000, environ={}, cuda_available=False)
    assert "--api-key" not in argv


def test_the_launch_line_and_the_log_tail_in_errors_are_redacted(tmp_path):
    # A stand-in for sglang.launch_server that, like SGLang (its "server_args=..." line), prints its arguments,
    # the key among them, then dies: the run's own launch line and the error carrying the log's tail hide the key.
    argv, env = launch_command("/models/m", 1, 30000, environ=dict(os.environ), cuda_available=False, api_key=KEY)
    command = [sys.executable, "-c", "import sys; print('server_args=', sys.argv[1:], flush=True); sys.exit(3)",
               *argv[3:]]
    log = tmp_path / "server.log"
    server = SGLangServer("http://127.0.0.1:9", str(log), command, env, timeout_s=30.0, api_key=KEY)
    with pytest.raises(SGLangServerError, match=r"exited with code 3 during start-up") as error:
        server.start()
    text = log.read_text()
    start_line = next(line for line in text.splitlines() if line.startswith("===== megatron-rl: starting"))
    assert "--api-key <redacted>" in start_line and KEY not in start_line
    assert KEY in text  # the server's own line: the log is the server's, so it is kept private
    assert stat.S_IMODE(log.stat().st_mode) == 0o600
    assert "server_args=" in str(error.value) and KEY not in str(error.value)


# ---- the run flag ------------------------------------------------------------------------------------------------

SGLANG = ["--model", "tiny-llama", "--rollout-backend", "sglang"]


def test_the_flag_and_the_environment_give_the_key_and_nothing_logged_shows_it(monkeypatch):
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    args = parse_args([*SGLANG, "--sglang-api-key", KEY])
    assert args.sglang_api_key.value == KEY and args.sglang == {}  # a run flag, not passed through
    assert KEY not in repr(vars(args)) and KEY not in json.dumps(run_config(args))
    assert parse_args(SGLANG).sglang_api_key is None
    monkeypatch.setenv("SGLANG_API_KEY", KEY)
    assert parse_args(SGLANG).sglang_api_key.value == KEY
    assert parse_args([*SGLANG, "--sglang-api-key=other"]).sglang_api_key.value == "other"  # the flag wins
    assert parse_args(["--model", "tiny-llama"]).sglang_api_key is None  # the built-in engine ignores the variable


def test_misuse_is_refused_naming_the_flag_without_repeating_the_key(monkeypatch, capsys):
    monkeypatch.delenv("SGLANG_API_KEY", raising=False)
    for argv, message in [(["--sglang-api-key", KEY], "--sglang-api-key need(s) --rollout-backend sglang"),
                          ([*SGLANG, "--sglang-api-key", KEY + " x"], "argument --sglang-api-key: the key must be "
                                                                       "non-empty printable ASCII without spaces")]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        err = capsys.readouterr().err
        assert message in err and KEY not in err
    monkeypatch.setenv("SGLANG_API_KEY", KEY + "\n")
    with pytest.raises(SystemExit):
        parse_args(SGLANG)
    err = capsys.readouterr().err
    assert "env SGLANG_API_KEY (--sglang-api-key): the key must be" in err and KEY not in err


@pytest.mark.parametrize("flag,pattern", [
    ("--sglang-api_key", r"--sglang-api-key \(--sglang-api-key sets it, or env SGLANG_API_KEY"),
    ("--sglang-admin-api-key", r"--sglang-admin-api-key \(the run's client authenticates every request with "
                               r"--sglang-api-key"),
])
def test_server_key_flags_passed_through_are_refused_at_setup(flag, pattern):
    args = parse_args([*SGLANG, flag, KEY])
    with pytest.raises(ValueError, match=pattern) as error:
        build_run_setup(args, 2, tokenizer=build_char_tokenizer())
    assert KEY not in str(error.value)


def test_dry_run_and_logged_command_lines_do_not_show_the_key(capsys):
    from megatron_rl.config.dry_run import main as dry_run

    dry_run(parse_args([*SGLANG, "--sglang-api-key", KEY, "--dry-run", "--world-size", "2"]))
    assert KEY not in capsys.readouterr().out
    assert redact_argv(["--lr", "1", "--sglang-api-key", KEY, f"--sglang-api-key={KEY}"]) == [
        "--lr", "1", "--sglang-api-key", "<redacted>", "--sglang-api-key=<redacted>"]
