"""Building an engine: the checkpoint's parts loaded in order, the trunk's CPU threads set beside
the encoder workers, and the first request's costs paid before serving (`warm_up`)."""

from __future__ import annotations

import io
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

from service.cpus import cpu_budget
from service.engine.allocator import keep_freed_memory
from service.engine.config import EngineConfig
from service.engine.inputs import MediaInput, Prompt
from service.engine.pool import EncoderPool
from service.engine.scheduler import Choice, Generation
from service.metrics import Metrics
from textcore.generate import SamplingParams
from textcore.model import KimiLinearForCausalLM
from textcore.splice import Span
from textcore.tokenizer import MEDIA_PAD_ID, NUM_BASE_TOKENS, Tokenizer
from vision.checkpoint import Checkpoint
from vision.media import plan_media

if TYPE_CHECKING:
    from service.engine.engine import Engine

log = logging.getLogger("service.engine.engine")


@dataclass(frozen=True)
class AttentionThreads:
    """How many torch threads a CPU trunk's prompt attention over many keys takes, asked at each
    such op: every usable CPU while the CPU encoder workers have nothing to encode (that op is
    quadratic work in one call), else the trunk's own share. The small ops keep the trunk's share."""

    pool: EncoderPool
    while_idle: int
    otherwise: int

    def __call__(self) -> int:
        return self.while_idle if self.pool.cpu_idle() else self.otherwise


def share_cpus(model: KimiLinearForCausalLM, pool: EncoderPool) -> None:
    """A CPU trunk takes the CPUs the encoder workers leave (an OMP_NUM_THREADS the operator set is
    kept), and its wide attention every CPU while they are idle."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    budget = cpu_budget()
    cpu_workers = sum(d.startswith("cpu") for d in pool.devices)
    own = budget.trunk_threads(cpu_workers * pool.threads_per_worker)
    torch.set_num_threads(own)
    if budget.usable > own:
        model.set_attention_threads(AttentionThreads(pool, budget.usable, own))
        log.info("trunk: a prompt's attention over many keys takes %d torch threads while the CPU encoder "
                 "workers are idle", budget.usable)


def load_engine(cls: type[Engine], config: EngineConfig, metrics: Metrics | None = None) -> Engine:
    """The tokenizer, the encoder pool and (unless `components="vision"`) the trunk, then the
    engine on them. Blocking; minutes for the real model."""
    if config.keep_freed_bytes and not keep_freed_memory(config.keep_freed_bytes):
        log.warning("not glibc: freed image buffers go back to the kernel (each large decode pays its page "
                    "faults again)")
    directory = Path(config.checkpoint)
    Checkpoint(directory).close()  # a missing or broken checkpoint is named before anything starts
    tokenizer = Tokenizer.from_pretrained(directory)
    pool = EncoderPool(directory, config.devices, limits=config.limits, threads_per_worker=config.threads_per_worker,
                       patchify=config.patchify, keep_freed_bytes=config.keep_freed_bytes)
    log.info("encoder workers: %s (%d torch/OpenCV threads each); %d request threads", ", ".join(pool.devices),
             pool.threads_per_worker, config.cpu_threads)
    try:
        model = None
        if config.components == "all":
            # The trunk shares the first GPU with encoder worker 0 when there is one; on CPU it
            # runs in float32 (bf16 matmuls are slow and inexact there), like the tower.
            first = pool.devices[0]
            device, dtype = (first, torch.bfloat16) if first.startswith("cuda") else ("cpu", torch.float32)
            model = KimiLinearForCausalLM.from_checkpoint(directory, dtype=dtype, device=device)
            if device == "cpu":
                share_cpus(model, pool)
            log.info("trunk: %s, %d torch threads in this process", device, torch.get_num_threads())
        return cls(config, tokenizer, pool, model, metrics)
    except BaseException:  # a model that cannot load, or a configuration that cannot serve it
        pool.close()
        raise


def decodable_ids(tokenizer: Tokenizer, vocab_size: int) -> torch.Tensor:
    """Bool [vocab_size]: ids the tokenizer can turn into text (its base ranks and the specials).

    The tiny default keeps the release's 163,840-row head but its vocabulary has only a few hundred
    base tokens; its random head would otherwise sample ids that have no text. With the release
    tokenizer every id decodes and the mask is all true."""
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[:tokenizer.num_base_tokens] = True
    mask[NUM_BASE_TOKENS:tokenizer.vocab_size] = True
    return mask


def name_or_path(checkpoint_dir: Path) -> str | None:
    """The checkpoint's own model id (`_name_or_path` in its config.json), if it has one."""
    try:
        name = json.loads((checkpoint_dir / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError):
        return None
    return name if isinstance(name, str) and name else None


def probe_png() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((56, 56, 3), 128, dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def warm_up(engine: Engine) -> None:
    """One small image through preprocessing, every encoder worker and a generation of two tokens
    through the scheduler, its prompt a few words and the image's rows (the serving path: the
    cached step, the prefill and the absorbed decode attention, the sampler and its logprobs), so
    the first real request pays no first-call costs (and a broken setup fails before it serves).
    Blocking."""
    probe = MediaInput(probe_png())
    engine.preparer.preprocess(probe)
    plan = plan_media(probe.modality, probe.data, probe.options, engine.config.limits)  # (not a request's caps)
    futures = [engine.pool.submit(probe, plan) for _ in engine.pool.devices]
    rows = [future.result() for future in futures][0]
    if engine.scheduler is None:
        return
    # Not a chat: the template alone is more tokens than a small --max-model-len (one sequence of
    # which is all the KV budget is known to hold).
    text = engine.tokenizer.encode("warm up")
    tokens = plan.num_tokens
    prompt = Prompt([*text, *[MEDIA_PAD_ID] * tokens], [Span(len(text), tokens)], thinking=False)
    ended: list[BaseException | None] = []
    done = threading.Event()

    def emit(item: Choice | BaseException | None) -> None:
        if not isinstance(item, Choice):
            ended.append(item)
            done.set()

    params = SamplingParams(max_new_tokens=2, ignore_eos=True, logprobs=True, top_logprobs=1)
    engine.scheduler.submit(Generation(prompt, [rows], params, emit))
    done.wait()
    if ended[0] is not None:
        raise ended[0]
