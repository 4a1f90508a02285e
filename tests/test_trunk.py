"""KimiLinear trunk: layer kinds, decode == full forward, batches of sequences of different lengths,
memory-linear prefill attention, fp8 cache, router, SiTU, MoE
grouping, Attention Residuals, checkpoint round trips (multimodal, text-only, MXFP4)."""

import itertools
import logging

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from textcore import mla, mxfp4
from textcore.attnres import AttnResStream, depth_mix
from textcore.config import TextConfig, k3, tiny
from textcore.kda import RMSNorm
from textcore.model import KimiLinearForCausalLM, ResProj, TrunkCache, random_weights
from textcore.moe import Expert, LatentMoE, Router, situ
from textcore.segments import Segments
from vision.checkpoint import Checkpoint, CheckpointError, write_checkpoint

SEED = 3


pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def model():
    return KimiLinearForCausalLM.random(tiny(), seed=SEED)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 163840, (2, 11), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def full_logits(model, ids):
    return model(ids)


def test_layer_kinds_follow_the_one_based_lists():
    cfg = k3()
    mla_layers = [i for i in range(93) if not cfg.is_kda(i)]
    assert mla_layers == [*range(3, 92, 4), 92]
    assert len(cfg.kda_layers) == 69 and len(mla_layers) == 24
    assert cfg.is_kda(0) and not cfg.is_moe(0) and cfg.is_moe(1)
    t = tiny()
    kinds = {t.is_kda(i) for i in range(t.num_hidden_layers)}
    assert kinds == {True, False}
    assert t.num_hidden_layers > 2 * t.attn_res_block_size  # the stack crosses AttnRes block boundaries
    assert TextConfig.from_dict(cfg.to_dict()) == cfg
    assert TextConfig.from_dict({"text_config": t.to_dict()}) == t


@pytest.mark.parametrize("prefill", [1, 4])
def test_incremental_decode_matches_full_forward(model, ids, full_logits, prefill):
    """Prefill (1 token: shorter than the conv window, through the decode path itself; or 4), then
    decode one token at a time through every KDA and MLA layer (chunked vs recurrent KDA, expanded
    vs absorbed MLA) and all three AttnRes blocks."""
    cache = model.new_cache(2)
    steps = [model(ids[:, :prefill], cache=cache)]
    steps += [model(ids[:, t:t + 1], cache=cache) for t in range(prefill, ids.shape[1])]
    torch.testing.assert_close(torch.cat(steps, 1), full_logits, atol=1e-4, rtol=0)
    assert [sequence.length for sequence in cache.sequences] == [ids.shape[1]] * 2


def test_sequences_of_different_lengths_decode_together(model, ids, full_logits):
    """Each row of a batch continues its own sequence: two caches of different lengths (prefilled
    alone, one in two chunks) step together and each gets the logits of its whole sequence alone."""
    pool = model.new_pool()
    first, second = model.new_sequence(pool), model.new_sequence(pool)  # the second's blocks come after the first's
    model(ids[:1, :7], cache=TrunkCache([first]))
    model(ids[1:, :2], cache=TrunkCache([second]))
    model(ids[1:, 2:4], cache=TrunkCache([second]))
    batch = TrunkCache([first, second])
    step = model(torch.stack([ids[0, 7:8], ids[1, 4:5]]), cache=batch, last_only=True)
    torch.testing.assert_close(step[0], full_logits[0, 7], atol=1e-4, rtol=0)
    torch.testing.assert_close(step[1], full_logits[1, 4], atol=1e-4, rtol=0)
    step = model(torch.stack([ids[0, 8:9], ids[1, 5:6]]), cache=batch, last_only=True)
    torch.testing.assert_close(step[1], full_logits[1, 5], atol=1e-4, rtol=0)
    assert (first.length, second.length) == (9, 6)
    fork = model.new_sequence(pool)
    fork.copy_from(second)  # a copy, in blocks of its own, continues like the original
    a, b = (model(ids[1:, 6:7], cache=TrunkCache([c]), last_only=True) for c in (second, fork))
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(a[0], full_logits[1, 6], atol=1e-4, rtol=0)


