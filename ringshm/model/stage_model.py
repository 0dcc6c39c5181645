"""``StageModel``: one contiguous layer range of a Llama-family decoder, with its own KV cache.

The model knows its layer range and whether it is first (embeds token ids) or last (final norm + LM head);
it knows nothing about processes or rings. RoPE, KV-append and attention go through ``ringshm.model.kernels``.

Two paths, fixed at construction:
- **CPU, fp32 activations (the default):** every matmul is ``ringshm.model.qmatmul`` over the checkpoint's own
  encoding (Q4_0 / Q4_1 / Q5_x / Q8_0 / Q4_K / Q5_K / Q6_K / MXFP4 / F16 / BF16 / F32, packed once at load), RMSNorm
  and SwiGLU are C kernels, and the embedding dequantizes only the rows it looks up. Every one of these
  computes a row in an order that does not depend on the other rows of the op or on the thread count, so a
  sequence's bits are the same whatever the chunking, the batch it shares an op with, or the stage split
  (batch invariance).
- **CUDA, or a bf16 compute dtype:** weights are dequantized at load to ``dtype`` on the device and the
  matmuls are ``torch.nn.functional.linear`` (the layer loop of ``ringshm.model.stage_torch``). Batch invariance is
  not promised there.

KV cache: per layer a ``KVPool`` (``ringshm.model.attention``) of ``n_blocks`` blocks of ``block_size`` positions,
``[n_blocks, n_kv_heads, block_size, head_dim]`` fp32 keys and values. A segment of a step op names its stream's
blocks in position order (its table, from the coordinator: ``ringshm.engine.kv_blocks``); rows are the
coordinator's stream slots. Without tables (an in-process caller) each row owns a fixed run of blocks (``row_table``).
Which positions each block holds is ``fill`` ``[n_blocks]``:

    segment (start s, n tokens, table T)  condition                           effect
    ------------------------------------  ----------------------------------  ---------------------------------------
    append / continue / overwrite          blocks before s hold every position  writes [s, s+n) into T's blocks, and
                                           (fill B), T[s // B] holds s % B       the blocks of [s, s+n) hold up to s+n
    read KV never written                  a block before s holds fewer         KVRangeError, nothing changed
    positions past the stage's context     s + n > max_seq_len                  KVRangeError, nothing changed
    reset(rows)                                                                 the rows' own blocks hold nothing

Layer math (Llama; Qwen2 adds q/k/v biases), per layer on the residual stream ``x [T, hidden]``:
    x += Wo · attention(rope(Wq · norm(x)), kv_append(rope(Wk · norm(x)), Wv · norm(x)))
    x += Wdown · (silu(Wgate · norm(x)) * (Wup · norm(x)))
Q, K and V are one fused matmul (``wqkv``), gate and up another (``w_gate_up``): fewer, larger GEMMs. A routed MoE
layer (``ModelConfig.moe``) replaces the last line with its router and experts (``ringshm.model_config.ModelConfig``'s
formula; csrc/layer.h for the order of every sum, which keeps each token's bits independent of its batch-mates).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ringshm._C import ffi, lib
from ringshm.config import DEFAULT_BLOCK_SIZE, MATMUL_ACTIVATIONS
from ringshm.errors import KVRangeError, check_status
from ringshm.model import kernels
from ringshm.model.attention import (
    MAX_HEAD_DIM,
    MAX_SEGMENTS,
    KVPool,
    kv_check,
    kv_mark,
    table_len,
)
from ringshm.model.head import StageOutput, head_outputs, plan_head
from ringshm.model.layer import Layer, layer_shape
from ringshm.model.loader import Checkpoint, StageWeights, check_layer_range
from ringshm.model.qmatmul import BEST_ISA, PackedWeight, embed_rows
from ringshm.model.rope import rope_inv_freq, rope_scale
from ringshm.model.stage_torch import TorchPath
from ringshm.model_config import ModelConfig
from ringshm.transport.messages import (
    MAX_TOP_LOGPROBS,
    WANT_ALL,
    WANT_ALLOWED,
    WANT_LAST,
    WANT_LOGITS,
    WANT_LOGPROBS,
    WANT_PROMPT_LOGPROBS,
    WANT_VALID,
    Segment,
)


class OpAbandoned(Exception):
    """Raised by ``StageModel.step`` when its ``abandoned`` check says every segment's stream has ended: the op
    stopped between layers. KV of the layers it ran was written into the segments' blocks but none of their
    positions is marked held (the streams are gone, their blocks go back unused)."""


@dataclass(frozen=True)
class StepPlan:
    """A checked step op: its segment table as int tuples, starts / lens int64 ``[n_seg]``, the block tables
    int32 ``[Σ n_table]`` and their offsets int64 ``[n_seg + 1]`` (segment i's table is
    ``tables[table_offs[i]:table_offs[i + 1]]``)."""

    table: list[tuple[int, int, int, int]]
    starts: torch.Tensor
    lens: torch.Tensor
    tables: torch.Tensor
    table_offs: torch.Tensor


def check_int8_runs_native(config: ModelConfig, activations: str) -> None:
    """Refuse 8-bit activations for a model whose stages would run the torch path (``runs_native``): it has no
    8-bit matmul, and the setting would be ignored silently.

    Raises:
        ValueError: ``activations`` is "int8" and the C layer does not take ``config``'s shapes."""
    if activations == "int8" and not runs_native(config, "cpu", torch.float32):
        raise ValueError(f"matmul_activations='int8' runs in the C layers, which need hidden % 16 == 0, intermediate "
                         f"% 8 == 0, expert widths % 16 == 0 and head_dim a multiple of 16 up to {MAX_HEAD_DIM} "
                         f"(this model: hidden {config.hidden}, intermediate {config.intermediate}, head_dim "
                         f"{config.head_dim}, experts {config.expert_intermediate}, shared "
                         f"{config.shared_expert_intermediate}): its stages run the torch path; use "
                         f"matmul_activations='float32'")


