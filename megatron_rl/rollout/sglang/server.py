"""One SGLang HTTP server per generator replica: launch it (or attach to a running one), wait until it
answers, check that it serves the model and TP size the run expects, and report its log when it dies.

Launching uses `python -m sglang.launch_server` in this interpreter's environment; `launch_command` builds its
command line and environment from explicit inputs (no process is started there, so it is unit-tested on CPU).
On a machine with CUDA each replica's server gets the GPUs of its generator ranks (`server_gpu_flags`); on a
machine without CUDA it gets SGLang's torch-native CPU flags (docs/sglang.md). Extra server flags
come from `--sglang-<flag>` on the megatron-rl command line, checked at run setup (`rollout/sglang/flags.py`).

With an API key (--sglang-api-key, or env SGLANG_API_KEY) a launched server gets it as SGLang's `--api-key`, and every
request of `SGLangServer` (one HTTP session) carries `Authorization: Bearer <key>`, which SGLang's middleware checks on
every endpoint but /health, /ready and /metrics. The key is replaced by "<redacted>" wherever this module writes a
command line or a server log's lines. Launched servers listen on the loopback address: only their replica's leader,
on the same node, talks to them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping

import requests
import torch

from megatron_rl.models.spec import ModelSpec
from megatron_rl.rollout.sglang.arguments import API_KEY_ENV, REDACTED
from megatron_rl.runtime.lifetime import die_with_parent


class SGLangServerError(RuntimeError):
    """The SGLang server died, never came up, answered with an error, or serves the wrong thing."""


# Server flags for SGLang's torch-native code paths on CPU (no CUDA graphs, no compiled grammar backend).
CPU_FLAGS = {"device": "cpu", "attention_backend": "torch_native", "disable_cuda_graph": True,
             "grammar_backend": "none"}


POOL_SIZE = 256  # HTTP connections kept open to one server (SGLangEngine's request threads)
LAUNCHER_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS"}


def redact(text: str, secret: str | None) -> str:
    """`text` with every occurrence of `secret` replaced by "<redacted>" (unchanged without a secret)."""
    return text.replace(secret, REDACTED) if secret else text


def _flag_list(flags: dict) -> list[str]:
    """Server arguments as command-line words: True is a bare switch, False/None are left out, a list is one
    flag followed by its values (SGLang's nargs="+" flags)."""
    out = []
    for key, value in flags.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        elif value is not False and value is not None:  # by identity: 0 (GPU 0, a zero setting) is a value
            out += [flag, str(value)]
    return out


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    """An integer launcher variable (torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE), None when unset."""
    value = environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def server_gpu_flags(local_rank: int, tp_size: int, cuda_visible_devices: str | None, cuda_available: bool, *,
                     gpu_id_step: int = 1, local_world_size: int | None = None, device_count: int | None = None,
                     replica: int | None = None) -> dict:
    """SGLang's `base_gpu_id` for one replica's server: the node-local rank of the replica's leader.

    Generator ranks of a replica are consecutive global ranks and torchrun numbers them LOCAL_RANK .. LOCAL_RANK
    + tp_size - 1 on their node, one GPU each, so the server takes those GPUs (SGLang's TP rank i runs on GPU
    base_gpu_id + i * gpu_id_step); without this every server of a node would start at GPU 0. SGLang's GPU ids
    index the devices CUDA_VISIBLE_DEVICES leaves visible, so when it is set it must list enough of them; a
    replica whose ranks would straddle two nodes (LOCAL_WORLD_SIZE) cannot have one server. Without CUDA
    (SGLang's CPU path) there are no GPU ids: returns {}. Raises ValueError naming the variables and the replica.
    """
    if not cuda_available:
        return {}
    who = f"generator replica {replica}" if replica is not None else "this generator replica"
    if local_rank < 0:
        raise ValueError(f"{who}: LOCAL_RANK={local_rank} is negative")
    if local_world_size is not None and local_rank + tp_size > local_world_size:
        raise ValueError(f"{who} straddles two nodes: its leader has LOCAL_RANK={local_rank} of "
                         f"LOCAL_WORLD_SIZE={local_world_size}, and its SGLang server needs its {tp_size} GPUs "
                         f"(--rollout-tensor-parallel-size) on one node; make the trainer's ranks and each replica's "
                         f"fill whole nodes")
    needed = local_rank + (tp_size - 1) * gpu_id_step + 1  # GPUs 0 .. the server's last, as SGLang indexes them
    if cuda_visible_devices is not None:
        visible = [d for d in cuda_visible_devices.split(",") if d.strip()]
        if len(visible) < needed:
            raise ValueError(f"{who}: CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} lists {len(visible)} GPU(s), but "
                             f"its SGLang server (leader LOCAL_RANK={local_rank}, --rollout-tensor-parallel-size "
                             f"{tp_size}, gpu_id_step {gpu_id_step}) needs visible GPUs up to index {needed - 1}; "
                             f"list every GPU of the node, or set --sglang-base-gpu-id")
    elif device_count is not None and device_count < needed:
        raise ValueError(f"{who}: this node has {device_count} GPU(s), but its SGLang server (leader "
                         f"LOCAL_RANK={local_rank}, --rollout-tensor-parallel-size {tp_size}, gpu_id_step "
                         f"{gpu_id_step}) needs GPUs up to index {needed - 1}; or set --sglang-base-gpu-id")
    return {"base_gpu_id": local_rank}


def worker_gpu(local_rank: int, tp_rank: int, extra_flags: dict) -> int:
    """The GPU (a CUDA index of this node) of SGLang TP rank `tp_rank` of the server whose leader's generator rank
    is `local_rank - tp_rank` here: base_gpu_id + tp_rank x gpu_id_step, base_gpu_id being the leader's LOCAL_RANK
    (`server_gpu_flags`) unless --sglang-base-gpu-id says otherwise. The generator rank of that TP rank computes on
    this GPU, so that DDMA lands in its memory and the worker opens it through CUDA IPC."""
    base = int(extra_flags.get("base_gpu_id", local_rank - tp_rank))
    return base + tp_rank * int(extra_flags.get("gpu_id_step", 1))


# The KV cache of a server on CPUs unless told: SGLang cannot measure the memory a CPU rank may use, and would size
# its cache from the whole machine's.
CPU_KV_CACHE_TOKENS = 65536


def launch_command(model_path: str, tp_size: int, port: int, *, environ: Mapping[str, str], cuda_available: bool,
                   device_count: int | None = None, cpu_count: int = 1, dtype: str = "float32",
                   extra_flags: dict | None = None, load_format: str = "dummy",
                   host: str = "127.0.0.1", replica: int | None = None, api_key: str | None = None,
                   python: str = sys.executable) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of one replica's `sglang.launch_server`, from explicit inputs: `environ`
    is the launching (leader) process's environment (LOCAL_RANK, LOCAL_WORLD_SIZE, CUDA_VISIBLE_DEVICES are read
    from it), `cuda_available` / `device_count` / `cpu_count` describe the machine. Nothing is started.

    The server's flags are the run's (model, TP size, address, dtype, token ids in, start-up weights and their
    version, on CPUs a KV cache of CPU_KV_CACHE_TOKENS (on GPUs SGLang sizes it from memory), `api_key` as
    `--api-key`), then its placement (GPUs from `server_gpu_flags`, or SGLang's
    CPU flags), then `extra_flags`, which override: `--sglang-base-gpu-id` replaces the computed GPU placement. The
    command holds the key: log it through `redact`."""
    extra_flags = dict(extra_flags or {})
    flags = {"model_path": model_path, "tp_size": tp_size, "host": host, "port": port, "dtype": dtype,
             "load_format": load_format, "skip_tokenizer_init": True,
             "weight_version": "-1" if load_format == "dummy" else "0",
             "max_total_tokens": None if cuda_available else CPU_KV_CACHE_TOKENS,
             "api_key": api_key}
    # The server runs its own torch.distributed world: it must not see this process's launcher settings
    # (torchrun's RANK / WORLD_SIZE / MASTER_PORT would make its TP workers join the training job's).
    # The key reaches it only as --api-key.
    env = {k: v for k, v in environ.items()
           if k not in LAUNCHER_ENV and k != API_KEY_ENV and not k.startswith("TORCHELASTIC_")}
    if cuda_available:
        if "base_gpu_id" not in extra_flags:
            flags.update(server_gpu_flags(_env_int(environ, "LOCAL_RANK") or 0, tp_size,
                                          environ.get("CUDA_VISIBLE_DEVICES"), True,
                                          gpu_id_step=int(extra_flags.get("gpu_id_step", 1)),
                                          local_world_size=_env_int(environ, "LOCAL_WORLD_SIZE"),
                                          device_count=device_count, replica=replica))
    else:
        flags.update(CPU_FLAGS)
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        # One OpenMP core set per TP rank ("0|1" for two ranks); ranks share cores when there are fewer.
        env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(str(r % max(cpu_count, 1)) for r in range(tp_size)))
    flags.update(extra_flags)
    return [python, "-m", "sglang.launch_server", *_flag_list(flags)], env


def write_model_dir(spec: ModelSpec, directory: str, eos_token_id: int | None = None, fp8: bool = False) -> str:
    """An HF model directory with only config.json: the server starts with `--load-format dummy` (random
    weights) and serves nothing until the first weight update gives it the policy. `fp8`: the config of a
    block-FP8 checkpoint (e4m3 weights, one fp32 `weight_scale_inv` per 128 x 128 block), the format SGLang
    can take FP8 weight updates in (DDMA sends exactly that)."""
    os.makedirs(directory, exist_ok=True)
    config = spec.to_hf_config()
    if eos_token_id is not None:
        config["eos_token_id"] = eos_token_id
    if fp8:
        from megatron_rl.models.fp8 import BLOCK

        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [BLOCK, BLOCK]}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return directory


# Mixture-of-experts fields that decide which experts a token goes to (and so the routes replayed), beyond the weights.
ROUTING_FIELDS = ("moe_router_topk", "moe_norm_topk_prob")
# Server arguments that change where SGLang keeps each expert's weights (checked against SGLang 0.5.23): the adapter
# sends EP rank k global experts k E_local .. (k+1) E_local - 1 as local experts 0 .. E_local - 1, [gate; up] rows.
MOE_LAYOUT_ARGS = {"moe_dp_size": (1, "experts split over MoE data-parallel groups"),
                   "ep_num_redundant_experts": (0, "redundant expert copies move experts between ranks"),
                   "enable_eplb": (False, "expert load balancing moves experts between ranks")}
# MoE runner backends whose FusedMoE keeps w13 otherwise: up rows first (flashinfer_cutlass), transposed
# (triton_kernel).
MOE_LAYOUT_BACKENDS = ("flashinfer_cutlass", "triton_kernel")


def served_model_problems(spec: ModelSpec, info: dict) -> list[str]:
    """What keeps a server with these server arguments (/server_info) from serving `spec` as the trainer computes
    it: a sliding window (SGLang 0.5.23's Llama/Mistral, Qwen2/3, Qwen3-MoE and Mixtral models build their attention
    without one, so they would attend to the whole context), and, for experts, server arguments that place them
    other than DDMA sends them."""
    problems = []
    if spec.sliding_window is not None:
        problems.append(f"model sliding_window {spec.sliding_window} (SGLang runs {spec.arch} with full attention: its "
                        "rollouts would not be the trainer's; use --rollout-backend local)")
    if spec.is_moe:
        for key, (want, why) in MOE_LAYOUT_ARGS.items():
            if key in info and info[key] != want:
                problems.append(f"{key} {info[key]} (this run needs {want}: {why})")
        if info.get("moe_runner_backend") in MOE_LAYOUT_BACKENDS:
            problems.append(f"moe_runner_backend {info['moe_runner_backend']} (it lays expert weights out otherwise "
                            "than the [gate; up] rows DDMA sends; use --sglang-moe-runner-backend auto)")
    return problems


class SGLangServer:
    def __init__(self, url: str, log_path: str | None = None, command: list[str] | None = None,
                 env: dict | None = None, timeout_s: float = 600.0, api_key: str | None = None):
        """`command`: how this object launches (and relaunches) the server; None for an attached one. `api_key`:
        sent with every request (the server's --api-key)."""
        self.url = url.rstrip("/")
        self.log_path = log_path
        self.command, self.env, self.timeout_s = command, env, timeout_s
        self.process: subprocess.Popen | None = None
        self._api_key = api_key
        self.http = requests.Session()  # shared by the request threads: one pooled connection each
        self.http.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=POOL_SIZE))
        if api_key:
            self.http.headers["Authorization"] = f"Bearer {api_key}"  # as SGLang's middleware reads it

    # ---- start -------------------------------------------------------------------------------------------------
    @classmethod
    def launch(cls, model_path: str, tp_size: int, port: int, log_path: str, dtype: str = "float32",
               extra_flags: dict | None = None, load_format: str = "dummy",
               host: str = "127.0.0.1", timeout_s: float = 600.0, replica: int | None = None,
               api_key: str | None = None) -> SGLangServer:
        """Start a server from this process (a replica's leader; `launch_command` says with which flags, GPUs
        and environment) and wait until it answers. `load_format="dummy"` starts with random weights, reported
        as weight version -1 until the first update; any other format loads the checkpoint, served as version 0.
        `host`: the address the server listens on, loopback by default (the leader is on the same node); `api_key`:
        the server's --api-key, sent with every request."""
        cuda = torch.cuda.is_available()
        command, env = launch_command(model_path, tp_size, port, environ=os.environ, cuda_available=cuda,
                                      device_count=torch.cuda.device_count() if cuda else None,
                                      cpu_count=os.cpu_count() or 1, dtype=dtype,
                                      extra_flags=extra_flags, load_format=load_format, host=host, replica=replica,
                                      api_key=api_key)
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        server = cls(f"http://{host}:{port}", log_path, command, env, timeout_s, api_key)
        server.start()
        return server

    def start(self) -> None:
        """Start (or, after a failure, restart) the launched server and wait until it answers."""
        if self.command is None:
            raise SGLangServerError(f"SGLang server {self.url} was attached, not launched by this run: it cannot be "
                                    "restarted from here")
        self.shutdown()
        with open(self.log_path, "ab") as log:
            if self._api_key:  # SGLang logs its server arguments, the key among them, at start-up
                os.chmod(self.log_path, 0o600)
            log.write(f"\n===== megatron-rl: starting {redact(' '.join(self.command), self._api_key)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True, preexec_fn=die_with_parent)
        try:
            self.wait_ready(self.timeout_s)
        except BaseException:
            self.shutdown()
            raise

    @classmethod
    def attach(cls, url: str, timeout_s: float = 60.0, api_key: str | None = None) -> SGLangServer:
        """A running server (--rollout-server-urls), once it answers and takes this run's credentials."""
        server = cls(url, timeout_s=timeout_s, api_key=api_key)
        server.wait_ready(timeout_s)
        server.get("/server_info")  # /health is open to anyone: a refused key shows here, named (`_call`)
        return server

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            self.raise_if_dead("during start-up")
            try:
                if self.http.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise SGLangServerError(f"SGLang server {self.url} did not answer /health within {timeout_s:.0f} s"
                                        + self._tail_text())
            time.sleep(1.0)

    def check(self, spec: ModelSpec, tp_size: int, required_flags: dict | None = None) -> dict:
        """Fail at start, with the mismatch named, when the server does not serve `spec` at `tp_size` or was not
        started with `required_flags` (server arguments, e.g. {"disable_radix_cache": True})."""
        info = self.get("/server_info")
        problems = [f"{key} {info.get(key)} (this run needs {' '.join(_flag_list({key: value}))})"
                    for key, value in (required_flags or {}).items() if info.get(key) != value]
        if info.get("tp_size") != tp_size:
            problems.append(f"tp_size {info.get('tp_size')} (the run's --rollout-tensor-parallel-size is {tp_size})")
        if info.get("dp_size", 1) != 1:
            problems.append(f"dp_size {info.get('dp_size')} (weight updates need one engine per replica: dp_size 1)")
        if info.get("admin_api_key"):
            problems.append("admin_api_key is set (SGLang then takes only the admin key for weight updates and "
                            "pauses, but the run sends --sglang-api-key; start it with --api-key alone)")
        if not info.get("skip_tokenizer_init"):
            problems.append("skip_tokenizer_init is off (the adapter sends token ids; start it with "
                            "--skip-tokenizer-init)")
        problems += served_model_problems(spec, info)
        config_path = os.path.join(str(info.get("model_path", "")), "config.json")
        if os.path.isfile(config_path):
            with open(config_path) as f:
                served = ModelSpec.from_hf_config(json.load(f))
            fields = {**spec.weight_fields(), **({f: getattr(spec, f) for f in ROUTING_FIELDS} if spec.is_moe else {})}
            problems += [f"model {field} {getattr(served, field)} (the trainer's is {value})"
                         for field, value in fields.items() if getattr(served, field) != value]
        else:
            problems.append(f"its model_path {info.get('model_path')!r} has no config.json readable here, so the "
                            "model cannot be checked against the trainer's")
        if problems:
            raise SGLangServerError(f"SGLang server {self.url} does not match this run: " + "; ".join(problems))
        return info

    # ---- requests ----------------------------------------------------------------------------------------------
    def get(self, path: str, timeout: float = 30.0) -> dict:
        return self._call("GET", path, None, timeout)

    def post(self, path: str, body: dict | None = None, timeout: float | None = 600.0) -> dict:
        return self._call("POST", path, body, timeout)

    def _call(self, method: str, path: str, body: dict | None, timeout: float | None) -> dict:
        try:
            response = self.http.request(method, self.url + path, json=body, timeout=timeout)
        except requests.RequestException as e:
            if self.process is not None:  # a dropped connection is often the first sign of a dying server
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(5.0)
            self.raise_if_dead(f"during {path}")
            raise SGLangServerError(f"SGLang server {self.url}{path}: {type(e).__name__}: {e}"
                                    + self._tail_text()) from e
        if response.status_code in (401, 403):
            raise SGLangServerError(self._refused(path, response.status_code))
        if response.status_code != 200:
            raise SGLangServerError(f"SGLang server {self.url}{path} answered {response.status_code}: "
                                    f"{response.text[:2000]}")
        return response.json() if response.content else {}

    def _refused(self, path: str, status: int) -> str:
        """The error for a request SGLang's API-key middleware refused (401; 403 for its admin-only endpoints)."""
        why = ("the API key of --sglang-api-key (or env SGLANG_API_KEY) is not its --api-key" if self._api_key else
               "it requires an API key: give its --api-key with --sglang-api-key or env SGLANG_API_KEY")
        return f"SGLang server {self.url} refused {path} (HTTP {status}): {why}"

    # ---- failure reporting and shutdown -----------------------------------------------------------------------------
    def alive(self) -> bool:
        return self.process is None or self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path or not os.path.isfile(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(self.log_path) - 64 * 1024))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])

    def _tail_text(self) -> str:
        tail = self.log_tail()
        return f"\n--- last lines of {self.log_path} ---\n{redact(tail, self._api_key)}" if tail else ""

    def raise_if_dead(self, when: str) -> None:
        """Raise with the exit code and the log's tail if the launched server has exited."""
        if not self.alive():
            raise SGLangServerError(f"SGLang server {self.url} exited with code {self.process.returncode} {when}"
                                    + self._tail_text())

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop a server this object launched: its whole process group (scheduler and TP workers too)."""
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        with contextlib.suppress(ProcessLookupError):  # what is left of the group, a dead leader's children too
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
