"""A stand-in for ``python -m fedswarm strategies --json`` (same shape, no torch)."""

import json

from fedswarm.config import RunConfig

print(json.dumps({
    "strategies": [
        {"name": "fedavg", "description": "Federated averaging.", "kind": "federated", "hyperparams": []},
        {"name": "topk", "description": "Top-k sparsification with error feedback.", "kind": "federated",
         "hyperparams": [
             {"name": "k", "default": 0.01, "help": "fraction of entries kept", "allowed": "float > 0 and <= 1"},
             {"name": "error_feedback", "default": True, "help": "keep residuals", "allowed": "bool"},
             {"name": "mode", "default": "sync", "help": "schedule", "allowed": "one of 'sync', 'async'"}]},
    ],
    "codecs": [{"name": "none", "description": "no compression", "kind": "codec", "hyperparams": []},
               {"name": "topk", "description": "top-k", "kind": "codec", "hyperparams": []}],
    "tasks": [{"name": "digits-mlp", "description": "sklearn digits, 2-layer MLP"}],
    "config": RunConfig.model_json_schema(),
}))