class ContiguousLatents:
    """The reference a block table is held to: one sequence's latents in one growing buffer."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def append(self, latent: torch.Tensor) -> None:
        self.rows.append(latent.float())

    def latents(self) -> torch.Tensor:
        return torch.cat(self.rows)


def test_block_table_attention_equals_the_contiguous_cache(model):
    """Three sequences in one pool of 4-token blocks, their blocks interleaved (they grow in turn,
    one partly filled block each): every decode step's gathered keys equal each sequence's latents
    laid end to end, exactly, and are finite past each length (masked there); the layer's output
    at every step equals the whole sequence attended at once (no cache: the contiguous keys) within
    fp32 noise."""
    cfg = model.cfg
    layer = model.model.layers[2].self_attn
    dims = layer.kv_lora_rank + layer.rope
    pool = mla.LatentPool(1, dims, torch.float32, block_size=4)
    caches = [mla.MLACache(mla.BlockTable(pool), 0) for _ in range(3)]
    refs = [ContiguousLatents() for _ in caches]
    gen = torch.Generator().manual_seed(9)
    whole = [torch.randn(1, n, cfg.hidden_size, generator=gen) for n in (13, 6, 9)]
    prefilled = (5, 2, 3)
    outs: list[list[torch.Tensor]] = [[] for _ in caches]

    def latent_of(x):
        c, k_rot = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, layer.rope], -1)
        return torch.cat([layer.kv_a_layernorm(c), k_rot], -1)[0]

    with torch.no_grad():
        for b, (cache, ref, x, n) in enumerate(zip(caches, refs, whole, prefilled, strict=True)):
            outs[b].append(layer(x[:, :n], Segments([n], [0], "cpu"), [cache]))
            ref.append(latent_of(x[:, :n]))
        for t in range(max(x.shape[1] for x in whole)):
            going = [b for b, (x, n) in enumerate(zip(whole, prefilled, strict=True)) if n + t < x.shape[1]]
            if len(going) < 2:
                break
            rows = torch.cat([whole[b][:, prefilled[b] + t:prefilled[b] + t + 1] for b in going], 1)
            step = layer(rows, Segments([1] * len(going), [caches[b].length for b in going], "cpu"),
                         [caches[b] for b in going])
            latents = latent_of(rows)  # as the layer computes them: the step's rows together
            for i, b in enumerate(going):
                outs[b].append(step[:, i:i + 1])
                refs[b].append(latents[i:i + 1])
            stacked = mla._stack_right_padded([caches[b] for b in going])
            for i, b in enumerate(going):
                expected = refs[b].latents()
                assert torch.equal(stacked[i, :len(expected)], expected)
                assert torch.isfinite(stacked[i, len(expected):]).all()  # masked by the attention
        assert len({tuple(c.table.blocks) for c in caches}) == 3
        assert sorted(sum((c.table.blocks for c in caches), [])) == list(range(pool.num_blocks))
        assert any(b != a + 1 for c in caches for a, b in itertools.pairwise(c.table.blocks))  # interleaved
        for b, (cache, x) in enumerate(zip(caches, whole, strict=True)):
            done = torch.cat(outs[b], 1)
            contiguous = layer(x[:, :done.shape[1]], Segments([done.shape[1]], None, "cpu"))
            torch.testing.assert_close(done, contiguous, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cache.latents(torch.float32), refs[b].latents(), atol=0, rtol=0)


def test_a_bounded_pool_grows_with_its_blocks_up_to_its_bound():
    """Without preallocate, the storage grows as blocks are taken (doubling, never past the
    bound); past the bound, OutOfBlocks; with preallocate, the bound from the start."""
    pool = mla.LatentPool(2, 3, torch.float32, num_blocks=10, block_size=4)
    assert (pool.allocated, pool.num_free, pool.allocated_bytes) == (0, 10, 0)
    first = pool.allocate(3)
    assert (pool.allocated, pool.num_free) == (3, 7)
    pool.allocate(4)
    assert (pool.allocated, pool.num_free) == (7, 3)  # what it needs, at least double
    pool.allocate(3)
    assert (pool.allocated, pool.num_free) == (10, 0)  # 14, held to the bound
    with pytest.raises(mla.OutOfBlocks):
        pool.allocate(1)
    pool.free(first)
    assert pool.allocate(3) == first and pool.allocated_bytes == 10 * 2 * 4 * 3 * 4
    whole = mla.LatentPool(2, 3, torch.float32, num_blocks=10, block_size=4, preallocate=True)
    assert (whole.allocated, whole.num_free) == (10, 10)


def test_a_table_that_changes_is_gathered_anew():
    """The gather's tables are made once a step and kept while the tables are unchanged: a table
    released and refilled with as many blocks (others now) is read from its new blocks."""
    pool = mla.LatentPool(1, 3, torch.float32, block_size=2)
    tables = [mla.BlockTable(pool) for _ in range(3)]
    a, b = (mla.MLACache(t, 0) for t in tables[:2])
    a.append(torch.ones(3, 3))
    b.append(torch.full((2, 3), 2.0))
    assert torch.equal(mla._stack_right_padded([a, b])[0, :3], torch.ones(3, 3))
    blocker = mla.MLACache(tables[2], 0)
    blocker.append(torch.zeros(2, 3))
    old = list(a.table.blocks)
    a.table.release()
    pool.free([blocker.table.blocks.pop()])  # freed after a's: a takes it first this time
    a.length = 0
    a.append(torch.full((3, 3), 5.0))
    assert a.table.blocks != old and len(a.table.blocks) == len(old)
    assert torch.equal(mla._stack_right_padded([a, b])[0, :3], torch.full((3, 3), 5.0))


def test_one_step_runs_decode_tokens_and_prompt_chunks_of_several_sequences(model, ids, full_logits):
    """`step`: a decode token of one sequence, a prompt chunk of another and the first chunk of a
    third (ids and embeddings mixed) in one forward; each gets the logits of its sequence alone."""
    decoding, chunked, fresh = model.new_sequence(), model.new_sequence(), model.new_sequence()
    model(ids[:1, :6], cache=TrunkCache([decoding]))
    model(ids[1:, :3], cache=TrunkCache([chunked]))
    out = model.step([ids[0, 6:7], model.embed_tokens(ids[1, 3:9]), ids[1, :5]], TrunkCache([decoding, chunked, fresh]))
    torch.testing.assert_close(out[0], full_logits[0, 6], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[1], full_logits[1, 8], atol=1e-4, rtol=0)
    torch.testing.assert_close(out[2], full_logits[1, 4], atol=1e-4, rtol=0)
    assert (decoding.length, chunked.length, fresh.length) == (7, 9, 5)
    out = model.step([ids[0, 7:8], ids[1, 9:10], ids[1, 5:6]], TrunkCache([decoding, chunked, fresh]))  # all decode
    torch.testing.assert_close(out, full_logits[[0, 1, 1], [7, 9, 5]], atol=1e-4, rtol=0)


def test_prefill_attention_is_memory_linear_and_equals_the_materialised_scores(monkeypatch):
    """The expanded MLA prefill, query block by query block through SDPA, equals the scores
    written out in full ([H, T, S] in fp32, the formula of the module docstring), with and without
    a cached prefix; blocks smaller than the prompt change nothing."""
    cfg = tiny()
    layer = KimiLinearForCausalLM.random(cfg, seed=SEED).model.layers[2].self_attn
    x = torch.randn(1, 300, cfg.hidden_size, generator=torch.Generator().manual_seed(4))

    def materialised(x):
        H, T = layer.num_heads, x.shape[1]
        q = layer.q_b_proj(layer.q_a_layernorm(layer.q_a_proj(x))).view(1, T, H, -1)
        c, k_rot = layer.kv_a_proj_with_mqa(x).split([layer.kv_lora_rank, layer.rope], -1)
        k_nope, v = layer.kv_b_proj(layer.kv_a_layernorm(c)).view(1, T, H, -1).split([layer.nope, layer.v_dim], -1)
        scores = torch.einsum("bthn,bshn->bhts", q[..., :layer.nope], k_nope)
        scores = scores + torch.einsum("bthr,bsr->bhts", q[..., layer.nope:], k_rot)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        probs = torch.softmax((scores * layer.scale).masked_fill(~causal, float("-inf")), -1)
        attn = torch.einsum("bhts,bshv->bthv", probs, v) * torch.sigmoid(layer.g_proj(x)).view(1, T, H, -1)
        return layer.o_proj(attn.reshape(1, T, -1))

    def run(part, cache):
        return layer(part, Segments([part.shape[1]], cache and [cache.length], "cpu"), cache and [cache])

    with torch.no_grad():
        expected = materialised(x)
        torch.testing.assert_close(run(x, None), expected, atol=1e-5, rtol=1e-5)
        monkeypatch.setattr(mla, "QUERY_CHUNK", 64)
        cache = mla.MLACache(mla.BlockTable(mla.LatentPool(1, layer.kv_lora_rank + layer.rope, x.dtype)), 0)
        chunks = [run(x[:, :130], cache), run(x[:, 130:131], cache), run(x[:, 131:], cache)]
        torch.testing.assert_close(torch.cat(chunks, 1), expected, atol=1e-5, rtol=1e-5)


def test_a_long_prompts_attention_runs_on_the_threads_it_is_given(monkeypatch):
    """set_attention_threads: the SDPA calls of a prompt's attention of WIDE_ATTENTION_SCORES or
    more (whole, or a chunk after a long prefix) run on the threads asked for, smaller ones and
    every other op on the trunk's own, which come back after; the logits are the same."""
    model = KimiLinearForCausalLM.random(tiny(), seed=SEED)
    seen: list[int] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    own = torch.get_num_threads()
    long = torch.randint(0, 1000, (1, 1060), generator=torch.Generator().manual_seed(5))
    assert 4 * 750 * 751 / 2 >= mla.WIDE_ATTENTION_SCORES > 4 * 300 * 301 / 2
    with torch.no_grad():
        plain = model(long)
        model.set_attention_threads(lambda: own + 1)
        seen.clear()
        wide = model(long)
        assert seen == [own + 1] * 3 and torch.get_num_threads() == own  # the 3 MLA layers
        torch.testing.assert_close(wide, plain, rtol=0, atol=0)
        seen.clear()
        model(long[:, :300])
        assert seen == [own] * 3
        cache = model.new_cache(1)
        seen.clear()
        model(long[:, :750], cache=cache)
        model(long[:, 750:1050], cache=cache)  # 300 queries after 750 keys: 4 x 300 x 900.5 scores
        model(long[:, 1050:], cache=cache)  # 10 after 1,050: 4 x 10 x 1,055.5, under it
        assert seen == [own + 1] * (3 + 3 * 2) + [own] * 3  # the 300-query chunk in 2 blocks of QUERY_CHUNK
        model.set_attention_threads(None)
        seen.clear()
        model(long)
        assert seen == [own] * 3


