"""Merged turns and shared prompts (masgraph/learn/packing.py, backends/hf/learner.sequence_logprobs): the plan by
hand, then the packed pass against every row computed alone (values and LoRA gradients, fp32), then a multi-turn graph
whose node's second call extends its first: one Flow-GRPO update packed and unpacked gives the same adapter.

Tolerances: the packed pass attends over the same tokens in a different batch layout (a KV cache, other padding), so
values differ only by fp32 summation order: ~1e-6 here, bounded at 2e-5 (the chunked log-softmax test's bound)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
import torch

from masgraph.backends.hf.learner import sequence_logprobs
from masgraph.learn.packing import merge_hosts, plan_rows, share_middles

VALUE_ATOL = 2e-5
GRAD_RTOL = 1e-4


@dataclass
class TRow:
    prompt_ids: list[int]
    completion_ids: list[int]
    temperature: float = 1.0


def test_a_row_goes_to_the_longest_sequence_it_is_a_prefix_of():
    seqs = [[1, 2, 3], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7], [1, 2, 9], [1, 2, 3]]
    assert merge_hosts(seqs) == [2, 2, 2, 3, 2]
    assert merge_hosts([[4, 5], [4, 5]]) == [0, 0]  # identical: the first hosts both
    assert merge_hosts([[1, 2], [2, 1]]) == [0, 1]


def test_a_cluster_keeps_sharing_while_it_saves_more():
    cluster, shared = share_middles([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9], [7, 8]])
    assert cluster == [0, 0, 0, 1]  # 3 x 2 shared tokens beat 2 x 3; [7, 8] shares nothing
    assert shared == [2, 2, 2, 2]
    cluster, shared = share_middles([[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [1, 9]])
    assert cluster == [0, 0, 1] and shared == [5, 5, 2]  # joining [1, 9] would save 2 x 1 < 1 x 5


def _episode_rows(system: list[int], question: list[int], first: list[int], user: list[int], second: list[int],
                  temperature: float = 1.0) -> list[TRow]:
    """Two calls of one node: the second prompt extends the first prompt + completion (a conversation)."""
    p1 = system + question
    return [TRow(p1, first, temperature), TRow(p1 + first + user, second, temperature)]


def _rows(vocab: int = 64) -> list[TRow]:
    gen = torch.Generator().manual_seed(5)

    def toks(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=gen).tolist()

    system, q1, q2, user = toks(9), toks(4), toks(6), toks(3)
    return [*_episode_rows(system, q1, toks(5), user, toks(4), 0.7),  # two samples of one question
            *_episode_rows(system, q1, toks(3), user, toks(6), 1.0),
            *_episode_rows(system, q2, toks(4), user, toks(2), 1.3),
            TRow(system + q2, toks(7), 1.0)]  # a single call


def test_the_plan_merges_turns_and_shares_each_questions_prompt():
    rows = _rows()
    plan = plan_rows(rows)
    assert [rows[h] for h in plan.hosts] == [rows[1], rows[3], rows[5], rows[6]]
    assert plan.host_of == [0, 0, 1, 1, 2, 2, 3]
    assert plan.prefix == 9  # the system prompt
    assert plan.groups == 2  # each question's prompt computed once for its two hosts
    assert plan.group[0] == plan.group[1] != plan.group[2] == plan.group[3]
    assert plan.start == [12, 12, 14, 14]  # the last prompt token of each host's first row
    stats = plan.stats(rows)
    assert stats["rows"] == 7 and stats["sequences"] == 4
    # computed: 9 (system) + 3 (q1, once for two samples, up to the last prompt token) + 5 (q2) + the tails
    tails = sum(len(rows[h].prompt_ids) + len(rows[h].completion_ids) - s for h, s in zip(plan.hosts, plan.start))
    assert stats["tokens_computed"] == 9 + 3 + 5 + tails < stats["tokens_received"]
    plain = plan_rows(rows, share=False, pack=False)
    assert plain.hosts == list(range(7)) and plain.prefix == 0 and plain.groups == 0
    assert plain.stats(rows)["tokens_computed"] == stats["tokens_received"]


def _tiny_peft(vocab: int = 64):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0)
    model = get_peft_model(AutoModelForCausalLM.from_config(config).eval(),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), adapter_name="pol")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a LoRA that changes the output (a fresh one is zero-effect)
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model


@pytest.mark.parametrize("share", [True, False])
def test_the_packed_pass_equals_every_row_computed_alone(share):
    model = _tiny_peft()
    rows = _rows()
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    upstream = torch.randn(sum(len(r.completion_ids) for r in rows), generator=torch.Generator().manual_seed(3))

    def run(fn):
        model.zero_grad(set_to_none=True)
        out = fn()
        (torch.cat(out) * upstream).sum().backward()
        return [o.detach() for o in out], [p.grad.clone() for p in lora]

    want, want_grads = run(lambda: [sequence_logprobs(model, [r], 0, share_prefix=False)[0] for r in rows])
    got, got_grads = run(lambda: sequence_logprobs(model, rows, 0, share_prefix=share))
    assert [g.shape for g in got] == [(len(r.completion_ids),) for r in rows]
    assert max((g - w).abs().max().item() for g, w in zip(got, want)) <= VALUE_ATOL
    for g, w in zip(got_grads, want_grads, strict=True):
        assert (g - w).abs().max().item() <= GRAD_RTOL * w.abs().max().item()


def _long_tails(vocab: int = 64) -> list[TRow]:
    """Rows whose tails (what follows the shared prompt) differ in length by up to 20x."""
    gen = torch.Generator().manual_seed(7)

    def toks(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=gen).tolist()

    system, q = toks(9), toks(4)
    return [*_rows(vocab), TRow(system + q, toks(40), 0.9), TRow(system + toks(30), toks(25), 1.0),
            TRow(system + q, toks(2), 1.1)]


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("overhead", [0, 6])
def test_tails_in_length_buckets_equal_one_left_padded_pass(share, overhead):
    """The tails run as passes over hosts of similar length (`buckets.plan`): the same log-probs and LoRA gradients
    as one pass left-padded to the longest, with fewer positions run."""
    from masgraph.backends.hf.logprobs import model_head

    model = _tiny_peft()
    rows = _long_tails()
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    upstream = torch.randn(sum(len(r.completion_ids) for r in rows), generator=torch.Generator().manual_seed(3))
    positions: list[int] = []
    hook = model_head(model).backbone.register_forward_pre_hook(
        lambda module, args, kwargs: positions.append(kwargs["input_ids"].numel()), with_kwargs=True)

    def run(pass_overhead):
        positions.clear()
        model.zero_grad(set_to_none=True)
        out = sequence_logprobs(model, rows, 0, share_prefix=share, pass_overhead=pass_overhead)
        (torch.cat(out) * upstream).sum().backward()
        return [o.detach() for o in out], [p.grad.clone() for p in lora], list(positions)

    try:
        want, want_grads, one = run(None)
        got, got_grads, bucketed = run(overhead)
    finally:
        hook.remove()
    assert len(bucketed) > len(one) and sum(bucketed) < sum(one)  # more passes, fewer positions (less padding)
    assert max((g - w).abs().max().item() for g, w in zip(got, want)) <= VALUE_ATOL
    for g, w in zip(got_grads, want_grads, strict=True):
        assert (g - w).abs().max().item() <= GRAD_RTOL * w.abs().max().item()


# ---- a multi-turn graph through the runner and one Flow-GRPO update --------------------------------------------

GRAPH = """\
name: two-turns
policies:
  main: {{model: "{model}", adapter: answer, trainable: true, sampling: {{temperature: 1.0, max_tokens: 3}}}}
