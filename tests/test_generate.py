"""Generation: greedy equals a no-cache argmax loop, batching equals running alone (greedy logits and
seeded draws), stops, and each sampling parameter against its definition (vLLM's order and formulas)."""

import math

import pytest
import torch

from textcore.config import END_OF_MSG, tiny
from textcore.generate import (
    MAX_TOP_LOGPROBS,
    Sampler,
    SamplingError,
    SamplingParams,
    TokenSpace,
    decode_step,
    generate,
    sample_batch,
)
from textcore.model import KimiLinearForCausalLM, TrunkCache

pytestmark = pytest.mark.usefixtures("torch_one_thread")
VOCAB = tiny().vocab_size
SPACE = TokenSpace(VOCAB)


@pytest.fixture(scope="module")
def model():
    return KimiLinearForCausalLM.random(tiny(), seed=11)


PROMPTS = [[163584, 1000, 2000, 3000, 4000, 5000], [163584, 42, 163605]]
# Prompts of four different lengths for the batched-vs-alone checks.
MANY = [[163584, 7, 8, 9, 10, 11, 12, 13, 14], [163584, 42, 163605], [5, 6], [163584, *range(300, 330)]]


def _greedy_without_cache(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_batch_equals_recomputing_every_prefix_alone(model):
    streamed = []
    out = generate(model, PROMPTS, params=SamplingParams(max_new_tokens=5, ignore_eos=True),
                   on_token=lambda i, t: streamed.append((i, t)))
    for i, prompt in enumerate(PROMPTS):
        assert out[i].tokens == _greedy_without_cache(model, prompt, 5)
        assert out[i].finish_reason == "length"
        assert [t for j, t in streamed if j == i] == out[i].tokens


def _decode(model, prompts, steps, samplers):
    """Prefill each prompt alone, then `steps` batched decode steps; tokens and logits per row."""
    pool = model.new_pool()
    caches = [model.new_sequence(pool) for _ in prompts]
    logits = torch.cat([model(torch.tensor([p]), cache=TrunkCache([c]), last_only=True)
                        for p, c in zip(prompts, caches, strict=True)])
    tokens, seen = [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(steps):
        for row, sample in enumerate(sample_batch(logits, samplers)):
            tokens[row].append(sample.token_id)
            seen[row].append(logits[row])
            samplers[row].take(sample.token_id)
        logits = decode_step(model, caches, [t[-1] for t in tokens], SPACE)
    return tokens, seen


def test_batched_decoding_equals_each_sequence_alone(model):
    """Sequences of four lengths decoding together: greedy ones get the same tokens and logits
    (within 1e-4 relative) as each alone, seeded ones the same draws, in one batch of mixed samplers."""
    greedy = SamplingParams(max_new_tokens=6, ignore_eos=True)
    seeded = SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.9, top_k=50, ignore_eos=True)

    def samplers():
        return [Sampler(greedy, SPACE), Sampler(seeded, SPACE, seed=3), Sampler(greedy, SPACE),
                Sampler(seeded, SPACE, seed=4)]

    batched_tokens, batched_logits = _decode(model, MANY, 6, samplers())
    for row, prompt in enumerate(MANY):
        alone_tokens, alone_logits = _decode(model, [prompt], 6, [samplers()[row]])
        assert batched_tokens[row] == alone_tokens[0], row
        for a, b in zip(batched_logits[row], alone_logits[0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))


def test_seeded_generation_is_the_same_batched_and_alone(model):
    p = SamplingParams(max_new_tokens=5, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    together = generate(model, MANY, params=p)
    assert [g.tokens for g in together] == [generate(model, [prompt], params=p)[0].tokens for prompt in MANY]
    assert [g.tokens for g in together] == [g.tokens for g in generate(model, MANY, params=p)]  # reproducible


def test_inputs_embeds_equal_input_ids(model):
    embeds = [model.embed_tokens(torch.tensor(p)) for p in PROMPTS]
    by_ids = generate(model, PROMPTS, params=SamplingParams(max_new_tokens=3))
    by_embeds = generate(model, inputs_embeds=embeds, params=SamplingParams(max_new_tokens=3))
    assert [g.tokens for g in by_ids] == [g.tokens for g in by_embeds]


def _first_tokens(model, n=3):
    return generate(model, PROMPTS[:1], params=SamplingParams(max_new_tokens=n, ignore_eos=True))[0].tokens


def test_stop_token_ids_and_end_of_msg(model):
    first = _first_tokens(model)
    # make the second generated token a stop token: generation ends there, without it
    out = generate(model, PROMPTS[:1], params=SamplingParams(max_new_tokens=10, stop_token_ids=(first[1],)))[0]
    assert out.tokens == first[:1] and out.finish_reason == "stop"
    assert SamplingParams().stop_token_ids == () and END_OF_MSG == 163586
    bias_to_end = {END_OF_MSG: 100.0}  # <|end_of_msg|> is always a stop token ...
    assert generate(model, PROMPTS[:1], params=SamplingParams(logit_bias=bias_to_end))[0].tokens == []
    # ... unless ignore_eos: then it is an ordinary token and the reply runs to its length
    ignored = generate(model, PROMPTS[:1], params=SamplingParams(max_new_tokens=3, logit_bias=bias_to_end,
                                                                 ignore_eos=True))[0]
    assert ignored.tokens == [END_OF_MSG] * 3 and ignored.finish_reason == "length"


def test_min_tokens_holds_back_every_stop_token(model):
    first = _first_tokens(model, 4)
    stops = SamplingParams(max_new_tokens=10, stop_token_ids=(first[0], first[2]), logit_bias={END_OF_MSG: 5.0})
    held = SamplingParams(max_new_tokens=10, stop_token_ids=(first[0], first[2]), logit_bias={END_OF_MSG: 5.0},
                          min_tokens=3)
    assert generate(model, PROMPTS[:1], params=stops)[0].tokens == []
    out = generate(model, PROMPTS[:1], params=held)[0]
    assert len(out.tokens) >= 3 and not {first[0], first[2], END_OF_MSG} & set(out.tokens[:3])


def test_logit_bias_moves_the_argmax(model):
    first = _first_tokens(model, 1)[0]
    banned = generate(model, PROMPTS[:1], params=SamplingParams(max_new_tokens=1, logit_bias={first: -100.0}))[0]
    assert banned.tokens and banned.tokens[0] != first
    forced = generate(model, PROMPTS[:1], params=SamplingParams(max_new_tokens=2, logit_bias={777: 100.0}))[0]
    assert forced.tokens == [777, 777]


def test_penalties_follow_vllm_formulas():
    """repetition over prompt and output tokens (divide positive logits, multiply negative ones),
    then frequency (times the count) and presence (once) over output tokens only."""
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)
    sampler = Sampler(params, TokenSpace(8), prompt_ids=[1, 2])
    for token in (2, 3, 3):
        sampler.take(token)
    logits = torch.tensor([1.0, 2.0, -2.0, 3.0, -1.0, 0.5, 0.0, 4.0])
    expected = logits.clone()
    for token in (1, 2, 3):  # in the prompt or the output
        expected[token] = expected[token] / 1.5 if expected[token] > 0 else expected[token] * 1.5
    expected[2] -= 0.5 * 1 + 0.25
    expected[3] -= 0.5 * 2 + 0.25
    torch.testing.assert_close(sampler.process(logits), expected)
    assert sampler.tokens == [2, 3, 3]
    # and with presence_penalty alone, a token already generated loses to an unseen one
    alone = Sampler(SamplingParams(presence_penalty=2.0), TokenSpace(4))
    alone.take(1)
    assert sample_batch(torch.tensor([[0.0, 1.0, 0.5, 0.0]]), [alone])[0].token_id == 2


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(min_tokens=2), SamplingParams(logit_bias={3: 5.0}),
                                    SamplingParams(frequency_penalty=0.5), SamplingParams(repetition_penalty=1.5),
                                    SamplingParams(presence_penalty=1.0, logit_bias={1: -2.0})])
