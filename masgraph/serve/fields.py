"""What each chat-completions field does on a served graph. A graph agent answers with an episode, so `n` is n
episodes; `temperature`, `top_p`, `max_tokens` (or `max_completion_tokens`) set its answering node's sampling
(the exit node's policy); `seed` seeds the episode; `stop` cuts the answer before a stop sequence; `logprobs`
are those of the answer's tokens, from the answering node's last call. A field that asks for what a graph agent
does not do (client-side `tools`, a `response_format` other than text, penalties, audio, ...) is a 400
`unsupported_parameter` naming it, never silently ignored. docs/export-serve.md has the table in words."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from masgraph.serve.agent import Agent
from masgraph.serve.guards import ApiError
from masgraph.serve.openai_api import ChatRequest
from masgraph.trace import LLMCall, Trace

__all__ = ["Plan", "StopCut", "answer_logprobs", "answer_tokenizer", "cut_at", "check_context", "finish_reason", "plan"]


@dataclass(frozen=True)
class Plan:
    """A request's fields as the episodes they ask for."""

    n: int = 1
    """Episodes to run, one per choice."""
    sampling: dict[str, Any] = field(default_factory=dict)
    """Settings replacing the answering node's policy's (temperature, top_p, max_tokens)."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    meta: dict[str, Any] = field(default_factory=dict)
    """Recorded with each episode's trace (user, metadata)."""


_NOTHING: dict[str, tuple[Callable[[Any], bool], str]] = {
    "response_format": (lambda v: v.get("type") == "text",
                        "an agent's answer is the text its graph produces; only {\"type\": \"text\"} is served"),
    "frequency_penalty": (lambda v: v == 0, "the backends sample without penalties; send 0 or leave it out"),
    "presence_penalty": (lambda v: v == 0, "the backends sample without penalties; send 0 or leave it out"),
    "logit_bias": (lambda v: not v, "the backends sample without a logit bias; leave it out"),
    "store": (lambda v: v is False, "this server keeps no stored completions (a run dir keeps traces: serve "
                                    "--store); leave it out"),
    "service_tier": (lambda v: v in ("auto", "default"), "this server has one tier: auto or default"),
    "modalities": (lambda v: v == ["text"], "an agent answers in text only"),
    "audio": (lambda v: False, "an agent answers in text only"),
    "prediction": (lambda v: False, "predicted outputs are not served"),
    "reasoning_effort": (lambda v: False, "an agent's effort is its graph; leave it out"),
    "verbosity": (lambda v: False, "an agent's answer is the text its graph produces; leave it out"),
    "web_search_options": (lambda v: False, "an agent searches with its graph's own tools; leave it out"),
    "top_logprobs": (lambda v: v == 0, "the backends record the sampled token's logprob only, not the "
                                       "alternatives; send logprobs: true without top_logprobs"),
}
"""Fields accepted only when they ask for nothing this server does not do: value -> whether it asks for nothing,
and why anything else is refused."""


def _unsupported(param: str, why: str) -> ApiError:
    return ApiError(400, f"{param}: {why}", param=param, code="unsupported_parameter")


def _refuse_tools(req: ChatRequest) -> None:
    """Client-side tools: a graph agent calls its own tools and never answers with `tool_calls`, so a request
    that offers the client's tools is refused unless it asks for no tool call (`tool_choice: "none"`)."""
    for tools, choice in (("tools", "tool_choice"), ("functions", "function_call")):
        offered, picked = getattr(req, tools), getattr(req, choice)
        if picked is not None and picked != "none" and not (picked == "auto" and not offered):
            raise _unsupported(choice, "a graph agent never answers with a tool call (it calls its graph's own "
                                       "tools); send \"none\" or leave it out")
        if offered and picked != "none":
            raise _unsupported(tools, "a graph agent calls its graph's own tools, not the client's: it would "
                                      f"never return tool_calls; leave {tools} out, or send {choice}: \"none\" "
                                      "for a plain answer")


def plan(req: ChatRequest, agent: Agent) -> Plan:
    """The episodes a request asks for, or a 400 naming the first field this agent cannot honour."""
    for name, (asks_nothing, why) in _NOTHING.items():
        value = getattr(req, name)
        if value is not None and not asks_nothing(value):
            raise _unsupported(name, why)
    _refuse_tools(req)
    if req.stream_options is not None and req.stream_options.include_obfuscation:
        raise _unsupported("stream_options.include_obfuscation", "no obfuscation padding is sent; leave it out")
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options: only with stream: true", param="stream_options")
    if req.masgraph.stream_steps and not req.stream:
        raise ApiError(400, "masgraph.stream_steps: only with stream: true (without a stream, masgraph.trace "
                            "returns the steps with the answer)", param="masgraph.stream_steps")
    n = req.n or 1
    if n > 1 and req.masgraph.conversation is not None:
        raise ApiError(400, "n: n > 1 in a conversation would add this request's facts to its memory n times; "
                            "send n: 1", param="n")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    sampling = {k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p),
                                  ("max_tokens", max_tokens)) if v is not None}
    answering = _answer_policy(agent)
    asked = [n for n in ("temperature", "top_p", "max_tokens", "max_completion_tokens", "logprobs")
             if getattr(req, n) not in (None, False)]
    if answering is None and asked:
        raise _unsupported(asked[0], f"the answering node {agent.graph.spec.exit!r} runs no LLM (no `policy:`), so "
                                     "there is nothing to apply it to; leave it out")
    if req.logprobs and answer_tokenizer(agent) is None:
        raise _unsupported("logprobs", f"the answering node's backend ({agent.graph.spec.exit!r}, policy "
                                       f"{answering!r}) has no tokenizer to name the tokens of its answer")
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if any(not s for s in stop):
        raise ApiError(400, "stop: an empty stop sequence would cut every answer to nothing", param="stop")
    meta = {k: v for k, v in (("user", req.user or req.safety_identifier), ("metadata", req.metadata)) if v}
    return Plan(n=n, sampling=sampling, seed=req.seed, stop=stop, logprobs=bool(req.logprobs), meta=meta)


