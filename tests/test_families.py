"""Every supported family on ringshm's own layer loop (issue 21), on the zoo's tiny random-weight models
(``tests/zoo.py``: an HF directory and a Q4_K_M-like GGUF of the same function, transformers fp32 as the oracle):

- greedy 32 tokens tie-aware equal to the oracle, from the HF directory and from the GGUF;
- the same bytes at 1 and 2 stages and whatever the prefill chunking;
- a stream's bytes alone equal its bytes beside 4 batch-mates in every step op (batch invariance);
- through the engine's processes for one family per source (2 stages, 4 streams at once).
"""

from __future__ import annotations

import pytest
import torch

from ringshm.model.loader import Checkpoint
from ringshm.model.reference import greedy_generate
from ringshm.model.stage_model import StageModel
from ringshm.transport.messages import WANT_LAST
from zoo import FAMILIES, prompt_ids

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPT_LEN, N_NEW, MAX_SEQ = 16, 32, 64


def _stages(path, splits: tuple[int, ...], activations: str = "float32") -> list[StageModel]:
    """The model at ``path`` cut at the given layer boundaries (``()``: one stage), sharing one load; its matmuls
    multiply ``activations`` (``EngineConfig.matmul_activations``)."""
    ckpt = Checkpoint.open(path)
    cfg = ckpt.config
    full = ckpt.load_stage((0, cfg.n_layers), True, True)
    bounds = [0, *splits, cfg.n_layers]
    return [StageModel(cfg, (a, b), a == 0, b == cfg.n_layers, 5, MAX_SEQ,
                       weights=full.select((a, b), a == 0, b == cfg.n_layers), activations=activations)
            for a, b in zip(bounds, bounds[1:])]


