"""Routed mixture-of-experts families (issue 29) on the zoo's tiny models (``tests/zoo.py``: 16 experts, top 4;
Mixtral top 2): Qwen3-MoE (top-k weights renormalised), OLMoE (not; q / k norms over the whole projection), Granite
MoE (softmax over the top-k logits, muP multipliers), Mixtral (renormalised; GGUF arch ``llama``), Qwen2-MoE (a
shared expert gated by a sigmoid) and Granite MoE Shared (an ungated shared expert).

``tests/test_families.py`` already runs every zoo family, these included, against transformers fp32 from the HF
directory and the GGUF, at 1 and 2 stages, chunked, and beside batch-mates. Here, what is particular to experts:

- the test prompts do not sit on router near-ties (the k-th and (k+1)-th router logits stay apart), so an
  equal-to-the-oracle result is not luck and a divergence would not be a routing tie;
- a stream's logits are the same bits alone, beside batch-mates that route every token to the same experts as
  it (each expert then serves several tokens of one op), beside strangers, and in a step of tokens that route to
  disjoint experts (each expert serving one token);
- a GGUF that merges gate and up (``ffn_gate_up_exps``, newer converters) gives the same bits as the split one,
  and so does one that holds each expert as its own 2-D tensor (llama.cpp's Mixtral files before 3-D experts);
- through the engine's stage processes (2 stages, prefix-cache hits, batched) the tokens equal the in-process
  ones;
- MoE families ringshm does not compute are refused by name with what they need.
"""

from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch

from ringshm.errors import UnsupportedArchitecture
from ringshm.model.loader import Checkpoint
from ringshm.model.reference import greedy_generate
from ringshm.model.stage_model import StageModel
from ringshm.transport.messages import WANT_LAST, WANT_LOGITS
from zoo import MOE_FAMILIES, prompt_ids
from zoo_convert import write_gguf

pytestmark = pytest.mark.usefixtures("torch_one_thread")

PROMPT_LEN, N_NEW, MAX_SEQ = 16, 32, 64
# The least router-logit gap l_k - l_(k+1) (k-th largest minus the next) the oracle-compared prompts may show.
# Measured on these models: ringshm's layer inputs differ from the oracle's by at most 1.5e-6 relative (rounding
# order), the router logits reach about 7 in magnitude, so the two engines' logits differ by ~1e-5 at most: a gap
# over 1e-4 cannot flip an expert.
ROUTER_GAP = 1e-4


def _stage(path, rows: int = 6, activations: str = "float32") -> StageModel:
    ckpt = Checkpoint.open(path)
    cfg = ckpt.config
    return StageModel(cfg, (0, cfg.n_layers), True, True, rows, MAX_SEQ,
                      weights=ckpt.load_stage((0, cfg.n_layers), True, True), activations=activations)


def _router_gaps(model, ids: list[int]) -> torch.Tensor:
    """The oracle's router-logit gap between the k-th and (k+1)-th expert (k = experts per token; the softmax keeps
    the order, so this is what decides the k-th pick) at every position of ``ids`` and every layer, fp32
    ``[n_layers, len(ids)]``."""
    k = model.config.num_experts_per_tok
    with torch.inference_mode():
        out = model.oracle()(torch.tensor([ids]), output_router_logits=True)
    gaps = []
    for logits in out.router_logits:  # per layer [T, E]
        top = logits.float().topk(k + 1, dim=-1).values
        gaps.append(top[:, k - 1] - top[:, k])
    return torch.stack(gaps)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_test_prompts_keep_the_kth_expert_apart_from_the_next(zoo, family):
    model = zoo(family)
    least = []
    for seed in (0, 1):  # the prompts test_families compares with the oracle (ringshm-to-ringshm ones need no gap)
        prompt = prompt_ids(PROMPT_LEN, model.config.vocab_size, seed)
        ids = prompt + model.oracle_greedy(prompt, N_NEW).tokens.tolist()
        least.append(float(_router_gaps(model, ids).min()))
    print(f"{family}: least router-logit gap l_k - l_(k+1) per prompt: {[f'{g:.1e}' for g in least]}")
    assert min(least) > ROUTER_GAP


