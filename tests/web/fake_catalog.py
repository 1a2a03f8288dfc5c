"""A stand-in for ``python -m fedswarm strategies --json`` (same shape, no torch)."""

import json

from fedswarm.config import RunConfig

LOCAL = ["local_steps", "local_epochs", "batch_size", "lr"]


def hp(name, default, help, allowed, **bounds):
    return {"name": name, "default": default, "help": help, "allowed": allowed,
            "type": type(default).__name__, "ge": bounds.get("ge"), "le": bounds.get("le"),
            "gt": bounds.get("gt"), "lt": bounds.get("lt"), "choices": bounds.get("choices")}


print(json.dumps({
    "strategies": [
        {"name": "fedavg", "description": "Federated averaging.", "kind": "federated", "hyperparams": [],
         "policy_keys": LOCAL},
        {"name": "topk", "description": "Top-k sparsification with error feedback.", "kind": "federated",
         "hyperparams": [
             hp("k", 0.01, "fraction of entries kept", "float > 0 and <= 1", gt=0, le=1),
             hp("error_feedback", True, "keep residuals", "bool"),
             hp("mode", "sync", "schedule", "one of 'sync', 'async'", choices=["sync", "async"]),
             hp("codec", "topk", "uplink codec", "str")],
         "policy_keys": LOCAL + ["codec", "codec_params"]},
        {"name": "dpsgd", "description": "Decentralized SGD.", "kind": "decentralized", "hyperparams": [],
         "policy_keys": []},
        {"name": "easgd", "description": "Elastic averaging.", "kind": "decentralized", "hyperparams": [],
         "policy_keys": [], "run_defaults": {"topology": "complete"}},
    ],
    "codecs": [{"name": "none", "description": "no compression", "hyperparams": []},
               {"name": "topk", "description": "top-k",
                "hyperparams": [hp("ratio", 0.01, "kept share", "float > 0.0 and <= 1.0", gt=0.0, le=1.0)]},
               {"name": "qsgd", "description": "QSGD",
                "hyperparams": [hp("levels", 16, "levels", "int >= 1 and <= 32767", ge=1, le=32767)]}],
    "tasks": [{"name": "digits-mlp", "description": "sklearn digits, 2-layer MLP"}],
    "config": RunConfig.model_json_schema(),
}))
