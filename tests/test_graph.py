"""Tracing and grouping: zoo models, other coding styles, the hook fallback, bad input.

Oracles: shapes from real forwards at the training batch (forward hooks), parameter lists of the models,
groups of ResNet-18 written out by hand from the paper's rule.
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import networkx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from precsearch.config.spec import ASSIGNABLE_KINDS
from precsearch.errors import PrecsearchError
from precsearch.graph.op_rules import OP_RULES
from precsearch.graph.tracing import trace
from precsearch.graph.types import TensorGraph
from precsearch.models import NAMES, build


def _example(batch: int = 2, shape: tuple[int, ...] = (3, 32, 32)) -> torch.Tensor:
    return torch.randn((batch, *shape), generator=torch.Generator().manual_seed(0))


def _module_output_shapes(model: nn.Module, x: torch.Tensor) -> dict[str, list[tuple[int, ...]]]:
    """Output shape of every leaf-module call in a real forward, by qualified name (oracle for shapes)."""
    shapes: dict[str, list[tuple[int, ...]]] = {}
    handles = [module.register_forward_hook(
        lambda m, a, out, name=name: shapes.setdefault(name, []).append(tuple(out.shape)))
        for name, module in model.named_modules() if not list(module.children())]
    with torch.no_grad():
        model(x)
    for handle in handles:
        handle.remove()
    return shapes


def _check_module_shapes(graph: TensorGraph, model: nn.Module, batch: int) -> None:
    model.eval()
    observed = _module_output_shapes(model, _example(batch, graph.input_shape))
    for op in graph.ops:
        if op.module in observed:
            assert graph.tensors[op.outputs[0]].shape == observed[op.module][op.call], op.name


def _assignable_by_group(graph: TensorGraph) -> list[set[str]]:
    return [{t for t in group.tensor_ids if graph.tensors[t].kind in ASSIGNABLE_KINDS} for group in graph.groups]


def _weight(op: str, *names: str) -> set[str]:
    return {f"{op}:{name}{suffix}" for name in names for suffix in ("", "_grad")}


def _act(*ops: str) -> set[str]:
    return {f"{op}:{kind}" for op in ops for kind in ("activation", "activation_grad")}


# --------------------------------------------------------------------------------------------- the zoo


@pytest.mark.parametrize("name", NAMES)
def test_zoo_graph_structure(name):
    torch.manual_seed(0)
    model = build(name, width=0.25)
    graph = trace(model, _example(), batch_size=5)
    assert graph.tracer == "fx" and graph.graph_module is not None and graph.batch_size == 5
    # one weight tensor (with grad, master copy, momentum of the same shape) per parameter
    params = dict(model.named_parameters())
    weights = {info.param: info for info in graph.tensors.values() if info.kind == "weight"}
    assert set(weights) == set(params)
    for qualname, info in weights.items():
        assert info.shape == tuple(params[qualname].shape)
        for suffix in ("_grad", "_master", "_momentum"):
            assert graph.tensors[info.id + suffix].shape == info.shape
    # every conv/linear call is a GEMM op that opens a group; every other op joins the current one
    gemm_modules = {n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    assert {op.name for op in graph.ops if op.role == "gemm"} == gemm_modules
    for group in graph.groups:
        roles = [next(op.role for op in graph.ops if op.name == name) for name in group.ops]
        assert roles[0] in ("input", "gemm") and set(roles[1:]) <= {"other"}
    # a GEMM's weight sits in the group that produced the GEMM's input (the paper's rule)
    producer_group = {t: graph.tensors[t].group for t in graph.tensors}
    for op in graph.ops:
        if op.role == "gemm":
            (source,) = op.input_tensors
            assert {graph.tensors[w].group for w in op.params} == {producer_group[source]}, op.name
    # layout-only ops make no tensor, and every activation is an op's output at the training batch
    assert not any(OP_RULES.op_type(op.module_type).pass_through for op in graph.ops)
    activations = [info for info in graph.tensors.values() if info.kind == "activation"]
    assert all(info.shape[0] == 5 for info in activations)
    assert graph.ops[0].role == "input" and f"{graph.ops[0].name}:activation_grad" not in graph.tensors
    _check_module_shapes(graph, model, 5)


def test_resnet18_groups_follow_the_paper_rule_block_by_block():
    graph = trace(build("resnet18", width=0.25), _example(), batch_size=4)
    groups = _assignable_by_group(graph)
    bn = ("weight", "bias")
    expected = [
        {"x:activation"} | _weight("conv1", "weight"),
        _act("conv1", "bn1", "relu") | _weight("bn1", *bn) | _weight("layer1.0.conv1", "weight"),
        # layer1.0: conv1 opens a group with its BN and ReLU; conv2's weight joins it (conv2's input is here)
        _act("layer1.0.conv1", "layer1.0.bn1", "layer1.0.relu1") | _weight("layer1.0.bn1", *bn)
        | _weight("layer1.0.conv2", "weight"),
        # conv2 opens the next group; the residual add and the last ReLU join it, and so does the weight of
        # the next block's conv1, whose input is this ReLU's output
        _act("layer1.0.conv2", "layer1.0.bn2", "add", "layer1.0.relu2") | _weight("layer1.0.bn2", *bn)
        | _weight("layer1.1.conv1", "weight"),
    ]
    assert groups[:4] == expected
    assert [g.ops for g in graph.groups[:4]] == [
        ("x",), ("conv1", "bn1", "relu"), ("layer1.0.conv1", "layer1.0.bn1", "layer1.0.relu1"),
        ("layer1.0.conv2", "layer1.0.bn2", "add", "layer1.0.relu2"),
    ]
    # layer2.0 has a 1x1-conv shortcut: both of its GEMMs that read layer1.1's output put their weights in
    # layer1.1's last group; the shortcut conv opens its own group after conv2's, with the add and ReLU.
    index = {name: g.index for g in graph.groups for name in g.ops}
    last_of_layer1 = groups[index["layer1.1.relu2"]]
    assert _weight("layer2.0.conv1", "weight") | _weight("layer2.0.shortcut.0", "weight") <= last_of_layer1
    assert groups[index["layer2.0.conv2"]] == (
        _act("layer2.0.conv2", "layer2.0.bn2") | _weight("layer2.0.bn2", *bn))
    assert groups[index["layer2.0.shortcut.0"]] == (
        _act("layer2.0.shortcut.0", "layer2.0.shortcut.1", "add_2", "layer2.0.relu2")
        | _weight("layer2.0.shortcut.1", *bn) | _weight("layer2.1.conv1", "weight"))
    assert index["layer2.0.conv2"] + 1 == index["layer2.0.shortcut.0"]
    # every assignable tensor is in exactly one group
    assert sum(len(g) for g in groups) == len(graph.assignable_ids())


# ------------------------------------------------------------------------------------- other styles


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, groups=channels)  # depthwise
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x))) + x


class Functional(nn.Module):
    """F.relu, torch.cat, x + y, torch.flatten, x.view, grouped and depthwise convs, F.conv2d on an own
    parameter, and one Block instance called twice."""

    def __init__(self, dynamic: bool = False) -> None:
        super().__init__()
        self.dynamic = dynamic
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = Block(8)
        self.grouped = nn.Conv2d(16, 16, 1, groups=4, bias=False)
        self.kernel = nn.Parameter(torch.randn(4, 16, 1, 1) * 0.1)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        x = F.relu(self.stem(x))
        if self.dynamic and x.sum() > -math.inf:  # data-dependent: FX cannot trace this
            x = x * 1.0
        y = self.block(self.block(x))
        z = torch.cat([x, y], dim=1)
        z = self.grouped(z) + z
        z = F.max_pool2d(F.conv2d(z, self.kernel), 4)
        return self.fc(torch.flatten(z, 1).view(z.shape[0], -1))


def test_functional_style_model():
    model = Functional()
    graph = trace(model, _example(), batch_size=3)
    names = [op.name for op in graph.ops]
    assert names == ["x", "stem", "relu", "block.conv", "block.bn", "relu_1", "add", "block.conv#1",
                     "block.bn#1", "relu_2", "add_1", "cat", "grouped", "add_2", "conv2d", "max_pool2d", "fc"]
    ops = {op.name: op for op in graph.ops}
    assert [ops[n].role for n in ("stem", "grouped", "conv2d", "fc")] == ["gemm"] * 4
    assert ops["cat"].input_tensors == ("relu:activation", "add_1:activation")
    assert ops["add"].input_tensors == ("relu_1:activation", "relu:activation")
    assert ops["fc"].input_tensors == ("max_pool2d:activation",)  # flatten and view are pass-throughs
    # the block's module instance runs twice: its weights are one tensor each, used by both calls
    assert graph.tensors["block.conv:weight"].consumers == ("block.conv", "block.conv#1")
    assert ops["block.conv#1"].params == ("block.conv:weight", "block.conv:bias")
    assert graph.tensors["conv2d:kernel"].param == "kernel"  # F.conv2d on an own parameter
    assert graph.tensors["conv2d:kernel"].shape == (4, 16, 1, 1)
    assert graph.tensors["cat:activation"].shape == (3, 16, 32, 32)
    assert graph.tensors["fc:activation"].shape == (3, 10)
    with torch.no_grad():
        pooled = F.max_pool2d(F.conv2d(torch.zeros(3, 16, 32, 32), model.kernel), 4)
    assert graph.tensors["max_pool2d:activation"].shape == tuple(pooled.shape)
    _check_module_shapes(graph, model, 3)


def test_data_dependent_control_flow_falls_back_to_hooks_with_one_warning():
    torch.manual_seed(0)
    static = Functional()
    dynamic = Functional(dynamic=True)
    dynamic.load_state_dict(static.state_dict())
    with pytest.warns(UserWarning) as caught:
        fallback = trace(dynamic, _example(), batch_size=3)
    messages = [str(w.message) for w in caught if "torch.fx" in str(w.message)]
    assert len(messages) == 1 and "could not trace Functional" in messages[0] and "module hooks" in messages[0]
    assert fallback.graph_module is None and fallback.tracer == "hooks"
    reference = trace(static, _example(), batch_size=3)
    # the fallback sees the same ops (plus the data-dependent x * 1.0), tensors, shapes and groups
    extra = {"mul"}
    assert [op.name for op in fallback.ops if op.name not in extra] == [op.name for op in reference.ops]
    same = {tid: (info.shape, info.kind) for tid, info in fallback.tensors.items() if not tid.startswith("mul:")}
    assert same == {tid: (info.shape, info.kind) for tid, info in reference.tensors.items()}
    assert fallback.tensors["block.conv:weight"].consumers == ("block.conv", "block.conv#1")
    assert fallback.tensors["relu:activation"].consumers == ("mul",)
    assert [g.ops[0] for g in fallback.groups] == [g.ops[0] for g in reference.groups]


@pytest.mark.parametrize("name", NAMES)
def test_hook_fallback_reproduces_the_fx_graph_of_every_zoo_model(name, monkeypatch):
    model = build(name, width=0.1)
    reference = trace(model, _example(), batch_size=6)

    def refuse(self, root, concrete_args=None):
        raise RuntimeError("FX switched off for this test")

    monkeypatch.setattr(torch.fx.Tracer, "trace", refuse)
    with pytest.warns(UserWarning, match="FX switched off for this test"):
        fallback = trace(model, _example(), batch_size=6)
    assert fallback.tracer == "hooks"
    assert fallback.groups == reference.groups

    def without_fx_node(graph):  # FX node names exist only when FX traced the model
        return {tid: dataclasses.replace(info, node="") for tid, info in graph.tensors.items()}

    assert without_fx_node(fallback) == without_fx_node(reference)
    assert [(op.name, op.role, op.input_tensors, op.params) for op in fallback.ops] == [
        (op.name, op.role, op.input_tensors, op.params) for op in reference.ops]


def test_shapes_extrapolate_exactly_when_batch_and_space_merge():
    class Merge(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            y = self.conv(x)
            return self.fc(y.permute(0, 2, 3, 1).reshape(-1, 4))  # (N*H*W, C): batch folded into dim 0

    graph = trace(Merge(), _example(2, (3, 10, 10)), batch_size=7)
    assert graph.tensors["fc:activation"].shape == (7 * 5 * 5, 2)
    assert graph.tensors["conv:activation"].shape == (7, 4, 5, 5)


def test_user_leaf_modules_are_single_ops():
    model = Functional()
    graph = trace(model, _example(), leaf_modules=[Block])
    block_ops = [op for op in graph.ops if op.name.startswith("block")]
    assert [(op.name, op.module_type) for op in block_ops] == [("block", "Block"), ("block#1", "Block")]
    assert block_ops[0].params == ("block:conv.weight", "block:conv.bias", "block:bn.weight", "block:bn.bias")
    assert graph.tensors["block:conv.weight"].param == "block.conv.weight"
    by_name = trace(model, _example(), leaf_modules=["Block"])
    assert [op.name for op in by_name.ops] == [op.name for op in graph.ops]
    with pytest.raises(PrecsearchError, match="leaf module 'Blok' names no module"):
        trace(model, _example(), leaf_modules=["Blok"])


def test_torchvision_resnet18():
    torchvision = pytest.importorskip("torchvision")
    model = torchvision.models.resnet18(num_classes=10)
    graph = trace(model, _example(1, (3, 64, 64)), batch_size=2)
    assert graph.tracer == "fx"
    assert sum(op.role == "gemm" for op in graph.ops) == 21  # 20 convs (3 downsample) + fc
    assert {info.param for info in graph.tensors.values() if info.kind == "weight"} == {
        name for name, _ in model.named_parameters()}
    _check_module_shapes(graph, model, 2)


# ------------------------------------------------------------------------------------- state and export


def test_trace_leaves_model_and_rng_untouched():
    model = build("tiny_cnn").eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.random.get_rng_state()
    trace(model, _example(), batch_size=8)
    assert not model.training and not any(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.random.get_rng_state())


def test_json_round_trip_dataframe_and_networkx(tmp_path):
    graph = trace(build("shufflenet_v2", width=0.1), _example(), batch_size=4)
    path = tmp_path / "graph.json"
    graph.save(path)
    loaded = TensorGraph.from_json(path.read_text())
    assert loaded.tensors == graph.tensors and loaded.ops == graph.ops and loaded.groups == graph.groups
    assert loaded.fingerprint() == graph.fingerprint() == json.loads(path.read_text())["fingerprint"]
    assert loaded.graph_module is None and list(tmp_path.iterdir()) == [path]
    frame = graph.to_dataframe()
    assert list(frame["id"]) == list(graph.tensors)
    assert {"id", "kind", "shape", "numel", "group"} <= set(frame.columns)
    assert (frame["numel"] == frame["shape"].map(math.prod)).all()
    nxg = graph.nx
    cat = next(op for op in graph.ops if op.module_type == "cat")
    assert set(nxg.predecessors(cat.name)) == set(cat.input_tensors)
    assert list(nxg.successors(cat.name)) == [f"{cat.name}:activation"]
    assert f"{cat.name}:activation_grad" in set(nxg.successors(f"{cat.name}:activation"))
    other = trace(build("shufflenet_v2", width=0.1), _example(), batch_size=8)
    assert other.fingerprint() != graph.fingerprint()
    with pytest.raises(PrecsearchError, match="not a precsearch.graph.tracing"):
        TensorGraph.from_json(json.dumps({"format": "something else"}))


def _multi_output_graph():
    class MultiOutput(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)

        def forward(self, x):
            y = self.conv(x)
            var, mean = torch.var_mean(y, dim=1, keepdim=True)
            first, second = torch.split(y, 2, dim=1)
            low, high = torch.chunk(y, 2, dim=1)
            return (y - mean) * var + first.sum() + second.sum() + low.mean() + high.mean()

    return trace(MultiOutput(), _example(shape=(3, 8, 8)), batch_size=2)


def test_two_output_op_links_each_output_to_its_own_gradient():
    graph = _multi_output_graph()
    nxg = graph.nx
    op = next(o for o in graph.ops if o.module_type == "var_mean")
    assert op.outputs == (f"{op.name}:activation", f"{op.name}:activation1")
    for index in ("", "1"):
        activation, gradient = f"{op.name}:activation{index}", f"{op.name}:activation_grad{index}"
        assert graph.tensors[gradient].kind == "activation_grad"
        assert list(nxg.predecessors(gradient)) == [activation]
        assert gradient in set(nxg.successors(activation))
    assert not list(networkx.selfloop_edges(nxg))


def test_split_and_chunk_pieces_are_views_of_their_source():
    """split/chunk outputs alias their input (they own no memory), so their users read the source tensor."""
    graph = _multi_output_graph()
    nxg = graph.nx
    assert not any(o.module_type in ("split", "chunk", "getitem") for o in graph.ops)
    readers = [o.name for o in graph.ops if o.module_type in ("sum", "mean")]
    assert len(readers) == 4
    for name in readers:
        assert list(nxg.predecessors(name)) == ["conv:activation"]


# ------------------------------------------------------------------------------------------ bad input


def test_model_neither_tracer_handles():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            if x.mean() > -1e9:  # data-dependent, so FX fails; then the real run fails too
                raise RuntimeError("this model is broken")
            return self.conv(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PrecsearchError) as info:
            trace(Broken(), _example())
    message = str(info.value)
    assert "\n" not in message and "Broken failed on the example input of shape (2, 3, 32, 32)" in message
    assert "this model is broken" in message and "torch.fx could not trace it either" in message


def test_model_returning_no_tensor():
    class Scalar(nn.Module):
        def forward(self, x):
            return x.sum().item()

    with pytest.raises(PrecsearchError, match="Scalar returns float, not a float tensor"):
        trace(Scalar(), _example())


def test_example_input_of_the_wrong_shape():
    with pytest.raises(PrecsearchError) as info:
        trace(build("tiny_cnn"), _example(2, (1, 32, 32)))
    message = str(info.value)
    assert "\n" not in message and "shape (2, 1, 32, 32)" in message
    assert "first layer conv1 (Conv2d) expects (N, 3, H, W)" in message
    with pytest.raises(PrecsearchError, match="expects \\(N, 3, H, W\\)"):
        trace(build("tiny_cnn"), torch.randn(3, 32, 32))
    with pytest.raises(PrecsearchError, match="batched tensor"):
        trace(build("tiny_cnn"), [1, 2, 3])
    with pytest.raises(PrecsearchError, match="batch size must be a positive integer"):
        trace(build("tiny_cnn"), _example(), batch_size=0)


def test_subclasses_of_conv_and_linear_are_gemm_leaves():
    from precsearch.runtime.accumulate import swap_chunked_layers

    model = build("tiny_cnn")
    swapped = swap_chunked_layers(model, ["*"], "e6m9s", 64)
    graph = trace(model, torch.randn(2, 3, 32, 32))
    gemms = [op.name for op in graph.ops if op.role == "gemm"]
    assert graph.graph_module is not None  # FX, not the hook fallback
    assert sorted(gemms) == sorted(swapped)


def test_gradients_arrive_fresh_exactly_where_one_conv_norm_or_relu_reads_an_output():
    """Hand count on ResNet-18: every conv output (read by its BN, 20), the BN outputs read by a ReLU (9), the
    ReLU outputs read by one conv alone (8), the sums (read by a ReLU, 8) and the input batch (read by the stem
    conv); not the BN outputs that a sum reads (its backward passes the gradient through, 11), the ReLU
    outputs read by a conv and a sum (8), the pooling (read by flatten) or the logits."""
    from precsearch.graph.in_place import gradient_arrives_fresh

    graph = trace(build("resnet18", width=0.25), torch.randn(2, 3, 32, 32))
    fresh = gradient_arrives_fresh(graph)
    counts: dict[str, int] = {}
    for op in graph.ops:
        if op.name in fresh:
            counts[op.module_type] = counts.get(op.module_type, 0) + 1
    assert counts == {"input": 1, "Conv2d": 20, "BatchNorm2d": 9, "ReLU": 8, "add": 8}

    class Twice(nn.Module):  # a ReLU output read twice by one op: its gradient is a sum, not one new tensor
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

        def forward(self, x):
            h = torch.relu(self.conv(x))
            return torch.mul(h, h)

    twice = trace(Twice(), torch.randn(2, 3, 4, 4))
    assert gradient_arrives_fresh(twice) == {op.name for op in twice.ops if op.module_type in ("input", "Conv2d")}


def test_gradients_pass_from_a_sum_exactly_where_a_sum_alone_reads_an_output():
    """Hand count on ResNet-18: each block's second BN output (8) and each shortcut's BN output (3) is read by
    the block's sum alone, which passes its gradient to it; not the block inputs that the sum reads too (a
    conv reads them as well), and an output read twice by one sum (its gradient is a new sum) is excluded."""
    from precsearch.graph.in_place import gradient_passes_from

    graph = trace(build("resnet18", width=0.25), torch.randn(2, 3, 32, 32))
    passes = gradient_passes_from(graph)
    by_name = {op.name: op for op in graph.ops}
    assert sorted(by_name[name].module_type for name in passes) == ["BatchNorm2d"] * 11
    assert sum(name.endswith(".bn2") for name in passes) == 8
    assert all(by_name[add].module_type == "add" for add in passes.values())

    class Doubled(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 1)

        def forward(self, x):
            h = self.conv(x)
            return torch.relu(h + h)

    assert gradient_passes_from(trace(Doubled(), torch.randn(2, 3, 4, 4))) == {}