def _run(stage: StageModel, prompts: list[list[int]], n_steps: int) -> list[list[bytes]]:
    """Prefill ``prompts`` (row r = prompt r) in one step op, then ``n_steps`` greedy decode ops of every row at
    once; returns each row's last-position logits (raw bytes) after the prefill and every decode."""
    stage.reset()
    out = stage.step(torch.tensor([t for p in prompts for t in p]),
                     [(r, 0, len(p), WANT_LAST | WANT_LOGITS) for r, p in enumerate(prompts)])
    logits = [[out.logits[r].numpy().tobytes()] for r in range(len(prompts))]
    tokens = out.token_ids.tolist()
    for i in range(n_steps):
        out = stage.step(torch.tensor(tokens), [(r, len(p) + i, 1, WANT_LAST | WANT_LOGITS)
                                                for r, p in enumerate(prompts)])
        tokens = out.token_ids.tolist()
        for r in range(len(prompts)):
            logits[r].append(out.logits[r].numpy().tobytes())
    return logits


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_streams_logits_are_the_same_bits_alone_in_a_crowd_on_its_experts_and_beside_strangers(zoo, family,
                                                                                                  activations):
    stage = _stage(zoo(family).gguf_path, activations=activations)
    prompt = prompt_ids(PROMPT_LEN, stage.config.vocab, 10)
    alone = _run(stage, [prompt], 8)[0]
    # five streams of the same prompt: every token of the op routes to the experts stream 0's token routes to,
    # so each of those experts runs on five rows at once
    crowd = _run(stage, [prompt] * 5, 8)
    assert all(c == alone for c in crowd)
    strangers = [prompt] + [prompt_ids(PROMPT_LEN - r, stage.config.vocab, 30 + r) for r in range(1, 5)]
    assert _run(stage, strangers, 8)[0] == alone


def _layer0_experts(model, token: int) -> set[int]:
    """The experts layer 0 routes a lone ``token`` at position 0 to (the oracle's router): at position 0 the layer's
    input is the token's embedding alone."""
    with torch.inference_mode():
        logits = model.oracle()(torch.tensor([[token]]), output_router_logits=True).router_logits[0]
    return set(logits[0].topk(model.config.num_experts_per_tok).indices.tolist())


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_tokens_routed_to_disjoint_experts_get_the_bits_they_get_alone(zoo, family):
    model = zoo(family)
    stage = _stage(model.gguf_path)
    picked, used = [], set()
    for token in range(3, stage.config.vocab):  # greedily: tokens whose layer-0 experts no earlier pick uses
        experts = _layer0_experts(model, token)
        if not experts & used:
            picked.append(token)
            used |= experts
        if len(picked) == 3:
            break
    assert len(picked) == 3, "no three tokens with disjoint layer-0 experts"
    together = _run(stage, [[t] for t in picked], 4)
    for t, got in zip(picked, together):
        assert got == _run(stage, [[t]], 4)[0]


@pytest.mark.parametrize("family, arch", [("qwen3moe", "qwen3moe"), ("gptoss", "gpt-oss")])
def test_a_gguf_with_gate_and_up_merged_gives_the_split_files_bits(zoo, tmp_path, family, arch):
    """llama.cpp's converter may merge each layer's gate and up experts into ffn_gate_up_exps (and gpt-oss's biases
    into ffn_gate_up_exps.bias, [E, 2 I] rows [gate | up])."""
    model = zoo(family)
    reader = gguf.GGUFReader(str(model.gguf_path))
    tensors = []
    for t in reader.tensors:
        data = np.array(t.data)
        if t.name.endswith(("ffn_up_exps.weight", "ffn_up_exps.bias")):
            continue
        if t.name.endswith(("ffn_gate_exps.weight", "ffn_gate_exps.bias")):  # up's rows after each expert's gate
            up = np.array(next(u.data for u in reader.tensors if u.name == t.name.replace("gate", "up")))
            tensors.append((t.name.replace("ffn_gate_exps", "ffn_gate_up_exps"), np.concatenate([data, up], axis=1),
                            t.tensor_type))
        else:
            tensors.append((t.name, data, t.tensor_type))
    merged = tmp_path / "merged.gguf"
    write_gguf(merged, arch, model.config, gguf.LlamaFileType.MOSTLY_Q4_K_M, "merged", tensors)
    prompts = [prompt_ids(PROMPT_LEN, model.config.vocab_size, s) for s in (10, 11)]
    assert _run(_stage(merged), prompts, 4) == _run(_stage(model.gguf_path), prompts, 4)


