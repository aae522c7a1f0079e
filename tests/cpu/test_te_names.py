"""Transformer Engine parameter names: `megatron_shards` against Megatron-Core's own TE layer spec.

With `--transformer-impl transformer_engine`, HF loading, the DDMA plan and checkpoints all take their Megatron
names from `layout.megatron_shards`. TE cannot be built here (no GPU), so the expected names are derived from
Megatron-Core itself rather than written down:

- the layer spec is the ModuleSpec returned by Megatron-Core's `get_gpt_layer_with_transformer_engine_spec()`
  (callable without TE, see `_te_layer_spec`); walking its submodule tree gives the path of every leaf module
  (`self_attention.linear_qkv`, `mlp.linear_fc1`, `input_layernorm` = IdentityOp, ...);
- whether a leaf gets a bias is read from the `bias=` argument its parent passes in Megatron-Core's source
  (`SelfAttention`: `add_bias_linear or add_qkv_bias`), evaluated on the run's TransformerConfig;
- the final norm's class is the `LayerNormImpl` that `transformer_block` picks when TE is importable (a layer
  spec, as `build_gpt_model` passes, gets its block norm from there), and the number of layers of each stage is
  Megatron-Core's `get_num_layers_to_build`;
- each leaf class maps to the parameters it registers (`_PARAMS`, the one hand-written table: TE's classes can
  only be listed from TE's source here).

The same derivation on the local spec must give exactly the names of local GPTModels really built here, which
checks the walker, the bias rule and the GPTModel-level composition where the real thing can run.
"""

import ast
import dataclasses
import functools
import inspect
import textwrap
import types

import megatron.core.extensions.transformer_engine as te_ext
import megatron.core.utils as mcore_utils
import pytest
from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer import transformer_block
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from packaging.version import Version

from megatron_rl.ddma.plan import make_plan
from megatron_rl.models.megatron_config import transformer_config
from megatron_rl.models.parallelism import GeneratorLayout, TrainerLayout
from megatron_rl.models.spec import get_model_spec
from megatron_rl.models.weight_map import megatron_shards
from megatron_rl.runtime.spawn import run_on_ranks

IMPLS = ("local", "transformer_engine")


def _bias_flag(config, bias):
    return ("bias",) if bias else ()


def _norm(config, bias):
    return ("weight",) if config.normalization == "RMSNorm" else ("weight", "bias")


def _attention_core(config, bias):
    return ("softmax_offset",) if config.softmax_type == "learnable" else ()


# What each leaf module registers, given the TransformerConfig and the `bias` its parent passes. TE is not
# installed, so its wrappers' parameters are listed from the sources: Megatron-Core's
# megatron/core/extensions/transformer_engine.py (which TE class each wrapper subclasses or builds; none passes
# `parameters_split`, so there is one `weight`/`bias`) and TransformerEngine's transformer_engine/pytorch/:
# module/layernorm_linear.py (LayerNormLinear: `layer_norm_weight`, `layer_norm_bias` unless normalization is
# RMSNorm, `weight`, `bias` only when bias=True), module/linear.py (Linear: `weight`, `bias` when bias=True),
# ops/basic/rmsnorm.py and ops/basic/layer_norm.py (TENorm builds te.pytorch.RMSNorm: `weight`; LayerNorm:
# `weight`, `bias`), attention/dot_product_attention/dot_product_attention.py (no parameters unless
# softmax_type is "learnable"). The local entries (tensor_parallel/layers.py, transformer/torch_norm.py,
# transformer/dot_product_attention.py, transformer/identity_op.py) are checked against built models below.
_PARAMS = {
    "TELayerNormColumnParallelLinear": lambda c, b: ("layer_norm_weight",)
    + (() if c.normalization == "RMSNorm" else ("layer_norm_bias",)) + ("weight",) + _bias_flag(c, b),
    "TEColumnParallelLinear": lambda c, b: ("weight",) + _bias_flag(c, b),
    "TERowParallelLinear": lambda c, b: ("weight",) + _bias_flag(c, b),
    "TELinear": lambda c, b: ("weight",) + _bias_flag(c, b),
    "TENorm": _norm,
    "TEDotProductAttention": _attention_core,
    "ColumnParallelLinear": lambda c, b: ("weight",) + _bias_flag(c, b),
    "RowParallelLinear": lambda c, b: ("weight",) + _bias_flag(c, b),
    "WrappedTorchNorm": _norm,
    "DotProductAttention": _attention_core,
    "IdentityOp": lambda c, b: (),
    "IdentityFuncOp": lambda c, b: (),
}