def runs_native(config: ModelConfig, device: str, dtype: torch.dtype) -> bool:
    """Whether a stage of ``config`` on ``device`` in ``dtype`` runs the C path (module docstring): fp32 on the CPU,
    and dims the kernels take as whole 16-float vectors; else the torch path, its weights dense in ``dtype``. A
    mixture of experts has no dense FFN: its ``intermediate`` (a key some files carry anyway) is not a dim."""
    return (device == "cpu" and dtype == torch.float32 and config.hidden % 16 == 0
            and (config.moe or config.intermediate % 8 == 0) and config.head_dim % 16 == 0
            and config.head_dim <= MAX_HEAD_DIM
            and config.expert_intermediate % 16 == 0 and config.shared_expert_intermediate % 16 == 0)


class StageModel(TorchPath):
    """Layers ``layer_range`` of a model, with the embedding when first and norm + LM head when last.

    Args:
        config: the whole model's shape.
        layer_range: ``range(start, stop)`` or ``(start, stop)`` inside ``[0, config.n_layers)``.
        is_first, is_last: whether this stage embeds token ids / applies final norm and LM head.
        max_rows: stream slots (a row appears at most once per op). max_seq_len: positions a stream may reach
            (≤ config's; the RoPE tables' length).
        dtype: activations (and dequantized weights on the torch path): fp32 default, bf16 option (torch path).
        kv_dtype: what the KV pools store: fp32 (default), fp16 or bf16 (``attention.KV_DTYPES``; rounded on
            append, read back exactly).
        weights: the stage's weights from ``ringshm.model.loader``; ``from_path`` loads them for you.
        block_size: positions per KV block (a multiple of ``attention.KEY_TILE``, at most ``attention.MAX_BLOCK``).
        n_blocks: blocks in this stage's pools; default: enough for every row to reach ``max_seq_len``
            (``row_table``'s fixed layout).
        activations: what the C path's matmuls of quantized weights multiply, "float32" or "int8" (the LM head's too;
            ``EngineConfig.matmul_activations``); the torch path ignores it.
        release_weights: set each ``weights.layers[j]`` to None once that layer is packed (``from_path``, which
            owns them: a load then never holds every layer's tensors as read beside the packed copy); False keeps
            them, for weights shared by several stages (``StageWeights.select``).

    Raises:
        LayerRangeError: the range is empty or outside the model.
        ValueError: ``max_rows``/``max_seq_len``/``n_blocks`` not positive, a bad block size, or weights for a
            different range.
    """

    def __init__(self, config: ModelConfig, layer_range: range | tuple[int, int], is_first: bool,
                 is_last: bool, max_rows: int, max_seq_len: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", weights: StageWeights | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, n_blocks: int | None = None,
                 kv_dtype: torch.dtype = torch.float32, release_weights: bool = False,
                 activations: str = "float32") -> None:
        self.config = config
        if activations not in MATMUL_ACTIVATIONS:
            raise ValueError(f"activations must be one of {MATMUL_ACTIVATIONS}, got {activations!r}")
        self.activations = activations
        self.layer_range = check_layer_range(layer_range, config.n_layers)
        if max_rows <= 0 or max_seq_len <= 0:
            raise ValueError(f"max_rows and max_seq_len must be positive, got {max_rows}, {max_seq_len}")
        if weights is None or weights.layer_range != self.layer_range:
            got = None if weights is None else weights.layer_range
            raise ValueError(f"StageModel for layers {self.layer_range} needs their weights, got {got}; "
                             f"use StageModel.from_path to load them")
        if (is_first and weights.embed is None) or (is_last and (weights.norm is None or weights.lm_head is None)):
            raise ValueError("weights lack the embedding (first stage) or final norm / LM head (last stage)")
        self.is_first, self.is_last = is_first, is_last
        self.max_rows, self.max_seq_len = max_rows, max_seq_len
        self.block_size = block_size
        self.blocks_per_row = table_len(max_seq_len, block_size)
        self.n_blocks = max_rows * self.blocks_per_row if n_blocks is None else n_blocks
        if self.n_blocks <= 0:
            raise ValueError(f"n_blocks must be positive, got {n_blocks}")
        self.dtype, self.device = dtype, torch.device(device)
        self.native = runs_native(config, self.device.type, dtype)
        if activations == "int8":
            if self.device.type != "cpu" or dtype != torch.float32:
                raise ValueError("activations='int8' runs on the CPU in float32")
            check_int8_runs_native(config, activations)
        self.norm = self.lm_head = self.embed = None
        if is_first:  # native: the encoded rows (a view of the file's map); else a dense table
            self.embed = weights.embed if self.native else weights.embed.dequantize().to(self.device, dtype)
        if is_last:
            self.norm = weights.norm.to(self.device, torch.float32 if self.native else dtype)
            self.lm_head = (PackedWeight(weights.lm_head) if self.native
                            else weights.lm_head.dequantize().to(self.device, dtype))
        self.layers = []
        for j in range(len(weights.layers)):  # a layer's checkpoint tensors may go once it is packed (from_path):
            self.layers.append(Layer(weights.layers[j], self.native, dtype, self.device))  # an HF load then holds
            if release_weights:  # them beside the packed copy one layer at a time, not all at once
                weights.layers[j] = None
        n_kv, d = config.n_kv_heads, config.head_dim
        self.kv = [KVPool(self.n_blocks, n_kv, block_size, d, self.device, kv_dtype) for _ in self.layers]
        self.fill = torch.zeros(self.n_blocks, dtype=torch.int32)  # positions each block holds
        # one RoPE table per distinct (base, scaling) among the stage's layers (Gemma 3: local and global)
        tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rope = []  # per layer of the stage: (cos, sin) [max_seq_len, D/2] fp32
        for i in self.layer_range:
            key = config.rope_of(i)
            if key not in tables:
                tables[key] = kernels.rope_tables(d, max_seq_len, inv_freq=rope_inv_freq(config, i),
                                                  device=self.device, scale=rope_scale(config, i))
            self.rope.append(tables[key])
        self.windows = [config.window(i) for i in self.layer_range]
        if self.native:
            self._c_layers = [layer.bind(kv, cos, sin, window) for layer, kv, (cos, sin), window in
                              zip(self.layers, self.kv, self.rope, self.windows)]
            self._c_shape = layer_shape(config, max_seq_len, activations)
            self._work = torch.empty(0, dtype=torch.float32)  # the layers' scratch, grown to the largest op

    @classmethod
    def from_path(cls, path: str | Path, layer_range: range | tuple[int, int] | None = None,
                  is_first: bool | None = None, is_last: bool | None = None, max_rows: int = 1,
                  max_seq_len: int = 2048, dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu", checkpoint: Checkpoint | None = None,
                  block_size: int = DEFAULT_BLOCK_SIZE, n_blocks: int | None = None,
                  kv_dtype: torch.dtype = torch.float32, activations: str = "float32") -> StageModel:
        """Load a stage from a ``.gguf`` file or HF directory, reading only its own tensors.

        ``layer_range`` defaults to all layers; ``is_first``/``is_last`` default to whether the range
        touches layer 0 / the last layer. ``max_seq_len`` is capped at the model's context length.
        Pass an already opened ``checkpoint`` to skip re-parsing the file. A GGUF's pages are dropped from this
        process once the weights are packed (``GGUFIndex.drop_pages``): the embedding faults its rows back in. Each
        layer's tensors as read (an HF checkpoint's are in memory, a GGUF's are views of its map) are let go once
        that layer is packed, so the packed copy never sits beside all of them.

        Raises:
            the errors of ``Checkpoint.open`` and ``Checkpoint.load_stage``.
        """
        ckpt = checkpoint if checkpoint is not None else Checkpoint.open(path)
        cfg = ckpt.config
        r = check_layer_range(layer_range if layer_range is not None else (0, cfg.n_layers), cfg.n_layers)
        first = r.start == 0 if is_first is None else is_first
        last = r.stop == cfg.n_layers if is_last is None else is_last
        weights = ckpt.load_stage(r, first, last)
        stage = cls(cfg, r, first, last, max_rows, min(max_seq_len, cfg.max_seq_len), dtype, device, weights,
                    block_size, n_blocks, kv_dtype, release_weights=True, activations=activations)
        if ckpt.gguf:  # every weight is packed (or dequantized) now: the file's pages need not stay in this process
            ckpt.source.index.drop_pages()
        return stage

    def reserve(self, tokens: int) -> None:
        """Allocate and touch the C layers' scratch for step ops of up to ``tokens`` tokens now, so that the first
        long op does not pay for it: the kernel's first touch of ~160 MB of fresh pages (OLMoE, 512 tokens) took
        ~0.1-0.3 s of that op's TTFT. A later larger op still grows it. No-op off the native path."""
        if self.native:
            need = lib.ringshm_layer_work_floats(self._c_shape, max(1, tokens))
            if self._work.numel() < need:
                self._work = torch.zeros(need, dtype=torch.float32)

    # ---- rows without tables (in-process use)
    # ------------------------------------------------------------------------------

    def row_table(self, row: int) -> torch.Tensor:
        """The fixed table of ``row`` for callers that send none (in-process use): blocks
        ``[row * blocks_per_row, (row + 1) * blocks_per_row)``, int32.

        Raises:
            KVRangeError: a row outside ``[0, max_rows)``, or a pool too small for the fixed layout."""
        self._check_row(row)
        if (row + 1) * self.blocks_per_row > self.n_blocks:
            raise KVRangeError(f"row {row}: the pool's {self.n_blocks} blocks do not hold a fixed run of "
                               f"{self.blocks_per_row} per row; send block tables")
        return torch.arange(row * self.blocks_per_row, (row + 1) * self.blocks_per_row, dtype=torch.int32)

    def row_length(self, row: int) -> int:
        """Positions ``row``'s fixed blocks (``row_table``) hold from position 0 on."""
        total = 0
        for f in self.fill[self.row_table(row).long()].tolist():
            total += f
            if f < self.block_size:
                break
        return total

    def reset(self, rows: int | Sequence[int] | None = None) -> None:
        """Forget what rows ``rows`` (all when None) hold in their fixed blocks (``row_table``): those blocks
        hold nothing any more. Memory is not cleared."""
        for r in range(self.max_rows) if rows is None else ([rows] if isinstance(rows, int) else rows):
            self.fill[self.row_table(r).long()] = 0

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_rows:
            raise KVRangeError(f"row {row} outside the stage's rows [0, {self.max_rows})")

    # ---- forward ---------------------------------------------------------------------------------

    def check_segments(self, segments: Sequence[Sequence[int]], n_tokens: int,
                       tables: torch.Tensor | None = None) -> StepPlan:
        """Validate a step op against this stage's KV before anything is written.

        ``segments``: ``(row, start, n_tokens, want)`` entries (``ringshm.transport.messages.Segment``); ``n_tokens``:
        the op's token count T; ``tables``: int32 ``[Σ ceil((start + n) / block_size)]``, each segment's block
        table in table order (None: each row's fixed table, ``row_table``). Returns the op as a ``StepPlan``.

        Raises:
            KVRangeError: a row outside the stage's rows, positions past ``max_seq_len``, or a segment whose table
                is short, names a block outside the pool, or reads KV its blocks do not hold (the message names it).
            ValueError: an empty table or one of more than ``attention.MAX_SEGMENTS``, a segment of < 1 token, a
                row in two segments, a ``want`` with unknown bits, segment tokens that do not add up to T, or a
                tables tensor of the wrong dtype or length.
        """
        if not segments:
            raise ValueError("a step op needs at least one segment")
        if len(segments) > MAX_SEGMENTS:
            raise ValueError(f"a step op of {len(segments)} segments is over the {MAX_SEGMENTS} one op may hold")
        table = [tuple(int(v) for v in seg) for seg in segments]
        seen: dict[int, int] = {}
        for i, (row, start, n, want) in enumerate(table):
            where = f"segment {i} (row {row}, start {start}, {n} tokens)"
            if n < 1 or want & ~WANT_VALID or (want & (WANT_LOGITS | WANT_ALLOWED) and not want & (WANT_LAST | WANT_ALL)
                                              ) or (want & WANT_ALLOWED and want & WANT_LOGITS):
                raise ValueError(f"{where}: needs n_tokens >= 1 and a want of WANT_* bits (LOGITS or ALLOWED only "
                                 f"with LAST or ALL, not both), got want {want:#x}")
            k = Segment(row, start, n, want).k
            if (want & WANT_LOGPROBS and not want & (WANT_LAST | WANT_ALL)) or (
                    want & WANT_PROMPT_LOGPROBS and want & WANT_ALL) or k > MAX_TOP_LOGPROBS or (
                    k and not want & (WANT_LOGPROBS | WANT_PROMPT_LOGPROBS)):
                raise ValueError(f"{where}: LOGPROBS needs LAST or ALL, PROMPT_LOGPROBS excludes ALL, and a top-k "
                                 f"count (<= {MAX_TOP_LOGPROBS}) needs one of them; got want {want:#x}")
            if row in seen:
                raise ValueError(f"{where}: row {row} is already segment {seen[row]}; a row may appear once per op")
            seen[row] = i
            if not 0 <= row < self.max_rows:
                raise KVRangeError(f"{where}: row {row} outside the stage's rows [0, {self.max_rows})")
            if start < 0 or start + n > self.max_seq_len:
                raise KVRangeError(f"{where}: positions [{start}, {start + n}) run past max_seq_len {self.max_seq_len}")
        if sum(n for _, _, n, _ in table) != n_tokens:
            raise ValueError(f"the segments hold {sum(n for _, _, n, _ in table)} tokens, the op carries {n_tokens}")
        starts = torch.tensor([s for _, s, _, _ in table], dtype=torch.int64)
        lens = torch.tensor([n for _, _, n, _ in table], dtype=torch.int64)
        need = [table_len(s + n, self.block_size) for _, s, n, _ in table]
        offs = torch.tensor([0, *itertools.accumulate(need)], dtype=torch.int64)  # [n_seg + 1]
        if tables is None:
            tables = torch.cat([self.row_table(r)[:k] for (r, _, _, _), k in zip(table, need)])
        elif tables.dtype != torch.int32 or tables.dim() != 1 or tables.numel() != int(offs[-1]):
            raise ValueError(f"the op's block tables must be int32 [{int(offs[-1])}] (ceil((start + n) / "
                             f"{self.block_size}) per segment), got {tables.dtype} {tuple(tables.shape)}")
        tables = tables.contiguous()
        bad = kv_check(self.fill, self.block_size, tables, offs, starts, lens)
        if bad >= 0:
            row, start, n, _ = table[bad]
            blocks = tables[int(offs[bad]):int(offs[bad + 1])]
            raise KVRangeError(f"segment {bad} (row {row}, start {start}, {n} tokens): its blocks "
                               f"{blocks.tolist()[:8]}{'...' if blocks.numel() > 8 else ''} do not hold the "
                               f"{start} positions before it (or name blocks outside the pool of {self.n_blocks})")
        return StepPlan(table, starts, lens, tables, offs)

    def step(self, x: torch.Tensor, segments: Sequence[Sequence[int]], targets: torch.Tensor | None = None,
             tables: torch.Tensor | None = None, abandoned=None, allowed=None
             ) -> torch.Tensor | StageOutput:
        """Run one step op: a ragged batch of segments, each ``n ≥ 1`` positions of a stream in the blocks its
        table names.

        ``x``: int64 token ids ``[T]`` on the first stage, else hidden states ``[T, hidden]`` (``dtype``), the
        segments' tokens one after another in table order. ``segments``: ``(row, start, n_tokens, want)``
        (``ringshm.transport.messages.Segment``; ``want`` of ``WANT_*``). ``tables``: as ``check_segments``.
        Matmuls, norms and the FFN run over all T tokens at once; RoPE, KV-append and attention per segment
        through its table. Each segment writes KV at ``[start, start+n)`` of its stream.

        Returns hidden states ``[T, hidden]``, or on the last stage a ``StageOutput``: ``token_ids`` int64
        ``[Σ outputs]`` (per segment in table order: none for ``WANT_NONE``, the last position's argmax for
        ``WANT_LAST``, every position's for ``WANT_ALL``), ``logits`` fp32 ``[n, vocab]`` of the last
        position of the n segments with ``WANT_LOGITS`` (None when none asks), and the logprobs of the
        positions with ``WANT_LOGPROBS`` / ``WANT_PROMPT_LOGPROBS`` (``ringshm.model.head``; the layout is
        ``ringshm.transport.messages``'). ``targets``: int64 ``[Σ n_targets]``, the id after each prompt position
        that ``WANT_PROMPT_LOGPROBS`` scores (only the last stage reads it). ``allowed``: int32
        ``[Σ n_allowed_rows, ceil(vocab / 32)]``, the token bitmask of each output position of the ``WANT_ALLOWED``
        segments, or a callable returning it, called once the logits are computed (the last stage's MASKS record:
        ``ringshm.runtime.stage``; ``ringshm.model.head.head_outputs``; only the last stage reads it). On the native
        path a segment's bytes do not depend on the other segments nor on where its blocks sit in the pool (batch
        invariance).
        ``abandoned``: None, or a callable asked before each layer whether every segment's stream has ended (a
        client that left: ``ringshm.runtime.stage.apply``); when it says so the op stops there.

        Raises:
            OpAbandoned: ``abandoned()`` returned True before a layer.
            KVRangeError / ValueError: as ``check_segments`` (nothing is written), ``x`` of the wrong shape
                or dtype for this stage, or (last stage) ``targets`` not one id per target position, ``allowed``
                not one bitmask row per masked output.
        """
        h = self._input(x)  # [T, hidden]
        op = self.check_segments(segments, h.shape[0], tables)
        plan = plan_head(op.table, [] if targets is None else targets.tolist(), allowed, self.config.vocab
                         ) if self.is_last else None
        if self.native:
            h = self._native_layers(h, op, abandoned, plan.positions if self.is_last else None)
        else:
            for li, layer in enumerate(self.layers):
                if abandoned is not None and abandoned():
                    raise OpAbandoned(f"every stream of the op ended before layer {self.layer_range.start + li}")
                h = self._layer(layer, li, h, lambda q, k, v, li=li: self._attend_segments(li, q, k, v, op))
        kv_mark(self.fill, self.block_size, op.tables, op.table_offs, op.starts, op.lens)
        if not self.is_last:
            return h
        return self._head(h, plan)

    def forward(self, x: torch.Tensor, row: int, start: int, *, all_positions: bool = False,
                return_logits: bool = False) -> torch.Tensor | StageOutput:
        """``step`` with one segment: ``n ≥ 1`` positions of ``row`` from ``start`` (a local convenience).

        ``x``: int64 ids ``[n]`` (first stage) or hidden states ``[n, hidden]``. Returns ``[n, hidden]``, or on
        the last stage a ``StageOutput`` with argmax ids ``[n]`` (``all_positions``) or ``[1]``, and the last
        position's fp32 logits ``[vocab]`` when ``return_logits``.

        Raises:
            as ``step``.
        """
        want = (WANT_ALL if all_positions else WANT_LAST) | (WANT_LOGITS if return_logits else 0)
        out = self.step(x, [(row, start, x.shape[0], want)])
        if isinstance(out, StageOutput) and out.logits is not None:
            out.logits = out.logits[0]
        return out

    __call__ = forward

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            if x.dim() != 1 or x.dtype != torch.int64 or x.shape[0] < 1:
                raise ValueError(f"first stage takes int64 token ids of [T], T ≥ 1; got {x.dtype} {tuple(x.shape)}")
            h = embed_rows(self.embed, x) if self.native else F.embedding(x.to(self.device), self.embed)  # [T, hidden]
            if self.config.embed_scale != 1.0:  # Gemma: x sqrt(hidden), an fp32 product per element
                h = h * torch.tensor(self.config.embed_scale, dtype=h.dtype, device=h.device)
            return h
        hidden = self.config.hidden
        if x.dim() != 2 or x.shape[1] != hidden or x.shape[0] < 1:
            raise ValueError(f"stage takes hidden states of [T, {hidden}], T ≥ 1; got {tuple(x.shape)}")
        return x.to(device=self.device, dtype=self.dtype)

    def _native_layers(self, h: torch.Tensor, op: StepPlan, abandoned=None, wanted: list[int] | None = None
                       ) -> torch.Tensor:
        """Every layer on ``h [T, hidden]`` for a checked op, one ``ringshm_layer_forward`` call per layer
        (``abandoned`` asked before each, as in ``step``). Returns a new ``[T, hidden]`` tensor.

        ``wanted``: on the last stage, the rows the head reads (``HeadPlan.positions``). Where they are at most half
        of T, the last layer writes every token's keys and values (``ringshm_layer_kv``) but runs attention, the output
        projection and the FFN on the wanted rows alone, each as a one-token segment at its position
        (``_wanted_rows``): the same bits for those rows (a token's rows do not depend on the tokens beside it, as
        chunking invariance asks), the other rows left as the layer before wrote them (nothing reads them). A
        256-token prefill chunk that wants one position thus skips 255 / 256 of the last layer's work after K / V
        (1 / 16 of the Llama-3.2-1B shape's layers); a chunk that wants none skips all of it."""
        if not self.is_first:  # written in place: a later stage's input may be a read-only ring record
            h = h.clone(memory_format=torch.contiguous_format)
        t = h.shape[0]
        need = lib.ringshm_layer_work_floats(self._c_shape, t)
        if self._work.numel() < need:
            self._work = torch.empty(need, dtype=torch.float32)
        args = self._layer_args(h, op.starts, op.lens, op.tables, op.table_offs)
        rows = None if wanted is None else sorted(set(wanted))
        # a few wanted rows only: each costs its Q / K / V again and a segment of its own
        few = rows is not None and 2 * len(rows) <= t and len(rows) <= MAX_SEGMENTS
        cut = len(self._c_layers) - 1 if few else len(self._c_layers)
        for li, c in enumerate(self._c_layers):
            if abandoned is not None and abandoned():
                raise OpAbandoned(f"every stream of the op ended before layer {self.layer_range.start + li}")
            status = (lib.ringshm_layer_forward if li < cut else lib.ringshm_layer_kv)(self._c_shape, c, *args)
            if status:  # the Python checks ran first: a refusal here is a bug or a malformed tensor
                check_status(status, f"layer {self.layer_range.start + li}: the C layer refused the op")
            if li == cut and rows:
                self._wanted_rows(h, op, rows, c, li)
        return h

    def _layer_args(self, h: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, tables: torch.Tensor,
                    table_offs: torch.Tensor) -> tuple:
        """``ringshm_layer_forward`` / ``ringshm_layer_kv``'s arguments after shape and weights for ``h [T, hidden]``
        fp32 and a segment table (int64 ``starts`` / ``lens [n_seg]``, int32 ``tables``, int64 ``table_offs
        [n_seg + 1]``), on this stage's scratch, threads and ISA. The tensors must outlive the call."""
        i64 = lambda v: ffi.cast("int64_t *", v.data_ptr())  # noqa: E731
        return (ffi.cast("float *", h.data_ptr()), h.shape[0], i64(starts), i64(lens),
                ffi.cast("int32_t *", tables.data_ptr()), i64(table_offs), lens.numel(),
                ffi.cast("float *", self._work.data_ptr()), self._work.numel(), torch.get_num_threads(), BEST_ISA)

    def _wanted_rows(self, h: torch.Tensor, op: StepPlan, rows: list[int], c, li: int) -> None:
        """The layer ``c`` on rows ``rows`` of ``h`` alone (in place), each a one-token segment of its stream at its
        position, through its segment's block table (``_native_layers``' ``wanted``)."""
        lens, offs, first = op.lens.tolist(), op.table_offs.tolist(), op.starts.tolist()
        ends = list(itertools.accumulate(lens))
        seg = [bisect.bisect_right(ends, r) for r in rows]  # the segment each row is in
        starts = torch.tensor([first[i] + r - (ends[i] - lens[i]) for r, i in zip(rows, seg)], dtype=torch.int64)
        tables = torch.cat([op.tables[offs[i]:offs[i + 1]] for i in seg])
        table_offs = torch.tensor([0, *itertools.accumulate(offs[i + 1] - offs[i] for i in seg)], dtype=torch.int64)
        x, ones = h[rows].contiguous(), torch.ones(len(rows), dtype=torch.int64)  # held until the call returns
        status = lib.ringshm_layer_forward(self._c_shape, c, *self._layer_args(x, starts, ones, tables, table_offs))
        if status:
            check_status(status, f"layer {self.layer_range.start + li}: the C layer refused the op's wanted rows")
        h[rows] = x

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over the last dim; ``x`` ``[..., hidden]`` (or ``[..., head_dim]`` for q/k norms)."""
        if self.native:
            return kernels.rms_norm(x.reshape(-1, x.shape[-1]), weight, self.config.rms_eps).reshape(x.shape)
        # HF LlamaRMSNorm: normalize in fp32, scale in the weights' dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_eps)
        return weight * xf.to(self.dtype)

    def _head(self, h: torch.Tensor, plan) -> StageOutput:
        """Final norm + LM head on ``h [T, hidden]``, only at the positions ``plan`` (``ringshm.model.head``) needs."""
        if not plan.positions:
            return StageOutput(torch.zeros(0, dtype=torch.int64))
        normed = self._rms_norm(h[plan.positions], self.norm)  # [n_pos, hidden]
        if self.native:
            logits = self.lm_head.matmul(normed, activations=self.activations)  # [n_pos, vocab]
        else:
            logits = F.linear(normed, self.lm_head).float()
        if self.config.logit_scale != 1.0:  # Granite's logits_scaling: one fp32 division, as transformers
            logits = logits / self.config.logit_scale
        cap = self.config.logit_softcap
        if cap:  # Gemma's final soft-cap, elementwise as transformers applies it
            logits = torch.tanh(logits / cap) * cap
        return head_outputs(logits, plan)