def _per_expert_tensors(model) -> list:
    """The zoo model's GGUF tensors with each 3-D ``ffn_*_exps`` cut into one 2-D ``ffn_*.{e}.weight`` per expert,
    as llama.cpp wrote Mixtral files before it stacked experts (its legacy ``LLM_TENSOR_FFN_*_EXP`` names)."""
    out = []
    for t in gguf.GGUFReader(str(model.gguf_path)).tensors:
        data = np.array(t.data)
        if t.name.endswith("_exps.weight"):
            base = t.name[:-len("_exps.weight")]
            out += [(f"{base}.{e}.weight", np.ascontiguousarray(data[e]), t.tensor_type) for e in range(len(data))]
        else:
            out.append((t.name, data, t.tensor_type))
    return out


def test_a_gguf_with_one_tensor_per_expert_gives_the_3d_files_bits(zoo, tmp_path):
    model = zoo("mixtral")
    path = tmp_path / "split.gguf"
    tensors = _per_expert_tensors(model)
    assert "blk.0.ffn_gate.15.weight" in {n for n, _, _ in tensors}
    write_gguf(path, "llama", model.config, gguf.LlamaFileType.MOSTLY_Q4_K_M, "split", tensors)
    prompts = [prompt_ids(PROMPT_LEN, model.config.vocab_size, s) for s in (10, 11)]
    assert _run(_stage(path), prompts, 4) == _run(_stage(model.gguf_path), prompts, 4)


def test_a_gguf_mixing_expert_layouts_is_refused_saying_so(zoo, tmp_path):
    from ringshm.errors import MissingTensor

    model = zoo("mixtral")
    stacked = [(t.name, np.array(t.data), t.tensor_type) for t in gguf.GGUFReader(str(model.gguf_path)).tensors]
    mixed = [t for t in _per_expert_tensors(model) if t[0].startswith("blk.0.")] + \
        [t for t in stacked if not t[0].startswith("blk.0.")]  # layer 0 a tensor per expert, the others 3-D
    write_gguf(tmp_path / "mixed.gguf", "llama", model.config, gguf.LlamaFileType.MOSTLY_Q4_K_M, "mixed", mixed)
    with pytest.raises(MissingTensor, match=r"blk\.1\.ffn_gate\.0\.weight.*another layout than layer 0's"):
        Checkpoint.open(tmp_path / "mixed.gguf")
    mixed = [t for t in stacked if t[0].startswith("blk.0.")] + \
        [t for t in _per_expert_tensors(model) if not t[0].startswith("blk.0.")]  # the reverse
    write_gguf(tmp_path / "mixed.gguf", "llama", model.config, gguf.LlamaFileType.MOSTLY_Q4_K_M, "mixed", mixed)
    with pytest.raises(MissingTensor, match=r"blk\.1\.ffn_gate_exps\.weight.*another layout than layer 0's"):
        Checkpoint.open(tmp_path / "mixed.gguf")


def test_a_per_expert_gguf_missing_one_expert_is_refused_naming_it(zoo, tmp_path):
    from ringshm.errors import InvalidCheckpoint, MissingTensor

    model = zoo("mixtral")
    path = tmp_path / "split.gguf"
    tensors = [t for t in _per_expert_tensors(model) if t[0] != "blk.2.ffn_up.9.weight"]
    write_gguf(path, "llama", model.config, gguf.LlamaFileType.MOSTLY_Q4_K_M, "split", tensors)
    with pytest.raises(MissingTensor, match=r"blk\.2\.ffn_up\.9\.weight' \(layer 2 w_exp_up expert 9\) not found$"):
        Checkpoint.open(path)
    # one expert more than the metadata counts: said as that, not as a tensor nothing reads
    n_e = model.config.num_local_experts
    extra = next((f"blk.2.ffn_up.{n_e}.weight", raw, t) for n, raw, t in tensors if n == "blk.2.ffn_up.0.weight")
    write_gguf(path, "llama", model.config, gguf.LlamaFileType.MOSTLY_Q4_K_M, "split",
               _per_expert_tensors(model) + [extra])
    with pytest.raises(InvalidCheckpoint, match=rf"blk\.2\.ffn_up\.{n_e}\.weight.*past the config's {n_e} experts"):
        Checkpoint.open(path)


