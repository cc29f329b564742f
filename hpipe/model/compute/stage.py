"""A stage: the units ``[start, end)`` of a model, their weights only, and their KV caches.

``forward(x, start, cache)`` takes token ids (if the stage holds the embedding) or the residual
stream ``[batch, tokens, hidden]``, for the positions ``start .. start+tokens-1`` of a sequence,
and returns the residual stream or, if the stage holds the head, logits (``None`` when told that
no logits are wanted: a prefill slice other than the last skips the LM head, the costliest unit
for one token).
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from hpipe.core.config import ModelConfig, RopeConfig
from hpipe.core.errors import InputError, ModelSourceError
from hpipe.core.units import UnitRange
from hpipe.model.compute import packed, stage_kernel
from hpipe.model.compute.layers import Attention, FeedForward, Head, build_unit, checkpoint_names, fused_rows, is_norm
from hpipe.model.compute.linear import DequantEmbedding, DequantLinear, QuantEmbedding, QuantLinear, prefill_rows
from hpipe.model.compute.rope import Rotary
from hpipe.model.kernels import library
from hpipe.model.kv.cache import StageCache
from hpipe.model.kv.pool import BLOCK_SIZE, BatchKV, Entry, KVPool
from hpipe.model.weights.blocks import TYPES, QuantizedWeight, random_weight
from hpipe.model.weights.dequant import dequantize
from hpipe.model.weights.store import WeightStore

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    dtype = name if isinstance(name, torch.dtype) else DTYPES.get(str(name).lower())
    if dtype is None:
        raise InputError(f"unknown dtype {name!r} (choose from float32, bfloat16, float16)")
    if dtype == torch.float16 and torch.device(device).type == "cpu":
        raise InputError("float16 is not supported on the CPU; use float32 or bfloat16")
    return dtype


class StageModel(nn.Module):
    def __init__(self, cfg: ModelConfig, units: UnitRange, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        super().__init__()
        if units.num_layers != cfg.num_layers:
            raise InputError(f"unit range {units} is for {units.num_layers} layers, the model has {cfg.num_layers}")
        self.cfg, self.units, self.dtype, self.device = cfg, units, dtype, torch.device(device)
        with torch.device("meta"):
            self.blocks = nn.ModuleDict({str(u): build_unit(cfg, u) for u in units})
        #: each RoPE the stage's attention units turn by (Gemma's sliding layers have their own)
        self.rotaries = {b.rope: Rotary(b.rope, cfg.head_dim, cfg.max_position_embeddings, self.device)
                         for b in self.blocks.values() if isinstance(b, Attention)}
        self._kernel: stage_kernel.StageKernel | None = None  # built on its first decode micro-batch
        self._low_precision = False  # whether its quantized projections compute prefill rows in bfloat16

    # --- construction -------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, store: WeightStore, cfg: ModelConfig, units: UnitRange, *,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        pack: bool | None = None) -> "StageModel":
        """Build the stage and read only its own tensors from ``store``.

        ``pack``: pack float32 CPU projections for MKL (:mod:`hpipe.model.compute.packed`); None (the
        default): where that pays (:func:`packed.pays`); True or False to compare the layouts.
        """
        stage = cls(cfg, units, dtype=dtype, device=device)
        for u, module in stage.blocks.items():
            names = checkpoint_names(cfg, int(u), module)
            label = getattr(store, "label", "the checkpoint")
            state = {}
            for p, parts in names.items():
                try:
                    state[p] = store.load_stacked(list(parts))
                except ModelSourceError as e:  # tensors that cannot be stacked: name the file and them
                    raise ModelSourceError(f"{label}: tensors {', '.join(parts)}: {e}") from None
            _check_shapes(module, state, names, label)
            if cfg.norm_offset:  # Gemma's checkpoints store a norm's factor minus one
                state.update({p: t.float() + cfg.norm_offset for p, t in state.items() if is_norm(p)})
            for p, weight in list(state.items()):
                if isinstance(weight, QuantizedWeight):
                    state.pop(p)
                    stage._place_quantized(module, p.rpartition(".")[0], weight, state)
            module.load_state_dict({p: t.to(device=stage.device, dtype=dtype) for p, t in state.items()},
                                   assign=True, strict=True)
        return stage._finish(pack)

    def _place_quantized(self, module: nn.Module, child: str, weight: QuantizedWeight, state: dict) -> None:
        """The linear or embedding ``child`` of ``module`` computes from ``weight``'s blocks (and its
        bias, popped from ``state``, goes with it): through the C++ kernels in float32 on the CPU,
        dequantized into the stage's dtype at each use on a GPU (:mod:`hpipe.model.weights.dequant`), or,
        on the CPU in another dtype, from ``weight`` dequantized once into it."""
        embedding = isinstance(getattr(module, child), nn.Embedding)
        if _at_use(self.device):
            weight = weight.to(self.device)
            setattr(module, child, DequantEmbedding(weight, self.dtype) if embedding else DequantLinear(
                weight, _to(state.pop(f"{child}.bias", None), self.device, self.dtype), self.dtype))
        elif self.dtype != torch.float32:
            state[f"{child}.weight"] = dequantize(weight.data, weight.parts.tolist(), weight.in_features, self.dtype)
        else:
            library.require("a stage of quantized weights")
            setattr(module, child, QuantEmbedding(weight) if embedding else QuantLinear(
                weight, state.pop(f"{child}.bias", None)))

    def _finish(self, pack: bool | None) -> "StageModel":
        # weights are in place: tie the embedding to the head, pack, switch to inference
        self._tie_embeddings()
        if self._quantized() and self.device.type == "cpu" and self.dtype == torch.float32:
            # its prefill slices follow the quantized kernels' precision, the head does not
            for block in self.modules():
                if isinstance(block, Attention):
                    block.low_precision_prefill = True
                if isinstance(block, (Attention, FeedForward)):
                    for m in block.modules():
                        if isinstance(m, QuantLinear):
                            m.low_precision = self._low_precision = True
                if isinstance(block, Head) and isinstance(block.lm_head, QuantLinear):
                    block.lm_head.head = True
        if pack is None:
            pack = packed.applies(self.device, self.dtype)
        if pack:
            self._pack()
        return self.eval()

    def _pack(self) -> None:
        # float32 on the CPU: the block projections' weights packed once for MKL (see
        # :mod:`hpipe.model.compute.packed`), and the LM head's unless it is this stage's embedding too (a
        # packed copy would double that tensor): a decode micro-batch of 16 rows took 16 ms through
        # SmolLM2's packed head against 26 ms plain, one row 8.5 against 9.6 ms (one thread)
        if not packed.possible(self.device, self.dtype):
            return
        for block in self.blocks.values():
            if isinstance(block, Attention):
                packed.pack_linears(block, ("qkv_proj", "o_proj"))
            elif isinstance(block, FeedForward):
                packed.pack_linears(block, ("gate_up_proj", "down_proj"))
            elif isinstance(block, Head) and not (self.cfg.tie_word_embeddings and self.units.has_embed):
                packed.pack_linears(block, ("lm_head",))

    def _tie_embeddings(self) -> None:
        # One tensor for embedding and LM head when the model ties them and this stage has both.
        if self.cfg.tie_word_embeddings and self.units.has_embed and self.units.has_head:
            head, embed = self.blocks[str(self.units.end - 1)], self.blocks["0"].embed_tokens
            if isinstance(embed, QuantEmbedding):
                head.lm_head = QuantLinear(embed.quantized)
            elif isinstance(embed, DequantEmbedding):
                head.lm_head = DequantLinear(embed.quantized, None, self.dtype)
            else:
                head.lm_head.weight = embed.weight

    @classmethod
    def random(cls, cfg: ModelConfig, units: UnitRange, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", seed: int = 0, pack: bool | None = None,
               weight_type: int = 0) -> "StageModel":
        """Random weights that depend only on (seed, unit): any split gives the same model.
        ``weight_type`` (a ggml type; 0: none): the matrices are random blocks of that type instead,
        as a stage of a GGUF holds them (the profiler times such units); a matrix whose width the
        type's blocks do not divide stays float."""
        stage = cls(cfg, units, dtype=dtype, device=device)
        for u, module in stage.blocks.items():
            names = checkpoint_names(cfg, int(u), module)
            state = {}
            for p, parts in names.items():
                shape = module.get_parameter(p).shape
                rows = fused_rows(cfg, p) if len(parts) > 1 else (shape[0],)
                pieces = []
                for hf_name, n in zip(parts, rows):
                    piece = (n, *shape[1:])
                    if is_norm(p):
                        pieces.append(torch.ones(piece, device=stage.device, dtype=dtype))
                        continue
                    digest = hashlib.sha256(f"{seed}:{hf_name}".encode()).digest()
                    gen = torch.Generator(device=stage.device).manual_seed(int.from_bytes(digest[:8], "little"))
                    pieces.append(torch.empty(piece, device=stage.device, dtype=dtype).normal_(0.0, 0.02,
                                                                                                generator=gen))
                state[p] = _stacked(pieces)
            if weight_type:
                per_block = TYPES[weight_type][1]
                for p, t in list(state.items()):
                    if p.endswith(".weight") and t.dim() == 2 and t.shape[1] % per_block == 0:
                        digest = hashlib.sha256(f"{seed}:{u}:{p}:blocks".encode()).digest()
                        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
                        state.pop(p)
                        stage._place_quantized(module, p.rpartition(".")[0],
                                               random_weight(weight_type, t.shape[0], t.shape[1], gen), state)
            module.load_state_dict(state, assign=True, strict=True)
        return stage._finish(pack)

    # --- caches ---------------------------------------------------------------------------
    def new_cache(self, batch: int, max_len: int) -> StageCache:
        """A cache of its own for ``batch`` rows of up to ``max_len`` positions (single-process use)."""
        self._check_max_len(max_len)
        return StageCache.allocate(self.units.attention_layers(), batch, max_len, self.cfg.num_kv_heads,
                                   self.cfg.head_dim, self.dtype, self.device)

    def new_pool(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> KVPool | None:
        """A pool of ``num_blocks`` KV blocks shared by the sequences of a daemon (None: no attention here)."""
        layers = self.units.attention_layers()
        return KVPool(layers, num_blocks, self.cfg.num_kv_heads, self.cfg.head_dim, self.dtype, self.device,
                      block_size) if layers else None

    def block_bytes(self) -> int:
        """Bytes of one KV block of this stage (0 for a stage without attention)."""
        return KVPool.block_bytes(len(self.units.attention_layers()), self.cfg.num_kv_heads, self.cfg.head_dim,
                                  self.dtype)

    def _check_max_len(self, max_len: int) -> None:
        if max_len > self.cfg.max_position_embeddings:
            raise InputError(
                f"declared max length {max_len} exceeds the model's context of {self.cfg.max_position_embeddings} tokens"
            )

    # --- forward --------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, x: torch.Tensor, start: int, cache: StageCache, *, all_logits: bool = False,
                logits: bool = True, prefill: bool | None = None) -> torch.Tensor | None:
        """Positions ``[start, start + tokens)`` of the ``batch`` rows of one cache: ``x`` is token ids
        ``[batch, tokens]`` or the residual stream ``[batch, tokens, hidden]``. Returns the residual
        stream, or at the head the logits of the last position ``[batch, 1, vocab]`` (every position's
        with ``all_logits``; None when no logits are wanted). ``prefill``: the positions are the
        prompt's (True: prefill rows, also a slice of one token) or decode tokens (False); None
        decides by length (two tokens or more: prefill), as the profiler's timings want."""
        if self.units.has_embed:
            if x.dtype not in (torch.int64, torch.int32) or x.dim() != 2:
                raise InputError(f"the first stage takes token ids [batch, tokens], got {x.dtype} {tuple(x.shape)}")
        elif x.dim() != 3 or x.shape[-1] != self.cfg.hidden_size:
            raise InputError(
                f"stage {self.units} takes the residual stream [batch, tokens, {self.cfg.hidden_size}], "
                f"got {tuple(x.shape)}"
            )
        batch, tokens = x.shape[0], x.shape[1]
        cache.check_slice(start, tokens, batch)
        wanted = "all" if all_logits else "last" if logits else "none"
        out = self.forward_batch(x.reshape(batch * tokens, *x.shape[2:]), cache.entries(start, tokens, wanted, prefill),
                                 cache.pool)
        cache.length = start + tokens
        if out is None or not self.units.has_head:
            return None if out is None else out.view(batch, tokens, -1)
        return out.view(batch, tokens if all_logits else 1, -1)

    @torch.inference_mode()
    def forward_batch(self, x: torch.Tensor, entries: list[Entry], pool: KVPool | None) -> torch.Tensor | None:
        """One micro-batch: ``x`` holds the tokens of every entry, concatenated (ids ``[tokens]`` at the
        first stage, else the residual stream ``[tokens, hidden]``). Norms, projections and MLPs run
        once over all of them; attention runs each entry against its own sequence's cache.

        Returns the residual stream ``[tokens, hidden]``, or at the head the logits ``[rows, vocab]``
        of the rows the entries ask for (in entry order), None if none does."""
        tokens = sum(e.length for e in entries)
        if x.shape[0] != tokens:
            raise InputError(f"the micro-batch has {x.shape[0]} tokens; its entries cover {tokens}")
        if self.units.has_embed:
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.cfg.vocab_size):
                raise InputError(f"token ids must lie in [0, {self.cfg.vocab_size})")
            x = x.to(self.device)
        else:
            x = x.to(self.device, self.dtype)
        positions = torch.cat([torch.arange(e.start, e.start + e.length) for e in entries]).to(self.device)
        tables = self.rotations(positions)
        if library.applies(self.device, self.dtype) and stage_kernel.fits(entries, pool):
            return self._decode_kernel(x, tables, entries, pool)
        kv = BatchKV(entries, pool, self.device) if pool is not None else None
        x = x[None]
        with prefill_rows(_prefill_rows(entries) if self._low_precision else None):
            for u, block in self.blocks.items():
                if isinstance(block, Attention):
                    x = block(x, *tables[block.rope], kv)
                elif self.units.has_head and int(u) == self.units.end - 1:
                    return self._logits(x[0], entries)
                else:
                    x = block(x)
        return x[0]

    def rotations(self, positions: torch.Tensor) -> dict[RopeConfig, tuple[torch.Tensor, torch.Tensor]]:
        """Each of the stage's RoPEs' (cos, signed sin) at ``positions [tokens]``, what its attention
        units take (:meth:`Attention.forward`)."""
        return {rope: rotary.cos_sin(positions, self.dtype) for rope, rotary in self.rotaries.items()}

    def _decode_kernel(self, x: torch.Tensor, tables: dict, entries: list[Entry], pool: KVPool) -> torch.Tensor | None:
        """:meth:`forward_batch` of a decode micro-batch through the C++ kernel (:mod:`hpipe.model.compute.stage_kernel`)."""
        if self._kernel is None:
            self._kernel = stage_kernel.StageKernel(
                [b for b in self.blocks.values() if isinstance(b, (Attention, FeedForward))], self.cfg)
        if self.units.has_embed:
            x = self.blocks["0"](x)
        x = self._kernel(x, tables, entries, pool)
        return self._logits(x, entries) if self.units.has_head else x

    def _logits(self, x: torch.Tensor, entries: list[Entry]) -> torch.Tensor | None:
        """The head over the rows of the residual stream ``x [tokens, hidden]`` the entries ask logits of."""
        rows = logit_rows(entries)
        if rows is None:
            return None
        with prefill_rows(_prefill_rows(entries)[rows]):  # the head's decode rows (QuantLinear.head)
            return self.blocks[str(self.units.end - 1)](x[rows] if len(rows) < len(x) else x)

    def parameter_count(self) -> int:
        """Parameters of the stage's units, packed and quantized weights included."""
        packed_numel = sum(m.weight_numel for m in self.modules() if isinstance(m, packed.PackedLinear))
        return sum(p.numel() for p in self.parameters()) + packed_numel + sum(
            w.rows * w.in_features for w in self._quantized())

    @property
    def low_precision_prefill(self) -> bool:
        """Whether its quantized projections multiply the rows of prefill slices in bfloat16 (while
        the process's prefill GEMM is bfloat16: :func:`hpipe.model.kernels.precision.prefill_in_bfloat16`)."""
        return self._low_precision

    def weight_bytes(self) -> int:
        """Bytes the stage's weights take: quantized ones as stored, the others in its dtype."""
        quantized = self._quantized()
        dense = self.parameter_count() - sum(w.rows * w.in_features for w in quantized)
        return dense * self.dtype.itemsize + sum(w.nbytes for w in quantized)

    def _quantized(self) -> list[QuantizedWeight]:
        """The stage's quantized weights, each once (a tied embedding and head share theirs)."""
        seen: dict[int, QuantizedWeight] = {}
        for m in self.modules():
            if isinstance(m, (QuantLinear, QuantEmbedding, DequantLinear, DequantEmbedding)):
                seen.setdefault(m.blocks.data_ptr(), m.quantized)
        return list(seen.values())


