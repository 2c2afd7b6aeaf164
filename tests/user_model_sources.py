"""The source of a user's model package, shared by the tests that write one: two networks with
``.features`` and ``.classifier`` and factories that meet the model contract
(learning/models/contract.py), plus two that break it. Each test adds its own factories."""

FACTORIES = '''
import torch
from torch import nn


class Rows(nn.Module):
    def __init__(self, width, num_classes):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(width, 16), nn.Tanh())
        self.classifier = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))


class Pictures(nn.Module):
    def __init__(self, in_channels, side, num_classes):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(in_channels, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(),
                                      nn.Flatten(), nn.Linear(4 * side * side, 16), nn.Tanh())
        self.classifier = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))


def table(num_classes, input_shape):
    return Rows(input_shape[0], num_classes)


def image(num_classes, in_channels, input_size):
    return Pictures(in_channels, input_size, num_classes)


def needs_hidden(num_classes, input_shape, hidden):
    return Rows(input_shape[0], num_classes)


def wrong_shape(num_classes, input_shape):
    return nn.Linear(input_shape[0], num_classes + 1)


'''