def test_a_per_expert_gguf_with_one_expert_of_another_type_is_refused_naming_it(zoo, tmp_path):
    from ringshm.errors import InvalidCheckpoint

    model = zoo("mixtral")
    path = tmp_path / "split.gguf"
    tensors = [(n, gguf.quants.dequantize(raw, t), gguf.GGMLQuantizationType.F32) if n == "blk.1.ffn_gate.5.weight"
               else (n, raw, t) for n, raw, t in _per_expert_tensors(model)]
    write_gguf(path, "llama", model.config, gguf.LlamaFileType.MOSTLY_Q4_K_M, "split", tensors)
    with pytest.raises(InvalidCheckpoint, match=r"blk\.1\.ffn_gate\.5\.weight.*F32.*one type"):
        Checkpoint.open(path)


def test_a_shared_expert_checkpoint_that_lies_is_refused_naming_what(zoo, tmp_path):
    import json
    import shutil

    from ringshm.errors import InvalidCheckpoint, MissingTensor

    shutil.copytree(zoo("granitemoeshared").hf_dir, tmp_path / "hf")  # a width no int can hold
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, "shared_intermediate_size": float("inf")}))
    with pytest.raises(InvalidCheckpoint, match="shared_intermediate_size"):
        Checkpoint.open(tmp_path / "hf")
    # a Granite GGUF whose header says a shared expert but whose tensors hold none (llama.cpp requires them)
    plain = [(t.name, np.array(t.data), t.tensor_type)
             for t in gguf.GGUFReader(str(zoo("granitemoe").gguf_path)).tensors]
    write_gguf(tmp_path / "no_shexp.gguf", "granitemoe", zoo("granitemoeshared").config,
               gguf.LlamaFileType.MOSTLY_Q4_K_M, "lies", plain)
    with pytest.raises(MissingTensor, match="ffn_gate_shexp"):
        Checkpoint.open(tmp_path / "no_shexp.gguf")
    # the shared expert's gate and up in two types (they are packed as one matmul)
    model = zoo("qwen2moe")
    mixed = [(n, gguf.quants.dequantize(raw, t), gguf.GGMLQuantizationType.F32) if n == "blk.1.ffn_up_shexp.weight"
             else (n, raw, t) for n, raw, t in ((t.name, np.array(t.data), t.tensor_type)
                                               for t in gguf.GGUFReader(str(model.gguf_path)).tensors)]
    write_gguf(tmp_path / "mixed.gguf", "qwen2moe", model.config, gguf.LlamaFileType.MOSTLY_Q4_K_M, "mixed", mixed)
    with pytest.raises(InvalidCheckpoint, match=r"blk\.1\.ffn_up_shexp\.weight.*F32.*one type"):
        Checkpoint.open(tmp_path / "mixed.gguf")