def test_processing_never_writes_the_logits_it_is_given(params):
    """process copies the row only to edit it in place; the batch's row (its raw logprobs) stays."""
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[*range(7), END_OF_MSG]] = True  # 8 columns, <|end_of_msg|> the last (min_tokens holds it back)
    sampler = Sampler(params, TokenSpace(VOCAB, allowed), prompt_ids=[1, 2])
    sampler.take(3)
    logits = torch.tensor([1.0, 2.0, -2.0, 3.0, -1.0, 0.5, 0.0, 4.0])
    before = logits.clone()
    processed = sampler.process(logits)
    assert torch.equal(logits, before)
    assert torch.equal(processed, before) == (not (params.min_tokens or params.logit_bias or params.penalised))


def test_logprobs_are_the_models_distribution(model):
    p = SamplingParams(max_new_tokens=3, logprobs=True, top_logprobs=4, ignore_eos=True)
    (out,) = generate(model, PROMPTS[:1], params=p)
    assert len(out.logprobs) == len(out.tokens) == 3
    logits = model(torch.tensor([PROMPTS[0]]), last_only=True)[0]
    expected = torch.log_softmax(logits, -1)
    first = out.logprobs[0]
    assert first.token_id == out.tokens[0] and first.top[0][0] == out.tokens[0]  # greedy: the most likely
    assert math.isclose(first.logprob, float(expected[out.tokens[0]]), rel_tol=1e-5)
    assert [i for i, _ in first.top] == torch.topk(expected, 4).indices.tolist()
    assert all(a[1] >= b[1] for a, b in zip(first.top, first.top[1:], strict=False))
    temperature = generate(model, PROMPTS[:1], params=SamplingParams(
        max_new_tokens=1, logprobs=True, temperature=0.5, seed=1))[0].logprobs[0]
    assert math.isclose(temperature.logprob, float(expected[temperature.token_id]), rel_tol=1e-5)  # raw, not tempered


