"""The real models the benchmarks train, written out here (no torchvision): what a step's
forward and backward compute, not only the shapes of its gradients.

- ``build("resnet50", torch)``: torchvision's ResNet-50 architecture (161 parameter tensors,
  25,557,032 parameters, checked against ``tools/shapes.py``);
- ``build("gpt2-small", torch)``: GPT-2 small (124M parameters, 12 pre-norm blocks of width 768,
  the head tied to the token embedding, 1,024 positions);
- ``inputs(name, torch, ...)`` makes a pool of synthetic batches (images and labels, or tokens)
  and ``loss(name, model, batch)`` the step's loss (cross-entropy) on one of them.

Used by training.py (ResNet-50), adamw_wallclock.py (GPT-2 small) and ddp_hooks.py (either).
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import resnet50_shapes  # noqa: E402  (tools/shapes.py's, checked against the model)

GPT2_SMALL = dict(vocab=50257, positions=1024, width=768, layers=12, heads=12)
NAMES = ("resnet50", "gpt2-small")


def build_resnet50(torch):
    nn = torch.nn

    class Bottleneck(nn.Module):
        def __init__(self, inplanes, planes, stride, downsample):
            super().__init__()
            self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(planes)
            self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(planes)
            self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(planes * 4)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = downsample

        def forward(self, x):
            idt = x if self.downsample is None else self.downsample(x)
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            return self.relu(out + idt)

    class ResNet50(nn.Module):
        def __init__(self, num_classes=1000):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
            inplanes, layers = 64, []
            for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
                mods = []
                for b in range(blocks):
                    ds = None
                    if b == 0:
                        ds = nn.Sequential(nn.Conv2d(inplanes, planes * 4, 1, stride, bias=False),
                                           nn.BatchNorm2d(planes * 4))
                    mods.append(Bottleneck(inplanes, planes, stride if b == 0 else 1, ds))
                    inplanes = planes * 4
                layers.append(nn.Sequential(*mods))
            self.layer1, self.layer2, self.layer3, self.layer4 = layers
            self.avgpool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(2048, num_classes)

        def forward(self, x):
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            return self.fc(torch.flatten(self.avgpool(x), 1))

    model = ResNet50()
    built = [tuple(p.shape) for p in model.parameters()]
    assert built == [tuple(s) for s in resnet50_shapes()], "ResNet-50 shapes differ"
    return model


def build_gpt2_small(torch, vocab, positions, width, layers, heads):
    nn = torch.nn
    F = torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, width)
            x = x + self.proj(a)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class GPT2(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(positions, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln = nn.LayerNorm(width)

        def forward(self, idx):
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.ln(x) @ self.tok.weight.t()  # the head tied to the embedding, as GPT-2

    return GPT2()


def build(name, torch):
    """``name``'s model, freshly initialised from torch's global generator."""
    if name == "resnet50":
        return build_resnet50(torch)
    if name == "gpt2-small":
        return build_gpt2_small(torch, **GPT2_SMALL)
    raise ValueError(f"no real model for {name!r}: one of {', '.join(NAMES)}")


def inputs(name, torch, pool, seed, batch, image_size=32, context=128):
    """``pool`` synthetic batches for ``name``: ``batch`` images of ``image_size`` pixels with
    labels (ResNet-50), or ``batch`` sequences of ``context`` + 1 tokens (GPT-2 small)."""
    g = torch.Generator().manual_seed(seed)
    if name == "resnet50":
        return [(torch.randn(batch, 3, image_size, image_size, generator=g),
                 torch.randint(0, 1000, (batch,), generator=g)) for _ in range(pool)]
    return [torch.randint(0, GPT2_SMALL["vocab"], (batch, context + 1), generator=g) for _ in range(pool)]


def loss(name, model, batch):
    """The step's cross-entropy loss of ``model`` (``name``'s) on ``batch`` from ``inputs``."""
    import torch.nn.functional as F
    if name == "resnet50":
        x, y = batch
        return F.cross_entropy(model(x), y)
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
