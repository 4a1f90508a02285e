"""KimiLinear text trunk: `KimiLinearModel` and `KimiLinearForCausalLM`.

Forward, top to bottom: embed -> for each layer [AttnRes mix -> input RMSNorm -> KDA or gated MLA
-> add to the stream; AttnRes mix -> post-attention RMSNorm -> dense SiTU FFN (layer 0) or Latent
MoE -> add] -> output AttnRes mix -> RMSNorm -> lm_head. A forward runs the new tokens of several
sequences laid end to end (`textcore.segments`), each continuing its own `SequenceCache`: `step`
takes sequences of different lengths (decode tokens and prompt chunks together), `forward` a
`[B, T]` batch.

Module names equal the published checkpoint names (prefix `language_model.` in the multimodal
layout, none in a text-only directory), so `state_dict()` keys ARE the checkpoint keys:

    model.embed_tokens.weight                         lm_head.weight
    model.norm.weight                                 model.output_attn_res_{norm,proj}.weight
    model.layers.{i}.input_layernorm.weight           model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.self_attention_res_{norm,proj}.weight, model.layers.{i}.mlp_res_{norm,proj}.weight
    KDA  model.layers.{i}.self_attn.{q,k,v,g,b,f_a,f_b,o}_proj.weight, {q,k,v}_conv1d.weight
         [proj, 1, kernel] fp32, A_log [128] fp32 (heads, zero-padded), dt_bias [proj] fp32,
         o_norm.weight [head_dim] fp32
    MLA  model.layers.{i}.self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa,
         kv_a_layernorm, kv_b_proj, g_proj, o_proj}.weight
    FFN  model.layers.0.mlp.{gate,up,down}_proj.weight
    MoE  model.layers.{i}.block_sparse_moe.{gate.weight, gate.e_score_correction_bias,
         experts.{e}.{w1,w2,w3}.weight (or .weight_packed/.weight_scale), routed_expert_down_proj,
         routed_expert_norm, routed_expert_up_proj, shared_experts.{gate,up,down}_proj}
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch import nn

from textcore.attnres import AttnResStream
from textcore.config import TextConfig
from textcore.kda import KDACache, KimiDeltaAttention, RMSNorm, linear
from textcore.mla import BlockTable, GatedMLA, LatentPool, MLACache
from textcore.moe import LatentMoE, Router, SiTUMLP
from textcore.mxfp4 import MXFP4Linear, apply_quantization_config
from textcore.segments import Segments
from vision.checkpoint import Checkpoint, CheckpointError

MULTIMODAL_PREFIX = "language_model."


class ResProj(nn.Module):
    """An AttnRes score vector, `weight` [1, hidden]. Not an nn.Linear: it is only ever dotted with
    normalised sources, and the checkpoint keeps it unquantised."""

    def __init__(self, hidden: int, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden, dtype=dtype))


class Embedding(nn.Embedding):
    """Created uninitialised (it is always loaded), like `textcore.kda.Linear`."""

    def reset_parameters(self) -> None:
        pass


class SequenceCache:
    """One sequence's decode state: per KDA layer its conv inputs and recurrent state (fixed-size,
    its own), per MLA layer its latents in the blocks of a `LatentPool` (`table`, shared by those
    layers, grown as tokens arrive). `length`: tokens seen."""

    def __init__(self, cfg: TextConfig, pool: LatentPool):
        self.table = BlockTable(pool)
        slots = itertools.count()
        self.layers: list[KDACache | MLACache] = [
            KDACache() if cfg.is_kda(i) else MLACache(self.table, next(slots)) for i in range(cfg.num_hidden_layers)
        ]
        self.length = 0

    def reserve(self, tokens: int) -> None:
        """Blocks for `tokens` more tokens (`textcore.mla.OutOfBlocks` from a pool at its bound without them)."""
        self.table.reserve(self.length + tokens)

    def release(self) -> None:
        """Return the blocks to the pool; the cache holds nothing after."""
        self.table.release()
        for i, layer in enumerate(self.layers):
            self.layers[i] = KDACache() if isinstance(layer, KDACache) else MLACache(self.table, layer.slot)
        self.length = 0

    def copy_from(self, source: SequenceCache) -> None:
        """Become a copy of `source` (of the same pool), into this cache's own blocks (taken if short)."""
        assert self.length == 0 and source.table.pool is self.table.pool, "copy into a fresh cache of the same pool"
        self.table.reserve(source.length)
        pool, used = self.table.pool, self.table.pool.blocks_for(source.length)
        pool.storage[:, self.table.tensor()[:used]] = pool.storage[:, source.table.tensor()[:used]]
        for i, layer in enumerate(source.layers):
            if isinstance(layer, KDACache):
                self.layers[i] = layer.clone()
            else:
                self.layers[i].length = layer.length
        self.length = source.length

    @staticmethod
    def state_bytes(cfg: TextConfig) -> int:
        """What a sequence holds outside the pool, whatever its length: its KDA states (fp32)."""
        return len(cfg.kda_layers) * KDACache.nbytes(cfg)


