"""Where each checkpoint format keeps a layer's routed experts, read as one ``RawWeight`` per expert for
``ringshm.model.loader.Checkpoint.load_stage``: GGUF's 3-D ``ffn_*_exps`` (views of its map; a merged
``ffn_gate_up_exps`` cut into gate and up rows) or its older 2-D tensor per expert (Mixtral, ``families.
GGUF_SPLIT_EXPERTS``); HF's tensor per expert, Granite's fused 3-D ``input_linear`` ([E, 2 I, hidden], rows
[gate | up]), gpt-oss's transposed 3-D ``gate_up_proj`` ([E, hidden, 2 I], columns gate, up interleaved) and OpenAI's
MXFP4 blocks of it (``families.HF_MXFP4_SUFFIXES``), re-laid into ggml's MXFP4 bytes.
"""

from __future__ import annotations

import torch

from ringshm.model import families
from ringshm.model.qmatmul import MXFP4, RawWeight
from ringshm.model.sources import Source
from ringshm.model_config import ModelConfig

# gpt-oss's interleaved gate / up rows (or columns): gate 0, up 0, gate 1, ...
_INTERLEAVED = {"w_exp_gate": slice(0, None, 2), "w_exp_up": slice(1, None, 2)}


class ExpertReader:
    """Reads one checkpoint's routed experts, a layer and a role (``families.EXPERT_FIELDS``) at a time."""

    def __init__(self, source: Source, config: ModelConfig, gguf: bool) -> None:
        self.source, self.config, self.gguf = source, config, gguf
        self._up_rows: dict[str, list[RawWeight]] = {}  # HF MXFP4: a layer's up experts, cut with its gate ones

    def read(self, prefix: str, field: str, name: str, loaded: list) -> list[RawWeight]:
        """The ``n_experts`` weights of role ``field`` under layer ``prefix`` (``name``: the family's tensor name for
        it), each ``[rows, cols]`` in ``F.linear`` layout; ``(name, weight)`` pairs are appended to ``loaded`` (for
        the NaN / Inf line). What is read was checked when the checkpoint was opened (names, shapes, types)."""
        cfg, src = self.config, self.source
        ie = cfg.expert_intermediate
        if not self.gguf and src.has(prefix + name + "_blocks"):  # gpt-oss as released: MXFP4 blocks
            out = self._mxfp4(prefix, field, name)
            what = {"w_exp_gate": " (gate rows)", "w_exp_up": " (up rows)"}.get(field, "")
            loaded.extend((f"{prefix}{name}_blocks expert {e}{what}", w) for e, w in enumerate(out))
            return out
        names = families.TENSOR_NAMES[cfg.arch]
        if not self.gguf and (names.hf_transposed_experts or names.hf_fused_experts):  # one 3-D tensor a layer
            full = src.get(prefix + name)
            if full.dtype not in (torch.float32, torch.float16, torch.bfloat16):
                full = full.float()
            if names.hf_transposed_experts:  # gpt-oss: [E, hidden, 2 I_e] (gate, up columns interleaved) or
                # [E, I_e, hidden]
                cols = _INTERLEAVED.get(field, slice(None))
                out = [RawWeight.from_tensor(full[e][:, cols].t().contiguous()) for e in range(cfg.n_experts)]
            else:  # Granite: [E, 2 I_e, hidden] rows [gate | up], or [E, hidden, I_e]
                rows = {"w_exp_gate": slice(0, ie), "w_exp_up": slice(ie, 2 * ie)}.get(field, slice(None))
                out = [RawWeight.from_tensor(full[e, rows]) for e in range(cfg.n_experts)]
            loaded.extend((f"{prefix}{name} expert {e}", w) for e, w in enumerate(out))
            return out
        split = self.gguf and cfg.arch == "mixtral" and src.has(prefix + families.GGUF_SPLIT_EXPERTS[field].format(e=0))
        if not self.gguf or split:  # a 2-D tensor per expert
            name = families.GGUF_SPLIT_EXPERTS[field] if split else name
            out = [src.get_raw(prefix + name.format(e=e)) for e in range(cfg.n_experts)]
            loaded.extend((prefix + name.format(e=e), w) for e, w in enumerate(out))
            return out
        merged = prefix + families.GGUF_MERGED_GATE_UP_EXPS
        if field != "w_exp_down" and src.has(merged):
            rows = torch.arange(0, ie) if field == "w_exp_gate" else torch.arange(ie, 2 * ie)
            out = [w.rows(rows) for w in src.get_raw_experts(merged)]
            name = families.GGUF_MERGED_GATE_UP_EXPS
        else:
            out = src.get_raw_experts(prefix + name)
        loaded.extend((f"{prefix}{name} expert {e}", w) for e, w in enumerate(out))
        return out

    def _mxfp4(self, prefix: str, field: str, name: str) -> list[RawWeight]:
        """OpenAI's MXFP4 experts of one role; gate_up's blocks are read once, the up rows kept for the next call."""
        if field == "w_exp_up":
            return self._up_rows.pop(prefix)
        blocks, scales = self.source.get(prefix + name + "_blocks"), self.source.get(prefix + name + "_scales")
        if field == "w_exp_gate":
            self._up_rows[prefix] = mxfp4_experts(blocks, scales, _INTERLEAVED["w_exp_up"])
        return mxfp4_experts(blocks, scales, _INTERLEAVED.get(field, slice(None)))


def mxfp4_experts(blocks: torch.Tensor, scales: torch.Tensor, rows: slice) -> list[RawWeight]:
    """OpenAI's MXFP4 experts (``families.HF_MXFP4_SUFFIXES``: ``blocks`` uint8 ``[E, R, G, 16]``, ``scales`` uint8
    ``[E, R, G]``, K = 32 G) as ggml's MXFP4 bytes, one ``RawWeight [len(rows), K]`` per expert, ``rows`` picked
    (gpt-oss's gate rows are the even ones, up the odd). The same numbers, re-laid: an OpenAI byte j holds weights 2j
    (low nibble) and 2j + 1, a ggml byte j weights j and j + 16; the nibble codes are the same e2m1 indices (ggml's
    kvalues are their values doubled) and ggml's half-scale 2^(e - 128) on doubled values is OpenAI's 2^(s - 127)
    on the values, so e = s. The one difference is e2m1's -0 (nibble 8), which ggml reads as +0: a zero either way."""
    out = []
    for e in range(blocks.shape[0]):  # an expert at a time: the transient copies stay one expert's size
        b, s = blocks[e, rows], scales[e, rows]
        n_rows, groups, _ = b.shape
        nib = torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(n_rows, groups, 32)  # the weights in order
        qs = nib[..., :16] | (nib[..., 16:] << 4)  # ggml: byte j = weight j | weight j + 16 << 4
        raw = torch.cat([s.unsqueeze(-1), qs], dim=-1).reshape(n_rows, groups * 17)
        out.append(RawWeight.from_bytes(MXFP4, n_rows, 32 * groups, raw))
    return out
