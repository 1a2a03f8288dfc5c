"""``digits-mlp-wide``: the task big enough for sketching (d in the hundreds of thousands)."""

from __future__ import annotations

import torch

from fedswarm.params import ParamLayout
from fedswarm.tasks import TASKS, get_task


def test_digits_mlp_wide_is_large_and_trains():
    task = get_task("digits-mlp-wide")
    assert "digits-mlp-wide" in TASKS
    model = task.model(0)
    assert ParamLayout.from_module(model).d == 64 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10 >= 200_000
    data = task.load_data(0, 0.2)
    x, y = data.train_x[:256], data.train_y[:256]
    assert model(x).shape == (256, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first = float(task.objective(model, x, y))
    for _ in range(30):
        opt.zero_grad()
        task.objective(model, x, y).backward()
        opt.step()
    assert float(task.objective(model, x, y)) < 0.5 * first
