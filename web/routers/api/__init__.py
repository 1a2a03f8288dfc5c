"""The JSON API (``/api/...``): runs and controls (:mod:`.runs`), a run's rounds as files
(:mod:`.export`), the fleet and policies (:mod:`.nodes`), ingest from swarm peers and remote
ServerApps (:mod:`.ingest`), users and tokens (:mod:`.admin`), webhooks (:mod:`.webhooks`)."""
