"""The layout mapping on labeled tensors: every HF row carries its own (tensor, row) label, so a shard's
content says exactly which rows it holds and in which order."""

import pytest
import torch

from megatron_rl.models import weight_map
from megatron_rl.models.parallelism import TrainerLayout
from megatron_rl.models.spec import get_model_spec

SPEC = get_model_spec("tiny-qwen2")  # 4 heads of 16, 2 KV heads, qkv bias


def _labeled(spec):
    """Each HF tensor's rows (or columns, for row-parallel weights) numbered 0.. in its first column."""
    out = {}
    for i, (name, shape) in enumerate(weight_map.hf_shapes(spec).items()):
        t = torch.zeros(shape)
        if len(shape) == 1:
            t[:] = torch.arange(shape[0]) + 1000 * i
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            t[:] = torch.arange(shape[1]) + 1000 * i
        else:
            t[:] = (torch.arange(shape[0]) + 1000 * i)[:, None]
        out[name] = t
    return out, {name: 1000 * i for i, name in enumerate(weight_map.hf_shapes(spec))}


def _rows(tensor, base, dim=0):
    line = tensor[:, 0] if dim == 0 and tensor.dim() > 1 else (tensor[0] if tensor.dim() > 1 else tensor)
    return (line - base).long().tolist()


def test_megatron_qkv_is_interleaved_per_query_group():
    hf, base = _labeled(SPEC)
    shards = weight_map.megatron_shards(SPEC, TrainerLayout(2, 1), tp_rank=1, pp_rank=0)
    qkv = weight_map.assemble(shards["decoder.layers.0.self_attention.linear_qkv.weight"], weight_map.slicer(hf))
    q, k, v = (base[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    # rank 1 holds query group 1: q heads 2-3 (rows 32..63), then k head 1, then v head 1 (rows 16..31)
    assert _rows(qkv[:32], q) == list(range(32, 64))
    assert _rows(qkv[32:48], k) == list(range(16, 32))
    assert _rows(qkv[48:], v) == list(range(16, 32))
    bias = weight_map.assemble(shards["decoder.layers.0.self_attention.linear_qkv.bias"], weight_map.slicer(hf))
    assert _rows(bias[32:48], base["model.layers.0.self_attn.k_proj.bias"]) == list(range(16, 32))


def test_sglang_qkv_is_q_then_k_then_v_and_replicates_kv_heads():
    hf, base = _labeled(SPEC)
    k = base["model.layers.1.self_attn.k_proj.weight"]
    for rank, kv_head in ((0, 0), (1, 0), (2, 1), (3, 1)):  # TP=4 > 2 KV heads: each KV head on 2 ranks
        shard = weight_map.sglang_shards(SPEC, 4, rank)["model.layers.1.self_attn.qkv_proj.weight"]
        qkv = weight_map.assemble(shard, weight_map.slicer(hf))
        assert qkv.shape == (16 + 16 + 16, 64)
        assert _rows(qkv[16:32], k) == list(range(16 * kv_head, 16 * kv_head + 16))


def test_gate_up_row_parallel_and_vocab_padding():
    hf, base = _labeled(SPEC)
    meg = weight_map.megatron_shards(SPEC, TrainerLayout(2, 2, make_vocab_size_divisible_by=48), 1, 1)
    fc1 = weight_map.assemble(meg["decoder.layers.0.mlp.linear_fc1.weight"], weight_map.slicer(hf))  # global layer 1
    assert _rows(fc1[:64], base["model.layers.1.mlp.gate_proj.weight"]) == list(range(64, 128))
    assert _rows(fc1[64:], base["model.layers.1.mlp.up_proj.weight"]) == list(range(64, 128))
    fc2 = weight_map.assemble(meg["decoder.layers.0.mlp.linear_fc2.weight"], weight_map.slicer(hf))
    assert fc2.shape == (64, 64)
    assert _rows(fc2, base["model.layers.1.mlp.down_proj.weight"], dim=1) == list(range(64, 128))
    out = meg["output_layer.weight"]  # vocab 128 padded to a multiple of 96 = 192: rank 1 holds 96..191
    assert out.shape == (96, 64)
    assert [(s.hf_name, s.start, s.stop) for s in out.segments] == [("lm_head.weight", 96, 128), (None, 128, 192)]
    assert (weight_map.assemble(out, weight_map.slicer(hf))[32:] == 0).all()


def test_transformer_engine_spec_fuses_norms_into_linears():
    local = weight_map.megatron_shards(SPEC, TrainerLayout(1, 1), 0, 0)
    te = weight_map.megatron_shards(SPEC, TrainerLayout(1, 1, transformer_impl="transformer_engine"), 0, 0)
    assert "decoder.layers.0.input_layernorm.weight" in local
    assert te["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"].segments == \
        local["decoder.layers.0.input_layernorm.weight"].segments
    assert te["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"].segments == \
        local["decoder.layers.0.pre_mlp_layernorm.weight"].segments
    assert len(te) == len(local)


def test_split_and_scatter_invert_assemble_for_every_layout():
    hf, _ = _labeled(SPEC)
    shapes = weight_map.hf_shapes(SPEC)
    for tp, pp in ((1, 1), (2, 1), (2, 2), (1, 2)):
        rebuilt = {}
        for t in range(tp):
            for p in range(pp):
                for shard in weight_map.megatron_shards(SPEC, TrainerLayout(tp, pp), t, p).values():
                    weight_map.scatter(shard, weight_map.assemble(shard, weight_map.slicer(hf)), rebuilt, shapes)
        assert rebuilt.keys() == hf.keys()
        assert all(torch.equal(rebuilt[n], hf[n]) for n in hf)


def test_layouts_the_generator_cannot_take_name_the_problem():
    with pytest.raises(ValueError, match=r"generator TP=3 \(--rollout-tensor-parallel-size\) does not divide "
                                         r"model 'tiny-qwen2': num_attention_heads 4"):
        weight_map.sglang_shards(SPEC, 3, 0)
    with pytest.raises(ValueError, match=r"trainer TP=4 \(--tensor-model-parallel-size\) does not divide "
                                         r"model 'tiny-qwen2'.*num_key_value_heads 2"):
        weight_map.megatron_shards(SPEC, TrainerLayout(4, 1), 0, 0)