nodes:
  answer: {{role: custom, agent: answer-then-check, policy: main}}
entry: answer
exit: answer
"""


def _two_turn_agent():
    from masgraph.agents import register_agent
    from masgraph.node import NodeOutput

    @register_agent("answer-then-check")
    async def answer_then_check(ctx):
        messages = [{"role": "user", "content": ctx.query}]
        first = await ctx.generate(messages)
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Answer: ?"}]
        second = await ctx.generate(messages)
        return NodeOutput(text=second.text, answer=second.text.strip())


@pytest.mark.parametrize("micro_batch", [16, 3])
def test_a_multi_turn_graphs_update_is_the_same_packed_and_unpacked(tiny, micro_batch):
    """One pass, and passes of 3 rows (each adapter's prompt prefix computed by the first and read by the others,
    `hf/prefixes.py`): the same loss and adapter as every row computed alone."""
    from masgraph.backends.hf import HFBackend
    from masgraph.backends.hf.learner import HFLearner
    from masgraph.graph import compile_spec
    from masgraph.learn.learner import LoraConfigSpec, WeightSync
    from masgraph.loader import parse_spec
    from masgraph.runtime.runner import RunConfig, Runner
    from masgraph.tasks import Item, Task
    from masgraph.trainers.flow_grpo import FlowGRPO, FlowGRPOConfig, build_rows

    class Alternating(Task):
        name = "alternating"

        def generate(self, split, n, seed):
            return [Item(f"{split}-{i}", f"{i} + 1 ?", str(i + 1)) for i in range(n)]

        def score(self, item, answer):
            return 0.0

    _two_turn_agent()
    graph = compile_spec(parse_spec(GRAPH.format(model=tiny), "two.yaml"))

    def learner_after_update(pack: bool):
        torch.manual_seed(0)
        learner = HFLearner(str(tiny), dtype="float32")
        learner.add_adapter("answer", LoraConfigSpec())
        learner.pack = pack
        return learner

    learner = learner_after_update(True)
    backend = HFBackend(learner.weights, seed=1)
    WeightSync(learner, [backend])()
    runner = Runner(graph, RunConfig(n=2, split="train", samples=4, concurrency=8), backends={"hf": backend})
    traces = asyncio.run(runner.run_task(Alternating(), store=False)).traces
    seen: dict[str, int] = {}
    for t in traces:  # rewards alternate within each group (a zero-variance group trains nothing)
        seen[t.item_id] = seen.get(t.item_id, -1) + 1
        t.reward = float(seen[t.item_id] % 2)
    rows = build_rows(traces, {"answer": "answer"}, FlowGRPOConfig())
    assert rows, "no row had a learning signal"
    prompts = {tuple(r.prompt_ids) for r in rows}
    extended = [r for r in rows if any(len(p) < len(r.prompt_ids) and tuple(r.prompt_ids[:len(p)]) == p
                                       for p in prompts)]
    assert extended, "the second call's prompt does not extend the first's: nothing to merge"

    results = {}
    for pack in (True, False):
        learner = learner_after_update(pack)
        config = FlowGRPOConfig.model_validate({"lr": 0.05, "batching": {"micro_batch": micro_batch}})
        metrics = FlowGRPO(learner, {"answer": "answer"}, config).update(traces)
        results[pack] = metrics, [p.detach().clone() for p in learner.parameters("answer")]
    (merged, w_merged), (plain, w_plain) = results[True], results[False]
    assert merged["rows/sequences"] < merged["rows/trained"] == plain["rows/sequences"]
    assert merged["rows/tokens_computed"] < plain["rows/tokens_computed"]
    assert merged["loss/total"] == pytest.approx(plain["loss/total"], abs=1e-5)
    moved = max((a - b).abs().max().item() for a, b in zip(w_plain, learner_after_update(True).parameters("answer")))
    assert moved > 1e-3  # the update did move the adapter
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(w_merged, w_plain))


def test_a_shared_prompts_gradient_repeats_bit_for_bit():
    """The samples of two long questions (5 and 11) share their question's KV (picked for each host): the gradient
    is the same on every run. With transformers' `batch_select_indices` (an indexed gather whose backward adds
    repeated rows with atomic adds in no fixed order on a CPU's threads) the LoRA gradients changed in their last
    bits run to run, which Adam turned into adapter differences of ~lr/10 between a resumed and a straight run."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                  max_position_embeddings=256, pad_token_id=0)
    model = get_peft_model(AutoModelForCausalLM.from_config(config).eval(),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), adapter_name="pol")
    gen = torch.Generator().manual_seed(2)
    questions = [torch.randint(1, 64, (80,), generator=gen).tolist() for _ in range(2)]
    rows = [TRow(q, torch.randint(1, 64, (3,), generator=gen).tolist()) for q, n in zip(questions, (5, 11))
            for _ in range(n)]
    assert plan_rows(rows).groups == 2  # each question computed once, its KV picked for each of its samples
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # two threads split the rows 0-7 | 8-15, so both add into question 2's KV gradient
    try:
        grads = set()
        for _ in range(4):
            model.zero_grad(set_to_none=True)
            torch.cat(sequence_logprobs(model, rows, 0)).sum().backward()
            grads.add(b"".join(p.grad.numpy().tobytes() for p in lora))
    finally:
        torch.set_num_threads(threads)
    assert len(grads) == 1