def test_sampling_is_seeded_and_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 2.9]])

    def draws(params, seeds):
        return {sample_batch(logits, [Sampler(params, TokenSpace(5), seed=s)])[0].token_id for s in seeds}

    assert draws(SamplingParams(temperature=1.0), [1]) == draws(SamplingParams(temperature=1.0), [1])
    assert draws(SamplingParams(temperature=1.0, top_k=1), range(10)) == {3}
    # p(3) ~ 0.41 < 0.6, so 4 (~0.37) is kept; 2 comes after 0.6 is reached
    assert draws(SamplingParams(temperature=1.0, top_p=0.6), range(40)) == {3, 4}
    # min_p keeps a token whose probability is at least min_p of the top one's, after temperature:
    # p(i) / p(3) = e^(i - 3): 4 is e^-0.1 ~ 0.905, 2 is e^-1 ~ 0.37
    assert draws(SamplingParams(temperature=1.0, min_p=0.5), range(60)) == {3, 4}
    assert draws(SamplingParams(temperature=1.0, min_p=0.3), range(60)) == {2, 3, 4}
    assert draws(SamplingParams(temperature=0.1, min_p=0.5), range(20)) == {3}  # e^(-0.1 / 0.1) ~ 0.37 < 0.5
    assert draws(SamplingParams(allowed_token_ids=[0, 2]), [0]) == {2}  # greedy among the allowed
    assert draws(SamplingParams(temperature=1.0, allowed_token_ids=[0, 1]), range(40)) == {0, 1}
    with pytest.raises(SamplingError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(SamplingError, match="allowed_token_ids names token 9, outside the vocabulary"):
        Sampler(SamplingParams(allowed_token_ids=[1, 9]), TokenSpace(5))
    assert draws(SamplingParams(), [0]) == {3}
    for extreme in (1e-40, 1e-5, 2.0):  # finite draws at any temperature in range (greedy below 1e-5)
        assert draws(SamplingParams(temperature=extreme), range(3)) <= {0, 1, 2, 3, 4}


@pytest.mark.parametrize("kwargs, message", [
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
    ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
    ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
    ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
    ({"temperature": 1e39}, "temperature must be <= 2, got 1e+39"),
    ({"top_p": float("inf")}, "top_p must be a finite number, got inf"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"top_p": 5.0}, "top_p must be in (0, 1], got 5.0"),
    ({"top_k": -2}, "top_k must be >= 0, got -2"),
    ({"n": 0}, "n must be >= 1, got 0"),
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
    ({"frequency_penalty": -3.0}, "frequency_penalty must be in [-2, 2], got -3.0"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be in [-2, 2], got nan"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0 and finite, got 0.0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty must be > 0 and finite, got inf"),
    ({"min_tokens": 5, "max_new_tokens": 4}, "min_tokens must be from 0 to max_new_tokens (4), got 5"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs must be from 0 to 20, got 21"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs to be true"),
    ({"stop": ("a", "")}, "stop must hold non-empty strings, got ['a', '']"),
    ({"stop_token_ids": (5, -1)}, "stop_token_ids must hold token ids (>= 0), got -1"),
    ({"logit_bias": {-3: 1.0}}, "logit_bias keys must be token ids (>= 0), got -3"),
    ({"logit_bias": {3: 101.0}}, "logit_bias[3] must be in [-100, 100], got 101.0"),
])
def test_bad_parameters_are_named(kwargs, message):
    """The one place sampling ranges are checked: a bad-input error naming the field and the value."""
    with pytest.raises(SamplingError) as caught:
        SamplingParams(**kwargs)
    assert str(caught.value) == message and caught.value.kind == "bad_input"
    assert isinstance(caught.value, ValueError)
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0)  # the edges are in range
    SamplingParams(temperature=2.0, top_p=5e-324, top_k=2**31 - 1, presence_penalty=-2, frequency_penalty=2,
                   min_tokens=256, logprobs=True, top_logprobs=MAX_TOP_LOGPROBS, logit_bias={0: -100, 1: 100})