def _copy_gguf(src, dst, drop_key: str | None = None, extra: tuple = ()) -> None:
    """``src`` rewritten to ``dst`` without metadata key ``drop_key``, with tensors ``extra`` (name, array) added."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", drop_key):
            continue
        vt = f.types[0]
        w.add_key_value(f.name, f.contents(), vt, sub_type=f.types[1] if vt == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, a in extra:
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_a_missing_expert_key_and_a_tensor_a_family_lacks_are_refused_naming_them(zoo, tmp_path):
    from ringshm.errors import InvalidCheckpoint

    src = zoo("qwen3moe").gguf_path
    _copy_gguf(src, tmp_path / "no_count.gguf", drop_key="qwen3moe.expert_count")
    with pytest.raises(InvalidCheckpoint, match=r"'qwen3moe\.expert_count' is missing"):
        Checkpoint.open(tmp_path / "no_count.gguf")
    n_e = Checkpoint.open(src).config.n_experts
    _copy_gguf(src, tmp_path / "bias.gguf", extra=(("blk.0.exp_probs_b.bias", np.zeros(n_e, np.float32)),))
    with pytest.raises(UnsupportedArchitecture, match=r"'blk\.0\.exp_probs_b\.bias'"):
        Checkpoint.open(tmp_path / "bias.gguf")


def test_a_mixture_of_experts_runs_native_whatever_its_unused_dense_ffn_width(zoo):
    """A MoE has no dense FFN: an odd ``feed_forward_length`` some files carry must not send it to the torch path
    (fp32 dense weights, no batch invariance, int8 refused), nor make the C layer refuse its shape: it runs natively
    and gives the bits of the same weights with the usual width, while a dense model of that width does go to the
    torch path."""
    from dataclasses import replace

    from ringshm.model.stage_model import runs_native

    odd = zoo("qwen3moe", intermediate_size=100)  # Qwen3MoeConfig's dense width: no layer of this model reads it
    moe = Checkpoint.open(odd.gguf_path).config
    assert moe.intermediate == 100 and runs_native(moe, "cpu", torch.float32)
    prompts = [prompt_ids(12, moe.vocab, 3), prompt_ids(5, moe.vocab, 4)]
    for activations in ("float32", "int8"):
        got = _stage(odd.gguf_path, activations=activations)
        assert got.native
        want = _stage(zoo("qwen3moe").gguf_path, activations=activations)
        assert _run(got, prompts, 3) == _run(want, prompts, 3), activations
    dense = Checkpoint.open(zoo("qwen3").gguf_path).config
    assert runs_native(dense, "cpu", torch.float32) and not runs_native(replace(dense, intermediate=7), "cpu",
                                                                         torch.float32)


def test_the_memory_check_covers_a_layer_of_experts_dequantized_at_load_twice(zoo):
    """Q3_K experts are dequantized to fp32 at load and a layer is packed at once: while it packs, all of that
    layer's expanded experts exist twice (a hostile review saw 4 layers of 64 Q2_K experts peak at 1.26 x a count
    that added only the largest tensor once), plus the dequantizer's ~3 x of one tensor."""
    from ringshm.runtime.resources import load_transient_bytes

    ckpt = Checkpoint.open(zoo("qwen3moe", "q3_k").gguf_path)
    _, grown = ckpt.stage_bytes((0, ckpt.config.n_layers), True, True)
    layer0 = [n for n in grown if n.startswith("blk.0.ffn_") and "_exps" in n]
    assert len(layer0) == 3, grown
    fp32 = [ckpt.source.held_bytes(n, True, 4.0)[0] for n in layer0]
    assert load_transient_bytes(ckpt, grown, True, 4.0) >= sum(fp32) + 2 * max(fp32)


def test_the_memory_check_counts_a_shared_expert_of_odd_width_as_the_dense_weights_the_torch_path_holds(zoo):
    from ringshm.config import EngineConfig
    from ringshm.errors import ResourceShortage
    from ringshm.model.stage_model import runs_native
    from ringshm.runtime.resources import check_memory

    odd = zoo("qwen2moe", shared_expert_intermediate_size=40)  # not whole 16-float vectors: the torch path
    cfg = Checkpoint.open(odd.gguf_path).config
    assert not runs_native(cfg, "cpu", torch.float32) and runs_native(Checkpoint.open(zoo("qwen2moe").gguf_path).config,
                                                                       "cpu", torch.float32)
    engine = EngineConfig(stages=1, max_rows=1, max_seq_len=64)
    with pytest.raises(ResourceShortage) as info:
        check_memory(engine, cfg, engine.layer_ranges(cfg.n_layers), 64, odd.gguf_path, available_bytes=1)
    weights = float(str(info.value).split("weights and layer scratch ")[1].split(" GiB")[0])
    dense = 4 * sum(p.numel() for p in odd.oracle().parameters()) / 2**30  # every weight fp32 on the torch path
    assert weights >= 0.9 * dense, (weights, dense)


def test_the_engine_serves_moe_over_two_stage_processes_with_prefix_hits_byte_identical(zoo):
    from ringshm.engine.engine import Engine

    model = zoo("olmoe")
    stage = _stage(model.gguf_path)
    shared = prompt_ids(40, stage.config.vocab, 21)  # a full KV block (32) the later prompts hit in the cache
    prompts = [shared + prompt_ids(6 + i, stage.config.vocab, 22 + i) for i in range(3)]
    want = []
    for p in prompts:
        stage.reset()
        want.append(greedy_generate([stage], torch.tensor(p), 16).tolist())
    with Engine(model=str(model.gguf_path), stages=2, max_rows=4, max_seq_len=MAX_SEQ, prefill_chunk=8,
                progress=False) as engine:
        first = engine.generate(prompts[0], max_new_tokens=16, ignore_eos=True)
        rest = engine.generate_batch(prompts[1:], max_new_tokens=16, ignore_eos=True)
    assert first.n_cached_tokens == 0 and all(r.n_cached_tokens == 32 for r in rest.results)
    assert [first.token_ids] + [r.token_ids for r in rest.results] == want


