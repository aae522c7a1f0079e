"""An LLM judge as the reward (--judge-model): a model of its own, served by an SGLang server of its own, reads
each response and gives a verdict.

The controller launches the server (on the GPUs from --judge-base-gpu-id, --judge-tensor-parallel-size of
them; on a machine without CUDA, SGLang's CPU path) with the judge's checkpoint, and restarts it when it dies,
at most --judge-max-restarts times, as generator servers are. Each sample's prompt is --judge-prompt-template
with {prompt}, {response} and {label} filled in, rendered with the judge tokenizer's chat template when it has
one; the judge answers greedily, at most --judge-max-new-tokens tokens. The verdict is the last match of
--judge-verdict-pattern in the answer: its first group, a number (the reward) or a word (yes / correct / true /
pass: 1.0; no / incorrect / false / fail: 0.0). An answer without a verdict, a judge that does not answer within
--reward-timeout, or one that is down after its restarts gives "scorer-failure" / "timeout": the sample is
excluded, never scored 0, and --max-consecutive-reward-failures stops a run whose judge fails on everything.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

import requests
import torch

from megatron_rl.rewards.types import RewardResult, RewardSample
from megatron_rl.rewards.verdicts import (
    DEFAULT_TEMPLATE,
    DEFAULT_VERDICT,
    check_template,
    check_verdict_pattern,
    parse_verdict,
)
from megatron_rl.rollout.sglang.server import SGLangServer, SGLangServerError


class SGLangJudge:
    def __init__(self, model_path: str, log_path: str, tp_size: int = 1, template: str = DEFAULT_TEMPLATE,
                 verdict_pattern: str = DEFAULT_VERDICT, max_new_tokens: int = 64, timeout_s: float = 30.0,
                 max_restarts: int = 3, base_gpu_id: int | None = None, port: int | None = None,
                 server_timeout_s: float = 600.0, max_concurrency: int = 32, dtype: str = "float32"):
        from transformers import AutoTokenizer

        from megatron_rl.runtime.spawn import free_port

        if torch.cuda.is_available() and base_gpu_id is None:
            raise ValueError("--judge-base-gpu-id: the judge needs GPUs of its own on the controller's node (the "
                             "first of its --judge-tensor-parallel-size GPUs, outside the run's ranks)")
        self.template, self.pattern = check_template(template), check_verdict_pattern(verdict_pattern)
        self.max_new_tokens, self.timeout_s, self.max_restarts = max_new_tokens, timeout_s, max_restarts
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.restarts = 0
        self._restart_lock = threading.Lock()
        extra = {} if base_gpu_id is None else {"base_gpu_id": base_gpu_id}
        self.server = SGLangServer.launch(model_path, tp_size, port or free_port(), log_path, dtype=dtype,
                                          extra_flags=extra, load_format="auto", timeout_s=server_timeout_s)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_concurrency, thread_name_prefix="judge")

    def __call__(self, samples: list[RewardSample], timeout_s: float | None = None) -> list[RewardResult]:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        return list(self.pool.map(lambda s: self.judge(s, timeout), samples))

    def prompt_ids(self, sample: RewardSample) -> list[int]:
        text = self.template.format(prompt=sample.prompt, response=sample.response, label=sample.label)
        if getattr(self.tokenizer, "chat_template", None):
            return list(self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                           add_generation_prompt=True, return_dict=False))
        return self.tokenizer.encode(text)

    def judge(self, sample: RewardSample, timeout_s: float) -> RewardResult:
        body = {"input_ids": self.prompt_ids(sample),
                "sampling_params": {"temperature": 0.0, "max_new_tokens": self.max_new_tokens,
                                    "stop_token_ids": [self.tokenizer.eos_token_id]
                                    if self.tokenizer.eos_token_id is not None else []}}
        for attempt in range(2):  # a second try only after a restart of a server that died
            try:
                response = self.server.post("/generate", body, timeout=timeout_s)
                break
            except SGLangServerError as e:
                if isinstance(e.__cause__, requests.Timeout):
                    return RewardResult(0.0, "timeout", None, f"the judge gave no answer within {timeout_s} s")
                if attempt or not self._restart_if_dead():
                    return RewardResult(0.0, "scorer-failure", None, f"the judge failed: {e}"[:500])
        answer = self.tokenizer.decode(response["output_ids"], skip_special_tokens=True)
        reward = parse_verdict(answer, self.pattern)
        if reward is None:
            return RewardResult(0.0, "scorer-failure", answer[-200:],
                                f"no verdict ({self.pattern.pattern}) in the judge's answer {answer[-200:]!r}")
        return RewardResult(reward, "scored", answer[-200:])

    def _restart_if_dead(self) -> bool:
        """Restart a dead server (once for all the threads that saw it die); False when it may not be."""
        with self._restart_lock:
            if self.server.alive():
                return True  # another thread restarted it, or it answered an error while alive: try once more
            if self.restarts >= self.max_restarts:
                return False
            self.restarts += 1
            print(f"[megatron-rl] the judge's SGLang server died; restart {self.restarts} of --judge-max-restarts "
                  f"{self.max_restarts}; the last lines of {self.server.log_path}:\n{self.server.log_tail(10)}",
                  flush=True)
            self.server.start()
            return True

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.server.shutdown()


def build_judge(args) -> SGLangJudge:
    """The run's judge, from its --judge-* flags; its server's log goes to OUTPUT_DIR/judge/server.log."""
    return SGLangJudge(args.judge_model, os.path.join(args.output_dir, "judge", "server.log"),
                       tp_size=args.judge_tensor_parallel_size, template=args.judge_prompt_template,
                       verdict_pattern=args.judge_verdict_pattern, max_new_tokens=args.judge_max_new_tokens,
                       timeout_s=args.reward_timeout, max_restarts=args.judge_max_restarts,
                       base_gpu_id=args.judge_base_gpu_id, server_timeout_s=args.rollout_server_timeout,
                       dtype="bfloat16" if args.bf16 else "float32")
