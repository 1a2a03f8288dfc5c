"""A stand-in for the `flwr` CLI talking to a SuperLink (records its arguments)."""

import json
import os
import sys

args = sys.argv[1:]
with open(os.environ["FAKE_FLWR_LOG"], "a") as f:
    f.write(json.dumps(args) + "\n")
NODES = [{"node-id": 4242, "status": "online", "owner-name": "pi-1"}]
if args[:2] == ["supernode", "list"]:  # FAKE_FLWR_NODES: the SuperNodes to list, as JSON
    print(json.dumps({"success": True, "nodes": json.loads(os.environ.get("FAKE_FLWR_NODES", "null")) or NODES}))
elif args[0] == "ls":
    print(json.dumps({"success": True, "runs": [{"run-id": 7, "app": "fedswarm==0.1.0", "status": "running"}]}))
elif args[0] == "log":
    print("INFO : round 1 done")
elif args[0] == "stop":
    print("stopped")
elif args[0] == "run":
    print(json.dumps({"success": True, "run-id": 8}))
else:
    sys.exit(2)