def test_keys_per_token_counts_the_multiply_adds_a_token_costs(model):
    """Against torch's own count of a one-token forward's matmuls (exactly the top-k experts run
    for one token): those, less the head's, are the weights' share keys_per_token divides."""
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(torch.tensor([[5]]), last_only=True)
    cfg = model.cfg
    weight_macs = counter.get_flop_counts()["Global"][torch.ops.aten.mm] // 2 - cfg.hidden_size * cfg.vocab_size
    per_key = len(cfg.full_attn_layers) * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    assert model.keys_per_token() * per_key == pytest.approx(weight_macs, rel=1e-12)


def test_fp8_latent_cache_within_tolerance_and_warns_once(model, ids, caplog, monkeypatch):
    """Stated tolerance, per MLA layer: e4m3 keeps 3 mantissa bits (<= 6.25% relative error per
    latent value, scale 1.0), so the layer output through an fp8 cache stays within 5% (relative
    Frobenius norm) of the exact one. (Whole-model logits are not a fair yardstick for a random
    tiny model: a small perturbation can flip a top-k routing decision.)"""
    monkeypatch.setattr(mla, "_warned_fp8", False)
    with caplog.at_level(logging.WARNING, logger="textcore.mla"):
        cache = model.new_cache(2, latent_dtype=torch.float8_e4m3fn)
        model.new_cache(2, latent_dtype=torch.float8_e4m3fn)
    assert sum("no KV cache scales" in r.message for r in caplog.records) == 1
    layer = model.model.layers[2].self_attn
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(2))
    exact = layer(x.reshape(1, 18, 64), Segments([9, 9], None, "cpu")).view(2, 9, 64)
    entry = cache.layer(2)

    def run(part):  # the two sequences' new tokens end to end, as the model lays them
        segments = Segments([part.shape[1]] * 2, [c.length for c in entry], "cpu")
        return layer(part.reshape(1, -1, 64), segments, entry).view(2, -1, 64)

    steps = [run(x[:, :4])] + [run(x[:, t:t + 1]) for t in range(4, 9)]
    err = torch.linalg.norm(torch.cat(steps, 1) - exact) / torch.linalg.norm(exact)
    assert entry[0].table.pool.storage.dtype == torch.float8_e4m3fn
    assert 0 < err <= 0.05
    # and the whole model runs on an fp8 cache
    assert torch.isfinite(model(ids, cache=model.new_cache(2, latent_dtype=torch.float8_e4m3fn))).all()
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        model.new_cache(1, latent_dtype=torch.float16)