class TrunkCache:
    """The decode state of a batch: one `SequenceCache` per row, which that row's tokens continue.
    Sequences of different lengths decode together; each keeps its own state between steps."""

    def __init__(self, sequences: list[SequenceCache]):
        self.sequences = sequences

    @property
    def batch(self) -> int:
        return len(self.sequences)

    def layer(self, i: int) -> list:
        return [sequence.layers[i] for sequence in self.sequences]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig, index: int, dtype=None):
        super().__init__()
        self.index = index
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = KimiDeltaAttention(cfg, dtype) if cfg.is_kda(index) else GatedMLA(cfg, dtype)
        if cfg.is_moe(index):
            self.block_sparse_moe = LatentMoE(cfg, dtype)
        else:
            self.mlp = SiTUMLP(hidden, cfg.intermediate_size, cfg, dtype)
        self.input_layernorm = RMSNorm(hidden, eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype=dtype)
        self.self_attention_res_norm = RMSNorm(hidden, eps, dtype=dtype)
        self.self_attention_res_proj = ResProj(hidden, dtype)
        self.mlp_res_norm = RMSNorm(hidden, eps, dtype=dtype)
        self.mlp_res_proj = ResProj(hidden, dtype)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, stream: AttnResStream, segments: Segments, caches: list | None) -> None:
        stream.begin_layer(self.index)
        h = stream.mix(self.self_attention_res_norm, self.self_attention_res_proj)
        stream.add(self.self_attn(self.input_layernorm(h), segments, caches))
        h = stream.mix(self.mlp_res_norm, self.mlp_res_proj)
        stream.add(self.ffn(self.post_attention_layernorm(h)))


