"""torchvision's zoo through precsearch: for each model, the fp32 saved bytes predicted vs measured (autograd's
own, saved_tensors_hooks), the runtime's saved bytes over the prediction under the hfp8 and fp16 baselines,
and the ops the runtime cannot enforce (GEMMs inside FX leaves). torchvision is not a precsearch dependency:
run this with an environment that has it (tests/test_zoo_torchvision.py is the same check as a test).

Usage: python benchmarks/zoo_check.py [--models resnet18 swin_t ...] [--all] [--batch 4] [--image 224]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from precsearch.analysis.checks import TOLERANCE, check_model

# The 14 models first tried (issue 17), in its order.
MODELS = ("resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_small", "efficientnet_b0", "densenet121",
          "regnet_y_400mf", "inception_v3", "convnext_tiny", "shufflenet_v2_x0_5", "squeezenet1_1", "vgg11_bn",
          "googlenet", "swin_t")


def build(name: str) -> torch.nn.Module:
    """A randomly initialised classifier with 10 classes (the auxiliary heads off, as one trains them)."""
    import torchvision

    extra = {"aux_logits": False, "init_weights": True} if name in ("inception_v3", "googlenet") else {}
    torch.manual_seed(0)
    return torchvision.models.get_model(name, weights=None, num_classes=10, **extra)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), metavar="NAME")
    parser.add_argument("--all", action="store_true", help="every classification model torchvision lists")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-params", type=float, default=100.0, metavar="MILLIONS",
                        help="skip (and list) larger models: their fp32 forwards outgrow a small machine")
    args = parser.parse_args()
    try:
        import torchvision
    except ImportError as error:
        print(f"zoo_check needs torchvision ({error}); install it beside torch", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    names = torchvision.models.list_models(module=torchvision.models) if args.all else args.models
    print(f"torch {torch.__version__}, torchvision {torchvision.__version__}; batch {args.batch}, "
          f"{args.image}x{args.image}, num_classes=10, CPU, {args.threads} thread(s)")
    print("| model | fp32 saved bytes: prediction error | hfp8: runtime saved / predicted | "
          "fp16: saved / predicted | unenforced ops | seconds |\n| --- | --- | --- | --- | --- | --- |")
    failed, skipped = [], []
    for name in names:
        start = time.perf_counter()
        model = build(name)
        millions = sum(p.numel() for p in model.parameters()) / 1e6
        if millions > args.max_params:
            skipped.append(f"{name} ({millions:.0f}M parameters)")
            continue
        batch = torch.randn((args.batch, 3, args.image, args.image), generator=torch.Generator().manual_seed(1))
        try:
            result = check_model(model, batch, name=name)
        except Exception as error:  # one model's failure is a row of the table, not the end of the run
            failed.append(name)
            print(f"| {name} | failed: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:200]} | | | | |")
            continue
        unenforced = (f"{len(result.unenforced)}, e.g. {next(iter(result.unenforced))} "
                      f"({'; '.join(sorted(set(result.unenforced.values())))})" if result.unenforced else "none")
        print(f"| {name} | {result.fp32_error:+.1%} | {result.ratio('hfp8'):.3f} | {result.ratio('fp16'):.3f} | "
              f"{unenforced} | {time.perf_counter() - start:.0f} |", flush=True)
        if not result.ok:
            failed.append(name)
    checked = len(names) - len(skipped)
    print(f"within {TOLERANCE:.0%}: {checked - len(failed)} of {checked}"
          + (f"; not: {', '.join(failed)}" if failed else "")
          + (f"; skipped (over --max-params): {', '.join(skipped)}" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