def test_router_selects_with_bias_but_weights_without():
    cfg = tiny()
    router = Router(4, cfg)
    with torch.no_grad():
        router.weight.copy_(torch.eye(8, 4) * 4)  # token [1,0,0,0]: expert 0 scores high, others 0.5
        router.e_score_correction_bias.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 0, 10.0]))
    ids, w = router(torch.tensor([[1.0, 0, 0, 0]]))
    assert sorted(ids[0].tolist()) == [0, 7]  # expert 7 only wins through its bias
    s0, s7 = torch.sigmoid(torch.tensor(4.0)), torch.tensor(0.5)
    expected = torch.stack([s0, s7]) / (s0 + s7)
    got = dict(zip(ids[0].tolist(), w[0].tolist(), strict=True))
    assert got[0] == pytest.approx(expected[0].item(), abs=1e-6)
    assert got[7] == pytest.approx(expected[1].item(), abs=1e-6)
    assert w.dtype == torch.float32


def test_situ_formula_in_fp32():
    g = torch.tensor([-30.0, -1.0, 0.0, 2.0, 50.0], dtype=torch.bfloat16)
    u = torch.tensor([100.0, -3.0, 1.0, 0.5, -60.0], dtype=torch.bfloat16)
    gf, uf = g.float(), u.float()
    ref = 4 * torch.tanh(gf / 4) * torch.sigmoid(gf) * 25 * torch.tanh(uf / 25)
    out = situ(g, u)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref.to(torch.bfloat16), atol=0, rtol=0)


