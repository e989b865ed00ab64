"""The model zoo: shapes, traceability, the CIFAR structure, parameter counts, specs and factory loading."""

from __future__ import annotations

import textwrap

import pytest
import torch
import torch.fx
from torch import nn

from precsearch.errors import PrecsearchError
from precsearch.models import INPUT_SHAPE, NAMES, build, parse_model_spec
from precsearch.models.common import TooNarrow, scale_channels

WIDTHS = (1.0, 0.5, 0.25, 0.1)


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", NAMES)
def test_zoo_model_runs_and_traces_faithfully(name: str, width: float) -> None:
    torch.manual_seed(0)
    model = build(name, width=width, num_classes=7).eval()
    x = torch.randn(2, *INPUT_SHAPE)
    with torch.no_grad():
        y = model(x)
        traced = torch.fx.symbolic_trace(model)
        y_traced = traced(x)
    assert y.shape == (2, 7)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y_traced, y, rtol=0, atol=0)
    assert any(n.op == "call_module" and isinstance(traced.get_submodule(n.target), nn.Conv2d)
               for n in traced.graph.nodes)


def _resnet18_parameters_by_hand(num_classes: int) -> int:
    """Parameters of the CIFAR ResNet-18 from its layer shapes, without building it."""
    def conv(cin: int, cout: int, k: int) -> int:
        return cin * cout * k * k

    def bn(c: int) -> int:
        return 2 * c

    total = conv(3, 64, 3) + bn(64)
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        total += conv(cin, cout, 3) + bn(cout) + conv(cout, cout, 3) + bn(cout)
        if stride != 1 or cin != cout:
            total += conv(cin, cout, 1) + bn(cout)
        total += 2 * (conv(cout, cout, 3) + bn(cout))
        cin = cout
    return total + 512 * num_classes + num_classes


def test_resnet18_parameter_count_matches_the_cifar_resnet18() -> None:
    assert _resnet18_parameters_by_hand(10) == 11_173_962
    count = _count(build("resnet18"))
    assert count == 11_173_962
    assert round(count * 4 / 2**20, 1) == 42.6
    assert _count(build("resnet18", num_classes=100)) == _resnet18_parameters_by_hand(100)


def _output_shape(model: nn.Module, submodule: str, x: torch.Tensor) -> tuple[int, ...]:
    seen: list[tuple[int, ...]] = []
    handle = model.get_submodule(submodule).register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    with torch.no_grad():
        model(x)
    handle.remove()
    return seen[0]


@pytest.mark.parametrize(("name", "submodule", "shape"), [
    ("resnet18", "layer1", (1, 64, 32, 32)),    # no stem max-pool: stage 1 at full resolution
    ("resnet18", "layer4", (1, 512, 4, 4)),
    ("mobilenet_v2", "layers.2", (1, 24, 32, 32)),  # CIFAR change: the first stride-2 stage has stride 1
    ("mobilenet_v2", "conv2", (1, 1280, 4, 4)),
    ("shufflenet_v2", "stage2", (1, 116, 16, 16)),
    ("shufflenet_v2", "conv5", (1, 1024, 4, 4)),
    ("squeezenet", "features.fire2", (1, 128, 32, 32)),
    ("squeezenet", "features.fire9", (1, 512, 8, 8)),
])
def test_cifar_form_keeps_resolution(name: str, submodule: str, shape: tuple[int, ...]) -> None:
    model = build(name).eval()
    assert _output_shape(model, submodule, torch.randn(1, *INPUT_SHAPE)) == shape


def test_width_scales_channels() -> None:
    model = build("resnet18", width=0.25)
    assert [model.get_submodule(f"layer{i}.1.conv2").out_channels for i in range(1, 5)] == [16, 32, 64, 128]
    assert model.linear.in_features == 128
    # 116 * 0.25 = 29 is odd; ShuffleNetV2 needs an even count to split in half and shuffle in 2 groups.
    shuffle = build("shufflenet_v2", width=0.25)
    assert _output_shape(shuffle.eval(), "stage2", torch.randn(1, *INPUT_SHAPE))[1] == 30


def test_scale_channels_rounding() -> None:
    assert scale_channels(64, 0.1) == 6          # 6.4
    assert scale_channels(128, 0.1) == 13        # 12.8
    assert scale_channels(24, 0.03) == 1         # 0.72
    assert scale_channels(116, 0.25, divisor=2) == 30   # 29 -> nearest even, halves up
    assert scale_channels(3, 0.4, divisor=2) == 2       # 0.6 of a pair
    with pytest.raises(TooNarrow, match=r"width=0.01 leaves a layer of 24 channels .* with none"):
        scale_channels(24, 0.01)                 # no layer is widened behind the user's back


@pytest.mark.parametrize("name", ["mobilenet_v2", "shufflenet_v2"])
def test_depthwise_models_contain_depthwise_convs(name: str) -> None:
    convs = [m for m in build(name, width=0.25).modules() if isinstance(m, nn.Conv2d)]
    assert any(c.groups > 1 and c.groups == c.in_channels == c.out_channels for c in convs)