def test_below_the_greedy_threshold_is_greedy_and_no_value_gives_nan():
    """As in vLLM, a temperature under 1e-5 is greedy (dividing float32 logits by 1e-40 gives inf,
    then NaN probabilities); a top_p that float32 rounds to 0 still keeps the likeliest token."""
    assert SamplingParams(temperature=1e-40).temperature == 0.0 == SamplingParams(temperature=9.9e-6).temperature
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
    space = TokenSpace(5)
    rows = [torch.tensor([0.0, 1.0, 2.0, 3.0, 2.9]), torch.tensor([float("-inf"), 5.0, 1.0, 0.0, 4.9])]
    for params in (SamplingParams(temperature=1e-40, seed=1), SamplingParams(temperature=1e-5, seed=1),
                   SamplingParams(temperature=1.0, top_p=5e-324), SamplingParams(temperature=2.0, top_p=1e-45)):
        sampler = Sampler(params, space, seed=0)
        assert [sampler.draw(sampler.process(row)) for row in rows] == [3, 1], params
    uniform = Sampler(SamplingParams(temperature=2.0), space, seed=0)
    assert all(uniform.draw(uniform.process(rows[1])) != 0 for _ in range(50))  # the masked id is never drawn


def test_token_ids_outside_the_vocabulary_are_named(model):
    for params, words in [(SamplingParams(stop_token_ids=(VOCAB,)), "stop_token_ids names token 163840"),
                          (SamplingParams(logit_bias={VOCAB + 5: 1.0}), "logit_bias names token 163845")]:
        with pytest.raises(SamplingError, match=rf"^{words}, outside the vocabulary \[0, 163840\)$"):
            generate(model, PROMPTS[:1], params=params)


def test_n_sequences_are_seeded_one_after_another():
    p = SamplingParams(seed=2**64 - 1)
    assert [p.seed_of(i) for i in range(3)] == [2**64 - 1, 0, 1] and SamplingParams().seed_of(1) is None


def test_bad_prompts_are_named(model):
    with pytest.raises(ValueError, match="empty"):
        generate(model, [[1], []])
    with pytest.raises(ValueError, match="token ids"):
        generate(model, [[163840]])
    with pytest.raises(ValueError, match="inputs_embeds"):
        generate(model, inputs_embeds=[torch.zeros(3, 5)])
    with pytest.raises(ValueError, match="exactly one"):
        generate(model)


def test_allowed_ids_restrict_what_is_sampled(model):
    vocab = model.cfg.vocab_size
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[[5, 17, 300]] = True
    for params in (SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=6, temperature=1.0, seed=3),
                   SamplingParams(max_new_tokens=6, logprobs=True, top_logprobs=5)):
        (out,) = generate(model, input_ids=[[1, 2, 3]], params=params, allowed_ids=allowed)
        assert out.tokens and set(out.tokens) <= {5, 17, 300}
        for entry in out.logprobs:  # blocked ids are never listed: 3 of the 5 asked for, most likely first
            assert sorted(i for i, _ in entry.top) == [5, 17, 300]
            assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
    with pytest.raises(ValueError, match="allowed_ids must be a bool mask"):
        generate(model, input_ids=[[1]], allowed_ids=torch.ones(7, dtype=torch.bool))