def _prefill_rows(entries: list[Entry]) -> torch.Tensor:
    """Which rows of a micro-batch are prefill rows (:attr:`Entry.prefill`: each entry's first ones)."""
    lengths = torch.tensor([e.length for e in entries])
    first = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)  # each row's entry's first row
    return torch.arange(len(first)) - first < torch.tensor([e.prefill for e in entries]).repeat_interleave(lengths)


def logit_rows(entries: list[Entry]) -> list[int] | None:
    """The rows of a micro-batch whose logits its entries ask for, in order (None: none)."""
    rows, off = [], 0
    for e in entries:
        if e.logits == "all":
            rows.extend(range(off, off + e.length))
        elif e.logits == "last":
            rows.append(off + e.length - 1)
        off += e.length
    return rows or None


def _at_use(device: torch.device) -> bool:
    """Whether a stage keeps its quantized weights as stored and dequantizes each at use, where it
    does not compute them with the CPU kernels: on a GPU, whose memory is what it lacks and whose
    bandwidth makes the pass cheap. Not on the CPU, where torch's operations make it the slowest
    way (SmolLM2 in bfloat16, 16 tokens: 19.7 s against 2.4 s dequantized once at load)."""
    return device.type != "cpu"


def _to(t: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(device=device, dtype=dtype)


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One checkpoint tensor as it is, or several stacked along dim 0 (a fused projection)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def _check_shapes(module: nn.Module, state: dict, names: dict[str, list[str]], label: str) -> None:
    """Refuse, naming the tensor, a stored tensor whose shape is not the one the model's config
    gives its parameter (a file whose metadata and tensors disagree: corrupt, or edited)."""
    for p, weight in state.items():
        want = tuple(module.get_parameter(p).shape)
        have = (weight.rows, weight.in_features) if isinstance(weight, QuantizedWeight) else tuple(weight.shape)
        if have != want:
            raise ModelSourceError(f"{label}: tensor {', '.join(names[p])} is {list(have)}; the model's config "
                                   f"makes it {list(want)}")