# ---- Megatron-Core's specs --------------------------------------------------------------------------------------

@functools.cache
def _te_layer_spec() -> ModuleSpec:
    """Megatron-Core's own `get_gpt_layer_with_transformer_engine_spec()`. Without TE its module leaves
    `TESpecProvider` unbound (it is imported under `try: import transformer_engine`) and the provider asks TE's
    version (for the q/k norm, unused here), so for the call only we bind the provider class Megatron-Core would
    have imported and report a TE version. The TE wrapper classes in the spec are then
    megatron.core.extensions.transformer_engine's own objects (stand-ins without TE), named by `_class_name`."""
    if gpt_layer_specs.HAVE_TE:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gpt_layer_specs, "TESpecProvider", TESpecProvider, raising=False)
        patch.setattr(mcore_utils, "_te_version", Version("2.9.0"))
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()


def _layer_spec(impl: str) -> ModuleSpec:
    if impl == "transformer_engine":
        return _te_layer_spec()
    return gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")  # as build_gpt_model


def _block_norm(impl: str) -> str:
    """The final layernorm's class: `transformer_block._get_block_submodules` gives a layer spec's block
    `layer_norm=LayerNormImpl`, which transformer_block sets under `if HAVE_TE:` (read from its source, as TE is
    not importable here) and otherwise to what it picked at import (the local build checks that one)."""
    if impl == "local":
        return transformer_block.LayerNormImpl.__name__
    tree = ast.parse(inspect.getsource(transformer_block))
    branch = next(node for node in tree.body if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
                  and node.test.id == "HAVE_TE")
    values = [node.value.id for node in branch.body if isinstance(node, ast.Assign)
              and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["LayerNormImpl"]]
    assert len(values) == 1, f"no single `LayerNormImpl = ...` under `if HAVE_TE:` in {transformer_block.__file__}"
    return values[0]


def _class_name(leaf) -> str:
    """A leaf's class name; without TE, TE's wrappers are stand-in objects, named by where
    megatron.core.extensions.transformer_engine binds them."""
    if isinstance(leaf, type):
        return leaf.__name__
    names = [name for name, value in vars(te_ext).items() if value is leaf]
    assert len(names) == 1, f"cannot name spec leaf {leaf!r} (bound as {names} in {te_ext.__name__})"
    return names[0]


def _is_submodule(node) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "submodules"


@functools.cache
def _bias_arguments(module: type) -> dict[str, ast.expr]:
    """slot -> the `bias=` expression `module.__init__` (or a base's) passes when building `submodules.<slot>`,
    either as `submodules.slot(..., bias=...)` or `build_module(submodules.slot, ..., bias=...)`."""
    out: dict[str, ast.expr] = {}
    for klass in reversed(module.__mro__):  # bases first: a subclass's own call wins
        init = vars(klass).get("__init__")
        if not inspect.isfunction(init):
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(init)))):
            if not isinstance(node, ast.Call):
                continue
            slot = node.func if _is_submodule(node.func) else next(iter(node.args[:1]), None)
            bias = [k.value for k in node.keywords if k.arg == "bias"]
            if _is_submodule(slot) and bias:
                out[slot.attr] = bias[0]
    return out


def _evaluate(expression: ast.expr | None, config) -> bool:
    if expression is None:
        return False
    code = compile(ast.Expression(expression), "<bias argument>", "eval")
    return bool(eval(code, {"__builtins__": {}}, {"self": types.SimpleNamespace(config=config)}))


def _leaves(spec: ModuleSpec, config, prefix: str = ""):
    """(module path, class name, bias) of every leaf module a ModuleSpec builds."""
    biases = _bias_arguments(spec.module)
    for field in dataclasses.fields(spec.submodules):
        value = getattr(spec.submodules, field.name)
        path = prefix + field.name
        if isinstance(value, ModuleSpec) and value.submodules is not None:
            yield from _leaves(value, config, path + ".")
        elif value is None or isinstance(value, dict) or inspect.isfunction(value):
            continue  # no module: an empty slot, a state-dict key map, or a function (bias-dropout-add)
        else:
            leaf = value.module if isinstance(value, ModuleSpec) else value
            yield path, _class_name(leaf), _evaluate(biases.get(field.name), config)


