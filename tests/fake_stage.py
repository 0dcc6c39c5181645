"""A fake-ring harness: the real rings, protocol, stage loop (``ringshm.runtime.stage.serve``) and coordinator, with a
model that answers like an oracle, so losslessness is an exact equality and a run takes milliseconds.

``OracleModel`` holds scripted sequences T (keyed by their first token). Its KV is paged as the real stage's: a
block holds the tokens written at its offsets, and a segment's context at position p is what the blocks its
table names hold at positions 0..p; the answer is T[p + 1] when that context equals T[:p + 1], else ``WRONG``.
So any segment applied to the wrong blocks, out of order, over positions never written, or with a cached block
attached one position off shows up as a wrong token. Reading what no op wrote raises ``KVRangeError`` (an ERROR
reply), exactly as ``StageModel`` does.
Every position the head runs at has fake logits ``[vocab]``: 10 at the oracle's answer, 9 at the id after it, 0
elsewhere (so its argmax is the answer, and banning the answer picks the next id); ``WANT_LOGITS`` returns them
and the logprob bits are answered from them by ``ringshm.model.head``, as the real last stage does.
``RecordingModel`` records every step op the stage sees as a tuple of its segments ``(row, start, n)``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from ringshm.engine.coordinator import Link, Stream
from ringshm.engine.kv_blocks import KVBlocks
from ringshm.engine.sampling import Sampler, TextStream
from ringshm.errors import KVRangeError, PeerDied
from ringshm.model.head import NON_FINITE, head_outputs, plan_head
from ringshm.runtime.stage import N_SLOTS, StageSpec, serve
from ringshm.transport import messages as m
from ringshm.transport.ring import Ring

WRONG = 0  # the token an oracle gives for a context that is not a prefix of its script
BLOCK = 16  # the fake stages' KV block size (small: short scripts still span several blocks)
EOS = 2


class OracleModel:
    """Single-stage fake of ``StageModel`` (first and last) over paged KV: see the module docstring."""

    def __init__(self, scripts: list[list[int]], max_rows: int, max_seq_len: int = 4096, vocab: int = 1024,
                 block_size: int = BLOCK, n_blocks: int | None = None):
        self.scripts = {t[0]: t for t in scripts}
        assert len(self.scripts) == len(scripts), "scripts need distinct first tokens"
        self.max_rows, self.max_seq_len, self.vocab = max_rows, max_seq_len, vocab
        self.block_size = block_size
        self.n_blocks = n_blocks if n_blocks is not None else max_rows * -(-max_seq_len // block_size)
        self.tokens: list[list[int]] = [[0] * block_size for _ in range(self.n_blocks)]  # per block, per offset
        self.fill = [0] * self.n_blocks  # positions each block holds (as StageModel.fill)
        self.version = [0] * self.n_blocks  # bumped by every write: memoised block matches go stale
        self._matches: dict[tuple, bool] = {}
        self.frames: list[tuple] = []
        self.device = torch.device("cpu")
        self.is_first = self.is_last = True

    def _is(self, block: int, script: list[int], j: int) -> bool:
        """Block ``block`` holds the script's block ``j`` (its B tokens), memoised per version of the block."""
        key = (block, self.version[block], script[0], j)
        if key not in self._matches:
            bs = self.block_size
            self._matches[key] = self.tokens[block] == script[j * bs:(j + 1) * bs]
        return self._matches[key]

    def _answer(self, table: list[int], pos: int) -> int:
        """The script's token after positions 0 .. pos as the blocks of ``table`` hold them, or WRONG."""
        bs = self.block_size
        first = self.tokens[table[0]][0]
        t = self.scripts.get(first)
        if t is None or pos + 1 >= len(t):
            return WRONG
        last = pos // bs
        if not all(self._is(table[j], t, j) for j in range(last)):
            return WRONG
        held = self.tokens[table[last]][:pos % bs + 1]
        return t[pos + 1] if held == t[last * bs:pos + 1] else WRONG

    def row_table(self, row: int) -> list[int]:
        per_row = -(-self.max_seq_len // self.block_size)
        return list(range(row * per_row, (row + 1) * per_row))

    def step(self, x, segments, targets=None, tables=None, allowed=None):
        """``StageModel.step`` over scripts: the same table checks (all before anything is written), the same
        outputs per ``want``; KV content lives in the blocks each segment's table names."""
        ids = [int(t) for t in x.reshape(-1)]
        bs = self.block_size
        if sum(g[2] for g in segments) != len(ids) or not segments:
            raise ValueError(f"the segments hold {sum(g[2] for g in segments)} tokens, the op carries {len(ids)}")
        rows = [g[0] for g in segments]
        if len(set(rows)) != len(rows):
            raise ValueError(f"a row may appear once per op, got rows {rows}")
        flat = [int(b) for b in tables.tolist()] if tables is not None else None
        seg_tables, o = [], 0
        for i, (row, start, n, _) in enumerate(segments):
            need = -(-(start + n) // bs)
            table = flat[o:o + need] if flat is not None else self.row_table(row)[:need]
            o += need
            if not 0 <= row < self.max_rows:
                raise KVRangeError(f"segment {i}: row {row} outside [0, {self.max_rows})")
            if start + n > self.max_seq_len:
                raise KVRangeError(f"segment {i}: row {row}: positions past max_seq_len {self.max_seq_len}")
            if len(table) < need or any(not 0 <= b < self.n_blocks for b in table):
                raise KVRangeError(f"segment {i}: its table {table} does not name {need} blocks of the pool")
            if any(self.fill[b] != bs for b in table[:start // bs]) or self.fill[table[start // bs]] < start % bs:
                raise KVRangeError(f"segment {i}: row {row}: start {start} reads KV positions never written")
            seg_tables.append(table)
        if flat is not None and o != len(flat):
            raise ValueError(f"the op's tables hold {len(flat)} ids, its segments need {o}")
        plan = plan_head(segments, [] if targets is None else targets.tolist(), allowed, self.vocab)
        where, o = [], 0  # op offset -> (its table, position)
        for (row, start, n, _), table in zip(segments, seg_tables):
            for j in range(n):
                p = start + j
                b = table[p // bs]
                self.tokens[b][p % bs] = ids[o + j]
                self.version[b] += 1
            for jb in range(start // bs, -(-(start + n) // bs)):  # as ringshm_kv_mark
                self.fill[table[jb]] = min(bs, start + n - jb * bs)
            where += [(table, start + j) for j in range(n)]
            o += n
        logits = torch.zeros(len(plan.positions), self.vocab)  # [n_pos, vocab]
        for i, p in enumerate(plan.positions):
            table, pos = where[p]
            answer = self._answer(table, pos)
            if answer == NON_FINITE:  # a script's NON_FINITE: the logits of broken weights there
                logits[i] = float("nan")
                continue
            logits[i, answer], logits[i, (answer + 1) % self.vocab] = 10.0, 9.0
        return head_outputs(logits, plan)


class RecordingModel(OracleModel):
    def step(self, x, segments, targets=None, tables=None, allowed=None):
        self.frames.append(tuple((g[0], g[1], g[2]) for g in segments))
        return super().step(x, segments, targets, tables, allowed)


class GatedModel(OracleModel):
    """An oracle whose ops wait on ``gate`` (a stopped stage) and take ``op_s`` each (a busy one)."""

    def __init__(self, *args, op_s: float = 0.0, **kw):
        super().__init__(*args, **kw)
        self.gate = threading.Event()
        self.gate.set()
        self.op_s = op_s

    def step(self, *args, **kw):
        assert self.gate.wait(timeout=60)
        time.sleep(self.op_s)
        return super().step(*args, **kw)


class SwappingRing:
    """Wraps the stage's output ring: holds back reply ``swap_at`` and sends it after the next one."""

    def __init__(self, ring: Ring, swap_at: int):
        self.ring, self.swap_at, self.count, self.held = ring, swap_at, 0, None

    def reserve(self, n, timeout_s=None):
        self._buf = bytearray(n)
        return memoryview(self._buf)

    def commit(self, n=None):
        data, self.count = bytes(self._buf), self.count + 1
        if self.count == self.swap_at:
            self.held = data
            return
        self.ring.send(data, timeout_s=5)
        if self.held is not None:
            self.ring.send(self.held, timeout_s=5)
            self.held = None

    def close(self):
        self.ring.close()


class TamperingRing(SwappingRing):
    """Wraps the stage's output ring: reply ``tamper_at`` goes out with its first segment's start moved by one
    (a reply that answers another segment table)."""

    def commit(self, n=None):
        self.count += 1
        data = bytes(self._buf)
        if self.count == self.swap_at:
            msg = m.decode(memoryview(data))
            g = msg.segments[0]
            msg.segments = [g._replace(start=g.start + 1)] + msg.segments[1:]
            data = m.encode(msg)
        self.ring.send(data, timeout_s=5)


class RelayModel:
    """A first stage in front of the oracle: takes ``op_s`` per op and passes the token ids on unchanged (as a
    real stage passes hidden states), so a fake run has stages that can be busy or idle one after another."""

    def __init__(self, op_s: float = 0.0):
        self.op_s = op_s
        self.device = torch.device("cpu")

    def reset(self, rows) -> None:
        pass

    def step(self, x, segments, targets=None, tables=None, allowed=None):
        time.sleep(self.op_s)
        return x


@dataclass
class FakeRing:
    """A coordinator ``Link`` wired to fake stages running ``serve`` in threads (relays first, the oracle last)."""

    link: Link
    model: OracleModel
    threads: list[threading.Thread]
    rings: list[Ring]
    status: list  # the stages' shared counters (N_SLOTS doubles each), as ``StageGroup.status`` holds them

    def close(self) -> None:
        try:
            self.link.send(m.Message(m.SHUTDOWN))
            self.link.recv(timeout_s=5)
        except Exception:
            pass
        for t in self.threads:
            t.join(timeout=5)
        for r in self.rings:
            r.close()
            r.unlink()


def start_fake_ring(model: OracleModel, swap_at: int | None = None, tamper_at: int | None = None,
                    max_op_tokens: int = 1 << 20, relays: list[RelayModel] = (), ring_timeout_s: float = 5
                    ) -> FakeRing:
    """The oracle ``model`` as the last of ``len(relays) + 1`` fake stages, each ``serve`` on its own thread."""
    models = [*relays, model]
    n = len(models)
    rings = [Ring.create(1 << 20) for _ in range(n + 1)]
    status = [0.0] * (N_SLOTS * n)
    threads = []
    for i, stage_model in enumerate(models):
        spec = StageSpec(index=i, n_stages=n, model_path="", layer_start=i, layer_stop=i + 1,
                         max_rows=model.max_rows, max_seq_len=model.max_seq_len, dtype="float32", device="cpu",
                         in_ring=rings[i].name, out_ring=rings[i + 1].name, cores=1, ring_timeout_s=ring_timeout_s,
                         max_op_tokens=max_op_tokens)
        out = rings[i + 1]
        if i == n - 1:
            out = (SwappingRing(out, swap_at) if swap_at is not None else
                   TamperingRing(out, tamper_at) if tamper_at is not None else out)

        def run(stage_model=stage_model, spec=spec, rin=rings[i], out=out):
            try:
                serve(stage_model, spec, rin, out, status)
            except PeerDied:
                pass

        threads.append(threading.Thread(target=run, daemon=True))
        threads[-1].start()

    def check_stages():
        if not all(t.is_alive() for t in threads):
            raise PeerDied("a fake stage thread ended")

    return FakeRing(Link(rings[0], rings[-1], check_stages, op_timeout_s=10), model, threads, rings, status)


def make_stream(index: int, script: list[int], prompt_len: int, max_new_tokens: int, row: int = -1) -> Stream:
    return Stream(index, row, script[:prompt_len], max_new_tokens, Sampler(), TextStream(None), frozenset({EOS}))


def fake_kv(model: OracleModel) -> KVBlocks:
    """The coordinator's KV blocks for a fake stage: as many blocks of its block size as its pool."""
    return KVBlocks(model.n_blocks, model.block_size, b"fake")
