"""An OpenAI-compatible endpoint over the rollout engine: an agent written against the OpenAI API, run unchanged
inside a rollout program, is RL-trained on exactly the tokens it sampled.

    async def generate(sample, client):
        session = await client.openai_session()
        agent = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key)
        await my_agent(agent, sample.prompt)          # any number of chat.completions.create calls
        return session.trajectory

Each session has its own URL (`base_url`, ending in /v1) on a server of the generator leader, on the loopback
interface only and keyed (`Authorization: Bearer <api_key>`, a random key per run). `POST .../chat/completions`
renders the first call's messages (and tools) with the chat template; every later call must repeat the
conversation so far, the assistant messages as the endpoint returned them, and add messages that are not the
policy's (tool results, a user turn): only those are rendered, as the tool loop renders them, and appended. The
policy's turns are never tokenized again. An answer's `<tool_call>` blocks come back as OpenAI `tool_calls`.
`POST .../completions` takes the prompt as token ids (or text, tokenized), which must begin with the session's
tokens so far. The run's sampling parameters apply (the behavior log-probs must be those the trainer's
correction assumes): `temperature`, `top_p` and the like are not taken from the request; `max_tokens` caps a
call within the trajectory's budget. A request that does not continue its session is refused (HTTP 400) and
the session's trajectory becomes an environment failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import secrets
import time

from aiohttp import web

from megatron_rl.rollout.agent.chat import ToolTurns
from megatron_rl.rollout.agent.trajectory import Trajectory
from megatron_rl.tools import EnvironmentFailure, parse_tool_calls
from megatron_rl.tools.calls import TOOL_CALL_BLOCK

MODEL_NAME = "policy"


class RequestError(Exception):
    """A request the endpoint refuses: HTTP 400 with the message."""


def _text(content) -> str:
    """A message's content as text: a string, None, or OpenAI content parts."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _comparable(message: dict) -> tuple:
    """What must be equal for a message to be the one the session already has."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {})
        arguments = function.get("arguments", "{}")
        with contextlib.suppress(json.JSONDecodeError):
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        calls.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    return message.get("role"), _text(message.get("content")).strip(), tuple(calls)


def _assistant_message(text: str, turn: int) -> tuple[dict, str]:
    """The OpenAI message of one policy turn and its finish reason: tool calls parsed out of the text."""
    calls = [c for c in parse_tool_calls(text) if c.error is None]
    if not calls:
        return {"role": "assistant", "content": text}, "stop"
    content = TOOL_CALL_BLOCK.sub("", text).strip() or None
    return {"role": "assistant", "content": content,
            "tool_calls": [{"id": f"call_{turn}_{k}", "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                           for k, c in enumerate(calls)]}, "tool_calls"


@dataclasses.dataclass
class OpenAISession:
    """One rollout program's conversation with the endpoint; `trajectory` is what it sampled."""
    base_url: str
    api_key: str
    client: object  # the program's GenerationClient
    turns: ToolTurns
    messages: list[dict] = dataclasses.field(default_factory=list)  # as the endpoint returned them
    error: str | None = None
    _trajectory: Trajectory | None = None
    _lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

    @property
    def trajectory(self) -> Trajectory:
        if self.error is not None:
            raise EnvironmentFailure(f"the OpenAI endpoint refused a request of the agent: {self.error}")
        if self._trajectory is None:
            raise EnvironmentFailure("the agent made no call to the OpenAI endpoint")
        return self._trajectory

    async def chat(self, body: dict) -> dict:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError("'messages' must be a non-empty list of message objects")
        if self._trajectory is None:
            self._trajectory = Trajectory(self.turns.prompt_tokens(messages, body.get("tools")))
        else:
            known = len(self.messages)
            for i, (given, kept) in enumerate(zip(messages, self.messages)):
                if _comparable(given) != _comparable(kept):
                    raise RequestError(f"message {i} ({given.get('role')}) is not the session's message {i}: a "
                                       "call must repeat the conversation so far as the endpoint returned it")
            new = messages[known:]
            if len(messages) < known or not new:
                raise RequestError(f"the conversation has {len(messages)} messages; the session's has {known}: a "
                                   "call must add at least one message to it")
            if any(m.get("role") == "assistant" for m in new):
                raise RequestError("an assistant message the policy did not write cannot be added to the session")
            self._trajectory.add_observation(self.turns.turn_tokens(new))
        generation = await self.client.sample(self._trajectory, **self._limits(body))
        text = self._decode(generation.token_ids)
        message, finish = _assistant_message(text, len(self.messages))
        if generation.finish_reason == "length":
            finish = "length"
        self.messages = [*messages, message]
        self._trajectory.response = text
        return self._answer("chat.completion", {"index": 0, "message": message, "finish_reason": finish,
                                                "logprobs": None}, generation)

    async def complete(self, body: dict) -> dict:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            token_ids = self.client.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            token_ids = list(prompt)
        else:
            raise RequestError("'prompt' must be a string or a list of token ids (one prompt)")
        if self._trajectory is None:
            self._trajectory = Trajectory(token_ids)
        else:
            known = self._trajectory.token_ids
            if token_ids[:len(known)] != known:
                raise RequestError(f"the prompt does not begin with the session's {len(known)} tokens so far (pass "
                                   "token ids: text tokenized again may split differently)")
            if len(token_ids) > len(known):
                self._trajectory.add_observation(token_ids[len(known):])
        generation = await self.client.sample(self._trajectory, **self._limits(body))
        text = self._decode(generation.token_ids)
        self._trajectory.response = text
        return self._answer("text_completion", {"index": 0, "text": text, "finish_reason": generation.finish_reason,
                                                "logprobs": None}, generation)

    def _limits(self, body: dict) -> dict:
        if body.get("n", 1) != 1:
            raise RequestError("'n' must be 1: each sample of a group is a session of its own")
        if body.get("stream"):
            raise RequestError("'stream' is not supported: each call answers whole")
        if body.get("stop"):
            raise RequestError("'stop' strings are not supported: the run's stop tokens end a turn")
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is None:
            return {}
        if not isinstance(limit, int) or limit < 1:
            raise RequestError(f"'max_tokens' must be a positive integer, got {limit!r}")
        return {"max_new_tokens": limit}

    def _decode(self, token_ids: list[int]) -> str:
        return self.client.tokenizer.decode([t for t in token_ids if t not in self.turns.end_of_turn_ids])

    def _answer(self, kind: str, choice: dict, generation) -> dict:
        prompt = len(self._trajectory.token_ids) - len(generation.token_ids)
        return {"id": f"{kind}-{secrets.token_hex(8)}", "object": kind, "created": int(time.time()),
                "model": MODEL_NAME, "choices": [choice],
                "usage": {"prompt_tokens": prompt, "completion_tokens": len(generation.token_ids),
                          "total_tokens": prompt + len(generation.token_ids)}}