def _gguf_of_arch(path, arch: str) -> None:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch, named", [("deepseek2", "MLA"), ("qwen3next", "Gated DeltaNet"),
                                         ("phimoe", "sparsemixer")])
def test_an_moe_gguf_ringshm_does_not_compute_is_refused_by_name(tmp_path, arch, named):
    _gguf_of_arch(tmp_path / "m.gguf", arch)
    with pytest.raises(UnsupportedArchitecture, match=f"{arch}.*{named}"):
        Checkpoint.open(tmp_path / "m.gguf")


def test_experts_in_a_dense_arch_are_refused_by_name(zoo, tmp_path):
    model = zoo("qwen3moe")
    reader = gguf.GGUFReader(str(model.gguf_path))
    tensors = [(t.name, np.array(t.data), t.tensor_type) for t in reader.tensors]
    cfg = model.config.to_dict()
    from transformers import Qwen3Config

    dense = Qwen3Config(**{k: v for k, v in cfg.items() if k in Qwen3Config().to_dict()})
    path = tmp_path / "dense.gguf"
    write_gguf(path, "qwen3", dense, gguf.LlamaFileType.MOSTLY_Q4_K_M, "experts-in-qwen3", tensors)
    with pytest.raises(UnsupportedArchitecture, match="expert"):
        Checkpoint.open(path)


def _rewrite(model, path, **config_changes) -> None:
    """The zoo model's GGUF tensors under a header written from its config with ``config_changes``."""
    reader = gguf.GGUFReader(str(model.gguf_path))
    tensors = [(t.name, np.array(t.data), t.tensor_type) for t in reader.tensors]
    cfg = copy.deepcopy(model.config)
    for key, value in config_changes.items():  # through the config's attribute map (num_experts is an alias)
        setattr(cfg, key, value)
    write_gguf(path, "qwen3moe", cfg, gguf.LlamaFileType.MOSTLY_Q4_K_M, "hostile", tensors)


@pytest.mark.parametrize("changes, named", [
    (dict(num_experts_per_tok=17), "expert_used_count = 17 is more than"),  # more per token than there are
    (dict(num_experts=10**6), "expert_count"),  # a count far past any model: refused before anything is sized
    (dict(num_experts=32), "ffn_gate_inp"),  # the tensors hold 16 experts, the header says 32
    (dict(moe_intermediate_size=512), "ffn_gate_exps"),  # the experts' width disagrees with the header
])
def test_an_moe_file_whose_header_lies_about_its_experts_is_refused_naming_what(zoo, tmp_path, changes, named):
    from ringshm.errors import InvalidCheckpoint

    _rewrite(zoo("qwen3moe"), tmp_path / "m.gguf", **changes)
    with pytest.raises(InvalidCheckpoint, match=named):
        Checkpoint.open(tmp_path / "m.gguf")