def _answer_policy(agent: Agent) -> str | None:
    """The policy of the answering node (the exit node), or None when it runs no LLM."""
    return getattr(agent.graph.spec.nodes[agent.graph.spec.exit], "policy", None)


def answer_tokenizer(agent: Agent) -> Any:
    """The tokenizer of the answering node's backend, when it records token ids (else None)."""
    policy = agent.engine.policies.get(_answer_policy(agent) or "")
    backend = getattr(policy, "backend", None)
    return getattr(backend, "tokenizer", None) if getattr(backend, "returns_tokens", False) else None


async def check_context(question: str, agent: Agent, plan: Plan, truncate: bool) -> None:
    """A 400 `context_length_exceeded` when the question alone outgrows a context of a model that answers it,
    less the room its calls leave to answer (`max_tokens`); `truncate` (the `masgraph.truncate` opt-in) lets it
    through, its prompts cut in the middle to fit. Backends that name no context (an API) check it themselves."""
    if truncate:
        return
    counted: dict[int, int] = {}
    exit_policy = _answer_policy(agent)
    for name, policy in agent.engine.policies.items():
        backend = policy.backend
        tokenizer = getattr(backend, "tokenizer", None)
        layout = getattr(backend, "layout", None)  # vllm's context is its token layout's
        context = getattr(backend, "max_context", None) or getattr(layout, "max_context", None)
        if tokenizer is None or not isinstance(context, int):
            continue
        if id(tokenizer) not in counted:  # a long question takes a while to tokenize: off the event loop
            counted[id(tokenizer)] = len(await asyncio.to_thread(tokenizer.encode, question,
                                                                 add_special_tokens=False))
        room = max(policy.spec.sampling.max_tokens, plan.sampling.get("max_tokens", 0) if name == exit_policy else 0)
        if counted[id(tokenizer)] > context - room:
            raise ApiError(400, f"messages: the question is {counted[id(tokenizer)]} tokens, and policy {name!r} "
                                f"({policy.spec.model}) has a context of {context} tokens, {room} of them kept to "
                                "answer in; send a shorter question (or masgraph: {\"truncate\": true} to cut its "
                                "prompts in the middle to fit)", param="messages", code="context_length_exceeded")


def answer_call(trace: Trace, node: str) -> LLMCall | None:
    """The answering node's last LLM call of an episode."""
    for step in reversed(trace.steps):
        if step.node == node and step.llm:
            return step.llm[-1]
    return None


def finish_reason(trace: Trace, node: str, cut: bool) -> str:
    """`length` when the answering node's last call ran out of `max_tokens` (and no stop sequence cut it
    earlier), else `stop`."""
    call = answer_call(trace, node)
    return "length" if not cut and call is not None and call.finish_reason == "length" else "stop"


def cut_at(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """`text` up to the first stop sequence, and whether one was there."""
    ends = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[:min(ends)], True) if ends else (text, False)


class StopCut:
    """An answer's text as it streams, cut before the first stop sequence: `feed` passes on what is sure to come
    before one (holding back an end that may begin one), `cut` says whether one was met."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop, self.seen, self.sent, self.cut = stop, "", "", False

    def feed(self, piece: str) -> str:
        if self.cut:
            return ""
        self.seen += piece
        kept, self.cut = cut_at(self.seen, self.stop)
        if not self.cut:  # hold back an end that is the start of a stop sequence
            hold = max((k for s in self.stop for k in range(1, len(s)) if kept.endswith(s[:k])), default=0)
            kept = kept[:len(kept) - hold]
        new, self.sent = kept[len(self.sent):], kept
        return new


def answer_logprobs(trace: Trace, node: str, answer: str, content: str, tokenizer: Any) -> dict[str, Any]:
    """OpenAI's `logprobs` of a choice: the tokens of the answering node's last call that make up the answer's
    text `content` (the answer, cut at a stop sequence), each with its logprob; all the call's tokens when the
    answer is not a span of its text."""
    call = answer_call(trace, node)
    if call is None:
        return {"content": [], "refusal": None}
    ids, logprobs = call.completion_ids, call.logprobs
    texts, before = [], ""
    for i in range(len(ids)):  # each token's text as the tokens before it leave it (a multi-byte char: at its end)
        now = tokenizer.decode(ids[:i + 1], skip_special_tokens=True)
        texts.append(now[len(before):] if now.startswith(before) else tokenizer.decode([ids[i]]))
        before = now
    start = before.rfind(answer) if answer else -1
    end = start + len(content)
    tokens, at = [], 0
    for text, lp in zip(texts, logprobs):
        if start < 0 or (at < end and at + len(text) > start) or (not text and start <= at < end):
            tokens.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
        at += len(text)
    return {"content": tokens, "refusal": None}