def test_latent_moe_grouped_experts_equal_per_token_reference(model):
    moe: LatentMoE = model.model.layers[1].block_sparse_moe
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1))
    ids, w = moe.gate(x)
    z = moe.routed_expert_down_proj(x)
    rows = []
    for t in range(x.shape[0]):
        acc = sum(w[t, s] * moe.experts[int(ids[t, s])](z[t]) for s in range(ids.shape[1]))
        rows.append(acc)
    ref = moe.routed_expert_up_proj(moe.routed_expert_norm(torch.stack(rows))) + moe.shared_experts(x)
    torch.testing.assert_close(moe(x), ref, atol=1e-5, rtol=1e-5)
    assert isinstance(moe.experts[3], Expert)
    names = dict(moe.named_parameters())
    assert {"experts.3.w1.weight", "experts.3.w2.weight", "experts.3.w3.weight", "gate.weight",
            "gate.e_score_correction_bias"} <= set(names)


@pytest.mark.parametrize("experts_at_once", [8, 3, 0])
def test_the_loop_decodes_the_active_mxfp4_experts_together(experts_at_once, monkeypatch):
    """Stacked MXFP4 experts: the per-expert loop decodes the active ones together, as many at once
    as the decode bound holds (all, three, or none: each expert's layers then decode their own),
    and gives what each expert's own layers give, token by token."""
    moe = KimiLinearForCausalLM.random(tiny(), seed=SEED).model.layers[1].block_sparse_moe
    for expert in moe.experts:
        for name in ("w1", "w2", "w3"):
            setattr(expert, name, mxfp4.MXFP4Linear.from_linear(getattr(expert, name)))
    assert moe.group_experts()
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(2))
    ids, w = moe.gate(x)
    z = moe.routed_expert_down_proj(x)
    reference = torch.stack([sum(w[t, s] * moe.experts[int(ids[t, s])](z[t:t + 1])[0] for s in range(ids.shape[1]))
                             for t in range(x.shape[0])])
    active = len(set(ids.reshape(-1).tolist()))
    per_expert = 8 * (moe._grouped[0][0].numel() + moe._grouped[2][0].numel())  # fp32 bytes of its three weights
    monkeypatch.setattr(mxfp4, "_TORCH_CHUNK_BYTES", per_expert * experts_at_once or per_expert - 1)
    decodes = []
    dequantize = mxfp4.dequantize
    monkeypatch.setattr(mxfp4, "dequantize", lambda *a, **k: decodes.append(1) or dequantize(*a, **k))
    moe.expert_backend = "loop"
    torch.testing.assert_close(moe.routed(z, ids, w), reference, rtol=1e-6, atol=1e-6)
    groups = -(-active // experts_at_once) if experts_at_once else None
    assert len(decodes) == (2 * groups if groups else 3 * active)  # a decode a group, or one for each layer


def test_attnres_k3_checkpoints_and_sources_without_allocating():
    """Drive the real stream state machine over the K3's 93 layers with meta tensors."""
    cfg = k3()
    x = torch.empty(1, 1, cfg.hidden_size, device="meta")
    stream = AttnResStream(x, cfg.attn_res_block_size)
    sources_at = []
    for i in range(cfg.num_hidden_layers):
        stream.begin_layer(i)
        sources_at.append(len(stream.sources()))
        stream.add(x)  # attention
        stream.add(x)  # FFN
    assert len(stream.checkpoints) == 8
    assert len(stream.sources()) == 9
    assert sources_at[0] == 1 and sources_at[1] == 2 and sources_at[12] == 2 and sources_at[13] == 3


def test_depth_mix_formula():
    gen = torch.Generator().manual_seed(5)
    norm, proj = RMSNorm(16, 1e-5), ResProj(16)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(16, generator=gen) + 0.5)
        proj.weight.copy_(torch.randn(1, 16, generator=gen))
    sources = [torch.randn(3, 16, generator=gen) * s for s in (1.0, 5.0, 0.2)]
    scores = torch.stack([(norm(v) * proj.weight[0]).sum(-1) for v in sources])  # <RMSNorm(v), w*p>
    ref = (torch.softmax(scores, 0)[..., None] * torch.stack(sources)).sum(0)  # over un-normalised v
    torch.testing.assert_close(depth_mix(sources, norm, proj), ref, atol=1e-5, rtol=1e-5)
    assert depth_mix(sources[:1], norm, proj) is sources[0]


