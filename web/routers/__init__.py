"""The dashboard's routes, one router per resource: :mod:`.api` (the JSON API under ``/api``, in
the OpenAPI schema) and :mod:`.pages` (the HTML pages and their forms). A route parses the request,
checks who asks (:mod:`fedswarm.web.deps`) and calls :mod:`fedswarm.web.services`; its request and
response bodies are :mod:`fedswarm.web.models`."""
