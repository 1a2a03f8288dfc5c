"""The local-SGD math every runtime shares (fedswarm.algorithms.local_sgd), against
independent oracles: the lazy draw-a-permutation-when-used-up loop (tests/minibatch_oracle.py),
and torch.optim.SGD. The draw's statistics: tests/test_minibatch_draw.py."""

from __future__ import annotations

import pytest
import torch

from fedswarm.algorithms.local_sgd import minibatch_plan, sgd_step
from tests.minibatch_oracle import batches


@pytest.mark.parametrize("n,steps,bs", [(10, 3, 3), (10, 4, 3), (10, 9, 3), (7, 5, 7), (5, 6, 8), (1, 4, 2),
                                        (12, 8, 4), (9, 0, 2), (3, 1, 16)])
def test_plan_is_the_lazy_permutation_loop(n, steps, bs):
    pos, size = minibatch_plan(n, steps, bs, seed=1234)
    assert pos.shape == (steps, min(bs, n)) and size.shape == (steps,)
    got = [pos[s, :int(size[s])].tolist() for s in range(steps)]
    assert got == batches(n, steps, bs, 1234)
    for s in range(steps):  # the padding is zeros
        assert pos[s, int(size[s]):].eq(0).all()


def test_plan_of_no_examples_and_bad_arguments():
    pos, size = minibatch_plan(0, 3, 4, seed=0)
    assert pos.shape == (3, 0) and size.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="batch_size"):
        minibatch_plan(5, 2, 0, seed=0)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_step_is_torch_sgd(momentum):
    torch.manual_seed(0)
    w0 = torch.randn(4, 3)
    grads = [torch.randn(4, 3) for _ in range(5)]
    ref = w0.clone().requires_grad_(True)
    opt = torch.optim.SGD([ref], lr=0.05, momentum=momentum)
    w, buf = w0.clone(), None
    for g in grads:
        ref.grad = g.clone()
        opt.step()
        w, buf = sgd_step(w, g, buf, 0.05, momentum)
    assert (buf is None) == (momentum == 0.0)
    torch.testing.assert_close(w, ref.detach(), rtol=0, atol=1e-6)


def test_step_on_a_client_axis_keeps_finished_clients():
    """Rows are clients with their own lr; a client whose steps are done keeps params and buffer."""
    torch.manual_seed(1)
    c, d, steps = 3, 5, torch.tensor([1, 3, 2])
    lr = torch.tensor([[0.1], [0.2], [0.05]])
    w0 = torch.randn(d)
    grads = torch.randn(3, c, d)
    w, buf = w0.expand(c, d).clone(), None
    for s in range(3):
        w, buf = sgd_step(w, grads[s], buf, lr, 0.5, (steps > s)[:, None])
    for k in range(c):  # each client alone, C = 1, only its own steps
        wk, bk = w0.clone(), None
        for s in range(int(steps[k])):
            wk, bk = sgd_step(wk, grads[s, k], bk, float(lr[k]), 0.5)
        torch.testing.assert_close(w[k], wk, rtol=0, atol=1e-6)
        torch.testing.assert_close(buf[k], bk, rtol=0, atol=1e-6)


def test_weighted_sum_is_the_weighted_mean_chunk_by_chunk():
    from fedswarm.algorithms.averaging import WeightedSum

    torch.manual_seed(2)
    x, w = torch.randn(7, 11), torch.tensor([3.0, 1.0, 5.0, 2.0, 8.0, 1.0, 4.0])
    oracle = (x.double() * w.double()[:, None]).sum(0) / w.double().sum()
    acc = WeightedSum(11)
    for lo in range(0, 7, 3):  # chunks of 3, 3, 1
        acc.add(x[lo:lo + 3], w[lo:lo + 3])
    assert acc.weight == float(w.sum())
    torch.testing.assert_close(acc.mean(), oracle.float(), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="no client has weight"):
        WeightedSum(3).mean()


def test_clip_sum_clips_each_row_then_sums():
    from fedswarm.algorithms.privacy.dp_fedavg import clip_sum

    x = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, -10.0]])  # norms 5, 0.5, 10
    total, within = clip_sum(x, 1.0)
    torch.testing.assert_close(total, torch.tensor([0.6 + 0.3, 0.8 + 0.4 - 1.0]))
    assert within == 1
