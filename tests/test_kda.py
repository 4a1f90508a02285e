"""KDA: the chunked (WY) form against the token-by-token recurrence, and the layer's decode cache."""

import pytest
import torch

from textcore import kda
from textcore.kda import CHUNK, ShortConv, chunk_kda, l2_normalize, recurrent_kda

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def _inputs(B, T, H, K, V, seed, decay_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(B, T, H, K, generator=gen))
    k = l2_normalize(torch.randn(B, T, H, K, generator=gen))
    v = torch.randn(B, T, H, V, generator=gen)
    # the layer's gate range: -5 * sigmoid(...) in [-5, 0); decay_scale < 1 keeps memory long
    g = -5.0 * decay_scale * torch.sigmoid(2 * torch.randn(B, T, H, K, generator=gen))
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen))
    state = torch.randn(B, H, K, V, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("T", [1, CHUNK - 1, 2 * CHUNK + 37])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("decay_scale", [1.0, 0.01])
def test_chunk_matches_recurrent(T, with_state, decay_scale):
    q, k, v, g, beta, state = _inputs(2, T, 3, 32, 24, seed=T, decay_scale=decay_scale)
    init = state if with_state else None
    o_ref, s_ref = recurrent_kda(q, k, v, g, beta, initial_state=init, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=init, output_final_state=True)
    assert o.shape == (2, T, 3, 24) and s.shape == (2, 3, 32, 24)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=0)


def test_chunk_matches_recurrent_across_slabs(monkeypatch):
    """Several slabs of chunks (the last one partial) carry the state from slab to slab."""
    monkeypatch.setattr(kda, "SLAB", 2)
    q, k, v, g, beta, state = _inputs(1, 5 * CHUNK + 7, 2, 16, 8, seed=11, decay_scale=0.01)
    o_ref, s_ref = recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=0)


def test_chunk_matches_recurrent_at_the_decay_bound():
    """g = LOG_DECAY_MIN everywhere: the factorised decays reach exp(+-80) and the masked entries
    above the diagonal overflow, yet the result is exact and finite."""
    q, k, v, _, beta, state = _inputs(1, 2 * CHUNK + 6, 2, 16, 8, seed=4)
    g = torch.full_like(q, kda.LOG_DECAY_MIN)
    o_ref, s_ref = recurrent_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    o, s = chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kda", [chunk_kda, recurrent_kda])
def test_inputs_are_not_modified(kda):
    """One head, one whole chunk: the chunked layout of g is then a plain view of g, yet chunk_kda
    must not sum its cumulative decay into the caller's tensor; recurrent_kda takes the caller's
    initial state without a copy and must not write it."""
    inputs = _inputs(1, CHUNK, 1, 16, 8, seed=5)
    copies = [t.clone() for t in inputs]
    kda(*inputs[:5], initial_state=inputs[5], output_final_state=True)
    for t, before in zip(inputs, copies, strict=True):
        assert torch.equal(t, before)


def test_initial_state_matters_and_split_sequences_compose():
    q, k, v, g, beta, state = _inputs(1, 150, 2, 16, 16, seed=7, decay_scale=0.01)
    full, s_full = chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    without, _ = chunk_kda(q, k, v, g, beta)
    assert (full - without).abs().max() > 1e-2  # the initial state is really used
    cut = 70
    first, s_mid = chunk_kda(q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut],
                             initial_state=state, output_final_state=True)
    second, s_end = chunk_kda(q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:],
                              initial_state=s_mid, output_final_state=True)
    torch.testing.assert_close(torch.cat([first, second], 1), full, atol=1e-5, rtol=0)
    torch.testing.assert_close(s_end, s_full, atol=1e-5, rtol=0)


def test_default_scale_and_no_state_returned():
    q, k, v, g, beta, _ = _inputs(1, 5, 1, 16, 4, seed=1)
    o, s = recurrent_kda(q, k, v, g, beta)
    o_scaled, _ = recurrent_kda(q, k, v, g, beta, scale=16**-0.5)
    assert s is None
    torch.testing.assert_close(o, o_scaled)


def test_bad_shapes_are_named():
    q, k, v, g, beta, _ = _inputs(1, 5, 2, 8, 4, seed=2)
    with pytest.raises(ValueError, match="beta must be"):
        chunk_kda(q, k, v, g, beta[..., :1])
    with pytest.raises(ValueError, match="log decay"):
        chunk_kda(q, k, v, g - 6, beta)
    with pytest.raises(ValueError, match="log decay"):
        chunk_kda(q, k, v, g.index_put((torch.tensor(0),) * 4, torch.tensor(float("nan"))), beta)
    with pytest.raises(ValueError, match="initial_state"):
        recurrent_kda(q, k, v, g, beta, initial_state=torch.zeros(1, 2, 8, 5))


def test_a_conv_step_is_the_conv_of_one_token():
    """ShortConv.step (a decode token of each sequence, the taps summed) gives what the conv of that
    one token after its state gives, and the same new state."""
    gen = torch.Generator().manual_seed(9)
    conv = ShortConv(24, 4)
    conv.weight.data = torch.randn(24, 1, 4, generator=gen)
    x, state = torch.randn(5, 1, 24, generator=gen), torch.randn(5, 24, 3, generator=gen)
    y, new = conv(x, state)
    y_step, new_step = conv.step(x[:, 0], state)
    torch.testing.assert_close(y_step, y[:, 0], atol=1e-6, rtol=1e-6)
    assert torch.equal(new_step, new)
