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
call within the trajectory's budget. At the budget the endpoint stops as the tool loop does (`client.observe`):
what does not fit is left out and the call answers finish_reason "length"; the trajectory is kept, truncated.
The tool calls of chat answers are counted in the trajectory.

Every request is checked field by field first (`openai_requests`). A malformed one, or one that does not continue
its session, is refused with HTTP 400 naming the field (413: a body too large), never a 500, and fails the
session: its `trajectory` raises `InvalidInput` and the sample is excluded. 503: the environment (the engine)
failed. aiohttp is imported only when the endpoint starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import secrets
import time

from megatron_rl.rollout.agent import boundary, openai_requests
from megatron_rl.rollout.agent.boundary import InvalidInput
from megatron_rl.rollout.agent.chat import ToolTurns
from megatron_rl.rollout.agent.openai_requests import ChatRequest, CompletionRequest, Message, ToolCallMessage
from megatron_rl.rollout.agent.trajectory import Trajectory
from megatron_rl.tools import EnvironmentFailure, parse_tool_calls
from megatron_rl.tools.calls import TOOL_CALL_BLOCK

MODEL_NAME = "policy"
MAX_BODY_BYTES = 64 * 2**20  # a long conversation's text, or its token ids, with room to spare


@dataclasses.dataclass
class OpenAISession:
    """One rollout program's conversation with the endpoint; `trajectory` is what it sampled."""
    base_url: str
    api_key: str
    client: object  # the program's GenerationClient
    turns: ToolTurns
    messages: tuple[Message, ...] = ()  # the conversation as the endpoint returned it
    error: Exception | None = None  # why a request was refused (InvalidInput: 400; EnvironmentFailure: 503)
    _trajectory: Trajectory | None = None
    _lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

    @property
    def trajectory(self) -> Trajectory:
        if isinstance(self.error, EnvironmentFailure):
            raise EnvironmentFailure(f"the OpenAI endpoint could not answer the agent: {self.error}")
        if self.error is not None:
            raise InvalidInput(f"the OpenAI endpoint refused a request of the agent: {self.error}")
        if self._trajectory is None:
            raise InvalidInput("the agent made no call to the OpenAI endpoint")
        return self._trajectory

    async def chat(self, request: ChatRequest) -> dict:
        trajectory = self._trajectory
        if trajectory is None:
            trajectory = self._start(_rendered(self.turns.prompt_tokens, [m.for_template() for m in request.messages],
                                               request.tools))
            room = True
        else:
            known = len(self.messages)
            for i, (given, kept) in enumerate(zip(request.messages, self.messages)):
                if given.comparable() != kept.comparable():
                    raise InvalidInput(f"message {i} ({given.role}) is not the session's message {i}: a call must "
                                       "repeat the conversation so far as the endpoint returned it")
            new = request.messages[known:]
            if len(request.messages) < known or not new:
                raise InvalidInput(f"the conversation has {len(request.messages)} messages; the session's has "
                                   f"{known}: a call must add at least one message to it")
            if any(m.role == "assistant" for m in new):
                raise InvalidInput("an assistant message the policy did not write cannot be added to the session")
            room = self.client.observe(trajectory, _rendered(self.turns.turn_tokens, [m.for_template() for m in new]))
        generation = await self.client.sample(trajectory, **_max_tokens(request.max_tokens))
        text = self._decode(generation.token_ids)
        calls = parse_tool_calls(text)
        trajectory.tool_calls += len(calls)
        trajectory.tool_errors += sum(c.error is not None for c in calls)  # malformed: not given to the agent
        message = _assistant_message(text, [c for c in calls if c.error is None], len(self.messages))
        finish = "length" if generation.finish_reason == "length" else "tool_calls" if message.tool_calls else "stop"
        self.messages = (*request.messages, message)
        if room:  # (a turn that did not fit leaves the last answer the one the reward scores)
            trajectory.response = text
        return self._answer("chat.completion", {"index": 0, "message": _openai_message(message),
                                                "finish_reason": finish, "logprobs": None}, generation)

    async def complete(self, request: CompletionRequest) -> dict:
        prompt = request.prompt
        if isinstance(prompt, str):
            prompt = boundary.token_ids(self.client.tokenizer.encode(prompt, add_special_tokens=False), "prompt",
                                        self.client.limits.vocab_size)
        trajectory, room = self._trajectory, True
        if trajectory is None:
            trajectory = self._start(prompt)
        else:
            known = trajectory.token_ids
            if prompt[:len(known)] != known:
                raise InvalidInput(f"the prompt does not begin with the session's {len(known)} tokens so far (pass "
                                   "token ids: text tokenized again may split differently)")
            if len(prompt) > len(known):
                room = self.client.observe(trajectory, prompt[len(known):])
        generation = await self.client.sample(trajectory, **_max_tokens(request.max_tokens))
        text = self._decode(generation.token_ids)
        if room:
            trajectory.response = text
        return self._answer("text_completion", {"index": 0, "text": text, "finish_reason": generation.finish_reason,
                                                "logprobs": None}, generation)

    def _start(self, prompt: list[int]) -> Trajectory:
        """The session's trajectory, from its first call's prompt, which must leave room for an answer."""
        limit = self.client.limits.max_context
        if len(prompt) >= limit:
            raise InvalidInput(f"the prompt has {len(prompt)} tokens: no room for an answer within --seq-length "
                               f"{limit}")
        self._trajectory = Trajectory(prompt)
        return self._trajectory

    def _decode(self, token_ids: list[int]) -> str:
        return self.client.tokenizer.decode([t for t in token_ids if t not in self.turns.end_of_turn_ids])

    def _answer(self, kind: str, choice: dict, generation) -> dict:
        prompt = len(self._trajectory.token_ids) - len(generation.token_ids)
        return {"id": f"{kind}-{secrets.token_hex(8)}", "object": kind, "created": int(time.time()),
                "model": MODEL_NAME, "choices": [choice],
                "usage": {"prompt_tokens": prompt, "completion_tokens": len(generation.token_ids),
                          "total_tokens": prompt + len(generation.token_ids)}}


