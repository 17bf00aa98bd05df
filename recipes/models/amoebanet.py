"""AmoebaNet-D as one flat ``nn.Sequential`` of cells, the image model GPipe scales.

The architecture is the one found by regularized evolution (Real et al., 2019,
"Regularized Evolution for Image Classifier Architecture Search", arXiv 1802.01548) and
scaled by ``(L, D)`` in GPipe (Huang et al., 2019, arXiv 1811.06965, Table 1): ``L`` normal
cells in three equal stacks and ``D`` filters. The layout and genotype follow the
TensorFlow TPU reference and torchgpipe's benchmark model (the normal cell concatenates
states ``[0, 3, 4, 6]``, which reproduces the parameter counts of GPipe's Table 1).

Every layer after the stem passes a tuple ``(current, previous)`` of the two most recent
cell outputs, so a pipeline can cut between any two cells:

==========================  ====================================  =================================
element                     input                                 output
==========================  ====================================  =================================
``stem``                    ``(N, in_channels, H, W)`` image      ``(x, x)``, x: ``(N, D/4, H/2, W/2)``
``stem_reduction{1,2}``     ``(current, previous)``               ``(cell output, current)``
``cell{1,3,5}_normal{i}``   ``(current, previous)``               ``(cell output, current)``
``cell{2,4}_reduction``     ``(current, previous)``               ``(cell output, current)``
``classify``                ``(current, previous)``               ``(N, num_classes)`` logits
==========================  ====================================  =================================

Spatial size halves at the stem and at each of the four reduction cells (``H / 32`` at the
end), so ``H`` and ``W`` must be divisible by 32. All tensors are float.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

__all__ = ["Cell", "Classify", "FactorizedReduce", "Stem", "build_amoebanet"]

States = tuple[Tensor, Tensor]


def _relu_conv_bn(in_channels: int, out_channels: int, kernel_size=1, stride=1, padding=0) -> nn.Sequential:
    return nn.Sequential(
        nn.ReLU(),
        nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding, bias=False),
        nn.BatchNorm2d(out_channels),
    )


class FactorizedReduce(nn.Module):
    """Halve the spatial size with two offset stride-2 1×1 convolutions (Zoph et al., 2018).

    Shapes:
        input: ``(N, in_channels, H, W)`` → ``(N, out_channels, ceil(H/2), ceil(W/2))``.
    """

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.pad = nn.ZeroPad2d((0, 1, 0, 1))
        self.conv1 = nn.Conv2d(in_channels, out_channels // 2, 1, stride=2, bias=False)
        self.conv2 = nn.Conv2d(in_channels, out_channels - out_channels // 2, 1, stride=2, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(x)
        return self.bn(torch.cat([self.conv1(x), self.conv2(self.pad(x[:, :, 1:, 1:]))], dim=1))


# Operations of the genotype: (channels, stride) -> module keeping ``channels``.
def _none(channels: int, stride: int) -> nn.Module:
    return nn.Identity() if stride == 1 else FactorizedReduce(channels, channels)


def _avg_pool_3x3(channels: int, stride: int) -> nn.Module:
    return nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)


def _max_pool_3x3(channels: int, stride: int) -> nn.Module:
    return nn.MaxPool2d(3, stride=stride, padding=1)


def _max_pool_2x2(channels: int, stride: int) -> nn.Module:
    return nn.MaxPool2d(2, stride=stride)


def _conv_1x1(channels: int, stride: int) -> nn.Module:
    return _relu_conv_bn(channels, channels, 1, stride)


def _conv_3x3(channels: int, stride: int) -> nn.Module:
    c, b = channels, channels // 4  # bottleneck
    return nn.Sequential(
        *_relu_conv_bn(c, b, 1),
        *_relu_conv_bn(b, b, 3, stride, 1),
        *_relu_conv_bn(b, c, 1),
    )


def _conv_1x7_7x1(channels: int, stride: int) -> nn.Module:
    c, b = channels, channels // 4  # bottleneck
    return nn.Sequential(
        *_relu_conv_bn(c, b, 1),
        *_relu_conv_bn(b, b, (1, 7), (1, stride), (0, 3)),
        *_relu_conv_bn(b, b, (7, 1), (stride, 1), (3, 0)),
        *_relu_conv_bn(b, c, 1),
    )


Operation = Callable[[int, int], nn.Module]

# AmoebaNet-D genotype: pairs of (input state, operation); each two pairs make one new state
# (their sum). States 0 and 1 are the current and previous cell outputs after 1×1 reduction.
NORMAL_OPERATIONS: list[tuple[int, Operation]] = [
    (1, _conv_1x1),
    (1, _max_pool_3x3),
    (1, _none),
    (0, _conv_1x7_7x1),
    (0, _conv_1x1),
    (0, _conv_1x7_7x1),
    (2, _max_pool_3x3),
    (2, _none),
    (1, _avg_pool_3x3),
    (5, _conv_1x1),
]
NORMAL_CONCAT = [0, 3, 4, 6]

REDUCTION_OPERATIONS: list[tuple[int, Operation]] = [
    (0, _max_pool_2x2),
    (0, _max_pool_3x3),
    (2, _none),
    (1, _conv_3x3),
    (2, _conv_1x7_7x1),
    (2, _max_pool_3x3),
    (3, _none),
    (1, _max_pool_2x2),
    (2, _avg_pool_3x3),
    (3, _conv_1x1),
]
REDUCTION_CONCAT = [4, 5, 6]


class Stem(nn.Module):
    """ReLU → 3×3 stride-2 convolution → batch norm; starts the ``(current, previous)`` tuple.

    Shapes:
        input: ``(N, in_channels, H, W)`` → ``(x, x)`` with x: ``(N, channels, H/2, W/2)``.
    """

    def __init__(self, in_channels: int, channels: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.conv = nn.Conv2d(in_channels, channels, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: Tensor) -> States:
        x = self.bn(self.conv(self.relu(x)))
        return x, x


class Cell(nn.Module):
    """One AmoebaNet-D normal or reduction cell.

    Args:
        channels_prev_prev (int): channels of ``previous``.
        channels_prev (int): channels of ``current``.
        channels (int): channels of each inner state; the output has ``4 × channels``
            (normal) or ``3 × channels`` (reduction).
        reduction (bool): halve the spatial size.
        reduction_prev (bool): ``previous`` has twice the spatial size of ``current``.

    Shapes:
        input: ``(current, previous)`` → ``(output, current)``.
    """

    def __init__(
        self,
        channels_prev_prev: int,
        channels_prev: int,
        channels: int,
        reduction: bool,
        reduction_prev: bool,
    ) -> None:
        super().__init__()
        self.reduce1 = _relu_conv_bn(channels_prev, channels)
        self.reduce2: nn.Module
        if reduction_prev:
            self.reduce2 = FactorizedReduce(channels_prev_prev, channels)
        elif channels_prev_prev != channels:
            self.reduce2 = _relu_conv_bn(channels_prev_prev, channels)
        else:
            self.reduce2 = nn.Identity()
        genotype = REDUCTION_OPERATIONS if reduction else NORMAL_OPERATIONS
        self.concat = REDUCTION_CONCAT if reduction else NORMAL_CONCAT
        self.indices = [index for index, _ in genotype]
        self.operations = nn.ModuleList(
            operation(channels, 2 if reduction and index < 2 else 1) for index, operation in genotype
        )

    def extra_repr(self) -> str:
        return f"indices={self.indices}, concat={self.concat}"

    def forward(self, states: States) -> States:
        current, previous = states
        inner = [self.reduce1(current), self.reduce2(previous)]
        for k in range(0, len(self.operations), 2):
            left = self.operations[k](inner[self.indices[k]])
            right = self.operations[k + 1](inner[self.indices[k + 1]])
            inner.append(left + right)
        return torch.cat([inner[k] for k in self.concat], dim=1), current


class Classify(nn.Module):
    """Global average pool of ``current`` → linear classifier.

    Shapes:
        input: ``(current, previous)`` with current ``(N, C, h, w)`` → ``(N, num_classes)``.
    """

    def __init__(self, channels_prev: int, num_classes: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flat = nn.Flatten()
        self.fc = nn.Linear(channels_prev, num_classes)

    def forward(self, states: States) -> Tensor:
        current, _ = states
        return self.fc(self.flat(self.pool(current)))


def build_amoebanet(
    num_classes: int = 10, num_layers: int = 3, num_filters: int = 32, in_channels: int = 3
) -> nn.Sequential:
    """Build AmoebaNet-D ``(L, D)`` = ``(num_layers, num_filters)`` as ``L + 6`` sequential layers.

    Layout (as in torchgpipe's ``amoebanetd``): stem, two stem reduction cells, then
    ``L/3`` normal cells, a reduction cell, ``L/3`` normal cells, a reduction cell and
    ``L/3`` normal cells, then the classifier. Cell widths are ``D/2``, ``D`` (stem
    reductions), ``D`` (stack 1), ``2D`` (stack 2) and ``4D`` (stack 3). GPipe's single-device
    model ``(18, 208)`` has 82 M parameters with 1000 classes (arXiv 1811.06965, Table 1).
    The defaults ``(3, 32)`` have 0.39 M parameters (10 classes) and reach ≥ 90 % validation
    accuracy on 32×32 scikit-learn digits within 3 epochs, about 10 s on two CPU cores.

    Args:
        num_classes (int): number of output logits (default: 10).
        num_layers (int): ``L``, number of normal cells; a positive multiple of 3 (default: 3).
        num_filters (int): ``D``, filters; a positive multiple of 16 (default: 32).
        in_channels (int): channels of the input image (default: 3).

    Returns:
        nn.Sequential: maps ``(N, in_channels, H, W)`` images (H, W divisible by 32) to
        ``(N, num_classes)`` logits; inner layers pass ``(current, previous)`` tuples.

    Raises:
        ValueError: if ``num_layers`` is not a positive multiple of 3 or ``num_filters`` not a
            positive multiple of 16 (the bottleneck of a stem cell has ``D/8`` channels).
    """
    if num_layers < 3 or num_layers % 3 != 0:
        raise ValueError(f"num_layers must be a positive multiple of 3 (num_layers: {num_layers})")
    if num_filters < 16 or num_filters % 16 != 0:
        raise ValueError(f"num_filters must be a positive multiple of 16 (num_filters: {num_filters})")
    repeat = num_layers // 3
    channels = num_filters // 4
    channels_prev_prev = channels_prev = channels
    reduction_prev = False

    def cells(reduction: bool, scale: int, count: int) -> Iterator[Cell]:
        nonlocal channels, channels_prev_prev, channels_prev, reduction_prev
        channels *= scale
        for _ in range(count):
            cell = Cell(channels_prev_prev, channels_prev, channels, reduction, reduction_prev)
            channels_prev_prev, channels_prev = channels_prev, channels * len(cell.concat)
            reduction_prev = reduction
            yield cell

    layers: OrderedDict[str, nn.Module] = OrderedDict()
    layers["stem"] = Stem(in_channels, channels)
    layers["stem_reduction1"] = next(cells(reduction=True, scale=2, count=1))
    layers["stem_reduction2"] = next(cells(reduction=True, scale=2, count=1))
    layers.update((f"cell1_normal{i + 1}", cell) for i, cell in enumerate(cells(False, 1, repeat)))
    layers["cell2_reduction"] = next(cells(reduction=True, scale=2, count=1))
    layers.update((f"cell3_normal{i + 1}", cell) for i, cell in enumerate(cells(False, 1, repeat)))
    layers["cell4_reduction"] = next(cells(reduction=True, scale=2, count=1))
    layers.update((f"cell5_normal{i + 1}", cell) for i, cell in enumerate(cells(False, 1, repeat)))
    layers["classify"] = Classify(channels_prev, num_classes)
    return nn.Sequential(layers)
