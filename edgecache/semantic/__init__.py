"""Layer 3, the semantic cache: a paraphrase of a cached first-turn prompt answered from its answer.

One module a job, from the bottom up:

- :mod:`~edgecache.semantic.embedders` turns text into vectors (the models shipped in wheels);
- :mod:`~edgecache.semantic.index` keeps them, one usearch index per tenant, scenario and namespace;
- :mod:`~edgecache.semantic.guard` finds differences an answer depends on (numbers, names, negation, order, code);
- :mod:`~edgecache.semantic.verifier` scores a candidate from cosine, overlap and the guard's rules, calibrated;
- :mod:`~edgecache.semantic.learner` learns from labels which candidates serve, under a false-hit target;
- :mod:`~edgecache.semantic.refusals`, :mod:`~edgecache.semantic.lookup` and :mod:`~edgecache.semantic.false_hits`
  are the words they share: why a candidate was refused, what a lookup decided, how wrong the served ones were;
- :mod:`~edgecache.semantic.deciders` decides by threshold, verifier or learner (pure functions);
- :mod:`~edgecache.semantic.cache` puts them behind lookup / remember / forget for the request path;
- :mod:`~edgecache.semantic.decision_log`, :mod:`~edgecache.semantic.labeling` and :mod:`~edgecache.semantic.tuning`
  record decisions, label them against fresh answers, and fit cuts from them (``edgecache tune``);
- :mod:`~edgecache.semantic.assembly` builds the layer from the settings.

Nothing here imports the HTTP front or the pipeline; the pipeline and the runtime import from here.
"""