def _rendered(render, messages: list[dict], *args) -> list[int]:
    """`render(messages, ...)`: the chat template's tokens; a template that cannot render them refuses the request
    (it may raise anything: a `raise_exception` of the template, a type error on an odd field)."""
    try:
        return render(messages, *args)
    except Exception as e:  # noqa: BLE001 - the request's content, not the endpoint, made the template fail
        raise InvalidInput(f"the chat template cannot render the messages: {type(e).__name__}: {e}") from None


def _max_tokens(limit: int | None) -> dict:
    return {} if limit is None else {"max_new_tokens": limit}


def _assistant_message(text: str, calls: list, turn: int) -> Message:
    """One policy turn as an OpenAI assistant message: its well-formed tool calls parsed out of the text."""
    if not calls:
        return Message("assistant", text)
    return Message("assistant", TOOL_CALL_BLOCK.sub("", text).strip() or None,
                   tuple(ToolCallMessage(f"call_{turn}_{k}", c.name, c.arguments) for k, c in enumerate(calls)))


def _openai_message(message: Message) -> dict:
    """An answer's message as OpenAI returns it (a tool call's arguments as a JSON string)."""
    out: dict = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                             for c in message.tool_calls]
    return out


class OpenAIEndpoint:
    """The generator leader's endpoint: started on the agent loop by the first session, stopped with the loop."""

    def __init__(self, tokenizer, end_of_turn_ids):
        self.tokenizer, self.end_of_turn_ids = tokenizer, end_of_turn_ids
        self.api_key = secrets.token_urlsafe(24)
        self.sessions: dict[str, OpenAISession] = {}
        self._turns: ToolTurns | None = None
        self._runner = None  # aiohttp's AppRunner
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
        from aiohttp import web  # only runs with an endpoint need aiohttp

        @web.middleware
        async def authorized(request, handler):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode("utf-8", "replace"), f"Bearer {self.api_key}".encode()):
                return _error(401, "a valid API key is needed (Authorization: Bearer <the session's api_key>)")
            if request.match_info.get("sid") not in self.sessions:
                return _error(404, "no such session (it ended with its rollout program)")
            return await handler(request)

        app = web.Application(middlewares=[authorized], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._handle)
        app.router.add_post("/sessions/{sid}/v1/completions", self._handle)
        app.router.add_get("/sessions/{sid}/v1/models", self._models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self._runner, self.port = runner, runner.addresses[0][1]

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [{"id": MODEL_NAME, "object": "model",
                                                              "owned_by": "megatron-rl"}]})

    async def _handle(self, request):
        """Every request the session cannot take is refused with 400 and fails the session (its trajectory is
        then excluded); 503: the environment (the engine) failed."""
        from aiohttp import web

        session = self.sessions[request.match_info["sid"]]
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            session.error = session.error or InvalidInput(f"the request body is larger than {MAX_BODY_BYTES} bytes")
            return _error(413, str(session.error))
        async with session._lock:
            try:
                if session.error is not None:
                    raise InvalidInput(f"the session failed earlier: {session.error}")
                body = openai_requests.body(raw)
                if request.path.endswith("/chat/completions"):
                    answer = await session.chat(openai_requests.chat(body))
                else:
                    answer = await session.complete(openai_requests.completion(body, session.client.limits.vocab_size))
                return web.json_response(answer)
            except InvalidInput as e:
                session.error = session.error or e
                return _error(400, str(e))
            except EnvironmentFailure as e:
                session.error = session.error or e
                return _error(503, str(e))


def _error(status: int, message: str):
    from aiohttp import web

    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)
