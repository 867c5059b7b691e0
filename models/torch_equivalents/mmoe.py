"""Multi-gate mixture of experts (models/mmoe.py): MLP experts mixed per task by a softmax gate."""

from __future__ import annotations

import torch
from torch import nn

from models.torch_equivalents.common import OnnxWeights, linear_state


def _relu_mlp(widths: tuple[int, ...]) -> nn.Sequential:
    """Linear + ReLU per consecutive pair of widths."""
    layers = []
    for cin, cout in zip(widths, widths[1:]):
        layers += [nn.Linear(cin, cout), nn.ReLU()]
    return nn.Sequential(*layers)


class MMoE(nn.Module):
    def __init__(self, features: int, experts: int, expert_hidden: tuple[int, ...], tasks: int,
                 tower_hidden: int):
        super().__init__()
        widths = (features, *expert_hidden)
        self.experts = nn.ModuleList(_relu_mlp(widths) for _ in range(experts))
        self.gates = nn.ModuleList(nn.Linear(features, experts, bias=False) for _ in range(tasks))
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(widths[-1], tower_hidden), nn.ReLU(), nn.Linear(tower_hidden, 1), nn.Sigmoid())
            for _ in range(tasks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = torch.stack([expert(x) for expert in self.experts], dim=1)  # [batch, experts, dim]
        outputs = []
        for gate, tower in zip(self.gates, self.towers):
            mix = torch.softmax(gate(x), dim=-1).unsqueeze(-1)
            outputs.append(tower((experts * mix).sum(dim=1)))
        return torch.cat(outputs, dim=1)  # [batch, tasks]


def build(weights: OnnxWeights) -> tuple[nn.Module, dict]:
    experts = weights.count("expert{}/fc0/weight")
    expert_hidden = tuple(weights.shape(f"expert0/fc{i}/weight")[1]
                          for i in range(weights.count("expert0/fc{}/weight")))
    tasks = weights.count("task{}/gate/weight")
    features = weights.shape("task0/gate/weight")[0]
    tower_hidden = weights.shape("task0/tower/fc0/weight")[1]
    module = MMoE(features, experts, expert_hidden, tasks, tower_hidden)
    state = {}
    for e in range(experts):
        for i in range(len(expert_hidden)):  # Linear i sits at index 2 * i of the Linear/ReLU sequence
            p = f"expert{e}/fc{i}"
            state |= linear_state(weights, f"{p}/weight", f"{p}/bias", f"experts.{e}.{2 * i}")
    for t in range(tasks):
        state |= linear_state(weights, f"task{t}/gate/weight", None, f"gates.{t}")
        for i, index in ((0, 0), (1, 2)):
            p = f"task{t}/tower/fc{i}"
            state |= linear_state(weights, f"{p}/weight", f"{p}/bias", f"towers.{t}.{index}")
    return module, state
