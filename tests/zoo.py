"""A zoo of tiny random-weight models, one per architecture family, each as an HF directory AND a GGUF file
that describe exactly the same function, with a transformers fp32 oracle that serves both.

``build(family, root, recipe="q4_k_m", seed=0) -> ZooModel`` writes ``root/hf`` (``config.json`` +
``model.safetensors``, fp32) and ``root/model.gguf``; ``ZooModel.oracle_greedy(prompt_ids, n_new)`` runs
transformers fp32 greedy on the HF directory (tokens and top-1/top-2 logit margins, as ``conftest.py``'s
``OracleGreedy``). The ``zoo`` fixture (``zoo_factory``) builds each (family, recipe, seed) once per session.

How the pair is made. The config comes from transformers' own config class. Every tensor is drawn on the
GGUF side first, in llama.cpp's layout and in the type the recipe gives it (``zoo_quant``); its HF copy is its
exact fp32 decode with the converter's transform undone. The GGUF is what llama.cpp's ``convert_hf_to_gguf.py``
(then ``llama-quantize`` for the K-quant and pure recipes) would write from that HF directory: tensor names
from gguf-py's own ``TensorNameMap``, metadata keys and transforms per family as the converter's
(``zoo_convert`` describes them), types per recipe as llama-quantize's (``zoo_quant``). Neither side carries a
tokenizer: prompts are token ids.

Families: ``llama`` (Llama 2 style), ``llama3`` (RoPE ``llama3`` scaling), ``mistral``, ``qwen2`` (q/k/v
biases, hidden 320), ``qwen3`` (q/k RMSNorm), ``gemma3`` (6 layers, 5 local with window 16 + 1 global),
``gemma3_softcap`` (final logit soft-cap 15), ``phi3`` (fused qkv and gate_up); the mixtures of experts
``qwen3moe`` (16 experts, top 4, renormalised) and ``olmoe`` (16 experts, top 4, not renormalised; q / k norms
over the whole projection, 4 KV heads) and ``granitemoe`` (16 experts, top 4, softmax over the top-k logits;
granite-3.0-1b-a400m's muP multipliers; untied) and ``mixtral`` (16 experts, top 2, renormalised; Mistral's
attention; GGUF arch ``llama``) and ``qwen2moe`` (16 experts, top 4, not renormalised, a shared expert 512 wide
gated by a sigmoid; q/k/v biases) and ``granitemoeshared`` (``granitemoe`` with an ungated shared expert 512
wide, HF ``shared_mlp.input_linear`` rows [gate | up]) and ``gptoss`` (16 experts, top 4, softmax over the top-k
logits; q/k/v/o biases, attention sinks, layers alternately sliding (window 16) and full, YaRN; biased router and
experts, the clamped SwiGLU; experts MXFP4 in every recipe, as the released files hold them, HF ``gate_up_proj``
``[E, hidden, 2 I]`` columns interleaved), expert width 256, written as transformers saves them
(one tensor per expert; Granite: ``input_linear`` / ``output_linear`` 3-D; Mixtral:
``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2``) and as the converter merges them (3-D ``ffn_*_exps``; the
router ``ffn_gate_inp`` stays F32).

Tied embeddings (no ``output.weight``): llama3, qwen2, qwen3, gemma3. Sizes: hidden 256, 4 query heads,
2 KV heads (gemma3: 1), head_dim 64, intermediate 512, vocab 512, 4 layers (gemma3: 6).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from oracle_gguf import same_name_maps
from zoo_convert import gguf_name_map, gguf_role, llama3_rope_factors, unpermute_qk, write_gguf
from zoo_experts import add_experts, add_granite_moe, add_granite_shared_gate_up, add_gptoss_experts
from zoo_quant import make_weight, recipe_file_type, tensor_type

WINDOW = 16  # gemma3 sliding window: shorter than a test prompt plus 32 new tokens


def _llama(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**{**_COMMON, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "head_dim": 64, **kw})


def _llama3(**kw):
    from transformers import LlamaConfig

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return LlamaConfig(**{**_COMMON, "rms_norm_eps": 1e-5, "head_dim": 64, "tie_word_embeddings": True,
                          "rope_parameters": rope, "original_max_position_embeddings": 32, **kw})


def _mistral(**kw):
    from transformers import MistralConfig

    return MistralConfig(**{**_COMMON, "rope_theta": 1e6, "rms_norm_eps": 1e-5, "head_dim": 64,
                            "sliding_window": None, **kw})


def _qwen2(**kw):
    from transformers import Qwen2Config

    return Qwen2Config(**{**_COMMON, "hidden_size": 320, "num_attention_heads": 5, "num_key_value_heads": 1,
                          "intermediate_size": 640, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
                          "tie_word_embeddings": True, **kw})


def _qwen3(**kw):
    from transformers import Qwen3Config

    return Qwen3Config(**{**_COMMON, "head_dim": 64, "rope_theta": 1e6, "rms_norm_eps": 1e-6,
                          "tie_word_embeddings": True, **kw})


def _gemma3(**kw):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**{**_COMMON, "num_hidden_layers": 6, "num_key_value_heads": 1, "head_dim": 64,
                               "query_pre_attn_scalar": 64, "sliding_window": WINDOW, "rms_norm_eps": 1e-6,
                               "pad_token_id": 0, "tie_word_embeddings": True, **kw})


def _qwen3moe(**kw):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**_COMMON, "head_dim": 64, "rope_theta": 1e6, "rms_norm_eps": 1e-6, **_MOE,
                             "moe_intermediate_size": 256, "norm_topk_prob": True, **kw})


def _olmoe(**kw):
    from transformers import OlmoeConfig

    return OlmoeConfig(**{**_COMMON, "num_key_value_heads": 4, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
                          "pad_token_id": 1, **_MOE, "intermediate_size": 256, "norm_topk_prob": False, **kw})


def _granitemoe(**kw):
    from transformers import GraniteMoeConfig

    # granite-3.0-1b-a400m's muP multipliers (its attention_multiplier is 1 / head_dim); untied, unlike it: tied,
    # the input token's embedding (x 12) dominates the last hidden state and greedy repeats it
    return GraniteMoeConfig(**{**_COMMON, "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "num_local_experts": 16,
                               "num_experts_per_tok": 4, "intermediate_size": 256, "tie_word_embeddings": False,
                               "embedding_multiplier": 12.0, "attention_multiplier": 1 / 64,
                               "residual_multiplier": 0.22, "logits_scaling": 6.0, **kw})


def _mixtral(**kw):
    from transformers import MixtralConfig

    # 16 experts, top 2 (Mixtral 8x7B: 8, top 2; 16 keeps llama-quantize's Q4_K_M rule for attn_k / attn_v)
    return MixtralConfig(**{**_COMMON, "head_dim": 64, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
                            "sliding_window": None, "num_local_experts": 16, "num_experts_per_tok": 2,
                            "intermediate_size": 256, **kw})


def _granitemoeshared(**kw):
    from transformers import GraniteMoeSharedConfig

    # Granite MoE with a shared expert (shared_mlp) 512 wide beside the routed ones, ungated
    return GraniteMoeSharedConfig(**{**_granitemoe().to_dict(), "shared_intermediate_size": 512, **kw})


def _qwen2moe(**kw):
    from transformers import Qwen2MoeConfig

    # Qwen1.5-MoE's layout: q/k/v biases, top-k not renormalised, a shared expert twice an expert's width
    return Qwen2MoeConfig(**{**_COMMON, "rope_theta": 1e6, "rms_norm_eps": 1e-6, **_MOE, "moe_intermediate_size": 256,
                             "shared_expert_intermediate_size": 512, "norm_topk_prob": False, **kw})


def _gptoss(**kw):
    from transformers import GptOssConfig

    # gpt-oss-20b's layout scaled down: layer_types alternate sliding / full, rope_parameters YaRN (factor 32,
    # ramp not truncated), swiglu_limit 7, all GptOssConfig's defaults but the original context: 16 positions x 32
    # = the zoo's 512, so that YaRN interpolates at the tests' positions
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 16}
    return GptOssConfig(**{**_COMMON, "head_dim": 64, "num_local_experts": 16, "num_experts_per_tok": 4,
                           "intermediate_size": 256, "sliding_window": WINDOW, "rms_norm_eps": 1e-5,
                           "rope_parameters": rope, **kw})


def _phi3(**kw):
    from transformers import Phi3Config

    return Phi3Config(**{**_COMMON, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "pad_token_id": 0,
                         "original_max_position_embeddings": 512, "sliding_window": None, **kw})


# 16 experts, top 4, expert width 256 (a multiple of 256: K-quant rows of down do not fall back; 16, not 8:
# llama-quantize gives 8-expert models Q8_0 attn_k / attn_v)
_MOE = {"num_experts": 16, "num_experts_per_tok": 4}
_COMMON = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512, "bos_token_id": 1,
           "eos_token_id": 2, "tie_word_embeddings": False}


@dataclass(frozen=True)
class Family:
    """One architecture: its transformers config, the GGUF arch the converter writes, and what it transforms.

    ``std``: standard deviation of the random weights by role (``linear`` for every projection, ``token_embd``,
    ``output``, ``bias``); ``norms``: GGUF-side RMSNorm weights are uniform in ``norms[role]`` (``norm`` for the
    roles not listed). All norm weights stay >= 0.5, so Gemma's ``w = g - 1`` and ``1 + w`` are exact in fp32
    (``1`` and ``g`` lie on the grid of ``g``'s ulp). Chosen so greedy continuations vary and the oracle's
    top-1/top-2 margins are mostly well above 1e-2.
    """

    config: Callable
    arch: str
    permute_qk: bool = False
    norm_shift: float = 0.0
    std: dict = field(default_factory=lambda: dict(_STD))
    norms: dict = field(default_factory=lambda: dict(_NORMS))
    hf_renames: tuple = ()  # (from, to) substrings: the names save_pretrained writes where they differ from modules'


# Mixtral's names on disk (save_pretrained and the released checkpoints): block_sparse_moe.gate, experts.{e}.w1 / w3 /
# w2 for gate / up / down, where transformers 5's modules say mlp.gate and fused mlp.experts tensors
_MIXTRAL_RENAMES = ((".mlp.gate.weight", ".block_sparse_moe.gate.weight"),
                    (".mlp.experts.", ".block_sparse_moe.experts."), (".gate_proj.weight", ".w1.weight"),
                    (".up_proj.weight", ".w3.weight"), (".down_proj.weight", ".w2.weight"))


# Measured over 4 prompts x 32 new tokens at q4_k_m, every family: 21-31 distinct tokens, no run of one token
# longer than 5, median top-1/top-2 margin 0.56-1.57, at most 2.3 % of steps under 1e-2 (std 0.05 everywhere gave
# runs of one token 7-16 long in llama / llama3).
_STD = {"token_embd": 0.1, "output": 0.2, "linear": 0.1, "bias": 0.05}
_NORMS = {"norm": (0.6, 1.6), "output_norm": (1.5, 2.0)}
# Gemma 3 ties the head to an embedding it scales by sqrt(hidden) = 16: with the weights above, the input token's
# own embedding dominates the last hidden state and greedy repeats it (margins 10-25). Small embeddings, large
# post-norms (the real 270M's norm weights run from about 0.3 to 280) and sharper attention (q/k norms) bury it:
# 23-31 distinct tokens of 32, no run longer than 3.
_GEMMA3_STD = {**_STD, "token_embd": 0.03}
_GEMMA3_NORMS = {**_NORMS, "attn_q_norm": (1.5, 3.0), "attn_k_norm": (1.5, 3.0), "post_attention_norm": (4.0, 8.0),
                 "post_ffw_norm": (4.0, 8.0), "output_norm": (4.0, 8.0)}
# Granite multiplies its embedding by 12: embeddings of std 0.02 (with 0.01 and a tied head, 3-10 distinct tokens of
# 32; with 0.02 untied, 26-28 and a median margin of 0.19)
_GRANITEMOE_STD = {**_STD, "token_embd": 0.02}
FAMILIES: dict[str, Family] = {
    "llama": Family(_llama, "llama", permute_qk=True),
    "llama3": Family(_llama3, "llama", permute_qk=True),
    "mistral": Family(_mistral, "llama", permute_qk=True),
    "qwen2": Family(_qwen2, "qwen2"),
    "qwen3": Family(_qwen3, "qwen3"),
    "gemma3": Family(_gemma3, "gemma3", norm_shift=1.0, std=_GEMMA3_STD, norms=_GEMMA3_NORMS),
    "gemma3_softcap": Family(lambda **kw: _gemma3(final_logit_softcapping=15.0, **kw), "gemma3", norm_shift=1.0,
                             std=_GEMMA3_STD, norms=_GEMMA3_NORMS),
    "phi3": Family(_phi3, "phi3"),
    "qwen3moe": Family(_qwen3moe, "qwen3moe"),
    "olmoe": Family(_olmoe, "olmoe"),
    "granitemoe": Family(_granitemoe, "granitemoe", permute_qk=True, std=_GRANITEMOE_STD),
    "mixtral": Family(_mixtral, "llama", permute_qk=True, hf_renames=_MIXTRAL_RENAMES),
    "qwen2moe": Family(_qwen2moe, "qwen2moe"),
    "granitemoeshared": Family(_granitemoeshared, "granitemoe", permute_qk=True, std=_GRANITEMOE_STD),
    "gptoss": Family(_gptoss, "gpt-oss", std={**_STD, "attn_sinks": 1.0}),
}
MOE_FAMILIES = ("qwen3moe", "olmoe", "granitemoe", "mixtral", "qwen2moe", "granitemoeshared", "gptoss")


class Greedy(NamedTuple):
    """A greedy continuation: ``tokens`` int64 ``[N]`` and the top-1 minus top-2 logit at each step, fp32 ``[N]``
    (the fields of ``conftest.OracleGreedy``, so ``assert_greedy_matches`` takes it)."""

    tokens: torch.Tensor
    margins: torch.Tensor


@dataclass
class ZooModel:
    """One built model. ``gguf_types``: GGUF tensor name → ggml type; ``config``: the transformers config."""

    family: str
    recipe: str
    seed: int
    hf_dir: Path
    gguf_path: Path
    config: object
    gguf_types: dict[str, gguf.GGMLQuantizationType]
    _oracle: object = None
    _greedy: dict = field(default_factory=dict)

    def oracle(self):
        """transformers' fp32 model from ``hf_dir`` (eager attention), loaded once.

        Raises:
            AssertionError: the checkpoint's tensors do not match the model class (missing / unexpected keys).
        """
        if self._oracle is None:
            model, info = load_transformers(self.hf_dir, output_loading_info=True)
            bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
            assert not bad, f"{self.family}: HF checkpoint does not match its model class: {bad}"
            self._oracle = model
        return self._oracle

    @torch.inference_mode()
    def oracle_greedy(self, prompt_ids: list[int] | torch.Tensor, n_new: int) -> Greedy:
        """The oracle's greedy ``n_new`` tokens after ``prompt_ids`` (KV-cached decode), cached per prompt."""
        ids = [int(t) for t in prompt_ids]
        key = (tuple(ids), n_new)
        if key not in self._greedy:
            model = self.oracle()
            out = model(torch.tensor([ids]), use_cache=True)
            tokens, margins = [], []
            for _ in range(n_new):
                logits = out.logits[0, -1]
                top2 = logits.topk(2).values
                tokens.append(int(logits.argmax()))
                margins.append(float(top2[0] - top2[1]))
                out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
            self._greedy[key] = Greedy(torch.tensor(tokens), torch.tensor(margins))
        return self._greedy[key]


def load_transformers(hf_dir: str | Path, gguf_file: str | None = None, **kwargs):
    """``AutoModelForCausalLM.from_pretrained(hf_dir, ...)`` in fp32 with eager attention, in eval mode, without
    the per-model progress bar or warnings (from a zoo GGUF transformers warns that it found no vocab size in the
    absent tokenizer); ``kwargs`` override config fields (or ask for ``output_loading_info``)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    bar, verbosity = logging.is_progress_bar_enabled(), logging.get_verbosity()
    logging.disable_progress_bar()
    logging.set_verbosity_error()
    try:
        with same_name_maps():  # one tensor-name map per model, not one per module (tests/oracle_gguf.py)
            out = AutoModelForCausalLM.from_pretrained(str(hf_dir), gguf_file=gguf_file, dtype=torch.float32,
                                                       attn_implementation="eager", **kwargs)
    finally:
        logging.set_verbosity(verbosity)
        if bar:
            logging.enable_progress_bar()
    (out[0] if isinstance(out, tuple) else out).eval()
    return out


def prompt_ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    """``n`` random token ids in ``[3, vocab)`` (above the BOS / EOS / pad ids), reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(3, vocab, (n,), generator=g)]


