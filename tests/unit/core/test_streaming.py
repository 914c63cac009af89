"""Streaming the answer (issue 30, finding 4): what of the generator's text streams (a sure prefix of the answer
its parser will read), the answer stream's bookkeeping, and the hf backend handing each decoded token to the
event loop while the batch still decodes. The server side (over a real socket) is in test_server.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from masgraph.agents import formats
from masgraph.agents.formats import parse_answer
from masgraph.agents.registry import register_agent
from masgraph.backends.base import Request
from masgraph.graph import compile_spec
from masgraph.loader import parse_spec
from masgraph.node import NodeContext, NodeOutput
from masgraph.spec import SamplingSpec
from masgraph.streaming import _FIELD, AnswerStream, answer_node, answer_prefix


@register_agent("stream-echo")
async def _echo(ctx: NodeContext) -> NodeOutput:
    return NodeOutput(text=ctx.query, answer=ctx.query)


CASES = ["Answer: 87", "Answer: 87\nQuestion: what next?", "**Answer:** 87", "## Answer = `87`", "Answer:\n87",
         'Answer: "Paris"', "answer: 3 * 4 = 12 ", "Answer: *", "Let me think.\nAnswer: 4.5\n", "The answer is 9.",
         "9", "Answer: 5\n<answer>6</answer>", "Final answer: 12", "Answer: x'"]


def test_the_answer_line_pattern_is_the_parsers():
    assert _FIELD == formats._FIELD


def test_every_prefix_streams_only_what_the_parser_will_answer():
    """Texts with one answer (no second form the parser prefers): whatever streamed after any prefix of the text
    is the beginning of the parsed answer, and the whole text streams all of it but stripped trailing chars."""
    for text in CASES:
        answer, _ = parse_answer(text)
        sent = ""
        for end in range(len(text) + 1):
            got = answer_prefix(text[:end])
            if got is None:  # a preferred form appeared: nothing more streams
                break
            if "<answer>" not in text and "Final answer" not in text:
                assert answer.startswith(got), (text, end, got, answer)
            sent = got if got.startswith(sent) else sent
        if "<answer>" not in text and "Final answer" not in text and formats._field(text, "answer"):
            assert answer.startswith(sent) and answer[len(sent):].strip("`*\"' ") == "", (text, sent, answer)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["Answer", "answer", "ANSWER", ":", "=", " ", "\n", "*", "**", "`", '"', "'", "#",
                                 "8", "7", "x", ".", "is", "the"]), max_size=14))
def test_answer_prefix_never_contradicts_the_parser(words):
    text = "".join(words)
    answer, _ = parse_answer(text)
    if formats._field(text, "answer") is None:  # no answer line: nothing streams before the end
        assert all(answer_prefix(text[:end]) == "" for end in range(len(text) + 1))
        return
    for end in range(len(text) + 1):
        assert answer.startswith(answer_prefix(text[:end])), (text, end)


def test_the_stream_passes_on_what_extends_it_and_stops_at_a_contradiction():
    async def main() -> list[str]:
        stream = AnswerStream("gen")
        for candidate in ["", "8", "8", "87", "8", "871", "9", "8719"]:  # "9": a retry that wrote another answer
            stream.offer(candidate)
        stream.close()
        return [piece async for piece in stream], stream

    pieces, stream = asyncio.run(main())
    assert pieces == ["871"]  # offered with no await between: joined into one piece
    assert stream.frozen and stream.sent == "871"
    assert stream.rest("8712") == "2" and stream.rest("871") == "" and stream.rest("9") is None


def test_only_the_built_in_generator_at_the_exit_streams():
    def exit_role(node: str) -> str | None:
        spec = compile_spec(parse_spec(f"""\
name: g
policies: {{p: {{backend: scripted, model: none}}}}
nodes:
  first: {{role: generator, policy: p}}
  last: {node}
