"""The names fedswarm's ServerApp and ClientApp agree on inside Flower messages.

Both halves (``fedswarm.server``, ``fedswarm.client``) and the strategies that build
messages import them from here, the layer under all three, so neither half imports the
other (docs/architecture.md).
"""

from __future__ import annotations

__all__ = ["RUN_KEY", "RESUME_ACTION", "RESUME_RECORD", "REPORT_PREFIX", "TELEMETRY_RECORD", "OWN_MODEL_KEY",
           "TELEMETRY_ACTION"]

#: Key of the train config naming the fedswarm run the nodes key their state by.
RUN_KEY = "fedswarm-run"
#: The query action a resumed server sends (message type ``query.fedswarm_resume``).
RESUME_ACTION = "fedswarm_resume"
#: The record of that query: ``run`` (fedswarm run id) and ``round`` (the checkpoint's round).
RESUME_RECORD = "resume"
#: Reply records named ``report.*`` are monitoring, not the algorithm's traffic
#: (the MeteredGrid counts them apart from ``bytes_up``).
REPORT_PREFIX = "report."
#: The reply record that carries a node's device telemetry (monitoring too, counted apart again).
TELEMETRY_RECORD = f"{REPORT_PREFIX}telemetry"
#: Config key of an evaluate message: score the node's own model (decentralized), not the message's.
OWN_MODEL_KEY = "fed-eval-own"
#: The query action of the eligibility probe (message type ``query.fedswarm_telemetry``): the node
#: replies with its telemetry record and a ``node`` record (``device_class``, ``partition-id``), no model.
TELEMETRY_ACTION = "fedswarm_telemetry"