def test_checkpoint_round_trip_multimodal_and_text_only(tmp_path, model, ids, full_logits):
    cfg = tiny()
    mm = tmp_path / "mm"
    write_checkpoint(mm, random_weights(cfg, SEED, dtype=torch.float32),
                     {"model_type": "kimi_k3", "text_config": cfg.to_dict()}, max_shard_bytes=40 * 2**20)
    loaded = KimiLinearForCausalLM.from_checkpoint(mm, dtype=torch.float32)
    torch.testing.assert_close(loaded(ids), full_logits, atol=1e-5, rtol=0)  # same weights; BLAS paths may differ
    text = tmp_path / "text"
    write_checkpoint(text, random_weights(cfg, SEED, dtype=torch.float32, prefix=""), cfg.to_dict())
    alone = KimiLinearForCausalLM.from_checkpoint(Checkpoint(text), dtype=torch.float32)
    torch.testing.assert_close(alone(ids), full_logits, atol=1e-5, rtol=0)
    assert alone.model.layers[0].self_attn.A_log.dtype == torch.float32

    weights = random_weights(cfg, SEED, dtype=torch.float32, prefix="")
    del weights["model.layers.2.self_attn.kv_b_proj.weight"]
    broken = tmp_path / "broken"
    write_checkpoint(broken, weights, cfg.to_dict())
    with pytest.raises(CheckpointError, match="model.layers.2.self_attn.kv_b_proj.weight"):
        KimiLinearForCausalLM.from_checkpoint(broken)


