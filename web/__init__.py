"""fedswarm's dashboard: a FastAPI app over the run store (``fedswarm.web.app.create_app``).

It imports only the core store and config, never torch or flwr.
"""
