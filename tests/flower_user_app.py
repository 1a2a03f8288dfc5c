"""A Flower user's own app, as a Flower user writes it: their model (no fedswarm task),
their data, an ordinary ``@app.train()`` that returns the new ``arrays``, and fedswarm's
``compression_mod``. Used by tests/test_compression_mod.py.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

import fedswarm.client

IN, HIDDEN, OUT = 16, 96, 3
SAMPLES = 96


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def teacher_data(partition: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed random teacher labels Gaussian inputs: each partition its own inputs."""
    g = torch.Generator().manual_seed(1000 + partition)
    x = torch.randn(SAMPLES, IN, generator=g)
    w = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(7))
    return x, (x @ w).argmax(dim=1)


app = ClientApp(mods=[fedswarm.client.compression_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    model = make_model()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = teacher_data(int(context.node_config.get("partition-id", 0)))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for i in range(0, SAMPLES, 16):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[i:i + 16]), y[i:i + 16])
        loss.backward()
        opt.step()
        losses.append(float(loss))
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"num-examples": SAMPLES, "train_loss": sum(losses) / len(losses)})})
    return Message(content, reply_to=msg)


def accuracy(arrays: ArrayRecord) -> float:
    model = make_model()
    model.load_state_dict(arrays.to_torch_state_dict())
    x, y = teacher_data(99)
    with torch.no_grad():
        return float((model(x).argmax(dim=1) == y).float().mean())
