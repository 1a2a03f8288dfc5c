"""``digits-resnet14``: a task with many variables for partial variable training."""

from __future__ import annotations

import pytest
import torch

from fedswarm.algorithms.selection.pvt import num_selected
from fedswarm.params import ParamLayout
from fedswarm.tasks import TASKS, get_task
from fedswarm.tasks.deep import digits_resnet14_wide, resnet_deep


def _oracle_tensors(width: int, n: int) -> list[int]:
    """Sizes of a CIFAR-style ResNet's tensors, counted by hand: stem conv + GroupNorm (w, b);
    per basic block two bias-free 3x3 convs with a GroupNorm each, plus a 1x1 projection and
    its GroupNorm where the width changes; the linear classifier (weight, bias)."""
    sizes, cin = [width * 9, width, width], width
    for cout in (width, 2 * width, 4 * width):
        for _b in range(n):
            sizes += [cout * cin * 9, cout, cout, cout * cout * 9, cout, cout]
            if cin != cout:
                sizes += [cout * cin, cout, cout]
            cin = cout
    return sizes + [10 * cin, 10]


def test_digits_resnet14_has_many_variables_and_trains():
    task = get_task("digits-resnet14")
    assert "digits-resnet14" in TASKS
    model = task.model(0)
    layout = ParamLayout.from_module(model)
    want = _oracle_tensors(8, 2)
    assert len(want) == 47 and len(layout.specs) == 47  # PVT's k = 1..2 of them caps the uplink at 47x..23x
    assert sorted(s.numel for s in layout.specs) == sorted(want) and layout.d == sum(want)
    assert num_selected(len(layout.specs), 0.05) == 2
    # same weights on every node for one seed
    assert torch.equal(torch.nn.utils.parameters_to_vector(task.model(0).parameters()),
                       torch.nn.utils.parameters_to_vector(model.parameters()))
    data = task.load_data(0, 0.2)
    x, y = data.train_x[:32], data.train_y[:32]
    assert x.shape[1:] == (1, 8, 8) and model(x).shape == (32, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small convolutions on a loaded machine: more threads only wait on each other
    try:
        first = float(task.objective(model, x, y).detach())
        for _ in range(25):
            opt.zero_grad()
            task.objective(model, x, y).backward()
            opt.step()
        assert float(task.objective(model, x, y).detach()) < 0.5 * first
    finally:
        torch.set_num_threads(threads)


def test_wide_variant_and_bad_sizes():
    wide = digits_resnet14_wide().model(0)
    sizes = [p.numel() for p in wide.parameters()]
    assert sorted(sizes) == sorted(_oracle_tensors(64, 2))
    with pytest.raises(ValueError, match="width >= 1"):
        resnet_deep(1, 10, width=0)
