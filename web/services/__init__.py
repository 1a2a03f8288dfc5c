"""What the routes call: the dashboard's work, with no HTTP in it.

Runs: starting and steering them (:mod:`.runs`), their processes (:mod:`.launcher`), the state a
run is really in (:mod:`.run_state`), the read models of the API and pages (:mod:`.queries`), live
updates (:mod:`.live`). The new-run form and what it may start: :mod:`.catalog`, :mod:`.forms`,
:mod:`.validation`. The fleet (:mod:`.fleet`, :mod:`.node_states`), a Flower federation
(:mod:`.federation`), users and tokens (:mod:`.accounts`), webhooks (:mod:`.webhooks`)."""