def _params(class_name: str, config, bias: bool) -> tuple[str, ...]:
    assert class_name in _PARAMS, f"spec uses {class_name}, whose parameters _PARAMS does not list"
    return _PARAMS[class_name](config, bias)


def expected_names(spec, layout: TrainerLayout, pp_rank: int) -> set[str]:
    """The parameter names of GPTModel stage `pp_rank` built from Megatron-Core's spec for `layout`."""
    config = transformer_config(spec, layout)
    first, last = pp_rank == 0, pp_rank == layout.pipeline_parallel_size - 1
    layer = [(path, p) for path, cls, bias in _leaves(_layer_spec(layout.transformer_impl), config)
             for p in _params(cls, config, bias)]
    names = {"embedding.word_embeddings.weight"} if first else set()
    for i in range(get_num_layers_to_build(config, pp_rank=pp_rank)):
        names |= {f"decoder.layers.{i}.{path}.{p}" for path, p in layer}
    if last:
        names |= {f"decoder.final_layernorm.{p}" for p in _params(_block_norm(layout.transformer_impl), config, False)}
        if not (spec.tie_word_embeddings and first):  # tied on one stage: the output layer reuses the embedding
            names.add("output_layer.weight")
    return names


# ---- the cases --------------------------------------------------------------------------------------------------

def _spec(name: str, tied: bool, num_layers: int = 2):
    return get_model_spec(name).replace(tie_word_embeddings=tied, num_layers=num_layers)


SPECS = [("tiny-llama", False), ("tiny-llama", True), ("tiny-qwen2", False), ("tiny-qwen2", True)]
# (num_layers, TrainerLayout keyword arguments)
LAYOUTS = [
    (2, dict(tensor_parallel_size=1, pipeline_parallel_size=1)),
    (2, dict(tensor_parallel_size=2, pipeline_parallel_size=1)),
    (2, dict(tensor_parallel_size=1, pipeline_parallel_size=2)),
    (2, dict(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)),
    (5, dict(tensor_parallel_size=2, pipeline_parallel_size=2, decoder_first_pipeline_num_layers=1)),
    (5, dict(tensor_parallel_size=1, pipeline_parallel_size=3, decoder_first_pipeline_num_layers=1,
             decoder_last_pipeline_num_layers=2)),
]


def _layout_id(num_layers: int, kwargs: dict) -> str:
    short = {"tensor_parallel_size": "tp", "pipeline_parallel_size": "pp", "data_parallel_size": "dp",
             "decoder_first_pipeline_num_layers": "first", "decoder_last_pipeline_num_layers": "last"}
    return f"L{num_layers}-" + "-".join(f"{short[k]}{v}" for k, v in kwargs.items())


def _diff(expected: set[str], got: set[str]) -> str:
    return f"missing {sorted(expected - got)}, unexpected {sorted(got - expected)}"


def test_te_spec_paths_and_classes():
    """What the TE layer spec of Megatron-Core really is: norms fused into linear_qkv / linear_fc1."""
    config = transformer_config(_spec("tiny-qwen2", False), TrainerLayout())
    leaves = {path: (cls, bias) for path, cls, bias in _leaves(_te_layer_spec(), config)}
    assert leaves["input_layernorm"] == ("IdentityOp", False)
    assert leaves["pre_mlp_layernorm"] == ("IdentityOp", False)
    assert leaves["self_attention.linear_qkv"] == ("TELayerNormColumnParallelLinear", True)  # qkv bias
    assert leaves["self_attention.core_attention"] == ("TEDotProductAttention", False)
    assert leaves["self_attention.linear_proj"] == ("TERowParallelLinear", False)
    assert leaves["mlp.linear_fc1"] == ("TELayerNormColumnParallelLinear", False)
    assert leaves["mlp.linear_fc2"] == ("TERowParallelLinear", False)
    # A layer spec (what build_gpt_model passes) gets its final norm from transformer_block's LayerNormImpl...
    block = transformer_block._get_block_submodules(config, _te_layer_spec(), pp_rank=0)
    assert block.layer_norm is transformer_block.LayerNormImpl
    # ...which is TENorm when TE is importable.
    assert _block_norm("transformer_engine") == "TENorm"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("num_layers,kwargs", LAYOUTS, ids=[_layout_id(n, k) for n, k in LAYOUTS])
