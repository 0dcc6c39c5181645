"""A fake-ring harness: the real rings, protocol, stage loop (``ringshm.runtime.stage.serve``) and coordinator, with a
model that answers like an oracle, so losslessness is an exact equality and a run takes milliseconds.

``OracleModel`` holds scripted sequences T (keyed by their first token). A row's KV "content" is the tokens
written to it; the answer at position p is T[p + 1] when the row's tokens 0..p equal T's, else ``WRONG``.
So any segment applied to the wrong row, out of order, or over positions never written shows up as a wrong
token. Reading past what a row holds raises ``KVRangeError`` (an ERROR reply), exactly as ``StageModel`` does.
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
from ringshm.engine.sampling import Sampler, TextStream
from ringshm.errors import KVRangeError, PeerDied
from ringshm.model.head import head_outputs, plan_head
from ringshm.runtime.stage import N_SLOTS, StageSpec, serve
from ringshm.transport import messages as m
from ringshm.transport.ring import Ring

WRONG = 0  # the token an oracle gives for a context that is not a prefix of its script
EOS = 2


class OracleModel:
    """Single-stage fake of ``StageModel`` (first and last): see the module docstring."""

    def __init__(self, scripts: list[list[int]], max_rows: int, max_seq_len: int = 4096, vocab: int = 1024):
        self.scripts = {t[0]: t for t in scripts}
        assert len(self.scripts) == len(scripts), "scripts need distinct first tokens"
        self.max_rows, self.max_seq_len, self.vocab = max_rows, max_seq_len, vocab
        self.content: list[list[int]] = [[] for _ in range(max_rows)]
        self.frames: list[tuple] = []
        self.device = torch.device("cpu")
        self.is_first = self.is_last = True

    def _answer(self, ctx: list[int]) -> int:
        t = self.scripts.get(ctx[0])
        if t is not None and len(ctx) < len(t) and t[: len(ctx)] == ctx:
            return t[len(ctx)]
        return WRONG

    def reset(self, rows) -> None:
        for r in rows:
            self.content[r] = []

    def step(self, x, segments, targets=None):
        """``StageModel.step`` over scripts: the same table checks (all before anything is written), the same
        outputs per ``want``."""
        ids = [int(t) for t in x.reshape(-1)]
        if sum(g[2] for g in segments) != len(ids) or not segments:
            raise ValueError(f"the segments hold {sum(g[2] for g in segments)} tokens, the op carries {len(ids)}")
        rows = [g[0] for g in segments]
        if len(set(rows)) != len(rows):
            raise ValueError(f"a row may appear once per op, got rows {rows}")
        for i, (row, start, n, _) in enumerate(segments):
            if not 0 <= row < self.max_rows:
                raise KVRangeError(f"segment {i}: row {row} outside [0, {self.max_rows})")
            if start > len(self.content[row]):
                raise KVRangeError(f"segment {i}: row {row}: start {start} reads KV positions never written "
                                   f"({len(self.content[row])} held)")
            if start + n > self.max_seq_len:
                raise KVRangeError(f"segment {i}: row {row}: positions past max_seq_len {self.max_seq_len}")
        plan = plan_head(segments, [] if targets is None else targets.tolist())
        where, o = [], 0  # op offset -> (row, position)
        for row, start, n, _ in segments:
            self.content[row] = self.content[row][:start] + ids[o: o + n]
            where += [(row, start + i) for i in range(n)]
            o += n
        logits = torch.zeros(len(plan.positions), self.vocab)  # [n_pos, vocab]
        for i, p in enumerate(plan.positions):
            row, pos = where[p]
            answer = self._answer(self.content[row][: pos + 1])
            logits[i, answer], logits[i, (answer + 1) % self.vocab] = 10.0, 9.0
        return head_outputs(logits, plan)


class RecordingModel(OracleModel):
    def step(self, x, segments, targets=None):
        self.frames.append(tuple((g[0], g[1], g[2]) for g in segments))
        return super().step(x, segments, targets)


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

    def step(self, x, segments, targets=None):
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
                    max_op_tokens: int = 1 << 20, relays: list[RelayModel] = ()) -> FakeRing:
    """The oracle ``model`` as the last of ``len(relays) + 1`` fake stages, each ``serve`` on its own thread."""
    models = [*relays, model]
    n = len(models)
    rings = [Ring.create(1 << 20) for _ in range(n + 1)]
    status = [0.0] * (N_SLOTS * n)
    threads = []
    for i, stage_model in enumerate(models):
        spec = StageSpec(index=i, n_stages=n, model_path="", layer_start=i, layer_stop=i + 1,
                         max_rows=model.max_rows, max_seq_len=model.max_seq_len, dtype="float32", device="cpu",
                         in_ring=rings[i].name, out_ring=rings[i + 1].name, cores=1, ring_timeout_s=5,
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
