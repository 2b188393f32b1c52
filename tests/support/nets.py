"""The small model of the distributed checks (tests/dist): two big weights (the sparse path),
small biases (the dense path) and an optional second head; no Horovod, no torch.distributed."""

import torch


class Net(torch.nn.Module):
    """Two big weights (sparse path) and small biases (dense path); head2 is optional."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(40, 96)
        self.fc2 = torch.nn.Linear(96, 10)
        self.head2 = torch.nn.Linear(96, 10)

    def forward(self, x, use_head2=True):
        h = torch.relu(self.fc1(x))
        out = self.fc2(h)
        return out + self.head2(h) if use_head2 else out
