"""The trunk's scheduler (service/engine/scheduler.py) on the tiny random trunk and a real scheduler
thread: generations decode together and each gets the tokens it gets alone; a long prompt is
prefilled in chunks while running streams go on; a cancelled sequence leaves the batch at the next
step and its blocks go back; under a KV pool too small for them all, sequences are preempted and
resumed and each still gets its tokens (greedy and seeded), with no deadlock when every running
sequence wants a block at once; n sequences copy one prefilled prompt."""

from __future__ import annotations

import gc
import itertools
import re
import threading
import time
import weakref

import pytest

from service.engine import scheduler as scheduler_module
from service.engine.inputs import Prompt
from service.engine.loading import decodable_ids
from service.engine.scheduler import Generation, GenerationResult, Logprobs, Scheduler, chunk_cost, prefill_chunk
from service.errors import BadRequest, TooLarge, Unavailable
from service.metrics import Metrics
from textcore.config import tiny
from textcore.generate import SamplingError, SamplingParams, generate
from textcore.model import KimiLinearForCausalLM, SequenceCache
from textcore.stops import TEXT_EVENTS

pytestmark = [pytest.mark.usefixtures("torch_one_thread"), pytest.mark.timeout(300)]
ORDER = itertools.count()  # one clock for the items of every job (they are emitted on one thread)


@pytest.fixture(scope="module")
def model():
    return KimiLinearForCausalLM.random(tiny(), seed=11)



@pytest.fixture(scope="module")
def allowed(model, tiny_tokenizer):
    return decodable_ids(tiny_tokenizer, model.cfg.vocab_size)


@pytest.fixture()
def scheduler_of(model, tiny_tokenizer, allowed):
    made = []

    def make(**limits) -> Scheduler:
        limits = {"max_num_seqs": 8, "max_num_batched_tokens": 4096, "kv_cache_bytes": 1 << 30, **limits}
        made.append(Scheduler(model, tiny_tokenizer, allowed_ids=allowed, **limits))
        return made[-1]

    yield make
    for scheduler in made:
        scheduler.close()


class Collector:
    """A job's emit: its items with the shared clock, and its end."""

    def __init__(self) -> None:
        self.items: list[tuple[int, int, object]] = []  # (clock, choice index, item)
        self.ended = threading.Event()
        self.error: BaseException | None = None

    def __call__(self, item) -> None:
        if item is None or isinstance(item, BaseException):
            self.error = item
            self.ended.set()
        else:
            self.items.append((next(ORDER), item.index, item.item))

    def tokens(self, index: int = 0) -> list[int]:
        return [item.chosen.token_id for _, i, item in self.items if i == index and isinstance(item, Logprobs)]

    def token_clocks(self, index: int = 0) -> list[int]:
        return [clock for clock, i, item in self.items if i == index and isinstance(item, Logprobs)]

    def results(self) -> list[GenerationResult]:
        return [item for _, _, item in sorted(self.items, key=lambda t: t[1]) if isinstance(item, GenerationResult)]

    def wait(self, timeout: float = 120) -> Collector:
        assert self.ended.wait(timeout), "the job did not end"
        assert self.error is None, self.error
        return self


def _prompt(tiny_tokenizer, text: str) -> Prompt:
    return Prompt([163584, *tiny_tokenizer.encode(text)], [], thinking=False)


def _submit(scheduler, prompt, **params) -> tuple[Generation, Collector]:
    collector = Collector()
    job = Generation(prompt, [], SamplingParams(logprobs=True, **params), collector)
    scheduler.submit(job)
    return job, collector