def batched_greedy(stage: StageModel, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    """Every prompt prefilled in one step op (row r = prompt r), then ``n_new - 1`` greedy decode ops of every row
    at once: each row's ``n_new`` tokens."""
    stage.reset()
    out = stage.step(torch.tensor([t for p in prompts for t in p]),
                     [(r, 0, len(p), WANT_LAST) for r, p in enumerate(prompts)])
    tokens = [[int(t)] for t in out.token_ids]
    for i in range(n_new - 1):
        out = stage.step(torch.tensor([t[-1] for t in tokens]),
                         [(r, len(p) + i, 1, WANT_LAST) for r, p in enumerate(prompts)])
        for t, new in zip(tokens, out.token_ids.tolist()):
            t.append(new)
    return tokens


@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_the_oracle_and_is_the_same_at_one_and_two_stages(zoo, family, source,
                                                                        assert_greedy_matches):
    model = zoo(family)
    path = model.hf_dir if source == "hf" else model.gguf_path
    one = _stages(path, ())
    n_layers = one[0].config.n_layers
    two = _stages(path, (n_layers // 2,))
    compared = 0
    for seed in (0, 1):
        prompt = prompt_ids(PROMPT_LEN, one[0].config.vocab, seed)
        ids = torch.tensor(prompt)
        alone = greedy_generate(one, ids, N_NEW)
        assert torch.equal(greedy_generate(two, ids, N_NEW, prefill_chunk=5), alone), "2 stages, chunks of 5"
        assert torch.equal(greedy_generate(one, ids, N_NEW, prefill_chunk=3), alone), "chunks of 3"
        compared += assert_greedy_matches(alone, model.oracle_greedy(prompt, N_NEW), f"{family} {source} seed {seed}")
    print(f"{family} {source}: {compared} of {2 * N_NEW} steps compared with the oracle")
    assert compared >= N_NEW, f"{family}: the oracle's margins tie too early for the comparison to mean anything"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_stream_beside_four_batch_mates_gets_the_bytes_it_gets_alone(zoo, family):
    stage = _stages(zoo(family).gguf_path, ())[0]
    prompts = [prompt_ids(PROMPT_LEN - r, stage.config.vocab, 10 + r) for r in range(5)]  # unequal lengths
    alone = greedy_generate([stage], torch.tensor(prompts[0]), N_NEW)
    assert batched_greedy(stage, prompts, N_NEW)[0] == alone.tolist()


@pytest.mark.parametrize("family, source", [("gemma3", "gguf"), ("qwen3", "hf"), ("gptoss", "gguf")])
def test_the_engine_serves_a_family_over_two_stage_processes_byte_identical_to_in_process(zoo, family, source):
    from ringshm.engine.engine import Engine

    model = zoo(family)
    path = model.hf_dir if source == "hf" else model.gguf_path
    stages = _stages(path, ())
    prompts = [prompt_ids(PROMPT_LEN, stages[0].config.vocab, 20 + i) for i in range(4)]
    want = []
    for p in prompts:
        stages[0].reset()
        want.append(greedy_generate(stages, torch.tensor(p), N_NEW).tolist())
    with Engine(model=str(path), stages=2, max_rows=4, max_seq_len=MAX_SEQ, prefill_chunk=8, progress=False,
                kv_cache_dtype="float32") as engine:  # the KV the in-process stages hold (fp16 rounds it)
        out = engine.generate_batch(prompts, max_new_tokens=N_NEW, ignore_eos=True)
    assert [r.token_ids for r in out.results] == want


# ------------------------------------------------------------------ fields that change the math: computed or refused
# Each setting below changes what a model computes. A model that sets it either equals the oracle (computed) or is
# refused with an error naming the field (never loaded and silently wrong).
COMPUTED = [
    ("llama", dict(mlp_bias=True)),  # biases on gate, up and down
    ("llama", dict(attention_bias=True)),  # Llama's covers q, k, v and o
    ("mistral", dict(sliding_window=16)),  # every layer slides (HF only: llama.cpp's converter drops the window)
    ("llama", dict(head_dim=32)),  # heads narrower than hidden / n_heads
    ("llama", dict(tie_word_embeddings=True)),
    ("qwen2", dict(tie_word_embeddings=False)),
    ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0})),
    # YaRN (Qwen 2.5 / 3 long context): over 16 original positions most dimensions interpolate, a few ramp
    ("qwen3", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                    "original_max_position_embeddings": 16})),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0, "beta_fast": 16.0,
                                    "beta_slow": 2.0, "original_max_position_embeddings": 8})),
    ("qwen3moe", dict(norm_topk_prob=False)),  # top-k weights as they are (HF only: llama.cpp's always renormalise)
    ("qwen3moe", dict(moe_intermediate_size=40)),  # experts not whole 16-float vectors: the torch path
    ("olmoe", dict(intermediate_size=40)),  # the same, with OLMoE's whole-projection q / k norms
    ("granitemoe", dict(intermediate_size=40)),  # the same, with Granite's top-k softmax and muP multipliers
    ("qwen2moe", dict(shared_expert_intermediate_size=40)),  # a shared expert of odd width: the torch path
    ("qwen2moe", dict(norm_topk_prob=True)),  # Qwen2-MoE renormalised (HF only: llama.cpp's qwen2moe never does)
    ("gptoss", dict(intermediate_size=40)),  # sinks, biases and the clamped SwiGLU on the torch path
    ("gptoss", dict(swiglu_limit=0.5)),  # a clamp that bites (HF only: llama.cpp fixes gpt-oss's at 7)
    ("gptoss", dict(experts_per_token=4, initial_context_length=4096)),  # OpenAI's config.json keys nothing reads
]
HF_ONLY = {"sliding_window", "norm_topk_prob", "swiglu_limit"}  # settings llama.cpp's converter does not carry over


@pytest.mark.parametrize("family, overrides", COMPUTED, ids=[f"{f}-{next(iter(o))}" for f, o in COMPUTED])
def test_a_setting_ringshm_computes_gives_the_oracles_tokens(zoo, family, overrides, assert_greedy_matches):
    model = zoo(family, "f32", **overrides)
    for path in (model.hf_dir,) if HF_ONLY & set(overrides) else (model.hf_dir, model.gguf_path):
        try:
            stages = _stages(path, ())
        except Exception as exc:  # noqa: BLE001 - a refusal is allowed only if it names the field
            pytest.fail(f"{family} {overrides} from {path.name} was refused: {exc}")
        prompt = prompt_ids(PROMPT_LEN, stages[0].config.vocab, 3)
        ours = greedy_generate(stages, torch.tensor(prompt), N_NEW)
        compared = assert_greedy_matches(ours, model.oracle_greedy(prompt, N_NEW), f"{family} {overrides} {path.name}")
        assert compared >= N_NEW // 2, f"{family} {overrides}: the oracle's margins tie too early to compare"


