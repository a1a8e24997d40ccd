"""The HTTP front: litestar routes and the OpenAI wire shapes, over the request path.

- :mod:`~edgecache.http.app` is the app factory and the routes (one :class:`~edgecache.settings.Settings` builds it);
- :mod:`~edgecache.http.server` runs it under uvicorn with the connection limits;
- :mod:`~edgecache.http.request_surface` and :mod:`~edgecache.http.calls` decode and validate a request into the
  pipeline's :class:`~edgecache.call.Call`; :mod:`~edgecache.http.openai_api` renders answers, JSON or SSE;
- :mod:`~edgecache.http.embeddings` serves ``/v1/embeddings``; :mod:`~edgecache.http.openapi` the schema;
- :mod:`~edgecache.http.access_log` writes one line per request;
- :mod:`~edgecache.http.front` holds the state only the front needs (response ids, parsed-body memo, access log).
"""