def _wait_for(condition, what: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


TEXTS = ["What is in the image?", "The quick brown fox jumps over the lazy dog.", "Hi", "A cat sitting on the window"]


def test_generations_decode_together_and_each_gets_its_tokens_alone(scheduler_of, model, tiny_tokenizer, allowed):
    scheduler = scheduler_of()
    params = [{"max_new_tokens": 8, "ignore_eos": True}, {"max_new_tokens": 6, "temperature": 1.0, "seed": 5},
              {"max_new_tokens": 8, "ignore_eos": True, "top_k": 3, "temperature": 0.7, "seed": 1},
              {"max_new_tokens": 5, "ignore_eos": True}]
    jobs = [_submit(scheduler, _prompt(tiny_tokenizer, text), **p) for text, p in zip(TEXTS, params, strict=True)]
    peak = 0
    while not all(c.ended.is_set() for _, c in jobs):
        peak = max(peak, scheduler.last_batch)
        time.sleep(0.001)
    assert peak >= 2  # they shared decode steps
    for (_, collector), text, p in zip(jobs, TEXTS, params, strict=True):
        collector.wait()
        alone = generate(model, [_prompt(tiny_tokenizer, text).ids], params=SamplingParams(**p), allowed_ids=allowed)[0]
        assert collector.tokens() == alone.tokens, text
        (result,) = collector.results()
        assert (result.finish_reason, result.completion_tokens) == (alone.finish_reason, len(alone.tokens))
        assert result.prompt_tokens == len(_prompt(tiny_tokenizer, text).ids) and result.image_tokens == 0
    _wait_for(lambda: scheduler.idle and scheduler.kv.used == 0, "every block back")


def test_a_long_prompt_is_prefilled_in_chunks_while_streams_run(scheduler_of, model, tiny_tokenizer, allowed):
    scheduler = scheduler_of(max_num_batched_tokens=32)
    _, running = _submit(scheduler, _prompt(tiny_tokenizer, "Hi"), max_new_tokens=400, ignore_eos=True)
    _wait_for(lambda: len(running.tokens()) >= 3, "the running stream's first tokens")
    long = _prompt(tiny_tokenizer, " ".join(TEXTS * 6))
    assert len(long.ids) > 8 * 32
    submitted = next(ORDER)
    _, late = _submit(scheduler, long, max_new_tokens=3, ignore_eos=True)
    late.wait()
    first = late.token_clocks()[0]
    during = [c for c in running.token_clocks() if submitted < c < first]
    # every step spends 31 tokens on the prompt and one on the stream: a token per chunk
    assert len(during) >= len(long.ids) // 32 - 1, (len(during), len(long.ids))
    alone = generate(model, [long.ids], params=SamplingParams(max_new_tokens=3, ignore_eos=True),
                     allowed_ids=allowed)[0]
    assert late.tokens() == alone.tokens  # chunked prefill gives the tokens of the whole prompt at once


@pytest.mark.parametrize("keys_per_token", [None, 1.0, 37.5, 965.3])
def test_prefill_chunk_is_the_most_tokens_whose_work_fits(keys_per_token):
    """Against a brute-force search: the chunk's cost fits the budget and one more token would not."""
    for budget, past, remaining in itertools.product([0.5, 1, 7.3, 31, 508, 4096], [0, 1, 999, 15_000], [1, 40, 10**6]):
        take = prefill_chunk(budget, past, remaining, keys_per_token)
        fits = [n for n in range(min(remaining, int(budget)) + 1) if chunk_cost(n, past, keys_per_token) <= budget]
        assert take == max(fits), (budget, past, remaining)
    assert chunk_cost(3, 10, 4.0) == 3 + (10 + 11 + 12) / 4.0  # chunk token i attends to past + i keys
    assert chunk_cost(3, 10, None) == 3


def test_a_chunk_is_weighed_by_its_attention_while_others_decode(scheduler_of, model, tiny_tokenizer, allowed,
                                                                 monkeypatch):
    """The chunks a long prompt is prefilled in, as the real step passes them to the trunk: alone,
    max_num_batched_tokens each; beside a running stream, the rest of the step weighed by
    prefill_chunk with the model's keys_per_token, shrinking as the prefix grows."""
    chunks: list[int] = []
    real = scheduler_module.decode_step

    def recording(model_, caches, tokens, space, prompt_chunks=()):
        chunks.extend(len(c) for c in prompt_chunks)
        return real(model_, caches, tokens, space, prompt_chunks)

    monkeypatch.setattr(scheduler_module, "decode_step", recording)
    long = _prompt(tiny_tokenizer, " ".join(TEXTS * 40))
    n = len(long.ids)
    scheduler = scheduler_of(max_num_batched_tokens=256)
    _submit(scheduler, long, max_new_tokens=1)[1].wait()
    assert chunks == [256] * (n // 256) + [n % 256] * (n % 256 > 0)

    chunks.clear()
    _, running = _submit(scheduler, _prompt(tiny_tokenizer, "Hi"), max_new_tokens=100_000, ignore_eos=True)
    _wait_for(lambda: len(running.tokens()) >= 2, "the running stream's first tokens")
    chunks.clear()  # the stream's own prompt
    _, late = _submit(scheduler, long, max_new_tokens=3, ignore_eos=True)
    late.wait()
    expected, done = [], 0
    while done < n:
        expected.append(prefill_chunk(255, done, n - done, model.keys_per_token()))
        done += expected[-1]
    assert chunks == expected and expected[0] > 2 * expected[-1]
    alone = generate(model, [long.ids], params=SamplingParams(max_new_tokens=3, ignore_eos=True),
                     allowed_ids=allowed)[0]
    assert late.tokens() == alone.tokens


def test_a_cancelled_sequence_leaves_the_batch_at_the_next_step(scheduler_of, tiny_tokenizer):
    scheduler = scheduler_of()
    job_a, a = _submit(scheduler, _prompt(tiny_tokenizer, TEXTS[0]), max_new_tokens=2000, ignore_eos=True)
    job_b, b = _submit(scheduler, _prompt(tiny_tokenizer, TEXTS[1]), max_new_tokens=2000, ignore_eos=True)
    _wait_for(lambda: scheduler.last_batch == 2 and len(a.tokens()) >= 2, "both sequences in one batch")
    cache = weakref.ref(next(s.cache for s in list(scheduler._running) if s.job is job_a))
    job_a.cancelled.set()
    seen = len(b.tokens())
    _wait_for(lambda: len(b.tokens()) >= seen + 2, "the other sequence's next tokens")
    assert scheduler.last_batch == 1 and scheduler.running == 1
    (other,) = scheduler._running
    assert scheduler.kv.used == len(other.cache.table.blocks)  # a's blocks are back in the pool
    gc.collect()
    assert cache() is None  # freed, not just forgotten
    stopped_at = len(a.tokens())
    _wait_for(lambda: len(b.tokens()) >= seen + 5, "more tokens")
    assert len(a.tokens()) == stopped_at and not a.ended.is_set()  # a cancelled job hears nothing more


def _blocks_budget(scheduler_of, blocks: int, max_num_seqs: int = 8) -> int:
    """The KV budget of a pool of `blocks` blocks beside `max_num_seqs` KDA states."""
    return blocks * scheduler_of().kv.block_bytes + max_num_seqs * SequenceCache.state_bytes(tiny())


def _run_all(scheduler, prompts, params) -> list[Collector]:
    collectors = [_submit(scheduler, prompt, **p)[1] for prompt, p in zip(prompts, params, strict=True)]
    return [c.wait() for c in collectors]


@pytest.mark.parametrize("sampling", [
    {"ignore_eos": True},
    {"temperature": 1.0, "top_k": 20, "presence_penalty": 0.5, "min_tokens": 30, "seed": 7},
    {"temperature": 1.0, "seed": 3, "n": 2, "ignore_eos": True},
], ids=["greedy", "seeded", "seeded-n2"])
def test_preempted_sequences_get_the_tokens_of_an_unconstrained_run(scheduler_of, tiny_tokenizer, sampling):
    """Four 40-token replies (or four pairs, n = 2) under a pool of 9 blocks (each sequence ends at 4
    or 5): sequences are preempted and prefilled again, and every reply (the seeded ones through
    their generators, the penalties and min_tokens, kept across) equals the one it gets with room
    for all."""
    prompts = [_prompt(tiny_tokenizer, text) for text in TEXTS]
    params = [{"max_new_tokens": 40, **sampling, **({"seed": sampling["seed"] + i} if "seed" in sampling else {})}
              for i in range(len(prompts))]
    roomy = _run_all(scheduler_of(), prompts, params)
    metrics = Metrics()
    tight = scheduler_of(kv_cache_bytes=_blocks_budget(scheduler_of, 9), metrics=metrics)
    cramped = _run_all(tight, prompts, params)
    assert tight.preemptions >= 2, tight.preemptions
    for free, squeezed in zip(roomy, cramped, strict=True):
        for index in range(sampling.get("n", 1)):
            assert squeezed.tokens(index) == free.tokens(index) and len(free.tokens(index)) > 0
        assert [r.completion_tokens for r in squeezed.results()] == [r.completion_tokens for r in free.results()]
    _wait_for(lambda: tight.idle and tight.kv.used == 0, "every block back")

    def metric(name: str) -> float | None:
        return metrics.registry.get_sample_value(name)

    assert metric("kimi_vision_kv_cache_preemptions_total") == tight.preemptions
    assert metric("kimi_vision_kv_cache_blocks_total") == 9
    _wait_for(lambda: metric("kimi_vision_kv_cache_blocks_used") == 0, "the gauge at the step's end")
    assert metric("kimi_vision_trunk_step_seconds_count") > 40  # a step per token at least


def test_no_deadlock_when_every_running_sequence_wants_a_block(scheduler_of, tiny_tokenizer):
    """Prompts of one block each, admitted until one block is left (the watermark): after their
    first tokens all four need a second block in the same step, and the pool has one. The latest
    admitted give theirs up in turn; every reply finishes, each the one it gets alone."""
    prompt = Prompt([163584, *tiny_tokenizer.encode(TEXTS[3])], [], thinking=False)
    prompt = Prompt(prompt.ids[:16] + [prompt.ids[1]] * (16 - len(prompt.ids)), [], thinking=False)
    params = [{"max_new_tokens": 20, "ignore_eos": True}] * 4
    alone = _run_all(scheduler_of(), [prompt], params[:1])[0].tokens()
    scheduler = scheduler_of(kv_cache_bytes=_blocks_budget(scheduler_of, 5))
    done = _run_all(scheduler, [prompt] * 4, params)
    assert scheduler.preemptions >= 3
    assert all(c.tokens() == alone for c in done)
    _wait_for(lambda: scheduler.idle and scheduler.kv.used == 0, "every block back")


def test_finished_cancelled_and_preempted_sequences_return_their_blocks(scheduler_of, tiny_tokenizer):
    """Blocks in use follow the tokens held: a long reply holds a block per 16 tokens (and the
    pool's storage about that much); a cancelled one gives them back at the next step, finished
    ones at once."""
    scheduler = scheduler_of()
    prompt = _prompt(tiny_tokenizer, TEXTS[0])
    job, long = _submit(scheduler, prompt, max_new_tokens=100_000, ignore_eos=True)
    _wait_for(lambda: len(long.tokens()) >= 40, "40 tokens")
    assert scheduler.kv.used >= scheduler.kv.blocks_for(len(prompt.ids) + 40 - 1)
    # on the CPU the pool's storage follows the blocks taken (doubling), not the 1 GiB budget
    assert scheduler.kv.allocated_bytes <= 2 * scheduler.kv.used * scheduler.kv.block_bytes + (1 << 20)
    _run_all(scheduler, [prompt] * 3, [{"max_new_tokens": 5}] * 3)
    job.cancelled.set()
    _wait_for(lambda: scheduler.idle and scheduler.kv.used == 0, "every block back")


def test_max_num_seqs_bounds_the_batch(scheduler_of, tiny_tokenizer):
    scheduler = scheduler_of(max_num_seqs=2)
    jobs = [_submit(scheduler, _prompt(tiny_tokenizer, text), max_new_tokens=12, ignore_eos=True) for text in TEXTS]
    peak = 0
    while not all(c.ended.is_set() for _, c in jobs):
        peak = max(peak, scheduler.last_batch)
        time.sleep(0.001)
    assert peak == 2 and all(len(c.wait().tokens()) == 12 for _, c in jobs)


def test_n_sequences_fork_one_prompt_and_are_seeded_one_after_another(scheduler_of, model, tiny_tokenizer, allowed):
    scheduler = scheduler_of()
    prompt = _prompt(tiny_tokenizer, TEXTS[0])
    _, three = _submit(scheduler, prompt, n=3, max_new_tokens=6, temperature=1.0, seed=40, ignore_eos=True)
    three.wait()
    for index in range(3):
        alone = generate(model, [prompt.ids], params=SamplingParams(max_new_tokens=6, temperature=1.0, seed=40 + index,
                                                                    ignore_eos=True), allowed_ids=allowed)[0]
        assert three.tokens(index) == alone.tokens
    assert [r.completion_tokens for r in three.results()] == [6, 6, 6]
    assert len({tuple(three.tokens(i)) for i in range(3)}) > 1  # different seeds, different replies


def test_stop_strings_end_a_reply_inside_the_batch(scheduler_of, tiny_tokenizer):
    """The reply ends where the stop string begins (greedy: find a piece of its own text first)."""
    scheduler = scheduler_of()
    prompt = _prompt(tiny_tokenizer, TEXTS[3])
    _, free = _submit(scheduler, prompt, max_new_tokens=30, ignore_eos=True, skip_special_tokens=False)
    text = "".join(item.text for _, _, item in free.wait().items if isinstance(item, TEXT_EVENTS))
    assert len(text) > 6, text
    stop = text[3:5]
    _, stopped = _submit(scheduler, prompt, max_new_tokens=100_000, ignore_eos=True, skip_special_tokens=False,
                         stop=(stop,))
    reply = "".join(item.text for _, _, item in stopped.wait().items if isinstance(item, TEXT_EVENTS))
    assert reply == text[:text.index(stop)]
    (result,) = stopped.results()
    assert result.finish_reason == "stop" and result.completion_tokens < 30
    assert stopped.tokens() == free.tokens()[:result.completion_tokens]
    # found on the output thread: the trunk drops the sequence at its next step, not 100,000 tokens later
    _wait_for(lambda: scheduler.idle and scheduler.kv.used == 0, "the stopped sequence's blocks back")


def test_a_job_that_could_never_run_is_refused_by_the_checks(scheduler_of, tiny_tokenizer):
    """More sequences than decode together, a sequence longer than the whole KV pool, more prompts
    than it holds, a token id outside the vocabulary: each refused by the checks a request passes
    when it is prepared (`check_sequences`, then `check` once the prompt is counted), with its own
    error, never queued (it would wait forever, or fail the step of every job); the scheduler goes
    on serving."""
    prompt = _prompt(tiny_tokenizer, TEXTS[0])
    scheduler = scheduler_of(max_num_seqs=2, kv_cache_bytes=_blocks_budget(scheduler_of, 1, max_num_seqs=2))
    fits = 16 - len(prompt.ids)  # one 16-token block: the prompt and this many tokens
    for params, error, words in (({"n": 3}, BadRequest, "n 3 is above this server's --max-num-seqs 2"),
                                 ({"max_new_tokens": fits + 1}, TooLarge, "needs 2 KV cache blocks of 16 tokens"),
                                 ({"n": 2}, TooLarge, "over the server's 1 (--kv-cache-memory-gb)"),
                                 ({"logit_bias": {200_000: 1.0}}, SamplingError,
                                  "logit_bias names token 200000, outside the vocabulary [0, 163840)")):
        sampling = SamplingParams(**{"max_new_tokens": fits, **params})
        with pytest.raises(error, match=re.escape(words)):
            scheduler.check_sequences(sampling)
            scheduler.check(len(prompt.ids), sampling)
        assert scheduler.idle
    _, ok = _submit(scheduler, prompt, max_new_tokens=fits, ignore_eos=True)
    assert len(ok.wait().tokens()) == fits
    _wait_for(lambda: scheduler.idle and scheduler.kv.used == 0, "every block back")


class FailingEmit(Collector):
    """A caller whose emit raises on its items once `fail` is set (a fault inside a step)."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = threading.Event()

    def __call__(self, item) -> None:
        if self.fail.is_set() and not (item is None or isinstance(item, BaseException)):
            raise RuntimeError("the caller's emit failed")
        super().__call__(item)


def test_a_failing_caller_ends_its_job_and_no_other(scheduler_of, tiny_tokenizer):
    """A caller whose emit raises (on the output thread) ends its own job with that error; its
    sequence leaves the batch at the next step, and the job running beside it and the one waiting
    run to their end."""
    scheduler = scheduler_of(max_num_seqs=2)
    _, running = _submit(scheduler, _prompt(tiny_tokenizer, TEXTS[0]), max_new_tokens=300, ignore_eos=True)
    failing = FailingEmit()
    params = SamplingParams(max_new_tokens=2000, ignore_eos=True, logprobs=True)
    scheduler.submit(Generation(_prompt(tiny_tokenizer, TEXTS[1]), [], params, failing))
    _wait_for(lambda: scheduler.last_batch == 2, "both sequences in one batch")
    _, waiting = _submit(scheduler, _prompt(tiny_tokenizer, TEXTS[2]), max_new_tokens=6, ignore_eos=True)
    assert scheduler.running == 2 and not waiting.items  # no room: it waits
    failing.fail.set()
    assert failing.ended.wait(60) and str(failing.error) == "the caller's emit failed"
    assert len(running.wait().tokens()) == 300
    assert len(waiting.wait().tokens()) == 6  # it took the failed job's place
    _wait_for(lambda: scheduler.idle and scheduler.kv.used == 0, "every block back")


def test_closing_ends_every_open_job_as_unavailable_and_refuses_new_ones(scheduler_of, tiny_tokenizer):
    """Unavailable (retryable), not a kindless error: a 500 to a client, a bug to a batch job."""
    scheduler = scheduler_of(max_num_seqs=1)
    _, running = _submit(scheduler, _prompt(tiny_tokenizer, TEXTS[0]), max_new_tokens=2000, ignore_eos=True)
    _, waiting = _submit(scheduler, _prompt(tiny_tokenizer, TEXTS[1]), max_new_tokens=8)
    _wait_for(lambda: len(running.tokens()) >= 2, "the first job's tokens")
    scheduler.close()
    for collector in (running, waiting):
        assert collector.ended.is_set() and isinstance(collector.error, Unavailable), collector.error
        assert str(collector.error) == "the engine was closed while the generation ran"
    with pytest.raises(Unavailable, match="the scheduler is closed"):
        _submit(scheduler, _prompt(tiny_tokenizer, TEXTS[2]), max_new_tokens=8)