YARN = [  # transformers' RoPE dicts: the defaults, gpt-oss's (no truncation), DeepSeek's mscales, a given factor
    {"factor": 4.0, "original_max_position_embeddings": 32768},
    {"factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707},
    {"factor": 2.0, "original_max_position_embeddings": 64, "attention_factor": 1.25, "beta_fast": 8.0},
]


@pytest.mark.parametrize("params", YARN, ids=range(len(YARN)))
def test_yarn_frequencies_and_attention_factor_are_transformers_bits(params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ringshm.model.families_hf import hf_config
    from ringshm.model.rope import rope_inv_freq, rope_scale

    config = LlamaConfig(hidden_size=1024, num_attention_heads=8, max_position_embeddings=131072,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, **params})
    want, attention = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours = hf_config(config.to_dict(), "yarn")
    assert torch.equal(rope_inv_freq(ours, 0), want)
    assert rope_scale(ours, 0) == attention


def test_yarn_without_an_original_context_is_refused_and_the_top_level_one_wins_for_llama3():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ringshm.errors import UnsupportedArchitecture
    from ringshm.model.families_hf import hf_config
    from ringshm.model.rope import rope_inv_freq

    base = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "num_hidden_layers": 1,
            "intermediate_size": 512, "vocab_size": 512}
    with pytest.raises(UnsupportedArchitecture, match="original_max_position_embeddings"):
        hf_config({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "x")
    llama3 = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    config = LlamaConfig(**{k: v for k, v in base.items() if k != "model_type"}, rope_parameters=dict(llama3),
                         original_max_position_embeddings=64, max_position_embeddings=1024)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    ours = hf_config({**base, "rope_parameters": llama3, "original_max_position_embeddings": 64,
                      "max_position_embeddings": 1024}, "x")
    assert torch.equal(rope_inv_freq(ours, 0), want)


def test_mixtral_reads_no_attention_bias_as_transformers_builds_none(zoo, tmp_path):
    import json
    import shutil

    shutil.copytree(zoo("mixtral", "f32").hf_dir, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "attention_bias": True, "mlp_bias": True}))
    config = Checkpoint.open(tmp_path / "hf").config
    assert not (config.attention_bias or config.o_bias or config.mlp_bias)


