"""A reward server (--rm-url): each sample is POSTed as JSON, the server answers with its reward.

The request body is {"prompt", "response", "label", "metadata", "finish_reason"} (`RewardSample`'s fields); the
answer is a JSON number, or an object with "reward" whose other keys are kept in `RewardResult.extras` (what a
--custom-rm-path function may return). Up to --rm-max-concurrency requests are in flight at once, on one
connection pool. The statuses are the local rewards': an answer that is not a finite reward is a
"scorer-failure" naming it; a server that does not answer within --reward-timeout is a "timeout", one that is
unreachable or answers 5xx or 429 is tried again --rm-retries times (with a doubling pause) and then a
"scorer-failure"; another 4xx is a "scorer-failure" at once (a wrong URL or a request the server rejects:
retrying cannot help). None of them is a reward: the sample is excluded, and a server that fails on everything
stops the run (--max-consecutive-reward-failures).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time
import urllib.parse

import httpx

from megatron_rl.rewards.custom import as_result
from megatron_rl.rewards.types import RewardResult, RewardSample

FLAG = "--rm-url"
RETRY_PAUSE_S = 0.5  # the pause before the first retry; it doubles with each


def check_url(url: str) -> str:
    """The URL when it is an http(s) URL with a host; otherwise a ValueError naming --rm-url."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{FLAG} {url!r}: expected an http:// or https:// URL with a host "
                         "(for example http://reward-host:8000/score)")
    return url


class RemoteReward:
    """Scores samples by asking the reward server at `url`, concurrently; one result per sample, always."""

    def __init__(self, url: str, timeout_s: float = 5.0, retries: int = 2, max_concurrency: int = 32):
        self.url, self.timeout_s, self.retries = check_url(url), timeout_s, retries
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
        self.client = httpx.Client(timeout=timeout_s, limits=limits)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_concurrency, thread_name_prefix="remote-reward")

    def __call__(self, samples: list[RewardSample], timeout_s: float | None = None) -> list[RewardResult]:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        return list(self.pool.map(lambda s: self.score(s, timeout), samples))

    def score(self, sample: RewardSample, timeout_s: float) -> RewardResult:
        body = dataclasses.asdict(sample)
        try:
            json.dumps(body)
        except (TypeError, ValueError) as e:
            return RewardResult(0.0, "bad-input", None, f"sample is not JSON for {FLAG} ({e})")
        failure = RewardResult(0.0, "scorer-failure")
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(RETRY_PAUSE_S * 2 ** (attempt - 1))
            tries = f"{attempt + 1} tr{'y' if attempt == 0 else 'ies'}"
            try:
                answer = self.client.post(self.url, json=body, timeout=timeout_s)
            except httpx.TimeoutException:
                failure = RewardResult(0.0, "timeout", None, f"{FLAG} {self.url}: no answer within {timeout_s} s "
                                                              f"({tries})")
                continue
            except httpx.HTTPError as e:
                failure = RewardResult(0.0, "scorer-failure", None, f"{FLAG} {self.url}: {type(e).__name__}: {e} "
                                                                     f"({tries})")
                continue
            if answer.status_code == 429 or answer.status_code >= 500:
                failure = RewardResult(0.0, "scorer-failure", None, f"{FLAG} {self.url}: HTTP {answer.status_code} "
                                                                     f"{answer.text[:200]!r} ({tries})")
                continue
            if answer.status_code != 200:
                return RewardResult(0.0, "scorer-failure", None, f"{FLAG} {self.url}: HTTP {answer.status_code} "
                                                                  f"{answer.text[:200]!r}")
            try:
                value = answer.json()
            except ValueError:
                return RewardResult(0.0, "scorer-failure", None, f"{FLAG} {self.url}: the answer is not JSON: "
                                                                  f"{answer.text[:200]!r}")
            return as_result(value, f"{FLAG} {self.url}")
        return failure

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.client.close()