def test_init_is_deterministic_under_manual_seed() -> None:
    torch.manual_seed(3)
    first = build("shufflenet_v2", width=0.1).state_dict()
    torch.manual_seed(3)
    second = build("shufflenet_v2", width=0.1).state_dict()
    torch.manual_seed(4)
    third = build("shufflenet_v2", width=0.1).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first["conv1.weight"], third["conv1.weight"])


@pytest.mark.parametrize(("spec", "expected"), [
    ("resnet18", ("resnet18", {})),
    ("resnet18:width=0.25,num_classes=100", ("resnet18", {"width": 0.25, "num_classes": 100})),
    (" resnet18 : width = 0.5 , classes = 100 ", ("resnet18", {"width": 0.5, "num_classes": 100})),
    ("tiny_cnn:", ("tiny_cnn", {})),
    ("pkg.models:make", ("pkg.models:make", {})),
    ("pkg.models:make:depth=3,name=abc,flag=true", ("pkg.models:make", {"depth": 3, "name": "abc", "flag": True})),
    ("usermodels:make", ("usermodels:make", {})),
    ("usermodels:make:width=2", ("usermodels:make", {"width": 2})),
])
def test_parse_model_spec(spec: str, expected: tuple) -> None:
    name, options = parse_model_spec(spec)
    assert (name, options) == expected
    assert [type(v) for v in options.values()] == [type(v) for v in expected[1].values()]


@pytest.mark.parametrize("spec", [
    "", ":width=1", "resnet18:width", "resnet18:width=", "resnet18:a=1:b=2", "resnet18:width=1,width=2",
    "resnet18:classes=3,num_classes=3", "pkg.models", "pkg.models:", "pkg.models:make:x=1:y=2",
])
def test_parse_model_spec_rejects_malformed(spec: str) -> None:
    with pytest.raises(PrecsearchError) as info:
        parse_model_spec(spec)
    assert "\n" not in str(info.value)


def test_build_accepts_options_in_the_name_and_keywords_override() -> None:
    model = build("tiny_cnn:width=0.5,classes=3", num_classes=5)
    assert model.linear.out_features == 5
    assert model.conv1.out_channels == 8
    assert build("tiny_cnn", classes=4).linear.out_features == 4


def test_unknown_model_lists_the_zoo() -> None:
    with pytest.raises(PrecsearchError) as info:
        build("resnet19")
    message = str(info.value)
    assert "resnet19" in message and "did you mean resnet18" in message
    assert all(name in message for name in NAMES)
    assert "package.module:function" in message


@pytest.mark.parametrize(("options", "fragment"), [
    ({"depth": 3}, "allowed: width, num_classes"),
    ({"width": 0}, "width=0"),
    ({"width": -0.5}, "width=-0.5"),
    ({"width": "wide"}, "width='wide'"),
    ({"width": float("nan")}, "width=nan"),
    ({"num_classes": 0}, "num_classes=0"),
    ({"num_classes": 2.5}, "num_classes=2.5"),
    ({"num_classes": True}, "num_classes=True"),
    ({"classes": 3, "num_classes": 3}, "not both"),
])
def test_bad_zoo_options(options: dict, fragment: str) -> None:
    with pytest.raises(PrecsearchError) as info:
        build("tiny_cnn", **options)
    assert fragment in str(info.value)


@pytest.fixture
def user_package(tmp_path, monkeypatch) -> str:
    """A package `userzoo_pkg.nets` on sys.path with factories good and bad."""
    package = tmp_path / "userzoo_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(textwrap.dedent("""
        from torch import nn

        def make(hidden=4, num_classes=10):
            layers = [nn.Flatten(), nn.Linear(3 * 32 * 32, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)]
            return nn.Sequential(*layers)

        def not_a_model():
            return 3

        VALUE = 5
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "userzoo_pkg.nets"


def test_factory_path_builds_user_model(user_package: str) -> None:
    model = build(f"{user_package}:make:hidden=6", num_classes=3)
    assert model[1].out_features == 6
    assert model(torch.randn(2, *INPUT_SHAPE)).shape == (2, 3)
    linear = build("torch.nn:Linear", in_features=4, out_features=2)
    assert isinstance(linear, nn.Linear) and linear.out_features == 2


@pytest.mark.parametrize(("spec", "fragments"), [
    ("no_such_pkg_q7.models:make", ["no_such_pkg_q7.models", "PYTHONPATH"]),
    ("userzoo_pkg.nets:missing", ["no attribute 'missing'", "userzoo_pkg.nets:missing"]),
    ("userzoo_pkg.nets:VALUE", ["not a callable", "userzoo_pkg.nets:VALUE"]),
    ("userzoo_pkg.nets:not_a_model", ["returned int", "torch.nn.Module"]),
    ("userzoo_pkg.nets:make:depth=2", ["cannot take options ['depth']", "hidden, num_classes"]),
])
def test_factory_errors_name_the_path(user_package: str, spec: str, fragments: list[str]) -> None:
    with pytest.raises(PrecsearchError) as info:
        build(spec)
    message = str(info.value)
    assert "\n" not in message
    assert all(f in message for f in fragments), message