REFUSED = [
    ("llama", "rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                  "original_max_position_embeddings": 32, "extrapolation_factor": 0.5},
     "extrapolation_factor"),  # a YaRN key transformers does not read either
    ("llama", "rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}, "dynamic"),
    ("qwen3", "rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1.0,
                                  "original_max_position_embeddings": 16}, "rope_theta"),  # log(base) = 0
    ("llama", "rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
     "one RoPE scaling"),  # beside rope_parameters' default: transformers would take the YaRN one
    ("gemma3", "rope_parameters", {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                      "original_max_position_embeddings": 16},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, "Gemma 3"),
    ("gemma3", "attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("gemma3", "use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("qwen3", "use_sliding_window", True, "use_sliding_window"),
    ("phi3", "partial_rotary_factor", 0.5, "partial_rotary_factor"),
    ("llama", "hidden_act", "gelu", "hidden_act"),
    ("llama", "some_new_switch", 1, "some_new_switch"),  # a field no release of ringshm has heard of
    ("qwen3moe", "mlp_only_layers", [1], "mlp_only_layers"),  # a dense layer among routed ones
    ("qwen2moe", "layer_types", ["sliding_attention"] * 4, "layer_types"),  # windows without use_sliding_window
    ("qwen3moe", "decoder_sparse_step", 2, "decoder_sparse_step"),
    ("gptoss", "layer_types", ["sliding_attention", "full_attention"], r"layer_types .* per layer: \d+ layers"),
    ("olmoe", "clip_qkv", 8.0, "clip_qkv"),
    ("qwen3moe", "model_type", "qwen3_next", "Gated DeltaNet"),  # MoE families not computed: by name, with why
    ("qwen3moe", "model_type", "deepseek_v3", "MLA"),
    ("gptoss", "quantization_config", {"quant_method": "bitsandbytes"}, "GGUF"),  # (MXFP4 experts are read)
    ("qwen3moe", "model_type", "phimoe", "sparsemixer"),
]


@pytest.mark.parametrize("family, field, value, named", REFUSED, ids=[f"{f}-{k}-{n}" for f, k, _, n in REFUSED])
def test_a_setting_ringshm_does_not_compute_is_refused_naming_it(zoo, tmp_path, family, field, value, named):
    import json
    import shutil

    from ringshm.errors import UnsupportedArchitecture

    src = zoo(family, "f32").hf_dir
    shutil.copytree(src, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg[field] = value
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match=named):
        Checkpoint.open(tmp_path / "hf")


@pytest.mark.parametrize("field, value", [("swiglu_limit", "7"), ("swiglu_alpha", True), ("swiglu_limit", None),
                                          ("swiglu_limit", 1e29), ("swiglu_alpha", 0)])
def test_a_bad_swiglu_setting_is_refused_naming_it(zoo, tmp_path, field, value):
    """gpt-oss's clamp and slope: a string, a bool, a null or a value past the C layer's range is refused by name
    before anything loads (a hostile review found "7" read as 7.0 and 1e29... failing every step instead)."""
    import json
    import shutil

    from ringshm.errors import InvalidCheckpoint

    shutil.copytree(zoo("gptoss", "f32").hf_dir, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(InvalidCheckpoint, match=field):
        Checkpoint.open(tmp_path / "hf")


def test_a_checkpoint_tensor_the_description_does_not_read_is_refused(zoo, tmp_path):
    """A bias the config does not announce (how an ignored mlp_bias once slipped through)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from ringshm.errors import UnsupportedArchitecture

    shutil.copytree(zoo("llama", "f32").hf_dir, tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.bias"] = torch.zeros(tensors["model.layers.1.mlp.down_proj.weight"].shape[0])
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedArchitecture, match="mlp.down_proj.bias"):
        _stages(tmp_path / "hf", ())


def test_a_type_the_matmul_does_not_read_is_dequantized_counted_at_fp32_and_said_once(zoo, caplog):
    model = zoo("llama", "q3_k")
    ckpt = Checkpoint.open(model.gguf_path)
    held, expanded = ckpt.stage_bytes((0, ckpt.config.n_layers), True, True)
    assert expanded and all(".weight" in n for n in expanded)
    q3 = [n for n, t in model.gguf_types.items() if t.name == "Q3_K"]
    assert set(q3) <= set(expanded)
    n_el = sum(int(torch.tensor(ckpt.source.index.tensors[n].shape).prod()) for n in q3)
    assert held >= 4 * n_el  # at fp32, not at the file's ~3.4 bits a weight
    with caplog.at_level("WARNING", logger="ringshm.model.loader"):
        stages = _stages(model.gguf_path, ())
    lines = [r.getMessage() for r in caplog.records if "dequantized to fp32 at load" in r.getMessage()]
    assert len(lines) == 1 and "Q3_K" in lines[0], lines
    prompt = prompt_ids(PROMPT_LEN, stages[0].config.vocab, 4)
    assert greedy_generate(stages, torch.tensor(prompt), 4).numel() == 4


def test_a_gate_and_up_of_two_types_are_counted_at_fp32_as_the_one_matmul_holds_them(zoo, tmp_path):
    """A layer's gate and up run as one matmul (concat_rows): of two types, both are held in F32, and the memory
    check must count that (a Q4_K gate beside a Q8_0 up was counted at its stored ~5 bits a weight)."""
    import gguf
    import numpy as np

    from ringshm.model.qmatmul import PackedWeight
    from zoo_convert import write_gguf
    from zoo_quant import recipe_file_type

    model = zoo("llama", "q4_k_m")
    reader = gguf.GGUFReader(str(model.gguf_path))
    tensors = []
    for t in reader.tensors:
        raw, qtype = np.array(t.data), gguf.GGMLQuantizationType(t.tensor_type)
        if t.name.endswith("ffn_up.weight"):
            assert qtype != gguf.GGMLQuantizationType.Q8_0
            raw, qtype = gguf.quants.quantize(gguf.quants.dequantize(raw, qtype), gguf.GGMLQuantizationType.Q8_0), \
                gguf.GGMLQuantizationType.Q8_0
        tensors.append((t.name, raw, qtype))
    path = tmp_path / "mixed.gguf"
    write_gguf(path, "llama", model.config, recipe_file_type("q4_k_m"), "mixed gate / up", tensors)
    ckpt = Checkpoint.open(path)
    n = ckpt.config.n_layers
    counted, expanded = ckpt.stage_bytes((0, n), True, True)
    assert {f"blk.{i}.ffn_{r}.weight" for i in range(n) for r in ("gate", "up")} <= set(expanded)
    stage = StageModel.from_path(path, max_rows=1, max_seq_len=64, checkpoint=ckpt)
    held = sum(w.nbytes for layer in stage.layers for w in vars(layer).values() if isinstance(w, PackedWeight))
    assert all(layer.w_gate_up.qtype == 0 for layer in stage.layers)  # F32: what the count must cover
    assert counted >= held, f"the memory check counts {counted} bytes, the layers hold {held}"
    # while a layer packs, its widened gate and up exist in fp32 beside their concatenation: the load margin too
    from ringshm.runtime.resources import load_transient_bytes

    fp32 = sum(ckpt.source.held_bytes(f"blk.0.ffn_{r}.weight", False, 4.0)[0] for r in ("gate", "up"))
    assert load_transient_bytes(ckpt, expanded, True, 4.0) >= fp32


def test_a_field_a_config_leaves_out_means_what_transformers_config_class_takes():
    """Each family's config class has its own defaults (rms_norm_eps 1e-5 for Phi-3, OLMoE, Mixtral and gpt-oss,
    Mixtral's RoPE base 1e6, gpt-oss's YaRN and window, Mistral's window, Gemma 3's activation): a config.json that
    leaves one out must read as transformers reads it, not as another family's default."""
    import transformers

    from ringshm.model.families import HF_TYPES
    from ringshm.model.families_hf import hf_config

    base = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
            "intermediate_size": 256, "vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    moe = {"qwen3_moe": "num_experts", "olmoe": "num_experts", "qwen2_moe": "num_experts", "granitemoe": "",
           "granitemoeshared": "", "mixtral": "", "gpt_oss": ""}
    for model_type in HF_TYPES:
        c = dict(base)
        if model_type in moe:
            c.update({moe[model_type] or "num_local_experts": 4, "num_experts_per_tok": 2})
            if model_type in ("qwen3_moe", "qwen2_moe"):
                c.update(moe_intermediate_size=256)
            if model_type == "qwen2_moe":
                c.update(shared_expert_intermediate_size=256)
        theirs = transformers.AutoConfig.for_model(model_type, **c)
        ours = hf_config({"model_type": model_type, **c}, model_type)
        rope = theirs.rope_parameters
        rope = rope.get("full_attention", rope)  # Gemma 3: per layer type
        assert ours.rms_eps == theirs.rms_norm_eps, model_type
        assert ours.rope_theta == rope["rope_theta"], model_type
        assert (ours.rope_scaling.kind if ours.rope_scaling else "default") == rope["rope_type"], model_type
        types = getattr(theirs, "layer_types", None)
        window = getattr(theirs, "sliding_window", None) or 0
        if types and "sliding_attention" in types:
            assert [ours.window(i) for i in range(4)] == [window if t == "sliding_attention" else 0 for t in types]
        elif ours.arch not in ("qwen2", "qwen3", "qwen3moe", "qwen2moe"):  # Qwen's window needs use_sliding_window
            assert ours.sliding_window == window, model_type
    assert hf_config({"model_type": "gpt_oss", **base, "num_local_experts": 4, "num_experts_per_tok": 2},
                     "x").rope_scaling.truncate is False  # GptOssConfig's own YaRN, the ramp not truncated