def test_random_weights_use_published_names():
    weights = random_weights(tiny(), 0)
    names = set(weights)
    a_log = weights["language_model.model.layers.0.self_attn.A_log"]
    assert a_log.shape == (128,) and a_log.dtype == torch.float32  # published: padded to 128 entries
    assert (a_log[4:] == 0).all() and (a_log[:4] != 0).all()
    for expected in [
        "language_model.model.embed_tokens.weight",
        "language_model.lm_head.weight",
        "language_model.model.output_attn_res_proj.weight",
        "language_model.model.layers.0.mlp.gate_proj.weight",
        "language_model.model.layers.0.self_attn.q_conv1d.weight",
        "language_model.model.layers.0.self_attn.f_b_proj.weight",
        "language_model.model.layers.1.block_sparse_moe.experts.7.w2.weight",
        "language_model.model.layers.1.block_sparse_moe.routed_expert_norm.weight",
        "language_model.model.layers.1.block_sparse_moe.shared_experts.down_proj.weight",
        "language_model.model.layers.2.self_attn.kv_a_proj_with_mqa.weight",
        "language_model.model.layers.2.self_attn.g_proj.weight",
        "language_model.model.layers.2.mlp_res_norm.weight",
    ]:
        assert expected in names, expected


def test_mxfp4_checkpoint_loads_packed_experts(tmp_path, model, ids, full_logits):
    from textcore.mxfp4 import K3_QUANTIZATION_CONFIG, MXFP4Linear, quantize_tensors

    cfg = tiny()
    weights = random_weights(cfg, SEED, dtype=torch.float32)
    linear = {f"language_model.{n}" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    packed = quantize_tensors(weights, K3_QUANTIZATION_CONFIG, linear_modules=linear)
    # the published checkpoint packs only the routed experts: keep the latent projections unpacked
    for name in list(packed):
        if "routed_expert_" in name and name.endswith(("weight_packed", "weight_scale")):
            del packed[name]
            base = name.rsplit(".", 1)[0] + ".weight"
            packed[base] = weights[base]
    assert "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed" in packed
    text_cfg = {**cfg.to_dict(), "quantization_config": K3_QUANTIZATION_CONFIG}
    write_checkpoint(tmp_path, packed, {"text_config": text_cfg})
    q = KimiLinearForCausalLM.from_checkpoint(tmp_path, dtype=torch.float32)
    moe = q.model.layers[1].block_sparse_moe
    assert isinstance(moe.experts[0].w1, MXFP4Linear)
    assert not isinstance(moe.routed_expert_down_proj, MXFP4Linear)
    assert not isinstance(q.model.layers[1].self_attn.q_proj, MXFP4Linear)
    # the same model with the experts' weights dequantised gives the same logits
    from textcore.mxfp4 import dequantize

    plain = dict(weights)
    for name in packed:
        if name.endswith(".weight_packed"):
            base = name[: -len("_packed")]
            plain[base] = dequantize(packed[name], packed[base.replace("weight", "weight_scale")], torch.float32)
    reference = KimiLinearForCausalLM(cfg)
    reference.load_state_dict({k[len("language_model."):]: v for k, v in plain.items()}, strict=True, assign=True)
    torch.testing.assert_close(q(ids), reference(ids), atol=1e-3, rtol=1e-3)