def test_an_hf_moe_missing_one_experts_tensor_is_refused_naming_it(zoo, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from ringshm.errors import MissingTensor

    shutil.copytree(zoo("olmoe").hf_dir, tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.7.up_proj.weight"]
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(MissingTensor, match=r"model\.layers\.1\.mlp\.experts\.7\.up_proj\.weight"):
        Checkpoint.open(tmp_path / "hf")


@pytest.mark.parametrize("edit, named", [
    (dict(num_experts_per_tok=None), "num_experts_per_tok is missing"),
    (dict(num_experts_per_tok=17), "num_experts_per_tok = 17 is more than the 16"),
    (dict(num_experts=8), "num_experts = 8 but num_local_experts = 16"),  # transformers' alias, disagreeing
])
def test_an_hf_moe_config_that_lies_about_its_experts_is_refused_naming_the_field(zoo, tmp_path, edit, named):
    import json
    import shutil

    from ringshm.errors import InvalidCheckpoint

    shutil.copytree(zoo("qwen3moe").hf_dir, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg.update(edit)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidCheckpoint, match=named):
        Checkpoint.open(tmp_path / "hf")


@pytest.mark.parametrize("family, drop, add, error, named", [
    ("qwen3moe", "attn_q_norm", None, "MissingTensor", "attn_q_norm"),  # the arch has q / k norms: not optional
    ("olmoe", "attn_k_norm", None, "MissingTensor", "attn_k_norm"),
    ("qwen3", "attn_q_norm", None, "MissingTensor", "attn_q_norm"),  # dense Qwen 3 alike (it was inferred before)
    ("qwen3moe", None, "attn_q.bias", "UnsupportedArchitecture", "attn_q.bias"),  # llama.cpp's MoE arches: no biases
    ("granitemoe", None, "attn_q_norm.weight", "UnsupportedArchitecture", "attn_q_norm"),  # Granite: no q / k norms
])
def test_a_gguf_missing_or_adding_what_its_arch_fixes_is_refused_by_name(zoo, tmp_path, family, drop, add, error,
                                                                         named):
    from ringshm import errors

    model = zoo(family)
    reader = gguf.GGUFReader(str(model.gguf_path))
    tensors = [(t.name, np.array(t.data), t.tensor_type) for t in reader.tensors
               if not (drop and f".{drop}." in t.name)]
    if add:
        width = model.config.num_attention_heads * model.config.hidden_size // model.config.num_attention_heads
        tensors += [(f"blk.{i}.{add}" + ("" if add.endswith((".bias", ".weight")) else ".weight"),
                     np.ones(width if add.endswith(".bias") else 64, np.float32), gguf.GGMLQuantizationType.F32)
                    for i in range(model.config.num_hidden_layers)]
    path = tmp_path / "m.gguf"
    write_gguf(path, ARCHS[family], model.config, gguf.LlamaFileType.MOSTLY_Q4_K_M, "edited", tensors)
    with pytest.raises(getattr(errors, error), match=named):
        Checkpoint.open(path)


ARCHS = {"qwen3moe": "qwen3moe", "olmoe": "olmoe", "granitemoe": "granitemoe", "qwen3": "qwen3"}


def test_gpt_oss_as_openai_releases_it_reads_its_mxfp4_experts_natively_and_equals_the_oracle(zoo, tmp_path,
                                                                                               assert_greedy_matches):
    """openai/gpt-oss-* on the Hub: the experts as MXFP4 _blocks / _scales (quantization_config mxfp4). Their values
    are exactly the fp32 checkpoint's (transformers' own decode of the blocks says so), ringshm packs them as the
    GGUF's MXFP4 bytes (the packed experts equal the GGUF path's, byte for byte), and greedy equals the oracle."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from ringshm.model import qmatmul as qm
    from ringshm.model.stage_model import StageModel
    from safetensors.torch import load_file
    from zoo_experts import gptoss_mxfp4_hf

    model = zoo("gptoss")
    hf = gptoss_mxfp4_hf(model, tmp_path / "mxfp4")
    packed, plain = load_file(str(hf / "model.safetensors")), load_file(str(model.hf_dir / "model.safetensors"))
    for part in ("gate_up_proj", "down_proj"):
        name = f"model.layers.1.mlp.experts.{part}"
        decoded = convert_moe_packed_tensors(packed[name + "_blocks"], packed[name + "_scales"], dtype=torch.float32)
        assert torch.equal(decoded, plain[name]), part
    ckpt = Checkpoint.open(hf)
    held, expanded = ckpt.stage_bytes((0, 4), True, True)  # the memory check counts the blocks as they are held
    blocks = sum(t.numel() for n, t in packed.items() if n.endswith(("_blocks", "_scales")))  # 1 byte each
    floats = sum(t.numel() for t in packed.values() if t.is_floating_point())  # F32: 4 bytes each
    assert not expanded and held == blocks + 4 * floats
    ours, gguf_side = StageModel.from_path(hf, max_rows=2, max_seq_len=64), _stage(model.gguf_path)
    for a, b in zip(ours.layers, gguf_side.layers):
        for role in ("exp_gate", "exp_up", "exp_down"):
            pa, pb = getattr(a, role), getattr(b, role)
            assert pa.qtype == pb.qtype == qm.MXFP4 and torch.equal(pa.packed, pb.packed), role
    prompt = prompt_ids(PROMPT_LEN, model.config.vocab_size, 5)
    from ringshm.model.reference import greedy_generate

    compared = assert_greedy_matches(greedy_generate([ours], torch.tensor(prompt), 32), model.oracle_greedy(prompt, 32),
                                     "gpt-oss mxfp4 HF")
    assert compared >= 16


@pytest.mark.parametrize("edit, named", [
    (dict(swiglu_alpha=2.5), "swiglu_alpha"),  # transformers' MXFP4 experts fix 1.702; its dequantized ones read it
    (dict(quantization_config={"quant_method": "mxfp4", "bits": 8}), "quantization_config.bits"),
    (dict(quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.mlp.experts"]}),
     "modules_to_not_convert"),  # transformers would ignore the blocks
    (dict(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config.quant_method"),
])
def test_an_mxfp4_setting_ringshm_does_not_read_as_transformers_does_is_refused_naming_it(zoo, tmp_path, edit, named):
    """Findings of a hostile review of the MXFP4 directory path: each of these loaded before."""
    import json

    from zoo_experts import gptoss_mxfp4_hf

    hf = gptoss_mxfp4_hf(zoo("gptoss"), tmp_path / "mxfp4")
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, **edit}))
    with pytest.raises(UnsupportedArchitecture, match=named):
        Checkpoint.open(hf)


def test_a_stage_lets_each_layers_tensors_as_read_go_once_that_layer_is_packed(zoo, tmp_path, monkeypatch):
    """An HF checkpoint's tensors are read into memory: held all at once beside the packed copy, a load of
    gpt-oss-20b's MXFP4 directory would take twice its 13 GB (the memory check counts it once). from_path lets
    each layer's go as it packs it; weights shared by several stages (StageModel(weights=...)) stay."""
    from ringshm.model.stage_model import StageModel
    from zoo_experts import gptoss_mxfp4_hf

    hf = gptoss_mxfp4_hf(zoo("gptoss"), tmp_path / "mxfp4")
    seen = []
    load = Checkpoint.load_stage
    monkeypatch.setattr(Checkpoint, "load_stage", lambda self, *a: seen.append(load(self, *a)) or seen[-1])
    StageModel.from_path(hf, max_rows=1, max_seq_len=32)
    assert seen and all(layer is None for layer in seen[0].layers)
    ckpt = Checkpoint.open(hf)
    shared = ckpt.load_stage((0, 4), True, True)
    StageModel(ckpt.config, (0, 4), True, True, 1, 32, weights=shared)
    assert all(layer is not None for layer in shared.layers)


def test_a_gpt_oss_gguf_s_sliding_pattern_is_read_and_another_base_for_its_sliding_layers_refused(zoo):
    """llama.cpp's gpt-oss slides layers 0, 2, 4, ... (set_swa_pattern(2)) unless the file's
    ``attention.sliding_window_pattern`` says otherwise (a period: 1 slides none; or one flag per layer), and reads
    ``rope.freq_base_swa`` as the sliding layers' RoPE base: ringshm takes the pattern and refuses a base other than
    ``rope.freq_base`` by name (both were accepted and ignored)."""
    from ringshm.model.checkpoint_check import check_gguf
    from ringshm.model.gguf_index import GGUFIndex

    index = GGUFIndex.open(zoo("gptoss").gguf_path)
    n, meta = index.meta["gpt-oss.block_count"], dict(index.meta)

    def config(**keys):
        index.meta = {**meta, **{f"gpt-oss.{k}": v for k, v in keys.items()}}
        return check_gguf(index)

    assert config().sliding_layers == tuple(i % 2 == 0 for i in range(n))
    assert config(**{"attention.sliding_window_pattern": 1}).sliding_layers == (False,) * n
    flags = [i == 1 for i in range(n)]
    assert config(**{"attention.sliding_window_pattern": flags}).sliding_layers == tuple(flags)
    assert config(**{"rope.freq_base_swa": meta["gpt-oss.rope.freq_base"]}).rope_local_theta == 0.0
    with pytest.raises(UnsupportedArchitecture, match=r"gpt-oss\.rope\.freq_base_swa = 10\.0"):
        config(**{"rope.freq_base_swa": 10.0})