def build(family: str, root: str | Path, recipe: str = "q4_k_m", seed: int = 0, **overrides) -> ZooModel:
    """Write ``root/hf`` and ``root/model.gguf`` for ``family`` (``FAMILIES``) with ``recipe``'s types;
    ``overrides`` are config fields (e.g. ``mlp_bias=True``) set on the family's transformers config.

    Raises:
        KeyError: unknown family or recipe (``FAMILIES``, ``zoo_quant.RECIPES``).
    """
    spec = FAMILIES[family]
    recipe_file_type(recipe)
    root = Path(root)
    hf_dir = root / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    config = spec.config(**overrides)
    config.dtype = "float32"
    shapes = _hf_shapes(config)
    config.architectures = [shapes.pop("_class")]
    n_layers = config.num_hidden_layers
    tied = bool(config.tie_word_embeddings)
    names = gguf_name_map(spec.arch, n_layers)
    rng = np.random.default_rng(seed)

    gguf_tensors: list[tuple[str, np.ndarray, gguf.GGMLQuantizationType]] = []
    hf_tensors: dict[str, torch.Tensor] = {}
    if config.to_dict().get("rope_parameters", {}).get("rope_type") == "llama3":
        gguf_tensors.append(("rope_freqs.weight", llama3_rope_factors(config), gguf.GGMLQuantizationType.F32))
    for hf_name, shape in shapes.items():
        if ".mlp.experts." in hf_name and spec.arch == "gpt-oss":  # 3-D in both, transposed and interleaved in HF
            add_gptoss_experts(hf_name, shape, spec, rng, gguf_tensors, hf_tensors)
            continue
        if ".mlp.experts." in hf_name:  # routed experts: 3-D in GGUF, one 2-D tensor per expert in HF
            add_experts(hf_name, shape, spec, recipe, n_layers, tied, rng, gguf_tensors, hf_tensors)
            continue
        if ".block_sparse_moe." in hf_name:  # Granite's names on disk differ from its modules'
            add_granite_moe(hf_name, shape, spec, recipe, n_layers, tied, rng, gguf_tensors, hf_tensors)
            continue
        if hf_name.endswith(".shared_mlp.input_linear.weight"):  # Granite's shared expert: [gate | up] in one
            add_granite_shared_gate_up(hf_name, shape, spec, recipe, n_layers, tied, rng, gguf_tensors, hf_tensors)
            continue
        # (gpt-oss's converter names the sinks as a weight: self_attn.sinks.weight -> attn_sinks.weight)
        gname = names.get_name(hf_name + (".weight" if hf_name.endswith(".sinks") else ""),
                               try_suffixes=(".weight", ".bias"))
        assert gname is not None, f"{family}: no GGUF name for {hf_name}"
        role, layer = gguf_role(gname)
        qtype = tensor_type(recipe, role, layer, n_layers, shape[-1], len(shape), tied)
        if len(shape) == 1 and role.endswith("norm"):
            lo, hi = spec.norms.get(role, spec.norms["norm"])
            raw = vals = rng.uniform(lo, hi, size=shape).astype(np.float32)
        else:
            std = spec.std.get(role, spec.std["bias" if role.endswith(".bias") else "linear"])
            raw, vals = make_weight(qtype, shape, std, rng)
        hf = vals
        if spec.permute_qk and role.split(".")[0] in ("attn_q", "attn_k"):
            hf = unpermute_qk(vals, config.num_attention_heads if role.startswith("attn_q")
                              else config.num_key_value_heads)
        if spec.norm_shift and role.endswith("norm"):
            hf = (vals - np.float32(spec.norm_shift)).astype(np.float32)
        if role == "ffn_gate_inp_shexp":  # the converter writes the HF [1, hidden] row as a vector [hidden]
            raw = raw.reshape(-1)
        gguf_tensors.append((gname, raw, qtype))
        hf_tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(hf, dtype=np.float32))

    for old, new in spec.hf_renames:
        hf_tensors = {name.replace(old, new): t for name, t in hf_tensors.items()}
    config.save_pretrained(str(hf_dir))
    save_file(hf_tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    gguf_path = root / "model.gguf"
    write_gguf(gguf_path, spec.arch, config, recipe_file_type(recipe), f"ringshm-zoo-{family}", gguf_tensors)
    return ZooModel(family, recipe, seed, hf_dir, gguf_path, config, {n: t for n, _, t in gguf_tensors})


def _hf_shapes(config) -> dict[str, tuple[int, ...]]:
    """HF state-dict names → shapes for ``config`` (model built on the meta device; a tied ``lm_head`` left out,
    as ``save_pretrained`` leaves it out); ``_class`` → the model class name."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    out: dict = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    out["_class"] = type(model).__name__
    return out


_BUILT: dict[tuple, ZooModel] = {}  # one build per (family, recipe, seed) per test session (process)


def zoo_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., ZooModel]:
    """``get(family, recipe="q4_k_m", seed=0, **config_overrides) -> ZooModel``, each built once per session under
    ``tmp_path_factory`` (the ``zoo`` fixture of ``conftest.py``)."""

    def get(family: str, recipe: str = "q4_k_m", seed: int = 0, **overrides) -> ZooModel:
        key = (family, recipe, seed, repr(sorted(overrides.items())))
        if key not in _BUILT:
            _BUILT[key] = build(family, tmp_path_factory.mktemp(f"zoo-{family}-{recipe}-{seed}"), recipe, seed,
                                **overrides)
        return _BUILT[key]

    return get
