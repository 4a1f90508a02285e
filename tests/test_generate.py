"""Generation: greedy equals a no-cache argmax loop, batching equals running alone, stops, sampling."""

import pytest
import torch

from textcore.config import END_OF_MSG, tiny
from textcore.generate import SamplingError, SamplingParams, generate, sample
from textcore.model import KimiLinearForCausalLM

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def model():
    return KimiLinearForCausalLM.random(tiny(), seed=11)


PROMPTS = [[163584, 1000, 2000, 3000, 4000, 5000], [163584, 42, 163605]]


def _greedy_without_cache(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def test_greedy_batch_equals_recomputing_every_prefix_alone(model):
    streamed = []
    out = generate(model, PROMPTS, params=SamplingParams(max_new_tokens=5, stop_token_ids=()),
                   on_token=lambda i, t: streamed.append((i, t)))
    for i, prompt in enumerate(PROMPTS):
        assert out[i].tokens == _greedy_without_cache(model, prompt, 5)
        assert out[i].finish_reason == "length"
        assert [t for j, t in streamed if j == i] == out[i].tokens


def test_inputs_embeds_equal_input_ids(model):
    embeds = [model.embed_tokens(torch.tensor(p)) for p in PROMPTS]
    by_ids = generate(model, PROMPTS, params=SamplingParams(max_new_tokens=3))
    by_embeds = generate(model, inputs_embeds=embeds, params=SamplingParams(max_new_tokens=3))
    assert [g.tokens for g in by_ids] == [g.tokens for g in by_embeds]


def test_stops_at_end_of_msg(model):
    first = generate(model, PROMPTS[:1], params=SamplingParams(max_new_tokens=3, stop_token_ids=()))[0].tokens
    # make the second generated token a stop token: generation ends there, without it
    stop = SamplingParams(max_new_tokens=10, stop_token_ids=(first[1],))
    out = generate(model, PROMPTS[:1], params=stop)[0]
    assert out.tokens == first[:1] and out.finish_reason == "stop"
    assert SamplingParams().stop_token_ids == (END_OF_MSG,) == (163586,)


def test_sampling_is_seeded_and_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 2.9]]).repeat(4, 1)
    p = SamplingParams(temperature=1.0, seed=1)
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert torch.equal(sample(logits, p, g1), sample(logits, p, g2))
    top1 = sample(logits, SamplingParams(temperature=1.0, top_k=1), torch.Generator().manual_seed(0))
    assert top1.tolist() == [3, 3, 3, 3]
    nucleus = SamplingParams(temperature=1.0, top_p=0.6)
    draws = {int(sample(logits[:1], nucleus, torch.Generator().manual_seed(s))) for s in range(40)}
    assert draws == {3, 4}  # p(3) ~ 0.41 < 0.6, so 4 (~0.37) is kept; 2 comes after 0.6 is reached
    assert sample(logits, SamplingParams(), None).tolist() == [3, 3, 3, 3]


def test_seeded_generation_reproducible(model):
    p = SamplingParams(max_new_tokens=4, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    first, second = (generate(model, PROMPTS, params=p) for _ in range(2))
    assert [g.tokens for g in first] == [g.tokens for g in second]


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
])
def test_bad_parameters_are_named(kwargs, message):
    """The one place sampling ranges are checked: a bad-input error naming the field and the value."""
    with pytest.raises(SamplingError) as caught:
        SamplingParams(**kwargs)
    assert str(caught.value) == message and caught.value.kind == "bad_input"
    assert isinstance(caught.value, ValueError)
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0)  # the edges are in range
    SamplingParams(temperature=2.0, top_p=5e-324, top_k=2**31 - 1)


def test_below_the_greedy_threshold_is_greedy_and_no_value_gives_nan():
    """As in vLLM, a temperature under 1e-5 is greedy (dividing float32 logits by 1e-40 gives inf,
    then NaN probabilities); a top_p that float32 rounds to 0 still keeps the likeliest token."""
    assert SamplingParams(temperature=1e-40).temperature == 0.0 == SamplingParams(temperature=9.9e-6).temperature
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 2.9], [float("-inf"), 5.0, 1.0, 0.0, 4.9]])
    for params in (SamplingParams(temperature=1e-40, seed=1), SamplingParams(temperature=1e-5, seed=1),
                   SamplingParams(temperature=1.0, top_p=5e-324), SamplingParams(temperature=2.0, top_p=1e-45)):
        assert sample(logits, params, torch.Generator().manual_seed(0)).tolist() == [3, 1], params
    uniform = sample(logits, SamplingParams(temperature=2.0), torch.Generator().manual_seed(0))
    assert uniform.tolist()[1] != 0  # the masked id is never drawn


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
    for params in (SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)):
        (out,) = generate(model, input_ids=[[1, 2, 3]], params=params, allowed_ids=allowed)
        assert out.tokens and set(out.tokens) <= {5, 17, 300}
    with pytest.raises(ValueError, match="allowed_ids must be a bool mask"):
        generate(model, input_ids=[[1]], allowed_ids=torch.ones(7, dtype=torch.bool))