def test_megatron_shards_names_match_megatron_core_spec(impl, num_layers, kwargs):
    for name, tied in SPECS:
        spec = _spec(name, tied, num_layers)
        layout = TrainerLayout(transformer_impl=impl, **kwargs)
        for p in range(layout.pipeline_parallel_size):
            expected = expected_names(spec, layout, p)
            for t in range(layout.tensor_parallel_size):
                got = set(megatron_shards(spec, layout, t, p))
                assert got == expected, f"{impl} {spec.name} tied={tied} {kwargs} tp={t} pp={p}: " \
                                        f"{_diff(expected, got)}"


# ---- the derivation against real local models --------------------------------------------------------------------

BUILT = [  # (model, tied, num_layers, layout kwargs), all on 2 ranks (TP changes shapes, not names)
    ("tiny-qwen2", True, 5, dict(tensor_parallel_size=1, pipeline_parallel_size=2,
                                 decoder_first_pipeline_num_layers=1)),
    ("tiny-qwen2", True, 2, dict(tensor_parallel_size=2, pipeline_parallel_size=1)),
    ("tiny-llama", False, 2, dict(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=2)),
]


def _build_local_models(cases):
    """On each rank: (tp rank, pp rank, parameter names) of the local GPTModel of each case."""
    from megatron.core import parallel_state

    from megatron_rl.trainer import parallel
    from megatron_rl.trainer.model import build_gpt_model

    out = []
    for name, tied, num_layers, kwargs in cases:
        spec, layout = _spec(name, tied, num_layers), TrainerLayout(**kwargs)
        parallel.initialize(layout, spec)
        try:
            model = build_gpt_model(spec, layout)
            out.append((parallel_state.get_tensor_model_parallel_rank(),
                        parallel_state.get_pipeline_model_parallel_rank(),
                        sorted(n for n, _ in model.named_parameters())))
        finally:
            parallel.destroy()
    return out


def test_derivation_matches_built_local_models():
    results = run_on_ranks(_build_local_models, 2, BUILT, timeout_s=120)
    for (name, tied, num_layers, kwargs), per_rank in zip(BUILT, zip(*results)):
        spec, layout = _spec(name, tied, num_layers), TrainerLayout(**kwargs)
        for t, p, built in per_rank:
            expected = expected_names(spec, layout, p)
            assert set(built) == expected, f"built local {name} tied={tied} {kwargs} tp={t} pp={p}: " \
                                           f"{_diff(expected, set(built))}"
            assert len(built) == len(expected)


# ---- the DDMA plan of a TE trainer ----------------------------------------------------------------------------

@pytest.mark.parametrize("name,tied,num_layers,kwargs", [
    ("tiny-qwen2", True, 2, dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
    ("tiny-llama", False, 5, dict(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2,
                                  decoder_first_pipeline_num_layers=1)),
    ("tiny-qwen2", True, 2, dict(tensor_parallel_size=2, pipeline_parallel_size=1)),
])
def test_ddma_plan_sends_exactly_the_te_names(name, tied, num_layers, kwargs):
    spec = _spec(name, tied, num_layers)
    trainer = TrainerLayout(transformer_impl="transformer_engine", **kwargs)
    plan = make_plan(spec, trainer, GeneratorLayout(1, 1, first_rank=trainer.world_size))
    owned = {}  # global trainer rank -> the TE names it holds
    for p in range(trainer.pipeline_parallel_size):
        names = expected_names(spec, trainer, p)
        for t in range(trainer.tensor_parallel_size):
            for d in range(trainer.data_parallel_size):
                owned[trainer.rank(d, p, t)] = (p, names)
    sent = {p: set() for p in range(trainer.pipeline_parallel_size)}
    for piece in plan.pieces:
        stage, names = owned[piece.src]
        assert piece.src_tensor in names, f"rank {piece.src} (pp {stage}) sends {piece.src_tensor!r}, " \
                                          f"not a TE parameter of its stage"
        sent[stage].add(piece.src_tensor)
    for p in range(trainer.pipeline_parallel_size):
        names = expected_names(spec, trainer, p)
        if tied:
            names.discard("output_layer.weight")  # the last stage's copy of the embedding: stage 0 sends it
        assert sent[p] == names, f"{spec.name} {kwargs} pp={p}: {_diff(names, sent[p])}"