class OpenAIEndpoint:
    """The generator leader's endpoint: started on the agent loop by the first session, stopped with the loop."""

    def __init__(self, tokenizer, end_of_turn_ids):
        self.tokenizer, self.end_of_turn_ids = tokenizer, end_of_turn_ids
        self.api_key = secrets.token_urlsafe(24)
        self.sessions: dict[str, OpenAISession] = {}
        self._turns: ToolTurns | None = None
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def open(self, client) -> OpenAISession:
        if self._runner is None:
            self._turns = ToolTurns(self.tokenizer, self.end_of_turn_ids)
            await self._start()
        sid = secrets.token_hex(8)
        session = OpenAISession(f"http://127.0.0.1:{self.port}/sessions/{sid}/v1", self.api_key, client, self._turns)
        self.sessions[sid] = session
        return session

    def close(self, session: OpenAISession) -> None:
        self.sessions = {sid: s for sid, s in self.sessions.items() if s is not session}

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _start(self) -> None:
        app = web.Application(middlewares=[self._authorized])
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._handle)
        app.router.add_post("/sessions/{sid}/v1/completions", self._handle)
        app.router.add_get("/sessions/{sid}/v1/models", self._models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self._runner, self.port = runner, runner.addresses[0][1]

    @web.middleware
    async def _authorized(self, request, handler):
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            return _error(401, "a valid API key is needed (Authorization: Bearer <the session's api_key>)")
        if request.match_info.get("sid") not in self.sessions:
            return _error(404, "no such session (it ended with its rollout program)")
        return await handler(request)

    async def _models(self, request):
        return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model",
                                                              "owned_by": "megatron-rl"}]})

    async def _handle(self, request):
        session = self.sessions[request.match_info["sid"]]
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        async with session._lock:
            try:
                if session.error is not None:
                    raise RequestError(f"the session failed earlier: {session.error}")
                chat = request.path.endswith("/chat/completions")
                return web.json_response(await (session.chat(body) if chat else session.complete(body)))
            except (RequestError, ValueError) as e:  # ValueError: a conversation the template cannot extend
                session.error = session.error or str(e)
                return _error(400, str(e))
            except EnvironmentFailure as e:
                session.error = session.error or str(e)
                return _error(503, str(e))


def _error(status: int, message: str):
    return web.json_response({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                             status=status)