edges: [{{source: first, target: last}}]
entry: first
exit: last
""", "g.yaml")).spec
        return answer_node(spec)

    assert exit_role("{role: generator, policy: p}") == "last"
    assert exit_role("{role: verifier, policy: p}") is None
    assert exit_role("{role: custom, agent: stream-echo}") is None  # a custom agent: its answer arrives whole


@pytest.mark.slow
def test_hf_backend_hands_each_token_to_the_loop_while_the_batch_decodes(tiny, monkeypatch):
    """The real HFBackend on the tiny model: a streamed request's sink sees its text grow token by token, each a
    beginning of the completion's text, while the batch is still decoding; other requests in the batch do not."""
    from masgraph.backends.hf import HFBackend
    from masgraph.backends.hf import backend as hf_module

    backend = HFBackend(str(tiny), dtype="float32", batch_wait_ms=20)
    forwards: list[float] = []

    def slowly(module, args, out):  # a slow step, and no special token (the random model would end at once)
        time.sleep(0.01)
        forwards.append(time.perf_counter())
        out.logits[..., :4] = float("-inf")  # <|endoftext|>, <|im_start|>, <|im_end|>, <unk>
        return out

    backend.model.register_forward_hook(slowly)
    seen: list[tuple[str, int]] = []

    class Recorder:
        def update(self, text: str) -> None:
            seen.append((text, len(forwards)))

    monkeypatch.setattr(hf_module, "sink_for", lambda r: Recorder() if r.key[1:2] == ("streamed",) else None)
    sampling = SamplingSpec(temperature=1.0, max_tokens=24)
    requests = [Request([{"role": "user", "content": "1 + 2 ?"}], sampling=sampling, seed=s, key=(0, node, 1, 0))
                for s, node in [(1, "streamed"), (2, "other")]]

    async def main():
        return await asyncio.gather(*(backend.complete([r]) for r in requests))

    [[streamed], [other]] = asyncio.run(main())
    assert streamed.batch_size == 2  # decoded in one batch with the request that does not stream
    texts = [t for t, _ in seen]
    assert texts and texts[-1] == streamed.text
    assert all(streamed.text.startswith(t) for t in texts)
    assert len(streamed.completion_ids) == 24 and len(texts) == 24  # one update per token (no partial characters here)
    assert seen[0][1] < len(forwards) - 1  # the first text came while later steps were still to decode
    asyncio.run(backend.aclose())


def test_hf_backend_without_a_stream_decodes_as_before(tiny):
    """No stream in the context: no sink, and the result is the same as a streamed one (streaming is a view)."""
    from masgraph.backends.hf import HFBackend
    from masgraph.streaming import CURRENT

    backend = HFBackend(str(tiny), dtype="float32", deterministic=True)
    req = Request([{"role": "user", "content": "3 * 4 ?"}], sampling=SamplingSpec(temperature=1.0, max_tokens=16),
                  seed=7, key=(0, "gen", 1, 0))

    async def ask(stream: AnswerStream | None):
        token = CURRENT.set(stream)
        try:
            [c] = await backend.complete([req])
        finally:
            CURRENT.reset(token)
        return c

    plain = asyncio.run(ask(None))
    streamed = asyncio.run(ask(AnswerStream("gen")))
    assert plain.completion_ids == streamed.completion_ids and plain.text == streamed.text
    assert not backend._streamed  # nothing left registered
    asyncio.run(backend.aclose())


def test_a_deterministic_batch_orders_requests_whatever_their_keys(tiny, run):
    """A judge's request ("judge", digest) batched with the scheduler's (episode, node, turn, k): one deterministic
    order, no comparison of text with numbers (it failed every judged episode of a real benchmark run)."""
    from masgraph.backends.hf import HFBackend, sortable

    backend = HFBackend(str(tiny), dtype="float32", deterministic=True)
    reqs = [Request([{"role": "user", "content": f"{i} + 1 ?"}], sampling=SamplingSpec(max_tokens=2), seed=i, key=k)
            for i, k in enumerate([("judge", "ab12"), (0, "gen", 1, 0), (), (3, "gen", 1, 0)])]
    out = backend._generate_in_order(reqs)
    assert len(out) == 4 and all(c.completion_ids for c in out)
    assert sorted(map(sortable, (r.key for r in reqs))) == [sortable(k) for k in
                                                            [(), (0, "gen", 1, 0), (3, "gen", 1, 0), ("judge", "ab12")]]