class KimiLinearModel(nn.Module):
    def __init__(self, cfg: TextConfig, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.output_attn_res_proj = ResProj(cfg.hidden_size, dtype)

    def forward(self, inputs_embeds: torch.Tensor, segments: Segments, cache: TrunkCache | None = None) -> torch.Tensor:
        """`inputs_embeds` `[1, N, hidden]`: the new tokens of `segments`' sequences end to end."""
        stream = AttnResStream(inputs_embeds, self.cfg.attn_res_block_size)
        for i, layer in enumerate(self.layers):
            layer(stream, segments, cache.layer(i) if cache is not None else None)
        return self.norm(stream.mix(self.output_attn_res_norm, self.output_attn_res_proj))


class KimiLinearForCausalLM(nn.Module):
    def __init__(self, cfg: TextConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.cfg = cfg
        self.model = KimiLinearModel(cfg, dtype)
        self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype if hasattr(self.lm_head, "weight") else self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def set_attention_threads(self, threads: Callable[[], int] | None) -> None:
        """Let a prompt's attention over many keys (`textcore.mla.WIDE_ATTENTION_SCORES`), the one op
        of the trunk big enough to gain from more torch threads, run on `threads()` of them, asked
        at each such op; None: on the trunk's own."""
        for layer in self.model.layers:
            if isinstance(layer.self_attn, GatedMLA):
                layer.self_attn.attention_threads = threads

    def keys_per_token(self) -> float:
        """How many earlier keys a prompt token attends to for that attention to cost what its own
        weights do: the multiply-adds of every projection and router once per token (a routed
        expert's top-k share of its own; not the head, which a prefill runs at its last token only)
        over those of one query-key pair in all MLA layers (q.k over the query/key width, p.v over
        the value width, every head, the expanded form of a prompt). Tiny config: ~965; K3: ~139,700.
        The scheduler weighs a prompt chunk's tokens by it while other sequences decode."""
        cfg = self.cfg
        routed_share = cfg.num_experts_per_token / cfg.num_experts
        weights = sum(m.in_features * m.out_features * (routed_share if ".experts." in name else 1)
                      for name, m in self.model.named_modules() if isinstance(m, nn.Linear | MXFP4Linear))
        weights += sum(m.weight.numel() for m in self.model.modules() if isinstance(m, Router))
        per_key = len(cfg.full_attn_layers) * cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)
        return weights / per_key

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size}); "
                             f"got {int(ids.min())}..{int(ids.max())}")
        return self.model.embed_tokens(ids)

    def new_pool(self, num_blocks: int | None = None, latent_dtype: torch.dtype | None = None, *,
                 preallocate: bool = False) -> LatentPool:
        """A pool for the MLA latents of many sequences: at most `num_blocks` blocks (None: no bound),
        allocated whole at once with `preallocate`, else as they are taken (`LatentPool`).
        latent_dtype torch.float8_e4m3fn stores them in fp8 (scale 1.0, warned once)."""
        cfg = self.cfg
        return LatentPool(len(cfg.full_attn_layers), cfg.kv_lora_rank + cfg.qk_rope_head_dim, self.dtype,
                          latent_dtype=latent_dtype, num_blocks=num_blocks, preallocate=preallocate,
                          device=self.device)

    def new_sequence(self, pool: LatentPool | None = None, latent_dtype: torch.dtype | None = None) -> SequenceCache:
        """A fresh sequence's cache, its latents in `pool` (None: a growing pool of its own)."""
        return SequenceCache(self.cfg, pool or self.new_pool(latent_dtype=latent_dtype))

    def new_cache(self, batch: int, latent_dtype: torch.dtype | None = None) -> TrunkCache:
        """A batch of `batch` fresh sequences, sharing one growing pool."""
        pool = self.new_pool(latent_dtype=latent_dtype)
        return TrunkCache([self.new_sequence(pool) for _ in range(batch)])

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                cache: TrunkCache | None = None, last_only: bool = False) -> torch.Tensor:
        """Logits `[B, T, vocab]` (fp32), or `[B, vocab]` for the last position with last_only.

        Exactly one of input_ids `[B, T]` / inputs_embeds `[B, T, hidden]`. With a cache, row b's T
        tokens continue sequence b of the cache (whatever its length; a prompt chunk or one decode
        token), and every sequence's state is updated; without one, each row is a whole sequence.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = self.embed_tokens(input_ids) if input_ids is not None else inputs_embeds
        if x.dim() != 3 or x.shape[-1] != self.cfg.hidden_size:
            raise ValueError(f"inputs must be [B, T, {self.cfg.hidden_size}] embeddings or [B, T] ids; "
                             f"got {tuple(x.shape)}")
        if cache is not None and cache.batch != x.shape[0]:
            raise ValueError(f"cache is for batch {cache.batch}, inputs have batch {x.shape[0]}")
        B, T, hidden = x.shape
        segments = Segments([T] * B, None if cache is None else [s.length for s in cache.sequences], x.device)
        h = self.model(x.to(self.dtype).reshape(1, B * T, hidden), segments, cache).view(B, T, hidden)
        for sequence in cache.sequences if cache is not None else ():
            sequence.length += T
        if last_only:
            h = h[:, -1]
        return self.lm_head(h).float()

    @torch.no_grad()
    def step(self, chunks: Sequence[torch.Tensor], cache: TrunkCache,
             head_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One forward over sequences of different lengths: `chunks[b]`, token ids `[T_b]` or
        embeddings `[T_b, hidden]`, continues `cache.sequences[b]` (a decode token, a prompt chunk).
        All their tokens run through the per-token layers together; the next-token logits at each
        chunk's last token, `[B, vocab]` (fp32), or `[B, len(head_ids)]`: only those ids' rows of the
        head (the ids that can be sampled)."""
        if len(chunks) != cache.batch:
            raise ValueError(f"{len(chunks)} chunks for a cache of {cache.batch} sequences")
        ids = [b for b, chunk in enumerate(chunks) if chunk.dim() == 1]
        rows = list(chunks)
        if ids:  # one embedding lookup for every chunk of ids
            looked_up = self.embed_tokens(torch.cat([chunks[b] for b in ids]).to(self.device))
            for b, part in zip(ids, looked_up.split([len(chunks[b]) for b in ids]), strict=True):
                rows[b] = part
        segments = Segments([len(r) for r in rows], [s.length for s in cache.sequences], self.device)
        h = self.model(torch.cat([r.to(self.device, self.dtype) for r in rows])[None], segments, cache)
        for sequence, n in zip(cache.sequences, segments.lengths, strict=True):
            sequence.length += n
        last = h[0, segments.last_positions()]
        if head_ids is None:
            return self.lm_head(last).float()
        return torch.nn.functional.linear(last, self.lm_head.weight[head_ids]).float()

    # ---- checkpoints ----
    @classmethod
    def from_checkpoint(cls, src, dtype: torch.dtype = torch.bfloat16,
                        device: str | torch.device = "cpu") -> KimiLinearForCausalLM:
        """Load from a checkpoint directory (or `vision.checkpoint.Checkpoint`): the multimodal layout
        (`text_config`, tensors under `language_model.`) or a text-only one (its config.json is the
        text config, tensors unprefixed). Built on the meta device, so weights are read once."""
        ck = src if isinstance(src, Checkpoint) else Checkpoint(src)
        multimodal = "text_config" in ck.config
        text = ck.config["text_config"] if multimodal else ck.config
        prefix = MULTIMODAL_PREFIX if multimodal else ""
        try:
            cfg = TextConfig.from_dict(text)
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{ck.path}: bad text config: {e}") from None
        quant = text.get("quantization_config") or ck.config.get("quantization_config")
        with torch.device("meta"):
            model = cls(cfg, dtype=dtype)
        if quant:
            _apply_quantization(model, quant, prefix, ck)
        ck.load_into(model, prefix)
        model = model.to(device).eval()
        for module in model.modules():
            if isinstance(module, LatentMoE):
                module.group_experts()  # MXFP4 experts: stacked for the grouped kernel (used on CUDA)
        return model

    @classmethod
    def random(cls, cfg: TextConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> KimiLinearForCausalLM:
        """A model with `random_weights` (for tests and benchmarks)."""
        with torch.device("meta"):
            model = cls(cfg, dtype=dtype)
        weights = random_weights(cfg, seed, dtype=dtype, prefix="")
        model.load_state_dict(weights, strict=True, assign=True)
        return model.eval()


def _apply_quantization(model: nn.Module, quant: dict, prefix: str, ck) -> None:
    """Swap the Linears the config targets for MXFP4Linear, except those the checkpoint itself
    stores unpacked (`X.weight` without `X.weight_packed`): the checkpoint's tensors are the truth
    (the published one packs only the routed experts although the regexes also reach e.g. the
    latent projections). Anything packed but not targeted fails the strict load with its name."""
    present = set(ck.names(prefix))
    unpacked = [
        prefix + name for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and prefix + name + ".weight" in present
        and prefix + name + ".weight_packed" not in present
    ]
    effective = dict(quant)
    effective["ignore"] = list(quant.get("ignore") or []) + unpacked
    apply_quantization_config(model, effective, prefix)


def init_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Deterministic weights in the ranges the trained model's tensors live in, fp32, on the
    generator's device."""
    leaf = name.rsplit(".", 2)[-2:]
    device = gen.device
    if name.endswith("A_log"):
        return torch.empty(shape, device=device).uniform_(0.0, 2.5, generator=gen)  # exp(A_log) in [1, 12]
    scale = 1.0
    if name.endswith("dt_bias") or name.endswith("e_score_correction_bias") or "conv1d" in name:
        scale = 0.5
    elif "norm" in leaf[0]:
        return 1.0 + 0.1 * torch.randn(shape, generator=gen, device=device)
    elif not name.endswith("embed_tokens.weight"):  # linear weights [out, in], the AttnRes score vectors [1, hidden]
        scale = shape[-1] ** -0.5
    return torch.randn(shape, generator=gen, device=device) * scale


def random_weights(cfg: TextConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                   prefix: str = MULTIMODAL_PREFIX) -> dict[str, torch.Tensor]:
    """Every trunk tensor under its checkpoint name (`prefix` + state_dict key), deterministic in
    seed. fp32 tensors of the reference (conv weights, A_log, dt_bias, router bias) stay fp32."""
    with torch.device("meta"):
        model = KimiLinearForCausalLM(cfg, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in sorted(model.state_dict().items()):
        value = init_tensor(name, tuple(t.shape), gen)
        if name.endswith("A_log"):
            value[cfg.kda_num_heads:] = 0  # the published layout's padding
        out[prefix + name] = value.to(t.dtype)
    return out

